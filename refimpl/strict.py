"""A strict device stand-in: host memory that behaves like a CuPy array where CuPy refuses, or
where a GPU would be slow, so that CI finds the GPU hazards without a GPU.

``REFIMPL_BACKEND=strict`` (or ``backend.set_backend("strict")``) makes ``backend.get_xp()``
this module's ``xp``: every array the run creates (parameters, batches, everything the layers
compute from them) is a ``StrictArray``, a NumPy array behind a wall.  Through the wall go only
what works on a device:

- the array's own module, ``xp = array_module(a)`` (``xp.matmul``, ``xp.exp(..., out=)``, ...),
  and the array's operators and methods (``a + b``, ``a.sum(axis=1)``, ``a[1:] = b``);
- explicit transfers: ``xp.asarray(host)`` in, ``backend.to_host(a)`` / ``a.get()`` /
  ``a.item()`` out.  Every transfer out is a device -> host synchronisation and is counted
  (``SYNCS``): a training step may make a few, not one per layer or per element;
- MPI: ``__cuda_array_interface__`` (as a CuPy array has), so ``parallel/buffers`` takes its
  device path, direct (``REFIMPL_CUDA_AWARE=1``) or staged through ``xp.asnumpy`` (counted in
  ``STAGED``, apart from the syncs).

And refused, with a ``StrictDeviceError`` naming the hazard:

- a NumPy function or ufunc on the array (``numpy.exp(a)``, ``numpy.asarray(a)``): on a GPU
  that is a hidden copy to host and back, or a TypeError;
- Python scalars and truth values (``float(a)``, ``int(a)``, ``if a:``, ``bool(a.any())``) and
  iteration: each one a hidden synchronisation, per element when it is in a loop;
- a host NumPy array mixed into a device operation (``a + host``, ``xp.matmul(a, host)``),
  which CuPy refuses too; move it with ``xp.asarray`` first.

NumPy scalars that a NumPy reduction would return (``a.sum()``) come back as 0-d arrays, as
CuPy's do.  Everything else is NumPy's own arithmetic: numbers are bit-identical to a NumPy
run.  For tests and CI only; nothing here is fast.
"""
from __future__ import annotations

import types

import numpy

#: Device -> host synchronisations (to_host, get, item, asnumpy outside MPI staging), by kind.
SYNCS = {"to_host": 0, "item": 0}
#: Host copies of device buffers made to stage an MPI message (REFIMPL_CUDA_AWARE off).
STAGED = {"messages": 0, "bytes": 0}


class StrictDeviceError(TypeError):
    """A GPU hazard: something that fails, or silently synchronises, on a device array."""


def reset_counts() -> None:
    for d in (SYNCS, STAGED):
        for k in d:
            d[k] = 0


def sync_count() -> int:
    return sum(SYNCS.values())


# ---------------------------------------------------------------- wrapping

def _unwrap(obj, host_ok=False):
    """The NumPy arrays inside ``obj`` (StrictArray, or lists / tuples / dicts of them);
    a host ``numpy.ndarray`` is refused unless ``host_ok`` (explicit transfers)."""
    if isinstance(obj, StrictArray):
        return obj._a
    if isinstance(obj, numpy.ndarray) and not host_ok and obj.ndim > 0:
        raise StrictDeviceError(
            f"a host NumPy array of shape {obj.shape} is mixed into a device operation (CuPy refuses "
            f"this): move it with xp.asarray first")
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unwrap(o, host_ok) for o in obj)
    if isinstance(obj, dict):
        return {k: _unwrap(v, host_ok) for k, v in obj.items()}
    if isinstance(obj, slice):
        return slice(*(_unwrap(v, host_ok) for v in (obj.start, obj.stop, obj.step)))
    return obj


def _wrap(obj):
    """NumPy results as StrictArrays (NumPy scalars as 0-d arrays, as CuPy returns them)."""
    if isinstance(obj, numpy.ndarray):
        return StrictArray(obj)
    if isinstance(obj, numpy.generic):
        return StrictArray(numpy.asarray(obj))
    if isinstance(obj, tuple):
        return tuple(_wrap(o) for o in obj)
    if isinstance(obj, list):
        return [_wrap(o) for o in obj]
    return obj


def _refuse(what):
    def method(self, *args, **kwargs):
        raise StrictDeviceError(f"{what} of a device array is a hidden device -> host synchronisation: "
                                f"use backend.to_host(a) (counted) where a host value is really needed")
    return method


class StrictArray:
    """A NumPy array seen as device memory (see the module docstring)."""

    __slots__ = ("_a",)
    __array_ufunc__ = None          # numpy.<ufunc>(a) -> TypeError; a + numpy scalar -> our __radd__

    def __init__(self, a):
        self._a = a

    # -------------------------------------------------- metadata (no data access)
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: StrictArray(self._a.T))

    def __len__(self):
        return len(self._a)

    def __repr__(self):
        return f"StrictArray(shape={self._a.shape}, dtype={self._a.dtype})"

    @property
    def __cuda_array_interface__(self):
        strides = None if self._a.flags.c_contiguous else self._a.strides
        return {"shape": self._a.shape, "typestr": self._a.dtype.str,
                "data": (self._a.ctypes.data, False), "version": 3, "strides": strides}

    # -------------------------------------------------- refused
    def __array__(self, dtype=None, copy=None):
        raise StrictDeviceError("a device array was converted to NumPy implicitly (numpy.asarray, or a "
                                "NumPy function given it): use backend.to_host(a), or the array's module")

    def __array_function__(self, func, types_, args, kwargs):
        raise StrictDeviceError(f"numpy.{func.__name__} was called on a device array: use the array's "
                                f"module (xp = backend.array_module(a); xp.{func.__name__})")

    __float__ = _refuse("float()")
    __int__ = _refuse("int()")
    __index__ = _refuse("int() / index")
    __complex__ = _refuse("complex()")
    __bool__ = _refuse("the truth value (if a: / bool(a))")
    __iter__ = _refuse("iterating over the elements")
    tolist = _refuse("tolist()")

    # -------------------------------------------------- explicit, counted transfers
    def item(self):
        SYNCS["item"] += 1
        return self._a.item()

    def get(self):
        """CuPy's device -> host copy."""
        SYNCS["to_host"] += 1
        return self._a.copy()

    # -------------------------------------------------- indexing
    def __getitem__(self, index):
        return _wrap(self._a[_unwrap(index)])

    def __setitem__(self, index, value):
        self._a[_unwrap(index)] = _unwrap(value)

    # -------------------------------------------------- every other method: NumPy's, walled
    #: Host access CuPy arrays do not have (NumPy would read the memory through them).
    _HOST_ONLY = frozenset({"ctypes", "data", "tobytes", "tofile", "dump", "dumps", "base"})

    def __getattr__(self, name):
        if name.startswith("__") or name in StrictArray._HOST_ONLY:
            # (no __array_interface__ / __array_struct__ / __dlpack__: NumPy would read through them)
            raise AttributeError(f"{name} of a device array")
        attr = getattr(self._a, name)
        if callable(attr):
            def method(*args, **kwargs):
                return _wrap(attr(*_unwrap(args), **_unwrap(kwargs)))
            method.__name__ = name
            return method
        return _wrap(attr)


def _binary(name):
    op = getattr(numpy.ndarray, name)

    def method(self, other):
        return _wrap(op(self._a, _unwrap(other)))
    method.__name__ = name
    return method


def _inplace(name):
    op = getattr(numpy.ndarray, name)

    def method(self, other):
        op(self._a, _unwrap(other))
        return self
    method.__name__ = name
    return method


def _unary(name):
    op = getattr(numpy.ndarray, name)

    def method(self):
        return _wrap(op(self._a))
    method.__name__ = name
    return method


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
              "lshift", "rshift"):
    for _form in (f"__{_name}__", f"__r{_name}__"):
        setattr(StrictArray, _form, _binary(_form))
    setattr(StrictArray, f"__i{_name}__", _inplace(f"__i{_name}__"))
for _name in ("__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__"):
    setattr(StrictArray, _name, _binary(_name))
for _name in ("__neg__", "__pos__", "__abs__", "__invert__"):
    setattr(StrictArray, _name, _unary(_name))
StrictArray.__hash__ = None


# ---------------------------------------------------------------- the module

#: Functions that move host data onto the device: they take host arrays.
_TRANSFERS = {"array", "asanyarray"}


def _function(name, fn):
    host_ok = name in _TRANSFERS

    def call(*args, **kwargs):
        return _wrap(fn(*_unwrap(args, host_ok), **_unwrap(kwargs, host_ok)))
    call.__name__ = name
    call.__doc__ = fn.__doc__
    return call


class _Namespace(types.SimpleNamespace):
    """NumPy's namespace (or a submodule of it) with every function walled."""

    def __init__(self, module):
        super().__init__()
        object.__setattr__(self, "_module", module)

    def __getattr__(self, name):
        obj = getattr(self._module, name)
        if isinstance(obj, types.ModuleType):
            return _Namespace(obj)
        if isinstance(obj, type) or not callable(obj):
            return obj                                   # dtypes, constants, classes
        return _function(name, obj)


class _StrictModule(_Namespace):
    """``xp`` of strict arrays: NumPy's functions on StrictArrays, plus CuPy's transfers."""

    ndarray = StrictArray

    def __init__(self):
        super().__init__(numpy)

    @staticmethod
    def asarray(a, dtype=None, order=None):
        """Host data is copied onto the "device" (as cupy.asarray copies); a device array
        passes through (cast if ``dtype`` asks)."""
        if isinstance(a, StrictArray):
            return StrictArray(numpy.asarray(a._a, dtype=dtype, order=order))
        return StrictArray(numpy.array(_unwrap(a, host_ok=True), dtype=dtype, order=order, copy=True))

    @staticmethod
    def asnumpy(a):
        """Device -> host copy (CuPy's): parallel/buffers stages MPI messages with it."""
        a = a._a if isinstance(a, StrictArray) else numpy.asarray(a)
        STAGED["messages"] += 1
        STAGED["bytes"] += a.nbytes
        return a.copy()

    @staticmethod
    def get_array_module(*arrays):
        return xp if any(isinstance(a, StrictArray) for a in arrays) else numpy


xp = _StrictModule()


def to_host(a):
    """A NumPy copy of a StrictArray (counted as one synchronisation)."""
    SYNCS["to_host"] += 1
    return a._a.copy()


__all__ = ["StrictArray", "StrictDeviceError", "xp", "to_host", "SYNCS", "STAGED", "reset_counts",
           "sync_count"]
