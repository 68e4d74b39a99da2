"""Run refimpl's CUDA C kernels on the host: the same source, compiled by a C++ compiler.

``refimpl/kernels/_cuda.py`` writes every kernel as grid-stride loops over every launch
dimension it uses, with no shared memory and no synchronisation; launched as one block of
one thread, such a kernel computes its whole result in one thread.  The header below stands
in for CUDA's: the launch coordinates of that one thread, ``__global__`` as nothing, and the
correctly rounded intrinsics as the plain operations (compiled with ``-ffp-contract=off``, so
each is rounded on its own, as on the device), ``expf``/``logf`` the C library's (CUDA's
differ from them, and from NumPy's, by an ulp or two), an atomic add a plain one.  What this cannot check: CUDA's own compiler
(``nvcc_compiles`` does), and anything about many threads at once (the kernels share no
memory between threads: each writes its own outputs).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from refimpl.kernels import _cuda

CXX = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
NVCC = shutil.which("nvcc")

HOST_HEADER = """
#include <math.h>
struct refimpl_uint3 { unsigned x, y, z; };
static const refimpl_uint3 threadIdx = {0, 0, 0}, blockIdx = {0, 0, 0};
static const refimpl_uint3 blockDim = {1, 1, 1}, gridDim = {1, 1, 1};
#define __global__
#define __device__
#define __forceinline__ inline
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
static inline unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) {
    unsigned long long old = *a; *a += v; return old; }
"""

_built = {}


def _build_dir() -> Path:
    path = Path(tempfile.gettempdir()) / f"refimpl-cuda-emulation-{os.getuid()}"
    path.mkdir(exist_ok=True)
    return path


def library(body, dtype) -> ctypes.CDLL:
    """The kernels of ``body`` for ``dtype`` compiled for the host (cached by content)."""
    code = HOST_HEADER + _cuda.source(body, dtype)
    digest = hashlib.sha256(code.encode()).hexdigest()[:16]
    if digest not in _built:
        out = _build_dir()
        src, lib = out / f"{digest}.cpp", out / f"{digest}.so"
        if not lib.exists():
            src.write_text(code)
            tmp = out / f"{digest}.{os.getpid()}.so"
            subprocess.run([CXX, "-O1", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC",
                            "-o", str(tmp), str(src)], check=True, capture_output=True, text=True)
            os.replace(tmp, lib)
        _built[digest] = ctypes.CDLL(str(lib))
    return _built[digest]


def run(body, name, kinds, values, dtype):
    """Kernel ``name`` of ``body`` on the host with ``values`` (NumPy arrays for the device
    arrays, C-contiguous; None for a null pointer), as one thread."""
    args = []
    ctype = ctypes.c_float if np.dtype(dtype) == np.float32 else ctypes.c_double
    for kind, v in zip(kinds, _cuda.arguments(kinds, values, dtype)):
        if kind == "ptr":
            if v is not None:
                assert v.flags.c_contiguous, "the kernels take C-contiguous arrays"
            args.append(None if v is None else ctypes.c_void_p(v.ctypes.data))
        elif kind == "i64":
            args.append(ctypes.c_longlong(int(v)))
        elif kind == "T":
            args.append(ctype(float(v)))
        else:
            args.append(ctypes.c_double(float(v)))
    getattr(library(body, dtype), name)(*args)


def nvcc_compiles(body, dtype, arch="sm_90"):
    """``nvcc --ptx`` of the kernels of ``body`` for ``dtype``: the CompletedProcess."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernels.cu"
        src.write_text(_cuda.source(body, dtype))
        return subprocess.run([NVCC, "--ptx", f"-arch={arch}", "-o", str(Path(tmp) / "k.ptx"), str(src)],
                              capture_output=True, text=True)
