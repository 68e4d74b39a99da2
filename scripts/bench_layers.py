#!/usr/bin/env python
"""Layer benchmark: refimpl's conv3d / conv_transpose3d / pooling vs PyTorch CPU and numpy GEMM.

Ops, on CosmoFlow-like layer shapes (float32, k=3, padding 1 for the convs):
conv3d forward, backward-data (``conv3d_input_grad``), backward-weights
(``conv3d_weight_grad``), full backward (``conv3d_backward``: dx, dw, db),
conv_transpose3d forward, and max / avg pooling forward and backward.

Columns: ours GFLOP/s, torch GFLOP/s, ours/torch, ours/GEMM (the numpy float32
GEMM rate on a square 2048^3 matmul, measured first in the same run and again
after every row, the best kept), peak temporary
memory of ours (tracemalloc: NumPy reports its buffers to it; the result
array is not counted) next to the input size.  A conv counts
``2 * N * F * C * kd*kh*kw * (output positions)`` flops per pass (the
transposed conv: per input position); pooling counts one op per window tap
(so its "GF/s" are Gop/s, and its ours/GEMM column means little).

The machine may be shared: ours and torch are timed alternately, repeat by
repeat, and the best of the repeats is kept, so the ratios are measured under
the same conditions.

    python scripts/bench_layers.py [--quick] [--threads N] [--json FILE]

``--threads`` sets numpy's BLAS threads (threadpoolctl if available, else the
environment, set before numpy is imported) and torch's intra-op threads.
torch is optional: without it the torch columns read n/a.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--quick", action="store_true", help="reduced set: batch 1, fewer repeats (< 1 min)")
ap.add_argument("--threads", type=int, default=None,
                help="BLAS / torch threads (default: all cores)")
ap.add_argument("--repeats", type=int, default=None, help="timed repeats per op (best kept)")
ap.add_argument("--json", metavar="FILE", help="write the numbers to FILE")
ap.add_argument("--only", default=None, help="run only rows whose op or shape contains this text")
args = ap.parse_args()

THREADS = args.threads or os.cpu_count() or 1
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(THREADS)

import numpy  # noqa: E402  (after the thread environment)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from refimpl.functional import _im2col  # noqa: E402
from refimpl.functional.conv3d import (conv3d, conv3d_backward, conv3d_input_grad,  # noqa: E402
                                       conv3d_weight_grad)
from refimpl.functional.conv_transpose3d import conv_transpose3d  # noqa: E402

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

REPEATS = args.repeats or (2 if args.quick else 4)


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def gemm_rate(n=2048, repeats=None):
    a = numpy.random.default_rng(0).standard_normal((n, n), dtype=numpy.float32)
    b = numpy.random.default_rng(1).standard_normal((n, n), dtype=numpy.float32)
    a @ b
    t = min(timed(lambda: a @ b) for _ in range(repeats or max(3, REPEATS)))
    return 2 * n ** 3 / t / 1e9


def peak_temp(fn):
    """Peak bytes traced during ``fn()`` minus the bytes of what it returns."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    out = fn()
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    outs = out if isinstance(out, tuple) else (out,)
    kept = sum(o.nbytes for o in outs if hasattr(o, "nbytes"))
    return peak - kept


def num(v, width):
    return f"{v:{width}.1f}" if v >= 10 else f"{v:{width}.2f}"


def mib(b):
    return f"{b / 2**20:.0f}" if b >= 2**20 else f"{b / 2**20:.2f}"


# ---------------------------------------------------------------------------- cases

def conv_cases(quick):
    # (name, N, C, F, n): CosmoFlow conv layers, k=3 pad 1
    # (C, F, n, batches); --quick: the first layer on 64^3 instead of 128^3, no 64->128
    layers = [(4, 32, 64 if quick else 128, [1] if quick else [1, 2]),
              (32, 64, 64, [1])] + ([] if quick else [(64, 128, 32, [1])]) + [
              (256, 512, 8, [1] if quick else [1, 4])]
    for c, f, n, batches in layers:
        for nb in batches:
            yield f"N={nb} {c}->{f} @{n}^3", nb, c, f, n


def make_rows(quick):
    """(op, shape label, flops, ours(), torch() or None, input bytes)."""
    rng = numpy.random.default_rng(0)
    rows = []
    for label, nb, c, f, n in conv_cases(quick):
        x = rng.standard_normal((nb, c, n, n, n), dtype=numpy.float32)
        w = rng.standard_normal((f, c, 3, 3, 3), dtype=numpy.float32) * 0.1
        b = rng.standard_normal(f, dtype=numpy.float32)
        dy = rng.standard_normal((nb, f, n, n, n), dtype=numpy.float32)
        flops = 2 * nb * f * c * 27 * n ** 3
        tx = tw = tb = tdy = None
        if torch is not None:
            tx, tw, tb, tdy = (torch.from_numpy(a) for a in (x, w, b, dy))

        def cb(tx=tx, tw=tw, tdy=tdy, mask=None):
            return torch.ops.aten.convolution_backward(
                tdy, tx, tw, None, [1] * 3, [1] * 3, [1] * 3, False, [0] * 3, 1, mask)

        t_ok = torch is not None
        rows += [
            ("conv3d fwd", label, flops, x.nbytes,
             lambda x=x, w=w, b=b: conv3d(x, w, b, 1, 1),
             (lambda tx=tx, tw=tw, tb=tb: torch.nn.functional.conv3d(tx, tw, tb, 1, 1)) if t_ok else None),
            ("conv3d bwd-data", label, flops, dy.nbytes,
             lambda dy=dy, w=w, s=x.shape: conv3d_input_grad(dy, w, s, 1, 1, 1),
             (lambda cb=cb: cb(mask=[True, False, False])) if t_ok else None),
            ("conv3d bwd-weight", label, flops, x.nbytes + dy.nbytes,
             lambda dy=dy, x=x, s=w.shape: conv3d_weight_grad(dy, x, s, 1, 1, 1),
             (lambda cb=cb: cb(mask=[False, True, False])) if t_ok else None),
            ("conv3d bwd (dx,dw,db)", label, 2 * flops, x.nbytes + dy.nbytes,
             lambda dy=dy, x=x, w=w: conv3d_backward(dy, x, w, 1, 1, 1),
             (lambda cb=cb: cb(mask=[True, True, True])) if t_ok else None),
        ]
    # transposed conv: the adjoints of two conv layers (k3 s1 p1), and a U-Net up-sampling (k2 s2)
    tcases = [("32->4 k3s1p1 @128^3", 32, 4, 128, 3, 1, 1),
              ("128->64 k2s2 @32^3->64^3", 128, 64, 32, 2, 2, 0)]
    if quick:
        tcases = tcases[1:]
    for label, cin, cout, n, k, s, p in tcases:
        x = rng.standard_normal((1, cin, n, n, n), dtype=numpy.float32)
        w = rng.standard_normal((cin, cout, k, k, k), dtype=numpy.float32) * 0.1
        flops = 2 * cin * cout * k ** 3 * n ** 3
        tx, tw = (torch.from_numpy(a) for a in (x, w)) if torch is not None else (None, None)
        rows.append(("conv_transpose3d fwd", "N=1 " + label, flops, x.nbytes,
                     lambda x=x, w=w, s=s, p=p: conv_transpose3d(x, w, None, s, p),
                     (lambda tx=tx, tw=tw, s=s, p=p: torch.nn.functional.conv_transpose3d(
                         tx, tw, None, s, p)) if torch is not None else None))
    if max_pool3d is not None:
        pcases = [("32 @128^3 k2", 32, 128), ("64 @64^3 k2", 64, 64), ("128 @32^3 k2", 128, 32)]
        if quick:
            pcases = pcases[2:]
        for label, c, n in pcases:
            x = rng.standard_normal((1, c, n, n, n), dtype=numpy.float32)
            dy = rng.standard_normal((1, c, n // 2, n // 2, n // 2), dtype=numpy.float32)
            ops = c * n ** 3                      # one op per window tap (k=2, s=2)
            tx = torch.from_numpy(x) if torch is not None else None
            tdy = torch.from_numpy(dy) if torch is not None else None

            def tbwd(fn, tx=tx, tdy=tdy):
                xg = tx.clone().requires_grad_()
                fn(xg, 2).backward(tdy)
                return xg.grad

            t_ok = torch is not None
            rows += [
                ("max_pool3d fwd", "N=1 " + label, ops, x.nbytes, lambda x=x: max_pool3d(x, 2),
                 (lambda tx=tx: torch.nn.functional.max_pool3d(tx, 2)) if t_ok else None),
                ("max_pool3d bwd", "N=1 " + label, ops, x.nbytes + dy.nbytes,
                 lambda x=x, dy=dy: max_pool3d_backward(dy, x, 2),
                 (lambda: tbwd(torch.nn.functional.max_pool3d)) if t_ok else None),
                ("avg_pool3d fwd", "N=1 " + label, ops, x.nbytes, lambda x=x: avg_pool3d(x, 2),
                 (lambda tx=tx: torch.nn.functional.avg_pool3d(tx, 2)) if t_ok else None),
                ("avg_pool3d bwd", "N=1 " + label, ops, x.nbytes + dy.nbytes,
                 lambda x=x, dy=dy: avg_pool3d_backward(dy, x, 2),
                 (lambda: tbwd(torch.nn.functional.avg_pool3d)) if t_ok else None),
            ]
    return rows


def load():
    try:
        with open("/proc/loadavg") as fh:
            return "load average " + " ".join(fh.read().split()[:3])
    except OSError:
        return "load average n/a"


def main():
    t_start = time.perf_counter()
    print(f"# threads={THREADS}  numpy {numpy.__version__}  torch "
          f"{torch.__version__ if torch is not None else 'n/a'}  "
          f"MAX_TEMP_BYTES={_im2col.MAX_TEMP_BYTES >> 20} MiB  repeats={REPEATS}"
          f"{'  (quick)' if args.quick else ''}  {load()}")
    if POOL_NOTE:
        print("# " + POOL_NOTE)
    # the GEMM rate: measured first, then once more after every row; the best counts
    # (on a shared machine a single measurement may land in a busy moment)
    gemm_first = gemm_rate()
    gemm_all = [gemm_first]
    results = []
    for op, label, flops, in_bytes, ours, theirs in make_rows(args.quick):
        if args.only and args.only not in op and args.only not in label:
            continue
        ours()                                      # warm-up (page faults, BLAS threads)
        if theirs is not None:
            theirs()
        t_ours, t_torch = [], []
        for _ in range(REPEATS):                    # interleaved: same machine state for both
            t_ours.append(timed(ours))
            if theirs is not None:
                t_torch.append(timed(theirs))
        tmp = peak_temp(ours)
        gemm_all.append(gemm_rate(repeats=1))
        results.append({"op": op, "shape": label, "flops": flops, "ours_s": min(t_ours),
                        "torch_s": min(t_torch) if t_torch else None,
                        "ours_gflops": flops / min(t_ours) / 1e9,
                        "torch_gflops": flops / min(t_torch) / 1e9 if t_torch else None,
                        "peak_temp_bytes": tmp, "input_bytes": in_bytes})
        print(f"  {op} {label}: done", file=sys.stderr, flush=True)
    gemm = max(gemm_all)
    print(f"# numpy float32 GEMM 2048^3: {gemm:.1f} GFLOP/s (best of {len(gemm_all)} "
          f"measurements; first {gemm_first:.1f}, median {sorted(gemm_all)[len(gemm_all) // 2]:.1f})")
    head = (f"{'op':<22} {'shape':<28} {'ours GF/s':>9} {'torch GF/s':>10} {'ours/torch':>10} "
            f"{'ours/GEMM':>9} {'peak tmp MiB':>12} {'input MiB':>9}")
    print(head)
    print("-" * len(head))
    na = "n/a"
    for r in results:
        g_ours, g_torch = r["ours_gflops"], r["torch_gflops"]
        r["ours_over_torch"] = g_ours / g_torch if g_torch else None
        r["ours_over_gemm"] = g_ours / gemm
        print(f"{r['op']:<22} {r['shape']:<28} {num(g_ours, 9)} "
              f"{(num(g_torch, 10) if g_torch else f'{na:>10}')} "
              f"{(f'{g_ours / g_torch:10.2f}' if g_torch else f'{na:>10}')} "
              f"{g_ours / gemm:9.2f} {mib(r['peak_temp_bytes']):>12} {mib(r['input_bytes']):>9}")
    print(f"# total {time.perf_counter() - t_start:.0f} s; {load()}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"threads": THREADS, "numpy": numpy.__version__,
                       "torch": torch.__version__ if torch is not None else None,
                       "gemm_gflops": gemm, "gemm_gflops_all": gemm_all,
                       "max_temp_bytes": _im2col.MAX_TEMP_BYTES, "quick": args.quick,
                       "repeats": REPEATS, "pool_note": POOL_NOTE, "rows": results}, fh, indent=1)


if __name__ == "__main__":
    main()
