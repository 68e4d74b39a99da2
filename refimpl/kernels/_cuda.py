"""CUDA C kernels for CuPy arrays: compiled once per source and dtype, launched over grid-stride loops.

Why hand-written kernels at all: on a GPU the reference's separable pooling stages and batch
norm's few NumPy-style passes are each several kernel launches and temporaries, and these
layers are launch- and bandwidth-bound there (docs/gpu.md: 0.08-0.33 of cuDNN).  One kernel
per pass reads each input once.

How they stay the reference: each kernel computes, per output element, the reference's
formula in the reference's order of operations, with every multiply and add rounded on its
own (``MUL``/``ADD``/``SUB``/``DIV`` are CUDA's ``__fmul_rn``-style intrinsics, which the
compiler never contracts into a fused multiply-add, as NVRTC does by default with ``*`` and
``+``).  So the elementwise results equal the reference's bit for bit, and a sum differs only
in the order of its float64 additions; ``EXP``/``LOG`` are CUDA's ``expf``/``logf`` (``exp``/
``log`` in float64), an ulp or two from NumPy's.

How they are tested without a GPU (tests/test_cuda_kernels.py): every source is compiled
with ``nvcc --ptx`` for both dtypes, and the same source runs on the host, compiled by a C++
compiler with a header that stands in for CUDA's (``tests/cuda_emulation.py``: one block of
one thread, so every grid-stride loop visits every element), against the reference.  That is
why every kernel here loops grid-stride over *every* launch dimension it uses and touches no
shared memory: run as one thread it computes the whole result.  On a GPU the same tests run
the kernels through CuPy (``scripts/gpu_check.sh``).

Arguments: arrays (C-contiguous device arrays, or None for a null pointer), then integers
(``long long``), then floats (``T``, the array dtype, or ``double``): ``SIGNATURES`` names each
kernel's argument kinds, so CuPy's launch and the host emulation pass the same values.
"""
from __future__ import annotations

import numpy

from .. import settings
from ..backend import array_module

#: The C++ types of the two dtypes and the correctly rounded operations of each.
PRELUDE = {
    "float32": ("typedef float T;\n#define MUL __fmul_rn\n#define ADD __fadd_rn\n"
                "#define SUB __fsub_rn\n#define DIV __fdiv_rn\n#define EXP expf\n#define LOG logf\n"),
    "float64": ("typedef double T;\n#define MUL __dmul_rn\n#define ADD __dadd_rn\n"
                "#define SUB __dsub_rn\n#define DIV __ddiv_rn\n#define EXP exp\n#define LOG log\n"),
}

#: Threads per block, and the most blocks along x (the grid-stride loops cover the rest).
THREADS = 256
MAX_BLOCKS = 4096

_modules = {}


def source(body, dtype) -> str:
    """The full CUDA C source of ``body`` for ``dtype`` (float32 or float64)."""
    name = numpy.dtype(dtype).name
    if name not in PRELUDE:
        raise TypeError(f"the CUDA kernels compute float32 and float64 arrays, got {name}")
    return PRELUDE[name] + body


def function(body, name, dtype):
    """The kernel ``name`` of ``body`` for ``dtype``, compiled by CuPy on first use and kept."""
    key = (body, numpy.dtype(dtype).name)
    if key not in _modules:
        import cupy
        _modules[key] = cupy.RawModule(code=source(body, dtype))
    return _modules[key].get_function(name)


def arguments(kinds, values, dtype):
    """``values`` as the typed scalars and arrays a kernel of argument ``kinds`` takes:
    ``"ptr"`` an array or None, ``"i64"`` an integer, ``"T"`` a float in ``dtype``,
    ``"f64"`` a float64."""
    if len(kinds) != len(values):
        raise TypeError(f"the kernel takes {len(kinds)} arguments, got {len(values)}")
    cast = {"i64": numpy.int64, "T": numpy.dtype(dtype).type, "f64": numpy.float64}
    return tuple(v if k == "ptr" else cast[k](v) for k, v in zip(kinds, values))


def blocks_for(total) -> int:
    """Blocks along x for ``total`` independent elements: one per ``THREADS``, at most ``MAX_BLOCKS``."""
    return int(max(1, min(MAX_BLOCKS, -(-int(total) // THREADS))))


#: Partial sums per sum on a device (each thread adds every lanes-th element in float64): enough
#: threads to fill a GPU with a few channels, few enough that adding the partials costs little.
SUM_LANES = 64 * THREADS


def sum_lanes(total) -> int:
    """Lanes of partial sums for ``total`` terms: ``SUM_LANES``, fewer for short sums (whole blocks)."""
    return int(max(1, min(SUM_LANES, -(-int(total) // THREADS) * THREADS)))


def flat(a):
    """``(a C-contiguous, N, C, V)``: an (N, C, ...) array seen as (N, C, V), V the product of
    the axes after the second (1 when there are none)."""
    a = array_module(a).ascontiguousarray(a)
    v = 1
    for extent in a.shape[2:]:
        v *= extent
    return a, a.shape[0], a.shape[1], v


def grid_rows(rows) -> int:
    """Blocks along y for ``rows`` rows (at least 1; CUDA allows at most 65535: the kernels'
    grid-stride loops over y cover the rest)."""
    return int(max(1, min(65535, int(rows))))


def launch(body, name, kinds, values, dtype, total, grid_y=1):
    """Run kernel ``name`` of ``body`` on the current stream over ``total`` elements along x
    (and ``grid_y`` blocks along y)."""
    fn = function(body, name, dtype)
    fn((blocks_for(total), int(grid_y)), (THREADS,), arguments(kinds, values, dtype))


def on_device(a) -> bool:
    """Whether ``a`` is a CuPy array."""
    return type(a).__module__.startswith("cupy")


ENV_KERNELS = "REFIMPL_CUDA_KERNELS"


def takes(a) -> bool:
    """Whether the CUDA kernels compute ``a``: a CuPy array of float32 or float64 (others, such
    as float16, take the reference), unless ``REFIMPL_CUDA_KERNELS=0`` turns them off (then
    the reference's array operations run: the way around a kernel that fails on some GPU)."""
    return on_device(a) and numpy.dtype(a.dtype).name in PRELUDE and settings.env_setting(ENV_KERNELS)


__all__ = ["PRELUDE", "THREADS", "MAX_BLOCKS", "SUM_LANES", "source", "function", "arguments", "blocks_for",
           "sum_lanes", "grid_rows", "flat", "launch", "on_device", "takes", "ENV_KERNELS"]
