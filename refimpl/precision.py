"""The float32 precision policy: GEMMs never round to TF32 unless asked.

NVIDIA's tensor cores multiply float32 matrices faster as TF32 (10 mantissa bits instead of
23).  PyTorch lets cuDNN do so for convolutions by default; CuPy's GEMMs do it when the
environment variable ``CUPY_TF32`` is set (read at CuPy's first float32 matrix product, then
cached: ``cupy._core._routines_linalg.get_compute_type``).  A reference must not
lose 13 bits silently because a user's shell exported ``CUPY_TF32=1``, so refimpl decides:

- float32 GEMMs use TF32 only when asked: ``REFIMPL_TF32=1`` (or ``refimpl train --tf32``), a
  speed/precision trade (docs/gpu.md, "Precision"); ``CUPY_TF32`` set to anything but 0 in the
  environment counts as asking, and is reported as such;
- every command sets ``CUPY_TF32`` for CuPy accordingly (to ``0`` unless asked) before CuPy is
  imported (``apply``, from ``cli.check_settings``), and, unless asked, NVIDIA's library-wide
  switch ``NVIDIA_TF32_OVERRIDE=0`` (cuBLAS and cuDNN then never pick TF32 on their own);
- the commands that compare numbers with an exact reference (``check-layer``, ``oracle``)
  refuse TF32 (exit 2, one line), and a float64 run refuses it too (float64 has no TF32: the
  request is a mistake).

On the CPU nothing changes (NumPy's BLAS has no TF32); the policy is checked there all the same,
so that a job script that would lower a GPU run's precision is caught on a laptop.
"""
from __future__ import annotations

import os

#: commands whose results are compared with an exact reference at 1e-10 (float64) or eps-scaled bounds
EXACT_COMMANDS = frozenset({"check-layer", "oracle"})


def requested(environ=None) -> str | None:
    """What asks for TF32 (``"REFIMPL_TF32=1"``, ``"CUPY_TF32=1"``), or None."""
    from .settings import parse_setting
    environ = os.environ if environ is None else environ
    if parse_setting("REFIMPL_TF32", environ.get("REFIMPL_TF32", "")):
        return "REFIMPL_TF32=1"
    cupy = environ.get("CUPY_TF32", "").strip()
    if cupy not in ("", "0"):
        return f"CUPY_TF32={cupy}"
    return None


def apply(command: str | None, environ=None) -> str | None:
    """Set CuPy's switch from the policy (before CuPy is imported) and refuse TF32 where the
    command compares with an exact reference; returns what asked for TF32, or None.
    ValueError of one line (bad input, exit 2)."""
    environ = os.environ if environ is None else environ
    source = requested(environ)
    if source is not None and command in EXACT_COMMANDS:
        raise ValueError(f"{source} lets float32 matrix products round to TF32 (10 mantissa bits), but "
                         f"refimpl {command} compares with an exact reference: unset it for this command")
    environ["CUPY_TF32"] = "1" if source is not None else "0"
    if source is None:
        environ["NVIDIA_TF32_OVERRIDE"] = "0"
    return source


def refuse_for_float64(dtype: str) -> None:
    """A float64 run asked for TF32: a mistake (ValueError naming what asked)."""
    source = requested()
    if source is not None and str(dtype) == "float64":
        raise ValueError(f"{source} asks for TF32 float32 matrix products, but this run computes in float64 "
                         f"(which has no TF32): unset it, or train in float32")


__all__ = ["EXACT_COMMANDS", "requested", "apply", "refuse_for_float64"]
