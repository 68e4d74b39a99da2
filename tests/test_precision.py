"""The float32 precision policy (refimpl/precision.py): no TF32 unless asked, and never where an
exact reference is compared (check-layer, the oracle) or in a float64 run.  Checked on the CPU:
a job script that would lower a GPU run's precision is caught anywhere."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from refimpl import precision
from refimpl.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_cupy_gets_tf32_only_when_asked():
    for environ, want, source in (({}, "0", None), ({"CUPY_TF32": "0"}, "0", None),
                                  ({"REFIMPL_TF32": "1"}, "1", "REFIMPL_TF32=1"),
                                  ({"REFIMPL_TF32": "off", "CUPY_TF32": "1"}, "1", "CUPY_TF32=1")):
        assert precision.apply("train", environ) == source
        assert environ["CUPY_TF32"] == want, environ
        assert environ.get("NVIDIA_TF32_OVERRIDE") == ("0" if source is None else None), environ
    with pytest.raises(ValueError, match="REFIMPL_TF32 must be a boolean"):
        precision.apply("train", {"REFIMPL_TF32": "maybe"})


@pytest.mark.parametrize("variable", ["REFIMPL_TF32", "CUPY_TF32"])
@pytest.mark.parametrize("argv", [
    ["check-layer", "conv3d", "--input", "1,1,4,4,4", "--grid", "1,1,1,1"],
    ["oracle", "generate", "hard", "--out", "cases"],
])
def test_exact_commands_refuse_tf32(monkeypatch, capsys, tmp_path, variable, argv):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(variable, "1")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{variable}=1 lets float32 matrix products round to TF32" in err
    assert f"refimpl {argv[0]} compares with an exact reference" in err
    assert not (tmp_path / "cases").exists()


def test_a_float64_run_refuses_tf32_and_a_float32_run_says_it_uses_it(tmp_path):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    common = [sys.executable, "-m", "refimpl", "train", "--steps", "1", "--gen-samples", "4", "--gen-val-samples", "0",
              "--no-plot", "--tf32"]
    proc = subprocess.run(common + ["--dtype", "float64", "--out", str(tmp_path / "a")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stderr
    assert "REFIMPL_TF32=1 asks for TF32 float32 matrix products, but this run computes in float64" in proc.stderr
    proc = subprocess.run(common + ["--out", str(tmp_path / "b")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "note: REFIMPL_TF32=1: float32 matrix products on a GPU may round to TF32" in proc.stdout
