"""buffers.py: host arrays pass through; device arrays are synchronised, then handed over
directly (CUDA-aware) or staged through host memory.  The device path runs without a GPU
on host memory exposing only __cuda_array_interface__ (refimpl.parallel.fake_device)."""
import importlib

import numpy as np
import pytest

from refimpl import backend
from refimpl.parallel import buffers, fake_device
from refimpl.parallel.fake_device import HostDeviceArray


@pytest.fixture
def device(monkeypatch):
    """Route buffers' array-module calls to the fake device; record stream synchronisations."""
    synced = []
    monkeypatch.setattr(buffers, "array_module", fake_device.array_module)
    monkeypatch.setattr(backend, "synchronize", lambda a=None: synced.append(a))
    was = buffers.cuda_aware()
    yield synced
    buffers.set_cuda_aware(was)


def test_host_arrays_pass_through_contiguous():
    a = np.arange(24.0).reshape(2, 3, 4)
    assert buffers.send_buffer(a) is a
    strided = buffers.send_buffer(a[:, ::2, 1:])
    assert strided.flags.c_contiguous and np.array_equal(strided, a[:, ::2, 1:])
    buf = buffers.recv_buffer((2, 3), np.float32, like=a)
    assert type(buf) is np.ndarray and buf.shape == (2, 3) and buf.dtype == np.float32
    assert buffers.finish_recv(buf, like=a) is buf


def test_fake_is_device_memory_only():
    fake = HostDeviceArray(np.ones(3))
    assert buffers.is_device(fake) and not buffers.is_device(np.ones(3))
    assert not hasattr(fake, "__array_interface__")
    with pytest.raises(TypeError):
        memoryview(fake)  # no buffer protocol: MPI must take the CUDA-array-interface route


@pytest.mark.parametrize("aware", [True, False])
def test_device_send_synchronises_then_hands_over_or_stages(device, aware):
    buffers.set_cuda_aware(aware)
    host = np.arange(12.0).reshape(3, 4)
    fake = HostDeviceArray(host)
    out = buffers.send_buffer(fake)
    assert device == [fake]  # the stream was synchronised before MPI may read
    if aware:
        assert out is fake
    else:
        assert type(out) is np.ndarray and np.array_equal(out, host) and out.ctypes.data != host.ctypes.data


def test_device_send_makes_strided_arrays_contiguous(device):
    buffers.set_cuda_aware(True)
    host = np.arange(24.0).reshape(4, 6)
    out = buffers.send_buffer(HostDeviceArray(host[:, 1::2]))
    assert out.__cuda_array_interface__["strides"] is None and np.array_equal(out.host, host[:, 1::2])
    assert len(device) == 1 and device[0] is out  # synchronised after the device-side copy


@pytest.mark.parametrize("aware", [True, False])
def test_device_receive_allocates_in_the_right_memory_and_lands_on_device(device, aware):
    buffers.set_cuda_aware(aware)
    like = HostDeviceArray(np.zeros(2))
    buf = buffers.recv_buffer((2, 5), np.float64, like=like)
    assert buffers.is_device(buf) == aware and buf.shape == (2, 5)
    if not aware:
        buf[...] = 7.0  # MPI writes into the host staging buffer
    else:
        buf.host[...] = 7.0
    got = buffers.finish_recv(buf, like=like)
    assert buffers.is_device(got) and np.array_equal(got.host, np.full((2, 5), 7.0))
    assert (got is buf) == aware


def test_switch_from_environment(monkeypatch):
    try:
        for value, expected in (("1", True), ("yes", True), ("0", False), ("", False)):
            monkeypatch.setenv("REFIMPL_CUDA_AWARE", value)
            assert importlib.reload(buffers).cuda_aware() is expected
    finally:
        monkeypatch.undo()
        importlib.reload(buffers)
