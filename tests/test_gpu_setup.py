"""GPU set-up without a GPU: one device per rank from the local rank, and whether the MPI
library is CUDA-aware (what a run on device arrays says at its start)."""
import types

import pytest

from refimpl import backend
from refimpl.parallel import buffers


@pytest.mark.parametrize("environ, expected", [
    ({}, None),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "3"}, 3),
    ({"SLURM_LOCALID": "1"}, 1),
    ({"MPI_LOCALRANKID": "2"}, 2),
    ({"MV2_COMM_WORLD_LOCAL_RANK": "5"}, 5),
    ({"PALS_LOCAL_RANKID": "7"}, 7),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "", "SLURM_LOCALID": "4"}, 4),     # empty: not set
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "x"}, None),
])
def test_local_rank(environ, expected):
    assert backend.local_rank(environ) == expected


def test_device_for():
    assert [backend.device_for(r, 4) for r in range(6)] == [0, 1, 2, 3, 0, 1]   # round-robin
    assert backend.device_for(None, 8) == 0
    with pytest.raises(ValueError, match="no CUDA device"):
        backend.device_for(0, 0)


def test_select_device_uses_the_local_rank(monkeypatch):
    used = []
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 4),
        Device=lambda i: types.SimpleNamespace(use=lambda: used.append(i))))
    monkeypatch.setattr(backend, "_cupy", lambda: fake)
    monkeypatch.setattr(backend, "_selected_device", None)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "6")
    assert backend.select_device() == 2 and backend.select_device() == 2
    assert used == [2]                                  # once per process


OMPI5 = "mca:opal:base:param:opal_built_with_cuda_support:value:{}\n"
OMPI4 = "mca:mpi:base:param:mpi_built_with_cuda_support:value:{}\n"


@pytest.mark.parametrize("environ, version, info, expected", [
    ({"MPICH_GPU_SUPPORT_ENABLED": "1"}, "MPICH", None, "yes"),
    ({"MPIR_CVAR_ENABLE_GPU": "1"}, "MPICH Version: 4.1", None, "yes"),
    ({}, "Open MPI v5.0.3", OMPI5.format("true"), "yes"),
    ({}, "Open MPI v5.0.3", OMPI5.format("false"), "no"),
    ({}, "Open MPI v4.1.5", OMPI4.format("true"), "yes"),
    ({}, "Open MPI v4.1.5", "nothing here", "unknown"),
    ({}, "Intel(R) MPI Library 2021", None, "unknown"),
])
def test_mpi_cuda_support(environ, version, info, expected):
    answer, how = buffers.mpi_cuda_support(environ, version, info)
    assert answer == expected and how


def test_mpi_cuda_support_of_this_mpi():
    """The real query runs (this machine's Open MPI is built without CUDA)."""
    answer, how = buffers.mpi_cuda_support()
    assert answer in ("yes", "no", "unknown") and how


def test_device_path_report(monkeypatch):
    monkeypatch.setattr(buffers, "_cuda_aware", True)
    with pytest.raises(ValueError, match="no CUDA support .*unset it"):
        buffers.device_path_report("cupy", ("no", "ompi_info: opal_built_with_cuda_support"))
    assert "handed to MPI directly" in buffers.device_path_report("cupy", ("yes", "MPIX_Query_cuda_support"))
    assert "unset REFIMPL_CUDA_AWARE" in buffers.device_path_report("cupy", ("unknown", "?"))
    assert "direct" in buffers.device_path_report("strict")          # host memory: any MPI
    monkeypatch.setattr(buffers, "_cuda_aware", False)
    line = buffers.device_path_report("cupy", ("yes", "MPIX_Query_cuda_support"))
    assert "staged through host memory" in line and "REFIMPL_CUDA_AWARE=1 would" in line
    assert "staged" in buffers.device_path_report("cupy", ("no", "x"))      # staging always works


SCRIPT = __import__("pathlib").Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.sh"


def test_gpu_check_script(tmp_path):
    """scripts/gpu_check.sh: --dry-run lists the GPU lane's commands (layers and models on CuPy
    against the host, every layer's check-layer, the cuDNN benchmark, CosmoFlow at
    128^3), each with options the commands accept; without a usable GPU it stops with exit 2
    and one message, having run nothing."""
    import subprocess
    dry = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0, dry.stderr
    lines = [line[2:] for line in dry.stdout.splitlines() if line.startswith("+ ")]
    assert any("python -m pytest -q -p no:cacheprovider tests/test_device_arrays.py" in c for c in lines)
    assert sum("check-layer" in c for c in lines) >= 24
    assert any("bench_layers.py --device cuda" in c for c in lines)
    assert any("--preset mlperf --backend cupy" in c for c in lines)
    assert any("bench_train.py --device cuda --tf32 off" in c and "2,1,1,1" in c for c in lines)
    assert any("bench_train.py --device cuda --tf32 on" in c and "2,1,1,1" in c for c in lines)
    # bench_train's lines parse, at MLPerf's CosmoFlow and the default U-Net sizes (its --device cuda defaults)
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_train", SCRIPT.parent / "bench_train.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    runs = [bench.parse_args(c.split("bench_train.py ", 1)[1].split()) for c in lines if "bench_train.py" in c]
    assert sorted(a.tf32 for a in runs) == ["off", "on"]
    for a in runs:
        assert (a.device, a.size, a.width, a.layers, a.kernel, a.unet_width, a.unet_layers) == (
            "cuda", 128, 32, 5, 2, 32, 3)
        assert a.grids == ["1,1,1,1", "2,1,1,1"] and a.models == ["cosmoflow", "unet3d"]
    # every refimpl train / check-layer line parses (argparse of the real commands)
    from refimpl.cli import build_parser
    parser = build_parser()
    for c in lines:
        if "python -m refimpl" in c:
            argv = c.split("python -m refimpl ", 1)[1].split()
            parser.parse_args(argv)
    real = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=120)
    try:
        import cupy
        has_gpu = cupy.is_available()
    except Exception:                                   # noqa: BLE001 - no CuPy or no CUDA
        has_gpu = False
    if not has_gpu:
        assert real.returncode == 2 and "finds no CUDA device" in real.stderr
        assert "+ " not in real.stdout
        assert not (tmp_path / "out").exists()          # no empty output folder left behind


@pytest.mark.parametrize("fake_cupy, says, not_says", [
    ("raise ImportError('no module named cupy_backends')", "CuPy is not installed", "finds no CUDA device"),
    ("def is_available():\n    return False\n", "CuPy is installed but finds no CUDA device", "pip install"),
    ("def is_available():\n    raise RuntimeError('CUDA driver version is insufficient')\n",
     "CuPy is installed but finds no CUDA device", "pip install"),
], ids=["cupy-missing", "no-device", "broken-driver"])
def test_gpu_check_says_what_is_missing(tmp_path, fake_cupy, says, not_says):
    """Without a usable GPU, gpu_check.sh names what is missing, CuPy itself (then: how to
    install it) or a device CuPy can see (then: not an install problem), runs nothing and
    creates no output folder.  A stand-in ``cupy`` module first on PYTHONPATH plays each case."""
    import os
    import subprocess
    fake = tmp_path / "fake"
    (fake / "cupy").mkdir(parents=True)
    (fake / "cupy" / "__init__.py").write_text(fake_cupy)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr and not_says not in proc.stderr and "nothing was run" in proc.stderr, proc.stderr
    assert "+ " not in proc.stdout and not (tmp_path / "out").exists()
