"""The registry of allreduce algorithms (refimpl/parallel/allreduce/): what registering refuses,
what is derived from it (predicted_time, the choices and options of ``refimpl train``, the
``allreduce_options`` config table) and the docs table that must name every algorithm.  No MPI."""
import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from refimpl.config import CHOICES, merge
from refimpl.parallel import allreduce
from refimpl.parallel.allreduce import (ALGORITHMS, Algorithm, Option, check_options, configurations,
                                        predicted_time, register)

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- registering

def toy_steps(flat, msgs, width: int = 3):
    yield []


def toy_cost(n, p, alpha, beta, gamma, width: int = 3):
    return width * alpha + n * beta


def check_width(value, p=None):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"width must be an int >= 1, got {value!r}")


def toy(**changes):
    fields = dict(name="toy", summary="a test algorithm", steps=toy_steps, cost=toy_cost,
                  options=(Option("width", default=3, allowed="an int >= 1", check=check_width, examples=(1, 5)),))
    return Algorithm(**{**fields, **changes})


@pytest.fixture
def registered_toy(monkeypatch):
    """A toy algorithm registered for one test (and gone after it)."""
    monkeypatch.setattr(allreduce.registry, "ALGORITHMS", dict(ALGORITHMS))
    monkeypatch.setattr(allreduce, "ALGORITHMS", allreduce.registry.ALGORITHMS)
    return register(toy())


def test_a_new_algorithm_is_priced_by_its_own_formula(registered_toy):
    assert predicted_time("toy", 1000, 4, 1.0, 0.01, 0.001) == 3 + 10
    assert predicted_time("toy", 1000, 4, 1.0, 0.01, width=5) == 5 + 10
    assert predicted_time("toy", 1000, 1, 1.0, 0.01) == 0.0
    assert ("toy", {}) in configurations() and ("toy", {"width": 5}) in configurations()
    with pytest.raises(ValueError, match=r"width must be an int >= 1, got 0"):
        predicted_time("toy", 1000, 4, 1.0, 0.01, width=0)


def wrong_default_steps(flat, msgs, width: int = 4):
    yield []


def undeclared_steps(flat, msgs, width: int = 3, depth: int = 2):
    yield []


def not_a_generator(flat, msgs, width: int = 3):
    return []


def no_options_cost(n, p, alpha, beta, gamma):
    return 0.0


@pytest.mark.parametrize("changes, match", [
    ({"cost": None}, "toy.* has no cost formula"),
    ({"name": "ring"}, "'ring' is already registered"),
    ({"name": "two words"}, "must be an identifier"),
    ({"summary": ""}, "has no summary"),
    ({"steps": not_a_generator}, "steps must be a generator function"),
    ({"steps": wrong_default_steps}, "option width defaults to 3, wrong_default_steps to 4"),
    ({"steps": undeclared_steps}, r"options of undeclared_steps \['depth', 'width'\] are not the declared"),
    ({"cost": no_options_cost}, r"options of no_options_cost \[\] are not the declared options \['width'\]"),
    ({"options": (Option("width", default=3, allowed="an int >= 1", check=check_width, examples=(0,)),)},
     "width must be an int >= 1, got 0"),
])
def test_register_refuses_an_incomplete_algorithm(monkeypatch, changes, match):
    monkeypatch.setattr(allreduce.registry, "ALGORITHMS", dict(ALGORITHMS))
    with pytest.raises(ValueError, match=match):
        register(toy(**changes))
    assert "toy" not in allreduce.registry.ALGORITHMS


def test_every_registered_algorithm_is_complete():
    """What register checked, and the order the tables and benchmarks show."""
    assert list(ALGORITHMS) == ["native", "ring", "recursive_doubling", "halving_doubling", "multicolor",
                                "hierarchical"]
    for algorithm in ALGORITHMS.values():
        assert callable(algorithm.cost) and algorithm.summary
        assert algorithm.steps.__module__ == algorithm.cost.__module__     # side by side, in one module


# ---------------------------------------------------------------- checking options

@pytest.mark.parametrize("name, options, match", [
    ("ring", {"colors": 2}, r"algorithm 'ring' takes no option\(s\) \['colors'\]; its options: none"),
    ("hierarchical", {"colors": 2}, r"takes no option\(s\) \['colors'\]; its options: group_size \(an int "
                                    r"dividing the number of ranks p"),
    ("multicolor", {"colors": 0}, r"colors must be an int >= 1, got 0"),
    ("multicolor", {"colors": "4"}, r"colors must be an int >= 1, got '4'"),
    ("multicolor", {"colors": True}, r"colors must be an int >= 1, got True"),
    ("hierarchical", {"group_size": 0}, r"group_size must be an int >= 1"),
    ("butterfly", {}, r"algorithm must be one of \["),
])
def test_bad_options_refused_in_one_line(name, options, match):
    with pytest.raises(ValueError, match=match) as err:
        check_options(name, options)
    assert "\n" not in str(err.value)


def test_options_that_depend_on_the_number_of_ranks():
    check_options("hierarchical", {"group_size": 4})                  # no p: any int >= 1
    check_options("hierarchical", {"group_size": 4}, 8)
    with pytest.raises(ValueError, match="group_size must be a divisor of the number of ranks 6, got 4"):
        check_options("hierarchical", {"group_size": 4}, 6)
    check_options("hierarchical", {"group_size": None}, 6)             # None: the default


# ---------------------------------------------------------------- refimpl train: flags and config

def test_the_command_line_offers_the_registered_algorithms():
    from refimpl.cli import build_parser
    assert CHOICES["allreduce"] == tuple(ALGORITHMS)
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    train = commands.choices["train"]
    flag = next(a for a in train._actions if "--allreduce" in a.option_strings)
    assert sorted(flag.choices) == sorted(ALGORITHMS)
    help_text = next(a for a in train._actions if "--allreduce-option" in a.option_strings).help
    assert all(o.name in help_text for a in ALGORITHMS.values() for o in a.options)


def test_importing_the_registry_starts_no_mpi():
    code = "import sys, refimpl.parallel.allreduce, refimpl.config; sys.exit('mpi4py.MPI' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def given(argv, tmp_path=None, toml=None):
    from refimpl.cli import build_parser
    from refimpl.commands.train import given_settings
    if toml is not None:
        path = tmp_path / "run.toml"
        path.write_text(toml)
        argv = argv + ["--config", str(path)]
    return given_settings(build_parser().parse_args(["train"] + argv))


def test_allreduce_option_flags(tmp_path):
    assert given(["--allreduce", "multicolor", "--allreduce-option", "colors=4"])["allreduce_options"] == \
        {"colors": 4}
    assert given(["--allreduce-option", "colors=4", "--allreduce-option", "colors=5"])["allreduce_options"] == \
        {"colors": 5}                                                   # the last wins
    assert given(["--allreduce-option", "group-size=2"])["allreduce_options"] == {"group_size": 2}
    assert given(["--allreduce-option", "mode=fast"])["allreduce_options"] == {"mode": "fast"}
    assert "allreduce_options" not in given([])
    with pytest.raises(ValueError, match=r"--allreduce-option must be NAME=VALUE \(e.g. colors=4\), got 'colors'"):
        given(["--allreduce-option", "colors"])
    # over the file's table, option by option; a flag naming another algorithm drops the file's options
    toml = 'allreduce = "multicolor"\n[allreduce_options]\ncolors = 3\n'
    assert given([], tmp_path, toml)["allreduce_options"] == {"colors": 3}
    assert given(["--allreduce-option", "colors=6"], tmp_path, toml)["allreduce_options"] == {"colors": 6}
    assert "allreduce_options" not in given(["--allreduce", "ring"], tmp_path, toml)


def test_allreduce_options_in_the_config():
    cfg = merge({"allreduce": "multicolor", "allreduce_options": {"colors": 4}})
    assert cfg["allreduce_options"] == {"colors": 4} and merge({})["allreduce_options"] == {}
    assert merge({"allreduce": "hierarchical", "allreduce_options": {"group_size": 3}})["allreduce_options"] == \
        {"group_size": 3}                                               # divides p? checked at the start
    for layer, match in [
        ({"allreduce": "ring", "allreduce_options": {"colors": 4}},
         r"^allreduce_options: algorithm 'ring' takes no option\(s\) \['colors'\]; its options: none$"),
        ({"allreduce": "multicolor", "allreduce_options": {"colors": 0}},
         r"^allreduce_options: colors must be an int >= 1, got 0$"),
        ({"allreduce": "multicolor", "allreduce_options": {"colour": 4}},
         r"takes no option\(s\) \['colour'\]; its options: colors \(an int >= 1, the number of trees k; default 2\)"),
        ({"allreduce": "multicolor", "allreduce_options": 4}, r"^allreduce_options must be a table"),
    ]:
        with pytest.raises(ValueError, match=match):
            merge(layer)
    # a later layer (flags, a resumed run's new settings) naming another algorithm drops the earlier options
    saved = {"allreduce": "multicolor", "allreduce_options": {"colors": 4}}
    assert merge(saved, {"allreduce": "ring"})["allreduce_options"] == {}
    assert merge(saved, {"allreduce": "multicolor"})["allreduce_options"] == {"colors": 4}
    assert merge(saved, {"allreduce_options": {"colors": 2}})["allreduce_options"] == {"colors": 2}


# ---------------------------------------------------------------- the docs

def test_docs_table_names_every_algorithm_and_its_options():
    """docs/communication.md, "The allreduce algorithms": one row per registered algorithm (and
    none for an algorithm that is not), with its options."""
    text = (ROOT / "docs" / "communication.md").read_text()
    section = text.split("## The allreduce algorithms", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)` \|.*$", section, re.M)}
    assert sorted(rows) == sorted(ALGORITHMS)
    for algorithm in ALGORITHMS.values():
        cells = rows[algorithm.name].split(" | ")
        assert all(f"`{o.name}`" in cells[2] for o in algorithm.options), (algorithm.name, cells[2])


def test_train_passes_the_options_to_the_gradient_allreduce(tmp_path):
    """``--allreduce-option`` reaches the synchroniser: a group size that does not divide the ranks is
    refused there (exit 2, one line), a valid one trains and is recorded in config.json."""
    import json
    import os
    import shutil
    root = Path(__file__).resolve().parent.parent
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("REFIMPL_")},
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_NUM_THREADS": "1"}
    base = [shutil.which("mpiexec"), "--oversubscribe", "-n", "2", sys.executable, "-m", "refimpl", "train",
            "--preset", "tiny", "--gen-samples", "4", "--gen-val-samples", "0", "--grid", "2,1,1,1",
            "--global-batch", "2", "--steps", "1", "--quiet", "--no-plot"]
    bad = subprocess.run(base + ["--out", str(tmp_path / "bad"), "--allreduce", "hierarchical",
                                 "--allreduce-option", "group_size=3"], env=env, cwd=root,
                         capture_output=True, text=True, timeout=300)
    lines = [line for line in bad.stderr.splitlines() if line.startswith("refimpl")]
    assert bad.returncode == 2 and len(lines) == 1 and "group_size" in lines[0], bad.stderr
    good = subprocess.run(base + ["--out", str(tmp_path / "good"), "--allreduce", "multicolor",
                                  "--allreduce-option", "colors=2"], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert good.returncode == 0, good.stderr
    assert json.loads((tmp_path / "good" / "config.json").read_text())["allreduce_options"] == {"colors": 2}
