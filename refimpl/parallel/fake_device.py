"""Host memory posing as device memory, to drive the device-buffer path without a GPU.

``HostDeviceArray`` exposes only ``__cuda_array_interface__`` (no buffer protocol,
no ``__array_interface__``), exactly what ``buffers`` and mpi4py look at for a CuPy
array; because the pointer is really host memory, a non-CUDA MPI moves it fine.
``host_device_module`` stands in for ``cupy`` where ``buffers`` allocates and copies
(``empty``, ``asarray``, ``asnumpy``, ``ascontiguousarray``); route to it with

    monkeypatch.setattr(refimpl.parallel.buffers, "array_module", fake_device.array_module)

For tests only: refimpl never creates these itself.
"""
from __future__ import annotations

import numpy

from .. import backend


class HostDeviceArray:
    """A NumPy array seen through ``__cuda_array_interface__`` (version 3) only."""

    def __init__(self, host):
        self.host = numpy.asarray(host)  # may be a strided view

    shape = property(lambda self: self.host.shape)
    dtype = property(lambda self: self.host.dtype)
    size = property(lambda self: self.host.size)
    nbytes = property(lambda self: self.host.nbytes)

    @property
    def __cuda_array_interface__(self):
        strides = None if self.host.flags.c_contiguous else self.host.strides
        return {"shape": self.host.shape, "typestr": self.host.dtype.str,
                "data": (self.host.ctypes.data, False), "version": 3, "strides": strides}


class host_device_module:
    """The few CuPy functions ``buffers`` calls, on HostDeviceArray."""

    @staticmethod
    def empty(shape, dtype):
        return HostDeviceArray(numpy.empty(shape, dtype))

    @staticmethod
    def asarray(a):  # host -> "device" copy
        return HostDeviceArray(numpy.array(a))

    @staticmethod
    def asnumpy(a):  # "device" -> host copy
        return a.host.copy()

    @staticmethod
    def ascontiguousarray(a):
        return HostDeviceArray(numpy.ascontiguousarray(a.host))


def array_module(*arrays):
    """``backend.array_module`` that knows HostDeviceArray."""
    if any(isinstance(a, HostDeviceArray) for a in arrays):
        return host_device_module
    return backend.array_module(*arrays)
