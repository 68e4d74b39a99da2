# %% [markdown]
# # Tutorial 1 — A 3D convolution by hand
#
#     mpiexec -n 4 --oversubscribe python tutorials/01_conv_by_hand.py     (any number of ranks; 1 works too)
#
# Everything else in refimpl (halo exchanges, spatial and model parallelism, U-Net) is built
# around one piece of math: a 3D convolution and its two backward passes. This tutorial
# derives them — forward as **im2col + one matrix product**, the weight gradient as another
# product with the same columns, the input gradient as the **adjoint of im2col** (col2im) —
# and reads the code that computes them: refimpl's **reference convolution**, the six short
# functions at the top of `refimpl/functional/conv3d.py` ("the math"). `algorithm="reference"`
# (or `REFIMPL_CONV_ALGORITHM=reference` for a whole run) makes `conv3d`, its backward and
# `conv_transpose3d` run exactly those functions, and the oracle computes its expectations with
# them. We check them against the definition, against an independent construction of the
# columns, against finite differences, and against the fast routes in `refimpl/kernels/` (tiled
# im2col, Winograd), all in float64. Last, it shows that the **transposed convolution** is
# nothing but the input gradient of a convolution, which is why U-Net's up-sampling path uses it.
#
# No MPI messages are needed: every rank runs the whole tutorial on its own random draw (seeded
# by its rank), so `p` ranks check `p` draws. The errors are reduced over the ranks
# (`allreduce(MAX)`) before every assert, so all ranks pass or fail together.
#
# A naming trap: `refimpl.functional` re-exports the *function* `conv3d`, so
# `from refimpl.functional import conv3d` — and even `import refimpl.functional.conv3d as conv` —
# gives you the function, not the module. The reference's building blocks are imported by name
# from the module, as below.

# %%
import inspect
from itertools import combinations
from pathlib import Path

import numpy as np
from mpi4py import MPI

import refimpl
from refimpl import functional as F
from refimpl.functional.conv3d import col2im, forward, im2col, input_grad, tap_windows, weight_grad
from refimpl.parallel.partition import transposed_output_extent, window_output_extent

comm = MPI.COMM_WORLD
rank = comm.rank
say = print if rank == 0 else (lambda *a, **k: None)


def worst(err):
    """The largest error over all ranks: every rank asserts the same number."""
    return comm.allreduce(float(err), op=MPI.MAX)


def equal_everywhere(a, b):
    """Whether a and b are equal bit for bit, on every rank (every rank gets the same answer)."""
    return comm.allreduce(bool(a.shape == b.shape and np.array_equal(a, b)), op=MPI.LAND)


def rel(got, ref):
    """Max-norm relative error."""
    return np.abs(got - ref).max() / np.abs(ref).max()


def show(*functions):
    """Print (rank 0) the source of library functions, with the file and lines they live in."""
    root = Path(refimpl.__file__).resolve().parent.parent
    for fn in functions:
        lines, first = inspect.getsourcelines(fn)
        where = Path(inspect.getsourcefile(fn)).resolve().relative_to(root)
        say(f"# ---- {where}, lines {first}-{first + len(lines) - 1}")
        say("".join(lines))


# %% [markdown]
# ## 1. The definition and the output extent
#
# Layout NCDHW, weight `(F, C, kd, kh, kw)` (PyTorch's). Like every deep-learning framework,
# "convolution" means cross-correlation (the kernel is not flipped). Per spatial axis, with
# stride $s$, zero padding $p$ and dilation $d$, output position $o$ reads input position
# $s\,o + d\,t - p$ through kernel tap $t$:
#
# $$ y[n,f,o] \;=\; b[f] + \sum_{c}\sum_{t} W[f,c,t]\; x[n,c,\,s\,o + d\,t - p], $$
#
# where $o$, $t$ and the input index are triples (depth, height, width) and an index outside
# $[0, n)$ reads zero (the padding). The window of output $o$ spans
# $[s\,o - p,\; s\,o - p + d(k-1)]$; it must end inside the padded input, $s\,o - p + d(k-1)
# \le n - 1 + p$, so the number of outputs per axis is
#
# $$ n_{out} \;=\; \left\lfloor \frac{n + 2p - d(k-1) - 1}{s} \right\rfloor + 1 . $$
#
# `refimpl.parallel.partition.window_output_extent(n, k, s, p, d)` computes it; we check it
# against a brute-force count of the windows that fit.

# %%
for n in range(1, 13):
    for k in (1, 2, 3, 4):
        for s in (1, 2, 3):
            for p in (0, 1, 2):
                for d in (1, 2):
                    fits = [o for o in range(n + 2 * p + 1) if s * o - p + d * (k - 1) <= n - 1 + p]
                    if not fits:                      # the kernel is larger than the padded input
                        continue
                    assert window_output_extent(n, k, s, p, d) == len(fits), (n, k, s, p, d)
say("window_output_extent agrees with counting the windows for n<=12, k<=4, s<=3, p<=2, d<=2")
say("examples: n=8 k=3 s=1 p=1 d=1 ->", window_output_extent(8, 3, 1, 1, 1),
    "('same' conv),  n=8 k=3 s=2 p=1 d=1 ->", window_output_extent(8, 3, 2, 1, 1),
    "(halves),  n=8 k=3 s=1 p=0 d=2 ->", window_output_extent(8, 3, 1, 0, 2))

# %% [markdown]
# Two layers for the rest of the tutorial, both float64:
#
# - **A**: a 3×3×3 "same" conv, stride 1, padding 1 — the workhorse of CosmoFlow and U-Net;
# - **B**: 3×3×3, stride 2, padding (1, 1, 2), dilation (1, 1, 2) — a down-sampling conv whose
#   windows have holes along the width.
#
# Different seed on every rank: each rank checks its own random data.

# %%
N, C, Fo = 2, 3, 4
LAYERS = {
    "A": dict(dhw=(6, 7, 5), kernel=(3, 3, 3), stride=(1, 1, 1), padding=(1, 1, 1), dilation=(1, 1, 1)),
    "B": dict(dhw=(9, 8, 10), kernel=(3, 3, 3), stride=(2, 2, 2), padding=(1, 1, 2), dilation=(1, 1, 2)),
}
rng = np.random.default_rng(100 + rank)
for name, L in LAYERS.items():
    L["x"] = rng.standard_normal((N, C) + L["dhw"])
    L["w"] = rng.standard_normal((Fo, C) + L["kernel"])
    L["b"] = rng.standard_normal(Fo)
    L["out"] = tuple(window_output_extent(n, k, s, p, d) for n, k, s, p, d in
                     zip(L["dhw"], L["kernel"], L["stride"], L["padding"], L["dilation"]))
    L["args"] = (L["stride"], L["padding"], L["dilation"])
    say(f"layer {name}: x {L['x'].shape}, w {L['w'].shape} -> y {(N, Fo) + L['out']}")

# %% [markdown]
# ### One output voxel, straight from the definition
#
# Before any trick: the formula above, literally, for one output voxel (skipping taps that
# land in the padding).

# %%


def conv_one_voxel(x, w, b, n, f, o, stride, padding, dilation):
    """y[n, f, o] by the definition: a sum over channels and kernel taps."""
    total = b[f]
    for c in range(x.shape[1]):
        for t in np.ndindex(*w.shape[2:]):
            i = [s * oo + d * tt - p for oo, tt, s, p, d in zip(o, t, stride, padding, dilation)]
            if all(0 <= ii < nn for ii, nn in zip(i, x.shape[2:])):
                total += w[f, c, t[0], t[1], t[2]] * x[n, c, i[0], i[1], i[2]]
    return total


# %% [markdown]
# ## 2. Forward = im2col + GEMM
#
# Fix one output position $(n, o)$. Its value for all $F$ filters is a dot product of the
# weight rows with the $K = C\,k_d k_h k_w$ input values the window reads. Copy those $K$
# values into a **column**; do it for all $M = N\,D' H' W'$ output positions and you get
# a $(K, M)$ matrix `col` — **im2col**. The whole convolution is then one matrix product:
#
# $$ \underbrace{Y}_{(F, M)} \;=\; \underbrace{W}_{(F, K)}\;\underbrace{\mathrm{col}}_{(K, M)} + b,
# \qquad \mathrm{col}[(c,t),\,(n,o)] = x[n, c, s\,o + d\,t - p]. $$
#
# Building it: pad $x$ with $p$ zeros per side (so the padding is just more zeros), then for
# each kernel tap $t$ the inputs that tap reads, over all outputs, form a **strided slice**
# of the padded input: start $d\,t$, step $s$, $n_{out}$ elements. $k_d k_h k_w$ slices fill
# the columns.
#
# That is exactly what refimpl's reference does. Here is its code, printed from the library you
# are running — `tap_windows` (the slices), `im2col` (the copies) and `forward` (the GEMM):

# %%
show(tap_windows, im2col, forward)

# %% [markdown]
# Things to notice:
#
# - `tap_windows` yields the taps in the weight's memory order (the width tap fastest), and
#   `im2col` stacks the rows as $(c, t)$; so the weight `(F, C, kd, kh, kw)` reshaped to
#   $(F, K)$ *is* the GEMM's left factor, no transpose needed.
# - The columns are ordered $(n, o)$: column $m$ = `np.ravel_multi_index((n,) + o, (N,) + out)`.
#   The GEMM's $(F, M)$ result is therefore $F$-major and `forward` transposes it to NCDHW.
# - These functions take arguments that are already checked: stride, padding and dilation as
#   3-tuples, and the output extent `out`. The public `F.conv3d(x, w, b, stride, padding,
#   dilation, algorithm="reference")` validates and normalises its arguments, computes `out`,
#   then returns `forward(...)` — nothing else.
#
# The fast routes compute the same sums differently: `refimpl/kernels/_im2col.py` builds the
# columns tap by tap too, but in bounded tiles and without a padded copy (out-of-range parts
# of each tap's box are zeroed in the tile), strides above 1 can go by input phases
# (`_phase_grid.py`), and 3×3×3 stride-1 convs by Winograd (`winograd.py`); `kernels/conv.py`
# picks one (`algorithm="auto"`, the default), or you name it (`"im2col"`, `"winograd"`).
#
# Now the checks. The same columns can be had without a Python loop: `sliding_window_view`
# gives every window of extent $d(k-1)+1$ as a zero-copy view; taking every $s$-th window and
# every $d$-th element inside it leaves exactly the taps. Both constructions only *copy*
# values, so they must agree bit for bit. Then one output voxel three ways — the definition
# (section 1), one column dotted with one weight row, and the library's `y` — and last the
# reference against the kernel routes and the routes against each other (`"im2col"` always;
# `"winograd"` only for 3×3×3, stride 1, dilation 1 — layer A).

# %%


def im2col_strided(x, kernel, out, stride, padding, dilation):
    xp = np.pad(x, [(0, 0), (0, 0)] + [(p, p) for p in padding])
    span = tuple(d * (k - 1) + 1 for k, d in zip(kernel, dilation))
    win = np.lib.stride_tricks.sliding_window_view(xp, span, axis=(2, 3, 4))  # (N,C,pos..,span..)
    win = win[(slice(None), slice(None))
              + tuple(slice(0, s * (o - 1) + 1, s) for o, s in zip(out, stride))
              + tuple(slice(None, None, d) for d in dilation)]                  # (N,C,out..,k..)
    col = win.transpose(1, 5, 6, 7, 0, 2, 3, 4)                                 # (C,k..,N,out..)
    return col.reshape(x.shape[1] * int(np.prod(kernel)), -1)


errs = {}
for name, L in LAYERS.items():
    x, w, b, out = L["x"], L["w"], L["b"], L["out"]
    s, p, d = L["args"]
    col = im2col(x, w.shape[2:], s, p, d, out)                     # the library's columns, (K, M)
    L["col"] = col
    assert equal_everywhere(col, im2col_strided(x, w.shape[2:], out, s, p, d)), name
    y = F.conv3d(x, w, b, s, p, d, algorithm="reference")
    assert equal_everywhere(y, forward(x, w, b, s, p, d, out)), name  # the public function = the math
    L["y"] = y
    n, f, o = 1, 2, tuple(oo // 2 for oo in out)
    m = np.ravel_multi_index((n,) + o, (N,) + out)                  # the column of output (n, o)
    scale = np.abs(y).max()
    by_definition = conv_one_voxel(x, w, b, n, f, o, s, p, d)
    by_column = w[f].ravel() @ col[:, m] + b[f]                     # one row of W times one column
    errs[f"{name} one voxel: definition"] = abs(y[(n, f) + o] - by_definition) / scale
    errs[f"{name} one voxel: W[f] . col[:, m] + b"] = abs(y[(n, f) + o] - by_column) / scale
    routes = {"reference": y}
    for algorithm in (("im2col", "winograd") if name == "A" else ("im2col",)):
        routes[algorithm] = F.conv3d(x, w, b, s, p, d, algorithm=algorithm)
    for r1, r2 in combinations(routes, 2):
        errs[f"{name} y: {r1} vs {r2}"] = rel(routes[r2], routes[r1])
    say(f"layer {name}: col is {col.shape[0]} x {col.shape[1]} (K x M), equal to the sliding-window "
        f"columns bit for bit; the GEMM is ({Fo} x {col.shape[0]}) @ ({col.shape[0]} x {col.shape[1]})")
for what, err in errs.items():
    err = worst(err)
    say(f"  forward {what:<34} max relative error over ranks {err:.1e}")
    assert err < 1e-12, what

# %% [markdown]
# The column matrix is big: layer A's `col` repeats every input value up to 27 times. That
# memory (and its traffic) is im2col's price for turning a convolution into one large GEMM,
# which is why the reference is not what refimpl runs by default: the kernel route builds the
# columns in bounded tiles (`max_temp_bytes`) and offers Winograd for 3×3×3 kernels.

# %%
for name, L in LAYERS.items():
    say(f"layer {name}: x has {L['x'].size} values, its columns {L['col'].size} "
        f"({L['col'].size / L['x'].size:.1f}x)")

# %% [markdown]
# ## 3. The two backward passes
#
# Let $L$ be a scalar loss and $dY = \partial L / \partial Y$, an $(F, M)$ matrix like $Y$.
# Because $Y = W\,\mathrm{col} + b$ is a matrix product, the chain rule gives three products:
#
# - **weight gradient** $\;dW = dY\,\mathrm{col}^\top$ — in indices
#   $dW[f,c,t] = \sum_{n,o} dy[n,f,o]\; x[n,c,s\,o+d\,t-p]$: the same columns as the forward;
# - **bias gradient** $\;db[f] = \sum_{n,o} dy[n,f,o]$;
# - **column gradient** $\;d\mathrm{col} = W^\top dY$, a $(K, M)$ matrix.
#
# What remains is to go from $d\mathrm{col}$ to $dx$. Each entry of `col` is a *copy* of one
# input value, and an input value appears in several columns (the windows overlap). The
# derivative of a copy is the identity, so each input collects the **sum** of the gradients of
# all its copies:
#
# $$ dx[n,c,i] \;=\; \sum_{(t, o)\,:\; s\,o + d\,t - p = i} d\mathrm{col}[(c,t),(n,o)] . $$
#
# That scatter-add is **col2im**, and it is exactly the *adjoint* (the transpose) of im2col:
# im2col is a linear map $x \mapsto \mathrm{col} = P x$ with $P$ a 0/1 matrix; col2im is
# $P^\top$. So $dx = P^\top W^\top dY$. Code-wise col2im is im2col with the copy reversed:
# the same strided slice per tap, `+=` instead of `=`, and the padding cropped off at the end
# (gradients that land on padding are discarded — padding is a constant, not a variable).
# Inside one tap the slice hits each input at most once, so a plain `+=` on the slice is safe;
# the overlaps are between taps, handled by the loop. The library's `col2im`, and the two
# gradients built on it — `input_grad` ($dx = \mathrm{col2im}(W^\top dY)$) and `weight_grad`
# ($dW = dY\,\mathrm{col}^\top$, rebuilding the columns):

# %%
show(col2im, input_grad, weight_grad)

# %% [markdown]
# The bias gradient is one line of the public `F.conv3d_backward(dy, x, w, stride, padding,
# dilation)`, which returns `(dx, dw, db)`: `db = dy.sum(axis=(0, 2, 3, 4))`. Its building
# blocks `F.conv3d_input_grad(dy, w, x.shape, ...)` and `F.conv3d_weight_grad(dy, x, w.shape,
# ...)` compute one gradient each (the distributed layers and the transposed conv reuse them);
# `dy` may cover only the *first* outputs per axis (`input_grad` and `weight_grad` pass
# `dy.shape[2:]` on as `out`), which the transposed conv of section 4 needs.
#
# ### Check (a): the adjoint, and the reference against the kernel routes
#
# First col2im's defining property, the adjoint identity
# $\langle P x, u\rangle = \langle x, P^\top u\rangle$ for random $x$, $u$ (its error measured
# relative to $\sum |(Px)_i\, u_i|$, the scale of a dot product's rounding: a random draw can make
# the dot product itself nearly cancel). Then: the public
# backward with `algorithm="reference"` returns exactly `input_grad` and `weight_grad`; $dW$
# equals $dY\,\mathrm{col}^\top$ with the *forward's* columns from section 2; and the reference
# gradients agree with the kernel routes, both through `conv3d_backward` and through the
# building blocks (separate kernel code paths), and the routes with each other.

# %%
errs = {}
for name, L in LAYERS.items():
    x, w, col, out = L["x"], L["w"], L["col"], L["out"]
    s, p, d = L["args"]
    u = rng.standard_normal(col.shape)
    lhs, rhs = np.vdot(col, u), np.vdot(x, col2im(u, x.shape, w.shape[2:], s, p, d, out))
    errs[f"{name} <Px,u> = <x,P^T u>"] = abs(lhs - rhs) / np.vdot(np.abs(col), np.abs(u))

    dy = rng.standard_normal((N, Fo) + out)
    L["g"] = dy
    dx, dw, db = F.conv3d_backward(dy, x, w, s, p, d, algorithm="reference")
    L["dx"], L["dw"] = dx, dw
    assert equal_everywhere(dx, input_grad(dy, w, x.shape, s, p, d)), name
    assert equal_everywhere(dw, weight_grad(dy, x, w.shape, s, p, d)), name
    dy_rows = dy.transpose(1, 0, 2, 3, 4).reshape(Fo, -1)          # (F, M), columns in col's (n, o) order
    errs[f"{name} dW = dY col^T (forward's col)"] = rel((dy_rows @ col.T).reshape(w.shape), dw)

    routes = {"reference": (dx, dw)}
    for algorithm in (("im2col", "winograd") if name == "A" else ("im2col",)):
        dx_k, dw_k, _ = F.conv3d_backward(dy, x, w, s, p, d, algorithm=algorithm)
        routes[algorithm] = (dx_k, dw_k)
        errs[f"{name} input_grad: reference vs {algorithm}"] = rel(
            F.conv3d_input_grad(dy, w, x.shape, s, p, d, algorithm=algorithm), dx)
        errs[f"{name} weight_grad: reference vs {algorithm}"] = rel(
            F.conv3d_weight_grad(dy, x, w.shape, s, p, d, algorithm=algorithm), dw)
    for r1, r2 in combinations(routes, 2):
        errs[f"{name} dx: {r1} vs {r2}"] = rel(routes[r2][0], routes[r1][0])
        errs[f"{name} dw: {r1} vs {r2}"] = rel(routes[r2][1], routes[r1][1])
for what, err in errs.items():
    err = worst(err)
    say(f"  backward {what:<38} max relative error over ranks {err:.1e}")
    assert err < 1e-12, what

# %% [markdown]
# ### Check (b): finite differences
#
# Check (a) compares code with code, and the kernel routes were written and tested against the
# reference: a mistake in the reference's formulas could be shared. So we also ask the
# definition of a derivative. Take $L = \sum y \cdot g$ with a fixed random $g$: then
# $\partial L/\partial y = g$, so $dx$, $dW$ are the backward of `dy = g` (computed in check
# (a) with `algorithm="reference"`). For a few random entries $\theta$ of $x$ and of $W$, the
# central difference of the reference forward
#
# $$ \frac{L(\theta + h) - L(\theta - h)}{2h} $$
#
# should match the analytic gradient. (Here $L$ is *linear* in $x$ for fixed $W$ and vice
# versa, so the central difference has no truncation error at all — only rounding, about
# $\varepsilon\,|L|/h$. We use $h = 10^{-3}$ and demand a relative error below $10^{-7}$; with a
# nonlinear loss one would balance truncation, $O(h^2)$, against rounding.)

# %%
h = 1e-3
fd_errs = []
for name, L in LAYERS.items():
    x, w, b, g = L["x"].copy(), L["w"].copy(), L["b"], L["g"]

    def loss():
        return float(np.sum(F.conv3d(x, w, b, *L["args"], algorithm="reference") * g))

    for arr, grad in ((x, L["dx"]), (w, L["dw"])):
        scale = np.abs(grad).max()
        for _ in range(4):
            idx = tuple(rng.integers(0, n) for n in arr.shape)
            keep = arr[idx]
            arr[idx] = keep + h
            up = loss()
            arr[idx] = keep - h
            down = loss()
            arr[idx] = keep
            fd = (up - down) / (2 * h)
            # relative to the entry, floored at 1e-3 x the gradient's scale (an entry may be ~0)
            fd_errs.append(abs(fd - grad[idx]) / max(abs(grad[idx]), 1e-3 * scale))
err = worst(max(fd_errs))
say(f"finite differences on {len(fd_errs)} entries of x and W per rank ({comm.size} rank(s)): "
    f"max relative error {err:.1e}")
assert err < 1e-7

# %% [markdown]
# ## 4. Transposed convolution is the input gradient
#
# The map $x \mapsto y$ (without bias) is linear: $y = A x$ with $A = W P$ (weights times
# im2col). Section 3 computed $dx = A^\top dy = P^\top W^\top dy$. A **transposed
# convolution** with the *same* weight, stride, padding and dilation is *defined* as that
# map $A^\top$, taking an array shaped like $y$ to an array shaped like $x$:
#
# $$ \mathrm{conv\_transpose}(u) = A^\top u, \qquad
#    \langle \mathrm{conv}(x),\, u \rangle = \langle x,\, \mathrm{conv\_transpose}(u) \rangle
#    \;\; \text{for all } x, u . $$
#
# The right-hand identity — the **dot-product test** — pins $A^\top$ down completely (its error
# measured as in section 3, relative to $\sum |y_i u_i|$), and we check it with `F.conv_transpose3d(u, w, stride=, padding=, output_padding=, dilation=)`.
# Its weight layout is `(C_in, C_out, k...)`: our conv weight `(F, C, k...)` read as is, since
# the transposed conv goes from $F$ channels back to $C$. With `algorithm="reference"` its
# forward is the reference's `input_grad(u, w, output_shape, ...)` — one line of
# `refimpl/functional/conv_transpose3d.py` — so it must equal `input_grad` bit for bit; the
# kernel routes must agree with it to rounding.
#
# One subtlety: with stride $s > 1$ several input extents give the same output extent (the
# floor in the extent formula drops a remainder $r = (n + 2p - d(k-1) - 1) \bmod s$). The
# transposed conv's own extent, $(n_{out}-1)s - 2p + d(k-1) + \mathrm{output\_padding} + 1$
# (`transposed_output_extent`), reproduces $n$ when `output_padding` $= r$. Layer B needs
# $(0, 1, 1)$.

# %%
errs = {}
for name, L in LAYERS.items():
    s, p, d = L["args"]
    r = tuple((n + 2 * pp - dd * (k - 1) - 1) % ss
              for n, k, ss, pp, dd in zip(L["dhw"], L["kernel"], s, p, d))
    back = tuple(transposed_output_extent(o, k, ss, pp, dd, rr)
                 for o, k, ss, pp, dd, rr in zip(L["out"], L["kernel"], s, p, d, r))
    assert back == L["dhw"], (back, L["dhw"])
    x, w = L["x"], L["w"]
    u = rng.standard_normal((N, Fo) + L["out"])
    y0 = F.conv3d(x, w, None, s, p, d, algorithm="reference")              # conv, no bias
    xt = F.conv_transpose3d(u, w, None, stride=s, padding=p, output_padding=r, dilation=d,
                            algorithm="reference")
    lhs, rhs = np.vdot(y0, u), np.vdot(x, xt)
    errs[f"{name} <conv x, u> = <x, convT u>"] = abs(lhs - rhs) / np.vdot(np.abs(y0), np.abs(u))
    assert equal_everywhere(xt, input_grad(u, w, x.shape, s, p, d)), name
    for algorithm in (("im2col", "winograd") if name == "A" else ("im2col",)):
        xt_k = F.conv_transpose3d(u, w, None, stride=s, padding=p, output_padding=r, dilation=d,
                                  algorithm=algorithm)
        errs[f"{name} convT: reference vs {algorithm}"] = rel(xt_k, xt)
    say(f"layer {name}: output_padding {r}; conv_transpose3d maps {u.shape} -> {xt.shape}; "
        f"<conv x, u> = {lhs:+.12f}, <x, convT u> = {rhs:+.12f}")
for what, err in errs.items():
    err = worst(err)
    say(f"  {what:<32} max relative error over ranks {err:.1e}")
    assert err < 1e-12, what

# %% [markdown]
# So refimpl writes the math once: `conv_transpose3d`'s forward *is* the conv's input gradient
# (`input_grad`), its input gradient is an ordinary conv (`forward`: the transpose of a
# transpose), and its weight gradient is `weight_grad` with the roles of `x` and `dy` swapped.
#
# **Why U-Net up-samples with it.** The encoder shrinks the volume with stride-2 maps
# (pooling, or a strided conv $A$ from $n$ to $n/2$). The decoder must go back to exactly the
# encoder's grid to concatenate the skip connection. $A^\top$ does that by construction: same
# kernel geometry, opposite shapes — and, unlike fixed interpolation, its weights are learned.
# refimpl's U-Net uses kernel 2, stride 2: the windows of the down conv tile the volume
# without overlap, so the up conv "stamps" one learned 2×2×2 patch per coarse voxel and the
# extent exactly doubles, $(n-1)\cdot 2 + 1 + 1 = 2n$. With kernel 3 and stride 2 the stamps
# overlap unevenly (the checkerboard artifacts of deconvolution), one reason the 2/2 choice is
# popular.

# %%
for n in (4, 5, 8, 16):
    assert window_output_extent(2 * n, 2, 2, 0, 1) == n and transposed_output_extent(n, 2, 2, 0, 1) == 2 * n
wu = rng.standard_normal((Fo, 2, 2, 2, 2))                     # (C_in=4, C_out=2, 2, 2, 2)
coarse = rng.standard_normal((1, Fo, 3, 4, 5))
fine = F.conv_transpose3d(coarse, wu, stride=2)
stamp = np.einsum("f,fcabe->cabe", coarse[0, :, 1, 2, 3], wu)  # coarse voxel (1,2,3)'s patch
err = worst(rel(fine[0, :, 2:4, 4:6, 6:8], stamp))
say(f"k=2 s=2 up-sampling: {coarse.shape} -> {fine.shape}; the fine 2x2x2 block of coarse voxel "
    f"(1, 2, 3) is its stamp, relative error {err:.1e}")
assert err < 1e-12

# %% [markdown]
# ## 5. Picture: what one output voxel reads, and where one coarse voxel writes
#
# Layer B in a (height, width) slice of the padded input, at the depth of the window's
# middle tap. The window of output $o$ covers rows $2o_h - 1 + \{0,1,2\}$ and columns
# $2o_w - 2 + \{0, 2, 4\}$ (stride 2, dilation 2 along the width). We draw the two outputs in
# the corner, $o_h = 0$ and $o_w \in \{0, 1\}$: part of their windows lies in the padding
# (it reads zeros), and the two neighbours share two columns — that overlap is why col2im must
# *add*. The second panel computes the same
# footprint the other way round — `conv_transpose3d` of a one-hot array with all-ones weights —
# and the footprints agree (asserted): the input-adjoint writes exactly where the conv reads.

# %%
L = LAYERS["B"]
s, p, d = L["args"]
kd, kh, kw = L["kernel"]
D, H, W = L["dhw"]
outs = [(2, 0, 0), (2, 0, 1)]                                      # two neighbours along the width
reads = np.zeros((len(outs), D, H, W), dtype=bool)
for j, o in enumerate(outs):
    for t in np.ndindex(kd, kh, kw):
        i = tuple(ss * oo + dd * tt - pp for oo, tt, ss, pp, dd in zip(o, t, s, p, d))
        if all(0 <= ii < nn for ii, nn in zip(i, L["dhw"])):
            reads[(j,) + i] = True
writes = np.zeros_like(reads)
for j, o in enumerate(outs):
    onehot = np.zeros((1, 1) + L["out"])
    onehot[(0, 0) + o] = 1.0
    r = tuple((n + 2 * pp - dd * (k - 1) - 1) % ss for n, k, ss, pp, dd in
              zip(L["dhw"], L["kernel"], s, p, d))
    writes[j] = F.conv_transpose3d(onehot, np.ones((1, 1) + L["kernel"]), stride=s, padding=p,
                                   output_padding=r, dilation=d)[0, 0] != 0
    assert np.array_equal(writes[j], reads[j]), o
say("the conv's read window of each output equals conv_transpose3d's write footprint")

plane = s[0] * outs[0][0] + d[0] * (kd // 2) - p[0]                # depth of the middle tap
if rank == 0:
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    ph, pw = p[1], p[2]
    grid = np.zeros((H + 2 * ph, W + 2 * pw))                      # 0: padding
    grid[ph:ph + H, pw:pw + W] = 1                                 # 1: input
    window = np.zeros((2,) + grid.shape, dtype=bool)               # padded coordinates
    for j, o in enumerate(outs):
        for a, e in np.ndindex(kh, kw):
            window[j, s[1] * o[1] + d[1] * a, s[2] * o[2] + d[2] * e] = True
    grid[window[0] & ~window[1]] = 2                               # 2, 3: one window; 4: both
    grid[window[1] & ~window[0]] = 3
    grid[window[0] & window[1]] = 4
    cmap = ListedColormap(["#dddddd", "white", "#4c9be8", "#f28e2b", "#8e44ad"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    ax = axes[0]
    ax.imshow(grid, cmap=cmap, vmin=-0.5, vmax=4.5)
    ax.add_patch(plt.Rectangle((pw - 0.5, ph - 0.5), W, H, fill=False, lw=2))
    ax.set_xticks(range(W + 2 * pw), [str(c - pw) for c in range(W + 2 * pw)], fontsize=7)
    ax.set_yticks(range(H + 2 * ph), [str(c - ph) for c in range(H + 2 * ph)], fontsize=7)
    ax.set_title(f"input slice d={plane} (grey: padding)\nblue: reads of y{outs[0]}, "
                 f"orange: y{outs[1]}, purple: both", fontsize=9)
    ax.set_xlabel("width index (stride 2, dilation 2)")
    ax.set_ylabel("height index (stride 2, dilation 1)")
    ax = axes[1]                                                   # same frame, written cells only
    grid2 = np.zeros_like(grid)
    grid2[ph:ph + H, pw:pw + W] = 1 + writes[0, plane] + 2 * writes[1, plane]
    ax.imshow(grid2, cmap=cmap, vmin=-0.5, vmax=4.5)
    ax.add_patch(plt.Rectangle((pw - 0.5, ph - 0.5), W, H, fill=False, lw=2))
    ax.set_xticks(range(W + 2 * pw), [str(c - pw) for c in range(W + 2 * pw)], fontsize=7)
    ax.set_yticks(range(H + 2 * ph), [str(c - ph) for c in range(H + 2 * ph)], fontsize=7)
    ax.set_title("conv_transpose3d of one-hot y(2,0,0) / y(2,0,1): where each writes\n"
                 "(same slice; nothing is written into the padding)", fontsize=9)
    ax.set_xlabel("width index")
    fig.tight_layout()
    fig.savefig("01_conv_by_hand.png", dpi=90)
    plt.close(fig)
    print("saved 01_conv_by_hand.png")

# %% [markdown]
# ## Summary
#
# | pass | formula | public function | the reference (`refimpl/functional/conv3d.py`) |
# |---|---|---|---|
# | forward | $Y = W\,\mathrm{col} + b$, $\mathrm{col} = \mathrm{im2col}(x)$ | `conv3d` | `forward`, `im2col`, `tap_windows` |
# | weight grad | $dW = dY\,\mathrm{col}^\top$, $db = \sum dY$ | `conv3d_weight_grad` | `weight_grad` |
# | input grad | $dx = \mathrm{col2im}(W^\top dY)$, col2im = im2col$^\top$ | `conv3d_input_grad` | `input_grad`, `col2im` |
# | both | the above | `conv3d_backward` | `input_grad`, `weight_grad`, `dy.sum` |
# | transposed conv | $\mathrm{convT}(u) = \mathrm{col2im}(W^\top u)$ | `conv_transpose3d` | `input_grad` |
#
# The public functions run the reference with `algorithm="reference"` (or
# `REFIMPL_CONV_ALGORITHM=reference`), and a fast route from `refimpl/kernels/` otherwise
# (`"auto"`, the default; `"im2col"`; `"winograd"`), each agreeing with the reference to
# rounding. The derivations of all these formulas are on the docs' Derivations page
# (`docs/derivations.md`, "Convolution").
#
# Next: splitting a sample over ranks, and why a convolution then needs its neighbours' voxels
# (blocks, needed ranges and halos: tutorial 02; the halo exchange itself: tutorial 03).

# %%
ok = comm.allreduce(1, op=MPI.SUM)
say(f"all checks passed on {ok} rank(s)")
