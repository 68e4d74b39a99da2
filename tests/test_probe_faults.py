"""scripts/probe_faults.py, the fault probe's failing rows re-run (issue 41): its flags, and
three cheap rows run for real (outputs onto special files, a digest stored as an array, the
newcomer's CLI errors), each of which must hold on the current code."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "probe_faults.py"


def probe(*args, timeout=180):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def test_help_and_bad_flags():
    proc = probe("--help")
    assert proc.returncode == 0 and "--only" in proc.stdout and "the probe saw then" in proc.stdout
    for bad in ("x", "0", "1,1", "13"):
        proc = probe("--only", bad)
        assert proc.returncode == 2 and "--only" in proc.stderr, (bad, proc.stderr)


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="the probe needs mpiexec (refimpl[mpi])")
def test_cheap_rows_hold(tmp_path):
    out = tmp_path / "probe.json"
    proc = probe("--only", "1,9,12", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert [r["row"] for r in report["rows"]] == [1, 9, 12]
    for r in report["rows"]:
        assert r["verdict"] == "holds" and r["exit_codes"] and set(r["exit_codes"]) == {2}, r
        assert r["then"] and r["expected"] and r["seconds"] > 0
    assert "| 9 | a case_digest stored as an array |" in proc.stdout and "3 of 3 rows hold" in proc.stdout
