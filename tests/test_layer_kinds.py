"""A layer kind declares its options and its statistics (issue 40, items 1 and 2).

A toy kind registered in the test (``SHIFT``: y = x - shift_by * mean_c(x), its option
``shift_by`` and its statistic ``xsum_partial``) gets a check-layer flag with its --help, a suite
key, a ``LayerCheck`` / ``CaseSpec`` option and its statistics in case files, with no line of
refimpl/check.py, refimpl/commands/ or refimpl/oracle/ naming it; the built-in options keep
their flags, defaults and messages; ``REFIMPL_KINDS`` registers kinds from files and refuses
bad values in one line; nothing outside refimpl/layers/ lists a kind's options.
"""
import argparse
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from refimpl import layers
from refimpl.check import LayerCheck
from refimpl.layers import Option, Statistic
from refimpl.oracle import load_case, parse_suite, write_case

ROOT = Path(__file__).resolve().parent.parent
AXES = (0, 2, 3, 4)


def per_channel(spec, layout=None):
    return (spec.input[1],) if layout is None else (layout.in_channels[1] - layout.in_channels[0],)


class ShiftKind(layers.LayerKind):
    """y = x - shift_by * mean_c(x): an option of its own, statistics of its own."""
    name = "toy_shift"
    options = (Option("shift_by", float, 1.0, "subtract SHIFT_BY times the channel mean", metavar="SHIFT_BY",
                      validate=math.isfinite, rule="a finite number"),)
    statistics = (Statistic("xsum_partial", "per-channel sum of x", per_channel),)
    dx_reads_forward = False

    def forward(self, spec, x, w, b):
        return x - spec.options["shift_by"] * x.mean(axis=AXES, keepdims=True), None

    def backward(self, spec, dy, saved):
        return dy - spec.options["shift_by"] * dy.mean(axis=AXES, keepdims=True), None, None

    def reduction_length(self, spec, tensor, out_shape):
        return math.prod(spec.input) // spec.input[1], "N·D·H·W"

    def rank_partials(self, spec, inputs, layout):
        return {"xsum_partial": (inputs["x"][layout.index("x")].sum(axis=AXES), [layout.in_channels[0]])}


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(layers.REGISTRY, ShiftKind.name, ShiftKind())
    return ShiftKind.name


def parser():
    from refimpl.commands import check_layer
    p = argparse.ArgumentParser()
    check_layer.add_arguments(p)
    return p


def parse(*argv):
    from refimpl.commands import check_layer
    return check_layer.parse_check(parser().parse_args(list(argv)), 1)


BASE = ("--input", "2,3,4,4,4", "--grid", "1,1,1,1")


# ---------------------------------------------------------------- a toy kind's option

def test_a_kinds_option_is_a_flag_with_help(toy):
    help_text = parser().format_help()
    assert "--shift-by SHIFT_BY" in help_text
    assert re.search(r"subtract SHIFT_BY times the channel mean\s+\(toy_shift\)", help_text), help_text
    check = parse(toy, *BASE, "--shift-by", "0.25")
    assert check.options == {"shift_by": 0.25} and check.shift_by == 0.25
    assert parse(toy, *BASE).options == {"shift_by": 1.0}                     # its default
    with pytest.raises(ValueError, match=r"^--shift-by applies to toy_shift only$"):
        parse("conv3d", *BASE, "--shift-by", "2")
    with pytest.raises(ValueError, match=r"^--shift-by must be a finite number, got inf$"):
        parse(toy, *BASE, "--shift-by", "inf")
    with pytest.raises(ValueError, match=r"^--groups applies to conv3d / conv_transpose3d only$"):
        parse(toy, *BASE, "--groups", "3")


def test_a_kinds_option_is_a_suite_key_and_in_its_case_file(toy, tmp_path):
    specs = parse_suite({"case": [{"name": "shift", "layer": toy, "input": [2, 3, 5, 4, 3], "shift_by": 0.5,
                                   "grids": [[1, 2, 1, 1], [1, 1, 3, 1]]}]}, "t")
    assert [s.options for s in specs] == [{"shift_by": 0.5}] * 2 and specs[0].shift_by == 0.5
    for bad, message in (({"shift_by": "half"}, "shift_by must be a number, got 'half'"),
                         ({"shift_by": float("nan")}, "shift_by must be a finite number"),
                         ({"groups": 2}, "groups applies to conv3d / conv_transpose3d only"),
                         ({"shift_bye": 1.0}, "unknown key(s) ['shift_bye']")):
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_suite({"case": [{"name": "s", "layer": toy, "input": [2, 3, 5, 4, 3], "grids": [[1, 2, 1, 1]],
                                   **bad}]}, "t")
    with pytest.raises(ValueError, match=re.escape("shift_by applies to toy_shift only")):
        parse_suite({"case": [{"name": "s", "layer": "conv3d", "input": [2, 3, 5, 4, 3], "grids": [[1, 2, 1, 1]],
                               "shift_by": 2.0}]}, "t")
    case = load_case(write_case(specs[1], str(tmp_path)))          # H = 4 over 3 ranks: uneven
    assert case.spec == specs[1] and case.spec.options == {"shift_by": 0.5}
    shapes = [case.ranks["float64"][r]["xsum_partial"][0].shape for r in range(3)]
    assert shapes == [(3,)] * 3
    x = case.inputs["float64"]["x"]
    total = sum(case.ranks["float64"][r]["xsum_partial"][0] for r in range(3))
    assert np.allclose(total, x.sum(axis=AXES))


def test_the_statistics_plant_is_offered_by_statistics(toy, tmp_path):
    pytest.importorskip("torch")
    from refimpl.oracle import torch_adapter
    spec, = parse_suite({"case": [{"name": "shift", "layer": toy, "input": [2, 3, 5, 4, 3],
                                   "grids": [[1, 2, 1, 1]], "dtypes": ["float64"]}]}, "t")
    case = load_case(write_case(spec, str(tmp_path)))
    assert torch_adapter.parse_plant("local-stats", case) == ("local-stats", None)
    conv, = parse_suite({"case": [{"name": "c", "layer": "conv3d", "input": [1, 2, 5, 4, 3],
                                   "grids": [[1, 2, 1, 1]], "dtypes": ["float64"]}]}, "t")
    conv_case = load_case(write_case(conv, str(tmp_path)))
    with pytest.raises(ValueError, match="reduces no statistics"):
        torch_adapter.parse_plant("local-stats", conv_case)
    with pytest.raises(ValueError, match="--plant must be one of"):
        torch_adapter.parse_plant("bn-local-stats", case)


def test_statistics_that_disagree_with_their_declaration_are_refused(monkeypatch, tmp_path):
    """A kind whose rank_partials gives a statistic of another shape than it declares (group
    norm's per-(sample, group) sums declared per channel): generate fails, naming both."""
    class Wrong(ShiftKind):
        statistics = (Statistic("xsum_partial", "declared per sample", lambda spec, lo=None: (spec.input[0],)),)
    monkeypatch.setitem(layers.REGISTRY, ShiftKind.name, Wrong())
    spec, = parse_suite({"case": [{"name": "w", "layer": ShiftKind.name, "input": [2, 3, 5, 4, 3],
                                   "grids": [[1, 2, 1, 1]], "dtypes": ["float64"]}]}, "t")
    with pytest.raises(RuntimeError, match=re.escape("rank_partials gives rank 0 xsum_partial of shape (3,), its "
                                                     "Statistic declares (2,)")):
        write_case(spec, str(tmp_path))


# ---------------------------------------------------------------- the built-in options, unchanged

def test_builtin_options_keep_their_flags_and_defaults():
    flags = {s for a in parser()._actions for s in a.option_strings}
    assert {"--ceil-mode", "--no-ceil-mode", "--count-include-pad", "--no-count-include-pad",
            "--divisor-override", "--groups"} <= flags
    args = parser().parse_args(["avg_pool3d", *BASE])
    assert (args.ceil_mode, args.count_include_pad, args.divisor_override, args.groups) == (False, True, None, 1)
    assert parse("avg_pool3d", *BASE).options == {"ceil_mode": False, "count_include_pad": True,
                                                  "divisor_override": None}
    assert parse("conv3d", *BASE).options == {"groups": 1}
    assert parse("batch_norm3d", *BASE).options == {}
    check = LayerCheck(layer="max_pool3d", input=(1, 2, 6, 6, 6), grid=(1, 1, 1, 1), kernel=2, ceil_mode=True)
    assert check.options == {"ceil_mode": True} and check.ceil_mode is True and check.groups == 1
    for kwargs, message in ((dict(layer="max_pool3d", count_include_pad=False), "--no-count-include-pad applies to "
                             "avg_pool3d only"),
                            (dict(layer="conv3d", ceil_mode=True), "--ceil-mode applies to max_pool3d / avg_pool3d "
                             "only"),
                            (dict(layer="avg_pool3d", count_include_pad=1), "--count-include-pad must be true or "
                             "false, got 1"),
                            (dict(layer="avg_pool3d", divisor_override=0), "--divisor-override must be a nonzero "
                             "integer, got 0"),
                            (dict(layer="conv3d", groups=True), "--groups must be a positive integer, got True")):
        with pytest.raises(ValueError, match=re.escape(message)):
            LayerCheck(input=(1, 2, 6, 6, 6), grid=(1, 1, 1, 1), kernel=2, **kwargs)
    with pytest.raises(TypeError, match="unknown option"):
        LayerCheck(layer="conv3d", input=(1, 2, 6, 6, 6), grid=(1, 1, 1, 1), ceil_mod=True)


def test_register_refuses_options_that_clash(monkeypatch):
    class Clash(ShiftKind):
        name = "clash"
        options = (Option("groups", int, 2, "another groups"),)

    class Reserved(ShiftKind):
        name = "reserved"
        options = (Option("kernel", int, 1, "a window argument"),)
    for kind, message in ((Clash(), "differs from the one of conv3d"), (Reserved(), "an argument every kind has")):
        with pytest.raises(ValueError, match=message):
            layers.register(kind)
        assert kind.name not in layers.REGISTRY


# ---------------------------------------------------------------- REFIMPL_KINDS

TOY_FILE = '''
from refimpl import layers
from refimpl.layers import Option


class Tiny(layers.LayerKind):
    name = "tiny_from_file"
    options = (Option("tiny_level", int, 0, "a level"),)


layers.register(Tiny())
'''


def run_refimpl(env_kinds, *args, cwd):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMI_", "REFIMPL_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    if env_kinds is not None:
        env["REFIMPL_KINDS"] = env_kinds
    return subprocess.run([sys.executable, "-m", "refimpl", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=120)


def test_refimpl_kinds_registers_a_file(tmp_path):
    (tmp_path / "tiny.py").write_text(TOY_FILE)
    proc = run_refimpl("tiny.py", "check-layer", "--help", cwd=tmp_path)
    assert proc.returncode == 0 and "tiny_from_file" in proc.stdout and "--tiny-level" in proc.stdout, proc.stderr
    assert "tiny_from_file" not in run_refimpl(None, "check-layer", "--help", cwd=tmp_path).stdout


@pytest.mark.parametrize("value, files, message", [
    ("tiny.txt", {}, "REFIMPL_KINDS must be a comma-separated list of Python files (FILE.py), got 'tiny.txt'"),
    ("tiny.py,", {}, "REFIMPL_KINDS must be a comma-separated list of Python files"),
    ("missing.py", {}, "REFIMPL_KINDS='missing.py' cannot be used: no such file missing.py"),
    ("empty.py", {"empty.py": "x = 1\n"}, "empty.py registers no layer kind"),
    ("broken.py", {"broken.py": "raise RuntimeError('boom')\n"}, "broken.py failed: RuntimeError: boom"),
    ("twice.py", {"twice.py": "from refimpl import layers\nlayers.register(layers.lookup('conv3d'))\n"},
     "twice.py failed: ValueError: layer kind 'conv3d': needs a name no other kind has"),
])
def test_refimpl_kinds_refuses_bad_values_in_one_line(tmp_path, value, files, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    proc = run_refimpl(value, "check-layer", "conv3d", "--input", "1,1,3,3,3", "--grid", "1,1,1,1", cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------- nothing outside layers/ lists an option

def test_no_option_or_statistic_is_listed_outside_the_kinds():
    """check.py, commands/, the oracle (but its model-trace tools) and plan.py name no option and
    no statistic of a kind: they read ``LayerKind.options`` and ``LayerKind.statistics``."""
    names = {o.name for o in layers.all_options().values()} | {
        s for k in layers.REGISTRY.values() for s in k.statistic_names()}
    files = [ROOT / "refimpl/check.py", ROOT / "refimpl/plan.py", *sorted((ROOT / "refimpl/commands").glob("*.py")),
             *[p for p in sorted((ROOT / "refimpl/oracle").glob("*.py")) if not p.name.startswith("trace")]]
    found = []
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if re.search(r"[\"']({})[\"']".format("|".join(map(re.escape, names))), code):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


# ---------------------------------------------------------------- group norm and instance norm

NORM_SUITE = {"case": [
    {"name": "groupnorm_spatial", "layer": "group_norm3d", "input": [2, 4, 5, 4, 3], "num_groups": 2,
     "grids": [[1, 2, 1, 1], [2, 1, 2, 1], [1, 1, 3, 1]]},
    {"name": "instancenorm_empty_block", "layer": "instance_norm3d", "input": [2, 3, 5, 2, 3],
     "grids": [[1, 1, 3, 1]]},
    {"name": "groupnorm_channel_parallel", "layer": "group_norm3d", "input": [2, 4, 4, 3, 3], "num_groups": 2,
     "model_parallel": "channel", "grids": [[1, 2, 1, 1, 2]]}]}


def test_group_and_instance_norm_cases_pass_and_their_statistics_plant_is_diagnosed(tmp_path):
    """Case files of group / instance norm hold every rank's per-(sample, group) sums; PyTorch
    passes them on spatial, data, empty-block and channel-split grids; with the statistics left
    unreduced (local-stats) y fails, diagnosed as not reduced over the spatial group."""
    pytest.importorskip("torch")
    from refimpl.oracle import compare, load_results, torch_adapter, write_results
    from refimpl.oracle.compare import root_cause
    (tmp_path / "cases").mkdir()
    for spec in parse_suite(NORM_SUITE, "norm"):
        case = load_case(write_case(spec, str(tmp_path / "cases")))
        n_r, g_r = case.ranks["float64"][0]["sum_partial"][0].shape
        assert g_r == (spec.options.get("num_groups", spec.input[1]) // (spec.grid[4] if len(spec.grid) == 5 else 1))
        for plant in (None, "local-stats"):
            glob, ranks = torch_adapter.run_case(case, torch_adapter.parse_plant(plant, case), "gathered")
            path = str(tmp_path / str(plant) / case.name)
            write_results(path, case, glob, ranks)
            report = compare(case, load_results(path, case))
            assert report.ok == (plant is None), (case.name, plant)
            if plant:
                cause = root_cause(report)
                assert cause.tensor == "y" and "not reduced over the spatial group" in cause.diagnosis, cause


def test_group_norm_options_and_splits_are_checked():
    assert parse("group_norm3d", "--input", "2,6,4,4,4", "--grid", "1,1,1,1", "--num-groups", "3").options == \
        {"num_groups": 3}
    assert parse("instance_norm3d", *BASE).options == {}
    for argv, message in ((("group_norm3d", *BASE, "--num-groups", "2"), "--num-groups 2 must divide the channels (3)"),
                          (("group_norm3d", *BASE, "--num-groups", "0"), "--num-groups must be a positive integer"),
                          (("instance_norm3d", *BASE, "--num-groups", "3"), "--num-groups applies to group_norm3d only"),
                          (("conv3d", *BASE, "--num-groups", "3"), "--num-groups applies to group_norm3d only")):
        with pytest.raises(ValueError, match=re.escape(message)):
            parse(*argv)
    with pytest.raises(ValueError, match="cut a group"):
        LayerCheck(layer="group_norm3d", input=(2, 6, 4, 4, 4), grid=(1, 1, 1, 1, 2), model_parallel="channel",
                   num_groups=3)
