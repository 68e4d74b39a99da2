"""Array module, dtype policy and device synchronisation.

Every array operation in refimpl goes through an array module ``xp``: NumPy by
default, CuPy when asked for (``REFIMPL_BACKEND=cupy`` in the environment, or
``set_backend("cupy")``).  The variable is read at the first use, not at import
(refimpl.settings parses it): a bad value is reported by the ``refimpl``
command's start-up check, or by that first use, but never breaks ``import``.
Pure functions never pick the module themselves from global state: they call
``array_module(x)`` on their inputs, so the same code runs on host and device
arrays (the CuPy idiom ``cupy.get_array_module``).

Dtype policy: training runs in float32 (``TRAIN_DTYPE``); gradient and oracle
checks run in float64 (``CHECK_DTYPE``).  Functions never mix dtypes silently:
``check_same_dtype`` raises ``ValueError`` naming the offending argument.

Before a device buffer is handed to MPI the producing stream must be finished,
otherwise MPI may read memory a kernel is still writing: ``synchronize(x)``
does that (a no-op for NumPy arrays).
"""
from __future__ import annotations

import ctypes
import ctypes.util

import numpy

from . import settings

TRAIN_DTYPE = numpy.float32
CHECK_DTYPE = numpy.float64
_DTYPES = {"float32": numpy.float32, "float64": numpy.float64}

_backend = None          # None: REFIMPL_BACKEND, read at the first backend_name()


def _cupy():
    """Import CuPy lazily: it is an optional dependency."""
    try:
        import cupy
    except ImportError as err:  # pragma: no cover - depends on the install
        raise RuntimeError(
            "the cupy backend needs CuPy: pip install 'refimpl[gpu]'") from err
    return cupy


#: 'strict' is refimpl.strict's device stand-in: NumPy memory behaving like CuPy's (CI, tests).
BACKENDS = ("numpy", "cupy", "strict")


def set_backend(name: str) -> None:
    """Select the array module for new arrays: 'numpy', 'cupy' or 'strict' (ValueError: another
    name, or cupy where it cannot run, with the reason from settings.cupy_unavailable)."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "cupy":
        reason = settings.cupy_unavailable()
        if reason:
            raise ValueError(f"backend 'cupy' asked for but {reason}")
    _backend = name


def backend_name() -> str:
    """'numpy', 'cupy' or 'strict': set_backend's choice, else ``REFIMPL_BACKEND`` (ValueError
    naming it)."""
    global _backend
    if _backend is None:
        _backend = settings.env_setting("REFIMPL_BACKEND")
    return _backend


def get_xp():
    """The array module of the run (numpy, cupy, or refimpl.strict's stand-in).  For cupy,
    the first call also makes this rank's GPU current (``select_device``)."""
    name = backend_name()
    if name == "strict":
        from .strict import xp
        return xp
    if name == "cupy":
        select_device()
        return _cupy()
    return numpy


#: Environment variables launchers set to a process's rank among those on its node.
LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID",
                        "MV2_COMM_WORLD_LOCAL_RANK", "PALS_LOCAL_RANKID")
_selected_device = None


def local_rank(environ=None) -> int | None:
    """This process's rank on its node, from the first of ``LOCAL_RANK_VARIABLES`` that is set
    (Open MPI, Slurm, MPICH/Intel MPI, MVAPICH, Cray PALS); None when none is."""
    import os
    environ = os.environ if environ is None else environ
    for name in LOCAL_RANK_VARIABLES:
        value = environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def device_for(local: int | None, count: int) -> int:
    """The GPU of a process: one per rank on a node, ``local_rank % count`` (ranks share GPUs
    round-robin when there are more ranks than GPUs); GPU 0 without a local rank."""
    if count < 1:
        raise ValueError("no CUDA device to select")
    return 0 if local is None else local % count


def select_device() -> int:
    """Make this rank's GPU current (once per process, before any device array is made):
    ``device_for(local_rank(), number of GPUs)``.  Returns its index."""
    global _selected_device
    if _selected_device is None:
        cupy = _cupy()
        index = device_for(local_rank(), cupy.cuda.runtime.getDeviceCount())
        cupy.cuda.Device(index).use()
        _selected_device = index
    return _selected_device


def _strict_array(a) -> bool:
    return type(a).__name__ == "StrictArray" and type(a).__module__ == "refimpl.strict"


def is_device_array(a) -> bool:
    """True for CuPy arrays (anything living in device memory) and the strict stand-in's."""
    return type(a).__module__.startswith("cupy") or _strict_array(a)


def array_module(*arrays):
    """numpy or cupy (or the strict stand-in), whichever the given arrays belong to (the
    device wins)."""
    for a in arrays:                    # the tests of _strict_array and is_device_array, inlined:
        kind = type(a)                  # this runs in every op, the reference conv's trace included
        if kind.__module__ == "refimpl.strict" and kind.__name__ == "StrictArray":
            from .strict import xp
            return xp
        if kind.__module__.startswith("cupy"):
            return _cupy()
    return numpy


def asarray(a, dtype=None):
    """Move ``a`` to the run's array module (host -> device when cupy)."""
    return get_xp().asarray(a, dtype=dtype)


def to_host(a):
    """A NumPy copy (or view) of ``a``, wherever it lives (a device -> host synchronisation
    for a device array: refimpl.strict counts them)."""
    if is_device_array(a):
        return a.get()
    return numpy.asarray(a)


def synchronize(a=None) -> None:
    """Wait until the current CUDA stream has finished writing ``a``.

    Must be called before a device buffer is passed to (CUDA-aware) MPI.
    A no-op for host arrays and when CuPy is not in use.
    """
    if a is not None and (not is_device_array(a) or _strict_array(a)):
        return
    if a is None and backend_name() != "cupy":
        return
    _cupy().cuda.get_current_stream().synchronize()


def resolve_dtype(dtype):
    """'float32' / 'float64' / numpy dtype -> numpy dtype class."""
    if isinstance(dtype, str):
        try:
            return _DTYPES[dtype]
        except KeyError:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}") from None
    dt = numpy.dtype(dtype)
    if dt not in (numpy.dtype(numpy.float32), numpy.dtype(numpy.float64)):
        raise ValueError(f"dtype must be float32 or float64, got {dt}")
    return dt.type


def check_same_dtype(**arrays) -> None:
    """Raise ValueError naming the argument whose dtype differs from the first one."""
    items = [(k, v) for k, v in arrays.items() if v is not None]
    if not items:
        return
    name0, a0 = items[0]
    for name, a in items[1:]:
        if a.dtype != a0.dtype:
            raise ValueError(
                f"dtype mismatch: {name} is {a.dtype} but {name0} is {a0.dtype}; "
                "cast explicitly (refimpl never mixes dtypes silently)")


def scatter_add(target, index, values) -> None:
    """``target[index] += values`` with repeated indices accumulated.

    numpy.add.at has no CuPy twin; cupyx.scatter_add is its equivalent.
    """
    if is_device_array(target):
        import cupyx
        cupyx.scatter_add(target, index, values)
    else:
        numpy.add.at(target, index, values)


ENV_ALLOCATOR = "REFIMPL_ALLOCATOR"
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4          # glibc mallopt parameters (malloc.h)


def tune_allocator() -> bool:
    """Let glibc's malloc keep freed memory for reuse (``REFIMPL_ALLOCATOR=retain``, the
    default) instead of returning it to the OS; ``system`` leaves malloc alone.

    Why: every layer allocates its output and temporaries afresh each step, and glibc
    serves blocks above 128 KiB-32 MiB with ``mmap`` and unmaps them on free, so each
    step faults in (and the kernel zeroes) every page again.  Measured here, that was
    a third of a 3x3x3 conv's forward (27 ms instead of 36-42 ms, N=2, 32->64, 32^3).
    ``mallopt(M_MMAP_MAX, 0)`` serves them from the heap, and a 1 GiB trim threshold
    keeps the freed heap; the process's resident memory then stays at its high-water
    mark (which training reaches every step anyway).  PyTorch's CPU tensors use the
    same malloc, so benchmarks compare like with like.  Called by the ``refimpl``
    command and the benchmarks; a library user may call it once at start-up.
    Returns True when the setting took effect (False: ``system``, or not glibc).
    """
    if settings.env_setting(ENV_ALLOCATOR) == "system":
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):                 # not glibc (macOS, musl): nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**30))
