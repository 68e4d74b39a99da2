"""scripts/probe_faults.py, the fault probe's failing rows re-run (issue 41): its flags, a
check that fails is reported as FAILS (exit 1), and three cheap rows run for real (outputs onto
special files, a digest stored as an array, the newcomer's CLI errors), each of which must hold
on the current code, leaving no temporary directory behind."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "probe_faults.py"
FIELDS = {"row", "done", "then", "expected", "exit_codes", "seconds", "verdict", "detail"}


def probe(*args, timeout=180, env=None):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def load_script():
    spec = importlib.util.spec_from_file_location("probe_faults", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_and_bad_flags(tmp_path):
    proc = probe("--help")
    assert proc.returncode == 0 and "--only" in proc.stdout and "the probe saw then" in proc.stdout
    assert "12  train --bogus" in proc.stdout                       # the rows, by number, for --only
    for bad in ("x", "0", "1,1", "13", "", "1,,2", "9;12"):
        proc = probe("--only", bad)
        assert proc.returncode == 2 and "argument --only" in proc.stderr and "1-12" in proc.stderr, (bad, proc.stderr)
        assert "Traceback" not in proc.stderr
    proc = probe("--only", "9", "--json", str(tmp_path / "no" / "such" / "dir.json"))
    assert proc.returncode == 2 and "--json" in proc.stderr and "no directory" in proc.stderr, proc.stderr


def test_a_check_that_fails_is_reported(tmp_path, capsys, monkeypatch):
    """The verdict is the check's: a row whose expectation does not hold is FAILS with what was
    seen, the exit codes seen so far kept, the table still printed, the exit status 1."""
    module = load_script()

    def wrong(tmp, codes):
        codes.append(module.expect(module.refimpl("train", "--step", "10"), 2, "did you mean --steps?"))
        module.expect(module.refimpl("train", "--bogus"), 0)                 # it exits 2

    monkeypatch.setattr(module, "ROWS", [(12, "train --bogus expected to pass", "-", "0", wrong)])
    assert module.main(["--only", "12", "--json", str(tmp_path / "r.json")]) == 1
    out = capsys.readouterr().out
    assert "| 12 | train --bogus expected to pass | - | 0 | 2 |" in out and "| FAILS: exit 2, expected 0" in out, out
    assert "0 of 1 rows hold" in out
    (row,) = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert row["verdict"] == "FAILS" and row["exit_codes"] == [2] and "unrecognized arguments" in row["detail"]


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="the probe needs mpiexec (refimpl[mpi])")
def test_cheap_rows_hold(tmp_path):
    out, scratch = tmp_path / "probe.json", tmp_path / "scratch"
    scratch.mkdir()
    proc = probe("--only", "1,9,12", "--json", str(out), env=dict(os.environ, TMPDIR=str(scratch)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert set(report) == {"rows", "seconds", "load_average"} and report["seconds"] > 0
    assert [r["row"] for r in report["rows"]] == [1, 9, 12]
    for r in report["rows"]:
        assert set(r) == FIELDS, r
        assert r["verdict"] == "holds" and r["exit_codes"] and set(r["exit_codes"]) == {2}, r
        assert r["then"] and r["expected"] and r["seconds"] > 0
    # where mknod is permitted (root), row 1 also writes onto a character device: four commands per node
    row1 = report["rows"][0]
    assert len(row1["exit_codes"]) == (4 if "not permitted" in row1["detail"] else 8), row1
    assert "| 9 | a case_digest stored as an array |" in proc.stdout and "3 of 3 rows hold" in proc.stdout
    assert list(scratch.iterdir()) == []          # its temporary directory gone, Open MPI's inside it
