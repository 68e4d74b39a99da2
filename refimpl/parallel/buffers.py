"""The one switch between device arrays and MPI: CUDA-aware or host-staged.

Every buffer refimpl hands to MPI goes through here:

- ``send_buffer(a)``: a C-contiguous array MPI may read now.  Host arrays pass
  through.  A device array first waits for its stream (a kernel may still be
  writing it: ``backend.synchronize``), then is handed over directly when MPI is
  CUDA-aware, or copied to host memory when it is not.
- ``recv_buffer(shape, dtype, like)``: where MPI writes a message meant for an
  array like ``like``: device memory when ``like`` is on the device and MPI is
  CUDA-aware, host memory otherwise.
- ``finish_recv(buf, like)``: the received data in ``like``'s memory (copies a
  staged host buffer to the device).

"Device array" means: exposes ``__cuda_array_interface__`` (CuPy arrays do, and
so does a host array wrapped in that interface, which is how the tests drive
this code path without a GPU: mpi4py hands the interface's pointer to MPI
either way).  Allocations and host<->device copies go through the array's
module, ``array_module(a)`` (``cupy``); tests replace it with a host stand-in.

CUDA-aware MPI is off unless ``REFIMPL_CUDA_AWARE`` says on (1, true, yes, on; see
refimpl.settings) or ``set_cuda_aware(True)`` is called: staging through the host
is always correct; direct device buffers need an MPI built with CUDA support.
The variable is read at the first use, not at import, so a bad value never
breaks ``import`` (the ``refimpl`` command reports it at start-up).
"""
from __future__ import annotations

import numpy

from .. import backend, settings
from ..backend import array_module

_cuda_aware = None       # None: REFIMPL_CUDA_AWARE, read at the first cuda_aware()


def set_cuda_aware(flag: bool) -> None:
    """Hand device buffers to MPI directly (True) or stage them through host memory (False)."""
    global _cuda_aware
    _cuda_aware = bool(flag)


def cuda_aware() -> bool:
    """set_cuda_aware's choice, else ``REFIMPL_CUDA_AWARE`` (ValueError naming it)."""
    global _cuda_aware
    if _cuda_aware is None:
        _cuda_aware = settings.env_setting("REFIMPL_CUDA_AWARE")
    return _cuda_aware


def is_device(a) -> bool:
    """True for arrays in device memory: anything exposing ``__cuda_array_interface__``."""
    return hasattr(a, "__cuda_array_interface__")


def _c_contiguous(a) -> bool:
    """C-contiguity from the array interface (strides None means C-contiguous)."""
    iface = a.__cuda_array_interface__
    strides = iface.get("strides")
    if strides is None:
        return True
    expected, step = [], numpy.dtype(iface["typestr"]).itemsize
    for n in reversed(iface["shape"]):
        expected.append(step)
        step *= n
    return all(n <= 1 or s == e for n, s, e in zip(iface["shape"], strides, reversed(expected)))


def send_buffer(a):
    """A contiguous buffer of ``a`` that MPI may read now (device or host, per the switch)."""
    xp = array_module(a)
    if not is_device(a):
        return xp.ascontiguousarray(a)
    if not _c_contiguous(a):
        a = xp.ascontiguousarray(a)
    backend.synchronize(a)  # the stream must have finished writing a before MPI reads it
    return a if cuda_aware() else xp.asnumpy(a)


def recv_buffer(shape, dtype, like):
    """An uninitialised buffer MPI can write a message for an array like ``like`` into."""
    if is_device(like) and cuda_aware():
        return array_module(like).empty(tuple(shape), dtype=dtype)
    return numpy.empty(tuple(shape), dtype=dtype)


def finish_recv(buf, like):
    """The received ``buf`` in ``like``'s memory: staged host data is copied to the device."""
    if is_device(like) and not is_device(buf):
        return array_module(like).asarray(buf)
    return buf


# ---------------------------------------------------------------- is this MPI CUDA-aware?

def mpi_cuda_support(environ=None, library_version=None, ompi_info_output=None) -> tuple[str, str]:
    """Whether the MPI library can take device buffers: ("yes" | "no" | "unknown", how it was
    found).  In order: mpi4py's ``MPI.Query_cuda_support`` (MPIX, where the library has it);
    Cray MPICH's ``MPICH_GPU_SUPPORT_ENABLED=1`` and MPICH's ``MPIR_CVAR_ENABLE_GPU=1``; Open
    MPI's ``ompi_info --parsable --all`` (``mpi_built_with_cuda_support`` in 4.x,
    ``opal_built_with_cuda_support`` in 5.x).  The arguments stand in for the environment,
    ``MPI.Get_library_version()`` and ompi_info's output in tests."""
    import os
    import re
    import shutil
    import subprocess

    from mpi4py import MPI
    environ = os.environ if environ is None else environ
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None and environ is os.environ:
        try:
            return ("yes" if query() else "no"), "MPIX_Query_cuda_support"
        except Exception:          # noqa: BLE001 - an MPI without the extension
            pass
    if environ.get("MPICH_GPU_SUPPORT_ENABLED") == "1":
        return "yes", "MPICH_GPU_SUPPORT_ENABLED=1 (Cray MPICH)"
    if environ.get("MPIR_CVAR_ENABLE_GPU") == "1":
        return "yes", "MPIR_CVAR_ENABLE_GPU=1 (MPICH)"
    version = MPI.Get_library_version() if library_version is None else library_version
    if "Open MPI" in version:
        if ompi_info_output is None:
            tool = shutil.which("ompi_info")
            if tool is None:
                return "unknown", "Open MPI, but ompi_info is not on PATH"
            try:
                ompi_info_output = subprocess.run([tool, "--parsable", "--all"], capture_output=True,
                                                  text=True, timeout=60).stdout
            except (OSError, subprocess.SubprocessError) as err:
                return "unknown", f"ompi_info failed ({err})"
        found = re.search(r"(mpi|opal)_built_with_cuda_support:value:(true|false)", ompi_info_output)
        if found:
            return ("yes" if found.group(2) == "true" else "no"), f"ompi_info: {found.group(1)}_built_with_cuda_support"
        return "unknown", "ompi_info does not say"
    return "unknown", f"no query for {version.splitlines()[0][:60] if version else 'this MPI'}"


def device_path_report(backend_name: str, support=None) -> str:
    """One line for the start of a run on device arrays: how device buffers reach MPI (direct
    or staged through host memory) and what the MPI library says about CUDA.  ValueError when
    device buffers would go directly to an MPI that reports no CUDA support (it would crash,
    or read garbage): staging is then the only correct path."""
    aware = cuda_aware()
    if backend_name == "strict":      # host memory behind the interface: any MPI reads it
        return (f"device buffers (strict stand-in): {'direct' if aware else 'staged through host memory'}"
                f" (REFIMPL_CUDA_AWARE={'1' if aware else '0'})")
    answer, how = support if support is not None else mpi_cuda_support()
    if aware and answer == "no":
        raise ValueError(f"REFIMPL_CUDA_AWARE=1 hands device buffers to MPI directly, but this MPI has no "
                         f"CUDA support ({how}): unset it (staged through host memory), or use an MPI built "
                         f"with CUDA (docs/gpu.md)")
    path = "handed to MPI directly" if aware else "staged through host memory"
    advice = ""
    if not aware and answer == "yes":
        advice = "; REFIMPL_CUDA_AWARE=1 would hand them over directly"
    elif aware and answer == "unknown":
        advice = "; if messages fail or hold garbage, unset REFIMPL_CUDA_AWARE"
    return f"device buffers {path} (REFIMPL_CUDA_AWARE={'1' if aware else '0'}); MPI CUDA support: {answer} ({how}){advice}"
