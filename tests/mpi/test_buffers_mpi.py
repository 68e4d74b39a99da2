"""Device buffers through real MPI without a GPU: host memory exposing only
__cuda_array_interface__ goes through buffers.py and mpi4py's CUDA-array route,
CUDA-aware (handed over directly) and staged (copied through host memory)."""
import numpy as np
import pytest
from mpi4py import MPI

from refimpl import backend
from refimpl.parallel import buffers, fake_device
from refimpl.parallel.buffers import finish_recv, recv_buffer, send_buffer
from refimpl.parallel.fake_device import HostDeviceArray


@pytest.fixture(params=[True, False], ids=["cuda-aware", "staged"])
def aware(request, monkeypatch):
    monkeypatch.setattr(buffers, "array_module", fake_device.array_module)
    monkeypatch.setattr(backend, "synchronize", lambda a=None: None)
    was = buffers.cuda_aware()
    buffers.set_cuda_aware(request.param)
    yield request.param
    buffers.set_cuda_aware(was)


def test_isend_recv_ring(comm, all_ranks_agree, aware):
    rank, size = comm.Get_rank(), comm.Get_size()
    x = HostDeviceArray(np.arange(6.0).reshape(2, 3) + 10 * rank)
    out = send_buffer(x)
    request = comm.Isend(out, dest=(rank + 1) % size, tag=5)
    buf = recv_buffer(x.shape, x.dtype, like=x)
    comm.Recv(buf, source=(rank - 1) % size, tag=5)
    request.Wait()
    got = finish_recv(buf, like=x)
    expected = np.arange(6.0).reshape(2, 3) + 10 * ((rank - 1) % size)
    all_ranks_agree(buffers.is_device(got) and (out is x) == aware and np.array_equal(got.host, expected),
                    f"aware={aware} got {getattr(got, 'host', got)}")


def test_allreduce(comm, all_ranks_agree, aware):
    rank, size = comm.Get_rank(), comm.Get_size()
    x = HostDeviceArray(np.linspace(0.0, 1.0, 5) * (rank + 1))
    buf = recv_buffer(x.shape, x.dtype, like=x)
    comm.Allreduce(send_buffer(x), buf, op=MPI.SUM)
    got = finish_recv(buf, like=x)
    expected = np.linspace(0.0, 1.0, 5) * size * (size + 1) / 2
    all_ranks_agree(buffers.is_device(got) and np.allclose(got.host, expected, rtol=1e-15),
                    f"aware={aware} got {got.host}")
