"""The ``refimpl`` command's help, as a newcomer reads it (and as docs' CLI reference page
shows it, generated from the same parsers): every option says what it does, the options that
must be given are listed as required, no reST markup, and the presets are named per model."""
import argparse
import re

import pytest

from refimpl.cli import build_parser, main
from refimpl.models import PRESETS


def parsers(parser=None, path=("refimpl",)):
    """(path, parser) of the command and of every sub-command, depth first."""
    parser = parser or build_parser()
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, path + (name,))


ALL = list(parsers())


@pytest.mark.parametrize("path, parser", ALL, ids=[" ".join(p) for p, _ in ALL])
def test_help_is_complete_and_plain(path, parser):
    text = parser.format_help()
    assert "``" not in text, f"{' '.join(path)}: reST literal in the help"
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or \
                action.help is argparse.SUPPRESS:       # a sub-command's help is its own line
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help, f"{' '.join(path)} {name}: no help"
        if action.required and action.option_strings:
            group = next(g for g in parser._action_groups if action in g._group_actions)
            assert group.title.startswith("required arguments"), f"{' '.join(path)} {name}: not shown as required"


def test_required_options_are_listed_as_such():
    helps = {" ".join(p): parser.format_help() for p, parser in ALL}
    for command, flags in {"refimpl check-layer": ("--input", "--grid"), "refimpl datagen": ("--out",),
                           "refimpl oracle generate": ("--out",), "refimpl oracle run-torch": ("--out",),
                           "refimpl plan": ("--ranks",)}.items():
        section = helps[command].split("required arguments", 1)[1].split("\n\n", 1)[0]
        for flag in flags:
            assert re.search(rf"^\s+{flag}\b", section, re.M), (command, flag, section)


def test_train_preset_help_names_each_models_presets():
    train = dict(ALL)[("refimpl", "train")]
    preset = next(a for a in train._actions if "--preset" in a.option_strings).help
    for model, presets in PRESETS.items():
        assert f"{model} {', '.join(presets)}" in preset, (model, preset)
    plan = dict(ALL)[("refimpl", "plan")]
    preset = next(a for a in plan._actions if "--preset" in a.option_strings).help
    for model, presets in PRESETS.items():
        assert f"{model} {', '.join(presets)}" in preset, (model, preset)


@pytest.mark.parametrize("argv, usage, hint", [
    (["train", "--step", "10"], "usage: refimpl train", "--step: did you mean --steps?"),
    (["oracle", "trace", "check", "t.h5", "r.h5", "--jsn", "x"], "usage: refimpl oracle trace check",
     "--jsn: did you mean --json?"),
    (["plan", "--model", "cosmoflow", "--ranks", "2", "--bach", "4"], "usage: refimpl plan",
     "--bach: did you mean --batch?"),
    (["check-layer", "conv3d", "--input", "1,1,4,4,4", "--grid", "1,1,1,1", "--kernal", "3"],
     "usage: refimpl check-layer", "--kernal: did you mean --kernel?"),
])
def test_an_unknown_or_abbreviated_flag_names_its_command_and_the_closest_flag(capsys, argv, usage, hint):
    """No abbreviations (``--step 10`` is not ``--steps 10``); the error is the sub-command's,
    with its usage and the closest flag, exit 2 before anything runs."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and "unrecognized arguments" in err and hint in err


def test_no_far_fetched_suggestion(capsys):
    """Flags are compared without their dashes: ``--quiet`` to ``oracle generate`` (which has
    none) suggests nothing, where the shared ``--`` once made it "did you mean --out?"."""
    with pytest.raises(SystemExit) as exit_:
        main(["oracle", "generate", "SUITE", "--out", "x", "--quiet"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --quiet" in err and "did you mean" not in err
