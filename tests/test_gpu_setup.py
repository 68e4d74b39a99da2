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
