#!/usr/bin/env python
"""Float32 error of Winograd F(4x4x4, 3x3x3) and F(4x4x4, 2x2x2) next to im2col, forward and backward.

For each shape and seed: ``max |y32 - y64| / max_o sum_{c,t} |w x|`` (the natural scale
of a dot product's rounding error), and the same for dx (scale: the input gradient of
|dy| and |w|) and dw (scale: the weight gradient of |dy| and |x|); float64 im2col is the
reference; kernel 3 with 'same' padding 1, kernel 2 with 'same' (0 before, 1 after).  The
largest ratio of all rows must stay below ``winograd.FLOAT32_BOUND``, the bound the module
documents and ``tests/test_winograd.py`` checks.

    python scripts/bench_winograd_error.py [--seeds 3] [--kernels 3 2] [--json FILE]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from refimpl.kernels import winograd  # noqa: E402
from test_winograd import float32_errors  # noqa: E402

SHAPES = [(2, 4, 8, 12), (2, 4, 32, 16), (1, 16, 32, 12), (1, 32, 16, 9), (1, 32, 64, 8),
          (1, 64, 32, 8), (1, 128, 128, 8), (1, 256, 64, 8)]

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--seeds", type=int, default=3, help="random seeds per shape (default 3)")
ap.add_argument("--kernels", type=int, nargs="+", default=[3, 2], choices=sorted(winograd.SCHEMES),
                help="kernel extents to measure (default 3 2: F(4,3) and F(4,2))")
ap.add_argument("--json", metavar="FILE", help="write the rows to FILE")
args = ap.parse_args()
if args.seeds < 1:
    ap.error("--seeds must be >= 1")

rows = []
print(f"{'k, N, C->F, size':>21} | {'im2col y / dx / dw':>27} | {'winograd y / dx / dw':>27}")
for k in args.kernels:
    for n, c, f, size in SHAPES:
        worst = {"im2col": [0.0] * 3, "winograd": [0.0] * 3}
        for seed in range(args.seeds):
            for alg, errs in float32_errors(n, c, f, size, seed, k=k).items():
                worst[alg] = [max(a, b) for a, b in zip(worst[alg], errs)]
        rows.append(dict(k=k, n=n, c=c, f=f, size=size, **worst))
        fmt = lambda v: " / ".join(f"{e:.1e}" for e in v)  # noqa: E731
        print(f"{f'{k}, {n}, {c}->{f}, {size}^3':>21} | {fmt(worst['im2col']):>27} | {fmt(worst['winograd']):>27}")
top = max(max(r["winograd"]) for r in rows)
print(f"largest Winograd ratio {top:.2e}; documented bound FLOAT32_BOUND = {winograd.FLOAT32_BOUND:.0e}"
      f" -> {'within' if top <= winograd.FLOAT32_BOUND else 'EXCEEDED'}")
if args.json:
    with open(args.json, "w") as fh:
        json.dump({"bound": winograd.FLOAT32_BOUND, "rows": rows}, fh, indent=1)
sys.exit(0 if top <= winograd.FLOAT32_BOUND else 1)
