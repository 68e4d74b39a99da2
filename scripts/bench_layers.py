#!/usr/bin/env python
"""Layer benchmark: refimpl's conv3d / conv_transpose3d / pooling / batch norm / activations vs PyTorch CPU.

Three tables, float32, every row timed as forward and backward passes:

1. conv fwd+bwd: ``conv3d`` + ``conv3d_backward`` (dx, dw, db) and
   ``conv_transpose3d`` + ``conv_transpose3d_backward`` against PyTorch's
   ``conv3d`` / ``conv_transpose3d`` forward and its autograd backward for a
   given ``dy`` (``torch.autograd.grad(y, (x, w, b), dy)``).  Rows: the seven
   block shapes of issue 9 (marked ``issue9``: the per-rank blocks of spatial
   parallelism), the CosmoFlow layers this script always had, and transposed
   convs (U-Net up-sampling k2 s2 p0, and k3 s1 p1).  Columns: best times in
   ms, ``torch time / our time`` for fwd, bwd and fwd+bwd (a throughput ratio:
   > 1 means refimpl is faster; fwd+bwd = the sum of the two best times), and
   ``ours/GEMM``: the flops of the three passes (fwd, dx, dw) over our fwd+bwd
   time, as a share of the numpy float32 GEMM rate (a square 2048^3 matmul,
   measured first and again after every row, the best kept), and ``torch/GEMM``
   the same share for PyTorch's fwd+bwd time: how close PyTorch's own kernels run
   to numpy's GEMM rate, i.e. what a GEMM-based conv with the same flops must reach
   (where PyTorch runs at 0.6 of it, 0.8 of PyTorch's speed asks ours/GEMM >= 0.48:
   the GEMMs and every copy around them at that share).  Below the table:
   the geometric mean of the fwd+bwd ratios over the issue's rows and over all
   conv rows, and the slowest row.
2. conv3d backward split: the halves of the conv3d backward on their own,
   ``conv3d_input_grad`` (dx) and ``conv3d_weight_grad`` (dw), against the
   autograd backward asked for dx only / dw only.
3. pooling (max / avg, k2 s2), batch norm (``batch_norm3d`` /
   ``batch_norm3d_backward``, training mode with running statistics, against
   ``torch.nn.functional.batch_norm``), group norm (``GROUP_NORM_GROUPS`` groups) and instance
   norm (``group_norm3d`` with one group per channel, against ``F.group_norm`` and
   ``F.instance_norm``), activations (relu, leaky_relu with
   slope 0.3) and dropout (p 0.5) on CosmoFlow / U-Net-like shapes, and the softmax
   cross-entropy of the U-Net's output (forward: the softmax and the loss's sums; backward:
   the gradient): times and ratios as above.

A conv counts ``2 * N * F * C * kd*kh*kw * (output positions)`` flops per pass
(the transposed conv: per input position); its backward counts two passes.
"peak tmp MiB" is the peak temporary memory of our passes (tracemalloc: NumPy
reports its buffers to it; what a pass returns is not counted), the largest
over the row's passes.

PyTorch runs as in training: its inputs require grad, so its forward records
the graph; its backward is timed alone (``retain_graph``: one recorded forward,
replayed).  Our backward functions take the forward's inputs (``x``) or cache,
and recompute what they need from them: max pooling's backward finds the
window maxima again, where PyTorch reuses the indices its forward saved.

The machine may be shared: ours and torch are timed alternately, pass by pass
and repeat by repeat, and the best of the repeats is kept, so the ratios are
measured under the same conditions; each timed call follows a short pause
(``SETTLE_S``) and one untimed call of the same pass (``WARM_CALLS``), as passes
follow each other in training.

    python scripts/bench_layers.py [--quick] [--threads N] [--repeats R] [--json FILE]
                                   [--only TEXT] [--algorithm auto|im2col|winograd]

``--threads`` sets numpy's BLAS threads (threadpoolctl if available, else the
environment, set before numpy is imported) and torch's intra-op threads.
``--algorithm`` is passed as ``algorithm=`` to the conv functions that accept
that keyword (checked with ``inspect.signature``); the header says which do.
torch is optional: without it the torch columns read n/a.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import os
import sys
import time

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--quick", action="store_true",
                help="reduced set: the issue-9 rows, no 128^3 volumes, fewer repeats")
ap.add_argument("--threads", type=int, default=None,
                help="BLAS / torch threads (default: all cores)")
ap.add_argument("--repeats", type=int, default=None, help="timed repeats per pass (best kept)")
ap.add_argument("--json", metavar="FILE", help="write the numbers to FILE")
ap.add_argument("--only", default=None,
                help="run only rows whose op or shape contains this text "
                     "('issue9': the issue's seven conv rows)")
ap.add_argument("--algorithm", default="auto", choices=("auto", "im2col", "winograd", "reference"),
                help="conv algorithm, passed to the conv functions that take an algorithm= keyword "
                     "(reference: the plain math of refimpl/functional/conv3d.py, to see what the kernels buy)")
ap.add_argument("--device", default="cpu", choices=("cpu", "cuda", "strict"),
                help="cpu: NumPy vs PyTorch CPU (default); cuda: CuPy vs PyTorch CUDA/cuDNN (the GPU "
                     "lane of scripts/gpu_check.sh); strict: refimpl on the strict device stand-in "
                     "(REFIMPL_BACKEND=strict: a CI smoke run of the device path) vs PyTorch CPU")
ap.add_argument("--phases", action="store_true",
                help="with --device cuda or strict: also where each conv row's fwd and bwd spend their time on the "
                     "device schedule (refimpl/kernels/_im2col_device.py: pad, columns, gemm, dw gemm, col2im, dx "
                     "buffers; other = the rest: launches, Python, a flipped-kernel dx's padded dy), each phase "
                     "between synchronised clocks")
ap.add_argument("--tf32", default="off", choices=("off", "on"),
                help="with --device cuda: off (default) compares full float32 on both sides (CuPy without TF32, "
                     "torch.backends.cudnn/cuda.matmul.allow_tf32 = False); on lets both round float32 matrix "
                     "products to TF32 (REFIMPL_TF32=1 for refimpl; docs/gpu.md, Precision). Run it once per "
                     "setting for the two columns of a like-for-like table")
args = ap.parse_args()
if args.tf32 == "on" and args.device != "cuda":
    ap.error("--tf32 on needs --device cuda (NumPy's BLAS and PyTorch CPU have no TF32)")
if args.phases and args.device == "cpu":
    ap.error("--phases times the device schedule: use it with --device cuda (or strict, its host stand-in)")
os.environ["REFIMPL_TF32"] = "1" if args.tf32 == "on" else "0"
os.environ["CUPY_TF32"] = "1" if args.tf32 == "on" else "0"     # read by CuPy when it is imported (below)

THREADS = args.threads or os.cpu_count() or 1
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(THREADS)

import numpy  # noqa: E402  (after the thread environment)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from refimpl.backend import tune_allocator  # noqa: E402
from refimpl.kernels import _im2col  # noqa: E402
from refimpl.functional.activations import (leaky_relu, leaky_relu_backward, relu,  # noqa: E402
                                            relu_backward)
from refimpl.functional.batch_norm import batch_norm3d, batch_norm3d_backward  # noqa: E402
from refimpl.functional.group_norm import group_norm3d, group_norm3d_backward  # noqa: E402
from refimpl.functional.dropout import dropout, dropout_backward  # noqa: E402
from refimpl.functional.losses import (SoftmaxParts, cross_entropy_backward,  # noqa: E402
                                       cross_entropy_local_sums)
from refimpl.functional.conv3d import (conv3d, conv3d_backward, conv3d_input_grad,  # noqa: E402
                                       conv3d_weight_grad)
from refimpl.functional.conv_transpose3d import (conv_transpose3d,  # noqa: E402
                                                 conv_transpose3d_backward)

try:
    from threadpoolctl import threadpool_limits
    threadpool_limits(THREADS)
except ImportError:
    pass

try:
    import torch
    torch.set_num_threads(THREADS)
except ImportError:
    torch = None

try:
    from refimpl.functional.pooling import (avg_pool3d, avg_pool3d_backward, max_pool3d,
                                            max_pool3d_backward)
except ImportError as err:
    max_pool3d = None
    POOL_NOTE = f"pooling rows skipped: refimpl.functional.pooling not importable ({err})"
else:
    POOL_NOTE = None

import tracemalloc  # noqa: E402

tune_allocator()       # as the refimpl command does; PyTorch shares the same malloc
from refimpl import backend  # noqa: E402

if args.device != "cpu":
    backend.set_backend("cupy" if args.device == "cuda" else "strict")
XP = backend.get_xp()
TORCH_DEVICE = "cuda" if args.device == "cuda" else "cpu"
if args.device == "cuda":                 # like for like: PyTorch's TF32 exactly as refimpl's
    import torch  # noqa: E402
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = args.tf32 == "on"


def dev(*arrays):
    """Host arrays -> refimpl's arrays on the benchmark's device (the same arrays on cpu)."""
    return arrays if args.device == "cpu" else tuple(XP.asarray(a) for a in arrays)


def synchronize():
    """Wait for queued device work (CuPy and torch CUDA): times must cover the kernels."""
    if args.device == "cuda":
        backend.synchronize()
        torch.cuda.synchronize()
REPEATS = args.repeats or (2 if args.quick else 4)
LEAKY_SLOPE = 0.3
DROPOUT_P = 0.5
#: Groups of the group norm rows (C / G >= 8 channels per group at every shape here).
GROUP_NORM_GROUPS = 4


# ---------------------------------------------------------------------------- conv algorithm

def takes_algorithm(fn):
    """Whether ``fn`` accepts an ``algorithm=`` keyword."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "algorithm" in params


CONV_FUNCTIONS = (conv3d, conv3d_backward, conv3d_input_grad, conv3d_weight_grad,
                  conv_transpose3d, conv_transpose3d_backward)
ALGO_TAKERS = [fn.__name__ for fn in CONV_FUNCTIONS if takes_algorithm(fn)]


def algo_kw(fn):
    """``{"algorithm": --algorithm}`` if ``fn`` takes the keyword, else ``{}``."""
    return {"algorithm": args.algorithm} if fn.__name__ in ALGO_TAKERS else {}


def algorithm_note():
    names = [fn.__name__ for fn in CONV_FUNCTIONS]
    if not ALGO_TAKERS:
        ignored = "" if args.algorithm == "auto" else f"; --algorithm {args.algorithm} ignored"
        return ("conv algorithm: built-in im2col + GEMM (no conv function takes an algorithm= "
                f"keyword{ignored})")
    left = [n for n in names if n not in ALGO_TAKERS]
    return (f"conv algorithm={args.algorithm} (passed to {', '.join(ALGO_TAKERS)}"
            + (f"; not taken by {', '.join(left)}" if left else "") + ")")


# ---------------------------------------------------------------------------- helpers

#: Pause before each timed call.  Both sides leave worker threads spinning for a while after
#: a call (PyTorch's OpenMP pool, OpenBLAS's threads); on a 2-core machine that spin steals a
#: core from whatever runs next, and the passes here alternate between the two sides.
#: Measured: our stride-2 forward 18.5 ms alone, 20.7 ms right after a torch conv, 18.8 ms
#: after a torch conv and a 5 ms pause.
SETTLE_S = 0.005
#: Untimed calls of the same pass right before each timed one.  In training the passes follow
#: each other with no pause; after one (a pause, the other side's call), a virtual machine's
#: cores wake slowly for a few milliseconds (the host's halt polling shrinks while a core is
#: idle).  Measured on a 2-core KVM guest (Zen 4), our stride-2 forward: 8 ms back to back,
#: 13-16 ms for the first three or four calls after a 0.2 s pause; PyTorch's 2.5-3 ms after
#: one call (its OpenMP threads spin between calls; ours wait on the GIL and a futex, so
#: they wake the cores more often).  Both sides get the same warm-up.
WARM_CALLS = 1


def timed(fn):
    synchronize()
    time.sleep(SETTLE_S)
    for _ in range(WARM_CALLS):
        fn()
    synchronize()
    t0 = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - t0


def gemm_rate(n=2048, repeats=None):
    a, b = dev(numpy.random.default_rng(0).standard_normal((n, n), dtype=numpy.float32),
               numpy.random.default_rng(1).standard_normal((n, n), dtype=numpy.float32))
    a @ b
    t = min(timed(lambda: a @ b) for _ in range(repeats or max(3, REPEATS)))
    return 2 * n ** 3 / t / 1e9


def _nbytes(out):
    """Bytes of the arrays in ``out`` (nested tuples walked: a batch norm cache holds xhat)."""
    if isinstance(out, (tuple, list)):
        return sum(_nbytes(o) for o in out)
    return getattr(out, "nbytes", 0) if hasattr(out, "shape") else 0      # NumPy / device arrays


def peak_temp(fn):
    """Peak bytes traced during ``fn()`` minus the bytes of what it returns (host memory only:
    0 on a device, whose allocations tracemalloc does not see)."""
    if args.device == "cuda":
        return 0
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    out = fn()
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return max(peak - _nbytes(out), 0)


def fmt_ms(seconds, width):
    if seconds is None:
        return f"{'n/a':>{width}}"
    v = seconds * 1e3
    digits = 0 if v >= 100 else 1 if v >= 10 else 2 if v >= 0.1 else 3
    return f"{v:{width}.{digits}f}"


def fmt_ratio(r, width):
    return f"{'n/a':>{width}}" if r is None else f"{r:{width}.2f}"


def mib(b):
    return f"{b / 2**20:.0f}" if b >= 2**20 else f"{b / 2**20:.2f}"


def geomean(values):
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def ratio(t_torch, t_ours):
    return t_torch / t_ours if t_torch is not None and t_ours else None


def rng_arrays(rng, *shapes):
    return [rng.standard_normal(s, dtype=numpy.float32) for s in shapes]


def tt(a, grad=False):
    """numpy -> torch (shared memory on cpu; a copy on cuda), a leaf that requires grad if asked."""
    t = torch.from_numpy(a).to(TORCH_DEVICE)
    return t.requires_grad_() if grad else t


def torch_bwd(y, inputs, dy):
    """Autograd backward of the recorded ``y`` for ``dy``, replayable (graph retained)."""
    return lambda: torch.autograd.grad(y, inputs, dy, retain_graph=True)


# ---------------------------------------------------------------------------- cases
# A case: dict(kind, op, shape (label), issue (bool), dims, flops {pass: flops} (convs),
# build() -> (passes {name: (ours, torch or None)}, input_bytes)).  build() runs when the
# row is timed, so only one row's arrays are alive at a time.

ISSUE_CONVS = [  # (N, C, F, n, k, s, p): issue 9's per-rank blocks
    (1, 4, 32, 64, 3, 1, 1), (2, 32, 64, 32, 3, 1, 1), (8, 32, 64, 16, 3, 1, 1),
    (1, 64, 128, 32, 3, 1, 1), (4, 128, 256, 8, 3, 1, 1), (2, 16, 32, 32, 3, 1, 1),
    (2, 32, 32, 33, 3, 2, 1)]


def legacy_convs(quick):
    """The CosmoFlow conv layers (k3 s1 p1) this script always timed."""
    if quick:
        return [(1, 32, 64, 64, 3, 1, 1), (1, 256, 512, 8, 3, 1, 1)]
    return [(1, 4, 32, 128, 3, 1, 1), (2, 4, 32, 128, 3, 1, 1), (1, 32, 64, 64, 3, 1, 1),
            (1, 64, 128, 32, 3, 1, 1), (1, 256, 512, 8, 3, 1, 1), (4, 256, 512, 8, 3, 1, 1)]


def transposed_convs(quick):
    """(N, C_in, C_out, n_in, k, s, p): U-Net up-sampling (k2 s2 p0) and k3 s1 p1."""
    new = [(2, 64, 32, 16, 2, 2, 0), (1, 32, 16, 32, 2, 2, 0), (2, 32, 32, 16, 3, 1, 1)]
    old = [(1, 128, 64, 32, 2, 2, 0)] + ([] if quick else [(1, 32, 4, 128, 3, 1, 1)])
    return new + old


def conv_out(n, k, s, p):
    return (n + 2 * p - k) // s + 1


def conv_case(nb, c, f, n, k, s, p, issue):
    o = conv_out(n, k, s, p)
    flops = 2 * nb * f * c * k ** 3 * o ** 3
    label = f"N={nb} {c}->{f} @{n}^3 k{k}s{s}p{p}"

    def build():
        rng = numpy.random.default_rng(0)
        x, w, b, dy = rng_arrays(rng, (nb, c, n, n, n), (f, c, k, k, k), (f,), (nb, f, o, o, o))
        w *= 0.1
        dx_, dw_, db_, ddy = dev(x, w, b, dy)
        passes = {
            "fwd": (lambda: conv3d(dx_, dw_, db_, s, p, **algo_kw(conv3d)), None),
            "bwd": (lambda: conv3d_backward(ddy, dx_, dw_, s, p, 1, **algo_kw(conv3d_backward)), None),
            "dx": (lambda: conv3d_input_grad(ddy, dw_, x.shape, s, p, 1, **algo_kw(conv3d_input_grad)),
                   None),
            "dw": (lambda: conv3d_weight_grad(ddy, dx_, w.shape, s, p, 1,
                                              **algo_kw(conv3d_weight_grad)), None),
        }
        if torch is not None:
            tx, tw, tb = (tt(a, grad=True) for a in (x, w, b))
            tdy = tt(dy)
            fn = torch.nn.functional.conv3d
            y = fn(tx, tw, tb, s, p)
            passes["fwd"] = (passes["fwd"][0], lambda: fn(tx, tw, tb, s, p))
            passes["bwd"] = (passes["bwd"][0], torch_bwd(y, (tx, tw, tb), tdy))
            passes["dx"] = (passes["dx"][0], torch_bwd(y, (tx,), tdy))
            passes["dw"] = (passes["dw"][0], torch_bwd(y, (tw,), tdy))
        return passes, x.nbytes + w.nbytes + dy.nbytes

    return dict(kind="conv3d", op="conv3d", shape=label, issue=issue,
                dims=dict(N=nb, C=c, F=f, n=n, k=k, s=s, p=p, out=o),
                flops={"fwd": flops, "bwd": 2 * flops, "dx": flops, "dw": flops}, build=build)


def tconv_case(nb, cin, cout, n, k, s, p):
    o = (n - 1) * s - 2 * p + k
    flops = 2 * nb * cin * cout * k ** 3 * n ** 3     # per input position
    label = f"N={nb} {cin}->{cout} @{n}^3->{o}^3 k{k}s{s}p{p}"

    def build():
        rng = numpy.random.default_rng(0)
        x, w, b, dy = rng_arrays(rng, (nb, cin, n, n, n), (cin, cout, k, k, k), (cout,),
                                 (nb, cout, o, o, o))
        w *= 0.1
        dx_, dw_, db_, ddy = dev(x, w, b, dy)
        ours_f = lambda: conv_transpose3d(dx_, dw_, db_, s, p, **algo_kw(conv_transpose3d))  # noqa: E731
        ours_b = lambda: conv_transpose3d_backward(  # noqa: E731
            ddy, dx_, dw_, s, p, 0, 1, **algo_kw(conv_transpose3d_backward))
        passes = {"fwd": (ours_f, None), "bwd": (ours_b, None)}
        if torch is not None:
            tx, tw, tb = (tt(a, grad=True) for a in (x, w, b))
            tdy = tt(dy)
            fn = torch.nn.functional.conv_transpose3d
            y = fn(tx, tw, tb, s, p)
            passes = {"fwd": (ours_f, lambda: fn(tx, tw, tb, s, p)),
                      "bwd": (ours_b, torch_bwd(y, (tx, tw, tb), tdy))}
        return passes, x.nbytes + w.nbytes + dy.nbytes

    return dict(kind="conv_transpose3d", op="conv_transpose3d", shape=label, issue=False,
                dims=dict(N=nb, C=cin, F=cout, n=n, k=k, s=s, p=p, out=o),
                flops={"fwd": flops, "bwd": 2 * flops}, build=build)


def conv_cases(quick):
    seen = set()
    for dims in ISSUE_CONVS + legacy_convs(quick):
        if dims not in seen:                 # (1, 64->128, 32^3) is in both lists
            seen.add(dims)
            yield conv_case(*dims, issue=dims in ISSUE_CONVS)
    for dims in transposed_convs(quick):
        yield tconv_case(*dims)


def layer_shapes(quick):
    """(N, C, n): CosmoFlow's pooled layers (N=1) and per-rank U-Net / CosmoFlow blocks."""
    old = [] if quick else [(1, 32, 128), (1, 64, 64)]
    return old + [(1, 128, 32), (2, 32, 32), (2, 64, 16)]


def layer_case(op, nb, c, n):
    pooled = op in ("max_pool3d", "avg_pool3d")
    o = n // 2 if pooled else n
    label = f"N={nb} {c} @{n}^3" + (" k2s2" if pooled else "")
    if op == "leaky_relu":
        label += f" slope {LEAKY_SLOPE}"
    if op == "dropout":
        label += f" p {DROPOUT_P}"
    if op == "group_norm3d":
        label += f" G {GROUP_NORM_GROUPS}"

    def build():
        rng = numpy.random.default_rng(0)
        hx, hdy = rng_arrays(rng, (nb, c, n, n, n), (nb, c, o, o, o))
        x, dy = dev(hx, hdy)
        F = torch.nn.functional if torch is not None else None
        theirs, extra = None, ()
        if op == "max_pool3d":
            # as the MaxPool3d layer runs them: forward keeps the masks, backward uses them
            masks = max_pool3d(x, 2, 2, return_masks=True)[1]
            ours_f = lambda: max_pool3d(x, 2, 2, return_masks=True)  # noqa: E731
            ours_b = lambda: max_pool3d_backward(dy, x, 2, 2, masks=masks)  # noqa: E731
            theirs = (lambda t: F.max_pool3d(t, 2, 2)) if F else None
        elif op == "avg_pool3d":
            ours_f, ours_b = (lambda: avg_pool3d(x, 2, 2)), (lambda: avg_pool3d_backward(dy, x, 2, 2))
            theirs = (lambda t: F.avg_pool3d(t, 2, 2)) if F else None
        elif op == "relu":
            ours_f, ours_b = (lambda: relu(x)), (lambda: relu_backward(dy, x))
            theirs = F.relu if F else None
        elif op == "leaky_relu":
            ours_f = lambda: leaky_relu(x, LEAKY_SLOPE)  # noqa: E731
            ours_b = lambda: leaky_relu_backward(dy, x, LEAKY_SLOPE)  # noqa: E731
            theirs = (lambda t: F.leaky_relu(t, LEAKY_SLOPE)) if F else None
        elif op == "dropout":
            # as the Dropout layer runs them: the forward draws the mask, the backward applies it
            mask = dropout(x, DROPOUT_P, 1)[1]
            ours_f = lambda: dropout(x, DROPOUT_P, 1)  # noqa: E731
            ours_b = lambda: dropout_backward(dy, mask, DROPOUT_P)  # noqa: E731
            theirs = (lambda t: F.dropout(t, DROPOUT_P, training=True)) if F else None
        elif op == "batch_norm3d":
            gamma, beta = 1 + 0.1 * rng.standard_normal((2, c), dtype=numpy.float32)
            beta -= 1
            r_mean, r_var = numpy.zeros(c, numpy.float32), numpy.ones(c, numpy.float32)
            dgamma, dbeta, dr_mean, dr_var = dev(gamma, beta, r_mean, r_var)
            ours_f = lambda: batch_norm3d(x, dgamma, dbeta, dr_mean, dr_var, training=True)  # noqa: E731
            cache = ours_f()[1]
            ours_b = lambda: batch_norm3d_backward(dy, cache)  # noqa: E731
            if F:
                tg, tbeta = tt(gamma.copy(), grad=True), tt(beta.copy(), grad=True)
                trm, trv = tt(r_mean.copy()), tt(r_var.copy())
                extra = (tg, tbeta)
                theirs = lambda t: F.batch_norm(t, trm, trv, tg, tbeta, training=True,  # noqa: E731
                                                momentum=0.1, eps=1e-5)
        elif op in ("group_norm3d", "instance_norm3d"):
            groups = GROUP_NORM_GROUPS if op == "group_norm3d" else c
            gamma, beta = 1 + 0.1 * rng.standard_normal((2, c), dtype=numpy.float32)
            beta -= 1
            dgamma, dbeta = dev(gamma, beta)
            ours_f = lambda: group_norm3d(x, groups, dgamma, dbeta)  # noqa: E731
            cache = ours_f()[1]
            ours_b = lambda: group_norm3d_backward(dy, cache)  # noqa: E731
            if F:
                tg, tbeta = tt(gamma.copy(), grad=True), tt(beta.copy(), grad=True)
                extra = (tg, tbeta)
                theirs = ((lambda t: F.group_norm(t, groups, tg, tbeta, eps=1e-5)) if op == "group_norm3d"
                          else (lambda t: F.instance_norm(t, weight=tg, bias=tbeta, eps=1e-5)))
        else:
            raise ValueError(op)
        passes = {"fwd": (ours_f, None), "bwd": (ours_b, None)}
        if theirs is not None:
            tx = tt(hx, grad=True)
            y = theirs(tx)
            passes = {"fwd": (ours_f, lambda: theirs(tx)),
                      "bwd": (ours_b, torch_bwd(y, (tx,) + extra, tt(hdy)))}
        return passes, hx.nbytes + hdy.nbytes

    return dict(kind=op, op=op, shape=label, issue=False, dims=dict(N=nb, C=c, n=n),
                flops=None, build=build)


def layer_cases(quick):
    ops = (["max_pool3d", "avg_pool3d"] if max_pool3d is not None else []) + [
        "batch_norm3d", "group_norm3d", "instance_norm3d", "relu", "leaky_relu", "dropout"]
    for nb, c, n in layer_shapes(quick):
        for op in ops:
            yield layer_case(op, nb, c, n)
    for nb, k, n in loss_shapes(quick):
        yield loss_case(nb, k, n)


def loss_shapes(quick):
    """(N, K classes, n): the U-Net's output at its per-rank block sizes."""
    return [(2, 3, 32)] + ([] if quick else [(1, 3, 128), (2, 4, 64)])


def loss_case(nb, k, n):
    """Softmax cross-entropy over K classes per voxel: ours forward = the softmax and the
    loss's sums (``SoftmaxParts``, ``cross_entropy_local_sums``), backward = the gradient from
    them; torch ``F.cross_entropy`` and its autograd backward."""
    def build():
        rng = numpy.random.default_rng(0)
        (hz,) = rng_arrays(rng, (nb, k, n, n, n))
        hy = rng.integers(0, k, size=(nb, n, n, n))
        z, y = dev(hz, hy)
        state = {}

        def ours_f():
            state["parts"] = SoftmaxParts(z)
            state["sums"] = cross_entropy_local_sums(z, y, parts=state["parts"])
            return state["sums"]
        ours_f()
        ours_b = lambda: cross_entropy_backward(z, y, state["sums"], parts=state["parts"])  # noqa: E731
        passes = {"fwd": (ours_f, None), "bwd": (ours_b, None)}
        if torch is not None:
            tz, ty = tt(hz, grad=True), torch.from_numpy(hy).to(TORCH_DEVICE)
            loss = torch.nn.functional.cross_entropy(tz, ty)
            passes = {"fwd": (ours_f, lambda: torch.nn.functional.cross_entropy(tz, ty)),
                      "bwd": (ours_b, torch_bwd(loss, (tz,), None))}
        return passes, hz.nbytes + hy.nbytes

    return dict(kind="cross_entropy", op="cross_entropy", shape=f"N={nb} K={k} @{n}^3", issue=False,
                dims=dict(N=nb, K=k, n=n), flops=None, build=build)


def selected(case):
    if not args.only:
        return True
    text = f"{case['op']} {case['shape']}" + (" issue9" if case["issue"] else "")
    return args.only in text


# ---------------------------------------------------------------------------- timing

def run_case(case):
    """Time every pass of ``case``: ours and torch alternately, the best of REPEATS kept."""
    passes, in_bytes = case["build"]()
    for name, (ours, theirs) in passes.items():     # warm-up (page faults, BLAS threads)
        ours()
        if theirs is not None:
            theirs()
    t_ours = {name: [] for name in passes}
    t_torch = {name: [] for name in passes}
    for _ in range(REPEATS):                        # interleaved: same machine state for both
        for name, (ours, theirs) in passes.items():
            t_ours[name].append(timed(ours))
            if theirs is not None:
                t_torch[name].append(timed(theirs))
    result = dict(kind=case["kind"], op=case["op"], shape=case["shape"], issue_row=case["issue"],
                  dims=case["dims"], input_bytes=in_bytes, passes={})
    for name, (ours, _) in passes.items():
        best_o = min(t_ours[name])
        best_t = min(t_torch[name]) if t_torch[name] else None
        result["passes"][name] = dict(ours_s=best_o, torch_s=best_t, ours_all_s=t_ours[name],
                                      torch_all_s=t_torch[name],
                                      torch_over_ours=ratio(best_t, best_o),
                                      peak_temp_bytes=peak_temp(ours))
        if case["flops"]:
            fl = case["flops"][name]
            result["passes"][name].update(flops=fl, ours_gflops=fl / best_o / 1e9,
                                          torch_gflops=fl / best_t / 1e9 if best_t else None)
    fwd, bwd = result["passes"]["fwd"], result["passes"]["bwd"]
    t_o = fwd["ours_s"] + bwd["ours_s"]
    t_t = fwd["torch_s"] + bwd["torch_s"] if fwd["torch_s"] is not None else None
    result["fwd_bwd"] = dict(ours_s=t_o, torch_s=t_t, torch_over_ours=ratio(t_t, t_o))
    if case["flops"]:
        result["fwd_bwd"]["flops"] = case["flops"]["fwd"] + case["flops"]["bwd"]
    result["peak_temp_bytes"] = max(p["peak_temp_bytes"] for p in result["passes"].values())
    return result


def add_gemm_shares(results, gemm):
    for r in results:
        for name, p in r["passes"].items():
            if "flops" in p:
                p["ours_over_gemm"] = p["ours_gflops"] / gemm
        fb = r["fwd_bwd"]
        if "flops" in fb:
            fb["ours_over_gemm"] = fb["flops"] / fb["ours_s"] / 1e9 / gemm
            fb["torch_over_gemm"] = (None if fb["torch_s"] is None
                                     else fb["flops"] / fb["torch_s"] / 1e9 / gemm)


def conv_summary(conv_rows):
    def stats(rows):
        ratios = [(r["fwd_bwd"]["torch_over_ours"], r) for r in rows
                  if r["fwd_bwd"]["torch_over_ours"] is not None]
        if not ratios:
            return dict(rows=len(rows), geomean_fwd_bwd=None)
        low, low_row = min(ratios, key=lambda t: t[0])
        return dict(rows=len(ratios),
                    geomean_fwd_bwd=geomean([v for v, _ in ratios]),
                    geomean_fwd=geomean([r["passes"]["fwd"]["torch_over_ours"] for _, r in ratios]),
                    geomean_bwd=geomean([r["passes"]["bwd"]["torch_over_ours"] for _, r in ratios]),
                    min_fwd_bwd=low, min_row=f"{low_row['op']} {low_row['shape']}")
    return dict(issue9=stats([r for r in conv_rows if r["issue_row"]]), all_conv=stats(conv_rows))


# ---------------------------------------------------------------------------- output

def load():
    try:
        with open("/proc/loadavg") as fh:
            return "load average " + " ".join(fh.read().split()[:3])
    except OSError:
        return "load average n/a"


def print_fwd_bwd_table(title, rows, gemm_column):
    print(f"\n## {title}")
    last = f"{'ours/GEMM':>9} {'torch/GEMM':>10} " if gemm_column else ""
    head = (f"{'op':<16} {'shape':<34} {'set':<6} {'fwd ours':>9} {'torch':>8} {'bwd ours':>9} "
            f"{'torch':>8} {'x fwd':>6} {'x bwd':>6} {'x f+b':>6} {last}{'tmp MiB':>7} {'in MiB':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        f, b, fb = r["passes"]["fwd"], r["passes"]["bwd"], r["fwd_bwd"]
        torch_share = fb.get("torch_over_gemm")
        share = (f"{fb['ours_over_gemm']:9.2f} "
                 f"{'n/a' if torch_share is None else format(torch_share, '.2f'):>10} "
                 if gemm_column else "")
        print(f"{r['op']:<16} {r['shape']:<34} {'issue9' if r['issue_row'] else '':<6} "
              f"{fmt_ms(f['ours_s'], 9)} {fmt_ms(f['torch_s'], 8)} {fmt_ms(b['ours_s'], 9)} "
              f"{fmt_ms(b['torch_s'], 8)} {fmt_ratio(f['torch_over_ours'], 6)} "
              f"{fmt_ratio(b['torch_over_ours'], 6)} {fmt_ratio(fb['torch_over_ours'], 6)} "
              f"{share}{mib(r['peak_temp_bytes']):>7} {mib(r['input_bytes']):>6}")


def print_summary(summary):
    def line(name, s):
        if s["geomean_fwd_bwd"] is None:
            return f"# {name}: n/a ({s['rows']} rows, no torch times)"
        return (f"# {name} ({s['rows']} rows): geomean torch/ours fwd+bwd {s['geomean_fwd_bwd']:.2f} "
                f"(fwd {s['geomean_fwd']:.2f}, bwd {s['geomean_bwd']:.2f}); "
                f"min {s['min_fwd_bwd']:.2f} at {s['min_row']}")
    if summary["issue9"]["rows"]:
        print(line("issue-9 rows", summary["issue9"]))
    if summary["all_conv"]["rows"]:
        print(line("all conv rows", summary["all_conv"]))


def print_split_table(rows):
    print("\n## conv3d backward split: conv3d_input_grad (dx) and conv3d_weight_grad (dw) alone")
    head = (f"{'op':<16} {'shape':<34} {'set':<6} {'dx ours':>9} {'torch':>8} {'dw ours':>9} "
            f"{'torch':>8} {'x dx':>6} {'x dw':>6} {'GF/s dx':>8} {'GF/s dw':>8} "
            f"{'GEMM dx':>7} {'GEMM dw':>7}")
    print(head)
    print("-" * len(head))
    for r in rows:
        dx, dw = r["passes"]["dx"], r["passes"]["dw"]
        print(f"{r['op']:<16} {r['shape']:<34} {'issue9' if r['issue_row'] else '':<6} "
              f"{fmt_ms(dx['ours_s'], 9)} {fmt_ms(dx['torch_s'], 8)} {fmt_ms(dw['ours_s'], 9)} "
              f"{fmt_ms(dw['torch_s'], 8)} {fmt_ratio(dx['torch_over_ours'], 6)} "
              f"{fmt_ratio(dw['torch_over_ours'], 6)} {dx['ours_gflops']:8.1f} {dw['ours_gflops']:8.1f} "
              f"{dx['ours_over_gemm']:7.2f} {dw['ours_over_gemm']:7.2f}")


# ---------------------------------------------------------------------------- --phases

class PhaseClock:
    """``_im2col_device.PROFILE``: seconds per phase, each between synchronised clocks."""

    def __init__(self):
        self.seconds = {}

    @contextlib.contextmanager
    def phase(self, name):
        synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            synchronize()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


def conv_phases():
    """Each selected conv row's fwd and bwd once more, the device schedule's phases timed
    (``_im2col_device.PROFILE``): a table of ms per phase, and its rows for the JSON."""
    from refimpl.kernels import _im2col_device
    phases = _im2col_device.PHASES
    rows = []
    for case in conv_cases(args.quick):
        if not selected(case):
            continue
        passes, _ = case["build"]()
        for name in ("fwd", "bwd"):
            ours = passes[name][0]
            try:
                timed(ours)                                  # warm: plans, kernels, allocator
                best = None
                for _ in range(REPEATS):
                    clock = PhaseClock()
                    ours()                                   # the warm call timed() makes, unrecorded
                    synchronize()
                    _im2col_device.PROFILE = clock
                    try:
                        t0 = time.perf_counter()
                        ours()
                        synchronize()
                        total = time.perf_counter() - t0
                    finally:
                        _im2col_device.PROFILE = None
                    if best is None or total < best[0]:
                        best = (total, clock.seconds)
            except (ValueError, NotImplementedError) as err:
                print(f"  phases {case['op']} {case['shape']} {name}: skipped ({err})", file=sys.stderr)
                continue
            total, seconds = best
            rows.append(dict(op=case["op"], shape=case["shape"], pass_=name, total=total,
                             phases={k: seconds.get(k, 0.0) for k in phases},
                             other=total - sum(seconds.values())))
    print("\n## where the device schedule's time goes (--phases; ms, the best of "
          f"{REPEATS} by total; each phase between synchronised clocks)")
    print(f"{'op':<17} {'shape':<30} {'pass':<4} {'total':>8} " + " ".join(f"{k:>10}" for k in phases)
          + f" {'other':>8}")
    for r in rows:
        print(f"{r['op']:<17} {r['shape']:<30} {r['pass_']:<4} {1e3 * r['total']:8.2f} "
              + " ".join(f"{1e3 * r['phases'][k]:10.2f}" for k in phases) + f" {1e3 * r['other']:8.2f}")
    if rows:
        spent = {k: sum(r["phases"][k] for r in rows) for k in phases}
        spent["other"] = sum(r["other"] for r in rows)
        whole = sum(r["total"] for r in rows)
        print("# share of all rows' time: " + ", ".join(f"{k} {100 * v / whole:.0f} %" for k, v in spent.items()))
    return rows


def main():
    t_start = time.perf_counter()
    load_start = load()
    print(f"# device={args.device} (refimpl on {type(XP).__name__ if args.device != 'cpu' else 'numpy'}, "
          f"torch on {TORCH_DEVICE})")
    print(f"# threads={THREADS}  numpy {numpy.__version__}  torch "
          f"{torch.__version__ if torch is not None else 'n/a'}  "
          f"MAX_TEMP_BYTES={_im2col.MAX_TEMP_BYTES >> 20} MiB  repeats={REPEATS}"
          f"{'  (quick)' if args.quick else ''}  {load_start}")
    print("# " + algorithm_note())
    if args.algorithm != "auto" and not ALGO_TAKERS:
        print(f"warning: --algorithm {args.algorithm} ignored: no conv function takes algorithm=",
              file=sys.stderr)
    if POOL_NOTE:
        print("# " + POOL_NOTE)
    print(f"# times: best of {REPEATS} in ms; x = torch time / our time (> 1: ours faster; f+b: "
          "sum of the best fwd and bwd times); ours/GEMM: 3 passes' flops / our fwd+bwd time / "
          "GEMM rate; torch/GEMM: the same for PyTorch's time")
    # the GEMM rate: measured first, then once more after every row; the best counts
    # (on a shared machine a single measurement may land in a busy moment)
    gemm_first = gemm_rate()
    gemm_all = [gemm_first]
    conv_rows, layer_rows, skipped = [], [], []
    for case in list(conv_cases(args.quick)) + list(layer_cases(args.quick)):
        if not selected(case):
            continue
        try:
            result = run_case(case)
        except (ValueError, NotImplementedError) as err:
            # e.g. --algorithm winograd forced on a conv it cannot compute (k2 s2, stride 2)
            skipped.append(dict(op=case["op"], shape=case["shape"],
                                error=f"{type(err).__name__}: {err}"))
            print(f"  {case['op']} {case['shape']}: skipped ({type(err).__name__}: {err})",
                  file=sys.stderr, flush=True)
            continue
        (conv_rows if case["flops"] else layer_rows).append(result)
        gemm_all.append(gemm_rate(repeats=1))
        print(f"  {case['op']} {case['shape']}: done", file=sys.stderr, flush=True)
    gemm = max(gemm_all)
    add_gemm_shares(conv_rows + layer_rows, gemm)
    summary = conv_summary(conv_rows)
    print(f"# {'numpy' if args.device != 'cuda' else 'CuPy'} float32 GEMM 2048^3: {gemm:.1f} GFLOP/s (best of {len(gemm_all)} "
          f"measurements; first {gemm_first:.1f}, median {sorted(gemm_all)[len(gemm_all) // 2]:.1f})")
    if conv_rows:
        print_fwd_bwd_table("conv fwd+bwd (bwd = dx, dw, db)", conv_rows, gemm_column=True)
        print_summary(summary)
    split_rows = [r for r in conv_rows if "dx" in r["passes"]]
    if split_rows:
        print_split_table(split_rows)
    if layer_rows:
        print_fwd_bwd_table("pooling, batch norm, activations, dropout, loss", layer_rows, gemm_column=False)
    for s in skipped:
        print(f"# skipped {s['op']} {s['shape']}: {s['error']}")
    phase_rows = conv_phases() if args.phases else []
    load_end = load()
    print(f"# total {time.perf_counter() - t_start:.0f} s; {load_end}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"threads": THREADS, "numpy": numpy.__version__,
                       "torch": torch.__version__ if torch is not None else None,
                       "gemm_gflops": gemm, "gemm_gflops_all": gemm_all,
                       "max_temp_bytes": _im2col.MAX_TEMP_BYTES, "quick": args.quick,
                       "repeats": REPEATS, "only": args.only, "algorithm": args.algorithm,
                       "algorithm_taken_by": ALGO_TAKERS, "algorithm_note": algorithm_note(),
                       "leaky_relu_slope": LEAKY_SLOPE, "pool_note": POOL_NOTE,
                       "load_start": load_start, "load_end": load_end,
                       "conv_summary": summary, "conv_rows": conv_rows, "layer_rows": layer_rows,
                       "conv_phases": phase_rows, "skipped": skipped}, fh, indent=1)


if __name__ == "__main__":
    main()
