"""Which computes an op: its math, written in ``refimpl/functional/``, or a kernel of ``refimpl/kernels/``.

One rule for pooling, batch norm, activations and losses (the convolution names its route
with ``algorithm=``): the kernel when it says it applies to the arrays (``kernel.applies``:
NumPy arrays, large enough, of the layout it handles), the math otherwise; and always the
math inside ``reference_only()``, which the oracle's expectations run in.  A kernel computes
the same values (tests/test_reference_ops.py); it is chosen for speed alone.
"""
from __future__ import annotations

_reference_only = 0           # how many reference_only() blocks are open


def kernel_for(kernel, *arrays):
    """``kernel`` (a module of refimpl/kernels/) when it applies to ``arrays``, else None: the math."""
    return None if _reference_only or not kernel.applies(*arrays) else kernel


class reference_only:
    """``with reference_only(): ...``: every op computes with its math alone, never a kernel
    (convs: pass ``algorithm="reference"``): what the oracle's expectations rest on."""

    def __enter__(self):
        global _reference_only
        _reference_only += 1
        return self

    def __exit__(self, *exc):
        global _reference_only
        _reference_only -= 1
