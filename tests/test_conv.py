"""conv3d / conv_transpose3d forward and backward.

- PyTorch CPU float64 as oracle (forward; dx, dw, db by autograd), relative error <= 1e-10,
  over Hypothesis-drawn shapes, kernels (odd and even, per axis), strides, paddings,
  dilations and output paddings;
- finite differences and the adjoint identity, without torch;
- every argument check;
- the temporary-memory bound: tiny budgets give the same result, with many tiles.
"""
import tracemalloc
from itertools import product

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from refimpl.kernels import _im2col, _phase_grid, routes
from refimpl.functional.args import transposed_out_size, window_out_size
from refimpl.functional.conv3d import (conv3d, conv3d_backward, conv3d_input_grad,
                                       conv3d_weight_grad)
from refimpl.functional.conv_transpose3d import conv_transpose3d, conv_transpose3d_backward

try:
    import torch
except ImportError:  # pragma: no cover - torch is an optional test dependency
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch oracle not installed "
                                 "(pip install 'refimpl[oracle]')")
RTOL = 1e-10
# budgets (bytes) from "one output row per tile" to "everything at once"
BUDGETS = st.sampled_from([1, 512, 4096, 64 * 2**20])


def rel_err(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = max(np.abs(b).max(initial=0.0), 1e-300)
    return np.abs(a - b).max(initial=0.0) / scale


triples = lambda lo, hi: st.tuples(*(st.integers(lo, hi),) * 3)  # noqa: E731


@st.composite
def conv_case(draw, transposed=False, stride_one=False):
    n, c, f = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    k, s, d = draw(triples(1, 5)), draw(triples(1, 3)), draw(triples(1, 2))
    s = (1, 1, 1) if stride_one else s
    p = tuple(draw(st.integers(0, ki)) for ki in k)
    if transposed:
        size = draw(triples(1, 5))
        op = tuple(draw(st.integers(0, max(si, di) - 1)) for si, di in zip(s, d))
        out = tuple(transposed_out_size(*a) for a in zip(size, k, s, p, d, op))
        assume(min(out) >= 1)
        return dict(n=n, c=c, f=f, size=size, k=k, s=s, p=p, d=d, op=op, out=out)
    size = draw(triples(1, 9))
    out = tuple(window_out_size(*a) for a in zip(size, k, s, p, d))
    assume(min(out) >= 1)
    return dict(n=n, c=c, f=f, size=size, k=k, s=s, p=p, d=d, out=out)


def torch_conv(x, w, b, dy, s, p, d):
    xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    y = torch.nn.functional.conv3d(xt, wt, bt, s, p, d)
    y.backward(torch.tensor(dy))
    return y.detach().numpy(), xt.grad.numpy(), wt.grad.numpy(), bt.grad.numpy()


def torch_conv_t(x, w, b, dy, s, p, op, d):
    xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    y = torch.nn.functional.conv_transpose3d(xt, wt, bt, s, p, op, 1, d)
    y.backward(torch.tensor(dy))
    return y.detach().numpy(), xt.grad.numpy(), wt.grad.numpy(), bt.grad.numpy()


# ------------------------------------------------------------------ PyTorch oracle

@needs_torch
@given(case=conv_case(), budget=BUDGETS, seed=st.integers(0, 2**16))
def test_conv3d_matches_torch(case, budget, seed):
    rng = np.random.default_rng(seed)
    c = case
    x = rng.standard_normal((c["n"], c["c"]) + c["size"])
    w = rng.standard_normal((c["f"], c["c"]) + c["k"])
    b = rng.standard_normal(c["f"])
    dy = rng.standard_normal((c["n"], c["f"]) + c["out"])
    y_ref, dx_ref, dw_ref, db_ref = torch_conv(x, w, b, dy, c["s"], c["p"], c["d"])

    y = conv3d(x, w, b, c["s"], c["p"], c["d"], max_temp_bytes=budget)
    dx, dw, db = conv3d_backward(dy, x, w, c["s"], c["p"], c["d"], max_temp_bytes=budget)
    assert y.dtype == dx.dtype == dw.dtype == np.float64
    assert rel_err(y, y_ref) <= RTOL
    assert rel_err(dx, dx_ref) <= RTOL
    assert rel_err(dw, dw_ref) <= RTOL
    assert rel_err(db, db_ref) <= RTOL
    # the building blocks alone give the same
    assert rel_err(conv3d_input_grad(dy, w, x.shape, c["s"], c["p"], c["d"]), dx_ref) <= RTOL
    assert rel_err(conv3d_weight_grad(dy, x, w.shape, c["s"], c["p"], c["d"]), dw_ref) <= RTOL


@needs_torch
@given(case=conv_case(transposed=True), budget=BUDGETS, seed=st.integers(0, 2**16))
def test_conv_transpose3d_matches_torch(case, budget, seed):
    rng = np.random.default_rng(seed)
    c = case
    # x: (N, C_in, ...), w: (C_in, C_out, k)
    x = rng.standard_normal((c["n"], c["c"]) + c["size"])
    w = rng.standard_normal((c["c"], c["f"]) + c["k"])
    b = rng.standard_normal(c["f"])
    dy = rng.standard_normal((c["n"], c["f"]) + c["out"])
    y_ref, dx_ref, dw_ref, db_ref = torch_conv_t(x, w, b, dy, c["s"], c["p"], c["op"], c["d"])

    y = conv_transpose3d(x, w, b, c["s"], c["p"], c["op"], c["d"], max_temp_bytes=budget)
    dx, dw, db = conv_transpose3d_backward(dy, x, w, c["s"], c["p"], c["op"], c["d"],
                                           max_temp_bytes=budget)
    assert rel_err(y, y_ref) <= RTOL
    assert rel_err(dx, dx_ref) <= RTOL
    assert rel_err(dw, dw_ref) <= RTOL
    assert rel_err(db, db_ref) <= RTOL


@needs_torch
@given(case=conv_case(), seed=st.integers(0, 2**16), data=st.data())
def test_building_blocks_accept_a_shorter_dy(case, seed, data):
    """dy covering only the first outputs per axis == the full dy with zeros elsewhere."""
    rng = np.random.default_rng(seed)
    c = case
    short = tuple(data.draw(st.integers(1, o)) for o in c["out"])
    x = rng.standard_normal((c["n"], c["c"]) + c["size"])
    w = rng.standard_normal((c["f"], c["c"]) + c["k"])
    dy = rng.standard_normal((c["n"], c["f"]) + short)
    full = np.zeros((c["n"], c["f"]) + c["out"])
    full[:, :, :short[0], :short[1], :short[2]] = dy
    _, dx_ref, dw_ref, _ = torch_conv(x, w, np.zeros(c["f"]), full, c["s"], c["p"], c["d"])
    dx = conv3d_input_grad(dy, w, x.shape, c["s"], c["p"], c["d"])
    dw = conv3d_weight_grad(dy, x, w.shape, c["s"], c["p"], c["d"])
    assert rel_err(dx, dx_ref) <= RTOL
    assert rel_err(dw, dw_ref) <= RTOL


@needs_torch
def test_float32_and_noncontiguous_inputs():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, 7, 6, 3)).astype(np.float32).transpose(0, 1, 4, 3, 2)
    w = rng.standard_normal((4, 5, 3, 2, 3)).astype(np.float32)[:, :, ::-1]
    b = rng.standard_normal(4).astype(np.float32)
    y = conv3d(x, w, b, (1, 2, 1), (1, 0, 2), (2, 1, 1))
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dx, dw, db = conv3d_backward(dy, x, w, (1, 2, 1), (1, 0, 2), (2, 1, 1))
    assert y.dtype == dx.dtype == dw.dtype == db.dtype == np.float32
    ref = torch_conv(*(a.astype(np.float64) for a in (x, w, b, dy)), (1, 2, 1), (1, 0, 2), (2, 1, 1))
    for ours, theirs in zip((y, dx, dw, db), ref):
        assert rel_err(ours, theirs) <= 1e-5


# ------------------------------------------------------- without torch: FD and adjoint

def _dir_deriv(f, a, v, h=1e-3):
    """Central difference of the scalar f at a along v (exact up to rounding: f is linear)."""
    return (f(a + h * v) - f(a - h * v)) / (2 * h)


CASES = [  # (N, C, F, size, k, s, p, d, op)
    (2, 2, 3, (5, 6, 4), (3, 2, 1), (1, 2, 1), (1, 0, 1), (1, 1, 2), (0, 1, 1)),
    (1, 3, 2, (4, 3, 5), (2, 3, 4), (2, 1, 3), (2, 1, 0), (2, 1, 1), (1, 0, 2)),
]


@pytest.mark.parametrize("n, c, f, size, k, s, p, d, op", CASES)
def test_conv3d_finite_differences(n, c, f, size, k, s, p, d, op):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, c) + size)
    w = rng.standard_normal((f, c) + k)
    b = rng.standard_normal(f)
    y = conv3d(x, w, b, s, p, d)
    g = rng.standard_normal(y.shape)                      # L = <conv3d(x, w, b), g>
    dx, dw, db = conv3d_backward(g, x, w, s, p, d)
    vx, vw, vb = (rng.standard_normal(a.shape) for a in (x, w, b))
    loss = lambda x_, w_, b_: float(np.sum(conv3d(x_, w_, b_, s, p, d) * g))  # noqa: E731
    for got, fd in ((np.sum(dx * vx), _dir_deriv(lambda a: loss(a, w, b), x, vx)),
                    (np.sum(dw * vw), _dir_deriv(lambda a: loss(x, a, b), w, vw)),
                    (np.sum(db * vb), _dir_deriv(lambda a: loss(x, w, a), b, vb))):
        assert abs(got - fd) <= 1e-8 * max(1.0, abs(fd))


@pytest.mark.parametrize("n, c, f, size, k, s, p, d, op", CASES)
def test_conv_transpose3d_finite_differences(n, c, f, size, k, s, p, d, op):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, c) + size)
    w = rng.standard_normal((c, f) + k)
    b = rng.standard_normal(f)
    y = conv_transpose3d(x, w, b, s, p, op, d)
    assert y.shape[2:] == tuple(transposed_out_size(*a) for a in zip(size, k, s, p, d, op))
    g = rng.standard_normal(y.shape)
    dx, dw, db = conv_transpose3d_backward(g, x, w, s, p, op, d)
    vx, vw, vb = (rng.standard_normal(a.shape) for a in (x, w, b))
    loss = lambda x_, w_, b_: float(np.sum(conv_transpose3d(x_, w_, b_, s, p, op, d) * g))  # noqa: E731
    for got, fd in ((np.sum(dx * vx), _dir_deriv(lambda a: loss(a, w, b), x, vx)),
                    (np.sum(dw * vw), _dir_deriv(lambda a: loss(x, a, b), w, vw)),
                    (np.sum(db * vb), _dir_deriv(lambda a: loss(x, w, a), b, vb))):
        assert abs(got - fd) <= 1e-8 * max(1.0, abs(fd))


@given(case=conv_case(), seed=st.integers(0, 2**16))
def test_adjoint_identities(case, seed):
    """<conv3d(x, w), g> == <x, input_grad(g, w)> == <w, weight_grad(g, x)>, and the
    transposed conv is the input-adjoint of conv."""
    rng = np.random.default_rng(seed)
    c = case
    x = rng.standard_normal((c["n"], c["c"]) + c["size"])
    w = rng.standard_normal((c["f"], c["c"]) + c["k"])
    g = rng.standard_normal((c["n"], c["f"]) + c["out"])
    lhs = np.sum(conv3d(x, w, None, c["s"], c["p"], c["d"]) * g)
    rhs_x = np.sum(x * conv3d_input_grad(g, w, x.shape, c["s"], c["p"], c["d"]))
    rhs_w = np.sum(w * conv3d_weight_grad(g, x, w.shape, c["s"], c["p"], c["d"]))
    scale = np.sqrt(np.sum(x * x) * np.sum(w * w) * np.sum(g * g)) + 1e-300
    assert abs(lhs - rhs_x) <= 1e-12 * scale
    assert abs(lhs - rhs_w) <= 1e-12 * scale
    # conv_transpose3d(g, w) with output_padding making it land on x's shape
    op = tuple(n - transposed_out_size(o, k, s, p, d, 0)
               for n, o, k, s, p, d in zip(c["size"], c["out"], c["k"], c["s"], c["p"], c["d"]))
    if all(o < max(s, d) for o, s, d in zip(op, c["s"], c["d"])):
        xt = conv_transpose3d(g, w, None, c["s"], c["p"], op, c["d"])
        assert rel_err(xt, conv3d_input_grad(g, w, x.shape, c["s"], c["p"], c["d"])) <= 1e-13


# ------------------------------------------------------------------ argument checks

def _xw(dtype=np.float64):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((1, 2, 5, 5, 5)).astype(dtype),
            rng.standard_normal((3, 2, 3, 3, 3)).astype(dtype))


@pytest.mark.parametrize("call, match", [
    (lambda x, w: conv3d(x[0], w), r"\bx must be 5-D"),
    (lambda x, w: conv3d(x, w[0]), r"\bw must be 5-D"),
    (lambda x, w: conv3d(x[:, :1], w), r"channel mismatch: x .* w"),
    (lambda x, w: conv3d(x, w, padding=-1), r"\bpadding\b"),
    (lambda x, w: conv3d(x, w, padding=(1, -1, 0)), r"\bpadding\b"),
    (lambda x, w: conv3d(x, w, stride=0), r"\bstride\b"),
    (lambda x, w: conv3d(x, w, stride=(1, 1)), r"\bstride\b"),
    (lambda x, w: conv3d(x, w, dilation=0), r"\bdilation\b"),
    (lambda x, w: conv3d(x, w, dilation=3), r"kernel of w .* padded input of x"),
    (lambda x, w: conv3d(x[:, :, :2], w), r"kernel of w .* depth"),
    (lambda x, w: conv3d(x, w.astype(np.float32)), r"dtype mismatch: w"),
    (lambda x, w: conv3d(x, w, np.zeros(3, np.float32)), r"dtype mismatch: b"),
    (lambda x, w: conv3d(x, w, np.zeros(4)), r"\bb must have shape \(3,\)"),
    (lambda x, w: conv3d(x, w, np.zeros((3, 1))), r"\bb must have shape"),
    (lambda x, w: conv3d(x.astype(np.int64), w), r"\bx must be a floating-point"),
    (lambda x, w: conv3d(x, w, max_temp_bytes=0), r"\bmax_temp_bytes\b"),
    (lambda x, w: conv3d_backward(np.zeros((1, 3, 3, 3, 3), np.float32), x, w), r"dtype mismatch: x"),
    (lambda x, w: conv3d_backward(np.zeros((1, 3, 3, 3, 2)), x, w), r"\bdy must have the conv output"),
    (lambda x, w: conv3d_backward(np.zeros((3, 3, 3, 3)), x, w), r"\bdy must be 5-D"),
    (lambda x, w: conv3d_backward(np.zeros((1, 3, 3, 3, 3)), x, w, padding=-2), r"\bpadding\b"),
    (lambda x, w: conv3d_input_grad(np.zeros((1, 3, 3, 3, 3)), w, (1, 2, 5, 5)), r"\binput_shape\b"),
    (lambda x, w: conv3d_input_grad(np.zeros((1, 3, 3, 3, 3)), w, (1, 1, 5, 5, 5)),
     r"channel mismatch: input_shape"),
    (lambda x, w: conv3d_input_grad(np.zeros((1, 3, 4, 3, 3)), w, x.shape), r"\bdy has spatial shape"),
    (lambda x, w: conv3d_input_grad(np.zeros((1, 2, 3, 3, 3)), w, x.shape), r"\bdy must have shape"),
    (lambda x, w: conv3d_input_grad(np.zeros((1, 3, 3, 3, 3), np.float32), w, x.shape),
     r"dtype mismatch: w"),
    (lambda x, w: conv3d_weight_grad(np.zeros((1, 3, 3, 3, 3)), x, (3, 2, 3, 3)), r"\bweight_shape\b"),
    (lambda x, w: conv3d_weight_grad(np.zeros((1, 3, 3, 3, 3)), x, (3, 1, 3, 3, 3)),
     r"channel mismatch: x .* weight_shape"),
    (lambda x, w: conv3d_weight_grad(np.zeros((1, 3, 3, 3, 3)), x, (3, 2, 7, 3, 3)),
     r"kernel of weight_shape"),
    (lambda x, w: conv3d_weight_grad(np.zeros((1, 3, 3, 3, 3)), x, w.shape, stride=(1, 0, 1)),
     r"\bstride\b"),
    (lambda x, w: conv3d_input_grad(np.zeros((1, 3, 3, 3, 3)), w, (1, 2, -1, 5, 5)),
     r"input_shape must be a 5-tuple .* of non-negative ints"),
    (lambda x, w: conv3d_input_grad(np.zeros((1, 3, 3, 3, 3)), w, "abcde"),
     r"input_shape must be a 5-tuple \(N, C, D, H, W\), got 'abcde'"),
])
def test_conv3d_bad_arguments(call, match):
    x, w = _xw()
    with pytest.raises(ValueError, match=match):
        call(x, w)


@pytest.mark.parametrize("groups", [1, 2])
def test_an_input_extent_of_zero_is_accepted_with_any_groups(groups):
    """A block that reads only padding along an axis (input extent 0, output from the padding):
    conv3d and conv3d_backward accept it with groups > 1 as with groups == 1 (each group's
    input gradient takes its slice's shape), dx empty, dW zero, the same as group by group."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 4, 0, 3, 5))
    w = rng.standard_normal((6, 4 // groups, 1, 3, 3))
    y = conv3d(x, w, padding=(1, 1, 1), groups=groups)
    assert y.shape == (2, 6, 2, 3, 5) and not y.any()
    dy = rng.standard_normal(y.shape)
    dx, dw, db = conv3d_backward(dy, x, w, padding=(1, 1, 1), groups=groups)
    assert dx.shape == x.shape and dw.shape == w.shape and not dw.any()
    np.testing.assert_allclose(db, dy.sum(axis=(0, 2, 3, 4)), rtol=1e-13)
    assert conv3d_input_grad(dy, w, x.shape, padding=(1, 1, 1), groups=groups).shape == x.shape


@pytest.mark.parametrize("call, match", [
    (lambda x, w: conv_transpose3d(x[0], w), r"\bx must be 5-D"),
    (lambda x, w: conv_transpose3d(x, w[0]), r"\bw must be 5-D"),
    (lambda x, w: conv_transpose3d(x, w[:1]), r"channel mismatch: x .* w"),
    (lambda x, w: conv_transpose3d(x, w, padding=-1), r"\bpadding\b"),
    (lambda x, w: conv_transpose3d(x, w, padding=9), r"\bpadding\b .* output extent"),
    (lambda x, w: conv_transpose3d(x, w, stride=0), r"\bstride\b"),
    (lambda x, w: conv_transpose3d(x, w, dilation=(1, 0, 1)), r"\bdilation\b"),
    (lambda x, w: conv_transpose3d(x, w, stride=2, output_padding=2), r"\boutput_padding\b"),
    (lambda x, w: conv_transpose3d(x, w, output_padding=1), r"\boutput_padding\b"),
    (lambda x, w: conv_transpose3d(x, w, output_padding=-1), r"\boutput_padding\b"),
    (lambda x, w: conv_transpose3d(x, w.astype(np.float32)), r"dtype mismatch: w"),
    (lambda x, w: conv_transpose3d(x, w, np.zeros(2, np.float32)), r"dtype mismatch: b"),
    (lambda x, w: conv_transpose3d(x, w, np.zeros(3)), r"\bb must have shape \(2,\)"),
    (lambda x, w: conv_transpose3d_backward(np.zeros((1, 2, 7, 7, 7), np.float32), x, w),
     r"dtype mismatch: x"),
    (lambda x, w: conv_transpose3d_backward(np.zeros((1, 2, 7, 7, 6)), x, w), r"\bdy must have"),
    (lambda x, w: conv_transpose3d_backward(np.zeros((1, 2, 7, 7, 7)), x, w, output_padding=(0, 0, 1)),
     r"\boutput_padding\b"),
])
def test_conv_transpose3d_bad_arguments(call, match):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 3, 5, 5, 5))
    w = rng.standard_normal((3, 2, 3, 3, 3))
    with pytest.raises(ValueError, match=match):
        call(x, w)


def test_output_padding_below_dilation_is_allowed():
    """PyTorch's rule is output_padding < max(stride, dilation), not < stride."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 1, 3, 3, 3))
    w = rng.standard_normal((1, 1, 2, 2, 2))
    y = conv_transpose3d(x, w, None, 1, 0, (2, 0, 1), 3)
    assert y.shape[2:] == (3 + 3 + 2, 6, 7)
    dx, dw, db = conv_transpose3d_backward(np.ones(y.shape), x, w, 1, 0, (2, 0, 1), 3)
    assert dx.shape == x.shape and dw.shape == w.shape and db.shape == (1,)


# ------------------------------------------------------------- memory bound, tiles

def _traced(fn):
    """(result, peak traced bytes during fn minus the bytes of the result).

    ``fn`` runs once untraced first: a first call fills Python's free lists of
    small tuples (the tap and tile bookkeeping), which tracemalloc would count
    as held memory, sometimes more than the bound (flaky, order-dependent)."""
    fn()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    out = fn()
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    outs = out if isinstance(out, tuple) else (out,)
    return out, peak - sum(o.nbytes for o in outs)


@pytest.mark.parametrize("budget", [1, 4096, 40_000])
def test_small_budget_same_result_and_bounded_memory(budget, monkeypatch):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 12, 10, 9))
    w = rng.standard_normal((4, 3, 3, 2, 3))
    s, p, d = (1, 2, 1), (1, 1, 2), (2, 1, 1)
    y0 = conv3d(x, w, None, s, p, d, max_temp_bytes=2**30)
    g = rng.standard_normal(y0.shape)
    dx0, dw0, _ = conv3d_backward(g, x, w, s, p, d, max_temp_bytes=2**30)
    t0 = conv_transpose3d(g, w, None, s, p, 0, d, max_temp_bytes=2**30)
    tb0 = conv_transpose3d_backward(t0, g, w, s, p, 0, d, max_temp_bytes=2**30)

    counts = []
    real_tiles = _im2col.tiles

    def counting(*a):
        out = real_tiles(*a)
        counts.append(len(out[0]))
        return out
    monkeypatch.setattr(_im2col, "tiles", counting)

    y, tmp_fwd = _traced(lambda: conv3d(x, w, None, s, p, d, max_temp_bytes=budget))
    (dx, dw, _), tmp_bwd = _traced(lambda: conv3d_backward(g, x, w, s, p, d, max_temp_bytes=budget))
    t, tmp_t = _traced(lambda: conv_transpose3d(g, w, None, s, p, 0, d, max_temp_bytes=budget))
    tb = conv_transpose3d_backward(t0, g, w, s, p, 0, d, max_temp_bytes=budget)

    assert min(counts) > 1, "a small budget must cut the work into several tiles"
    for a, b in ((y, y0), (dx, dx0), (dw, dw0), (t, t0)) + tuple(zip(tb, tb0)):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13 * np.abs(b).max())
    # column (+ GEMM-output) tile <= max(budget, one output row's); the rest is small and
    # fixed: weight copies and Python objects (tile list, slices)
    kk, f, wo = 3 * 3 * 2 * 3, 4, y0.shape[-1]
    row = (kk + f) * wo * 8
    bound = max(budget, row) + 6 * w.nbytes + 32 * 1024
    full = kk * y0[0, 0].size * y0.shape[0] * 8          # the unchunked column matrix
    assert 2 * bound < full
    for tmp in (tmp_fwd, tmp_bwd, tmp_t):
        assert tmp <= bound, (tmp, bound)


def test_tiles_cover_the_output_once():
    for n, out, pos in [(3, (4, 5, 6), 1), (3, (4, 5, 6), 13), (3, (4, 5, 6), 31),
                        (3, (4, 5, 6), 121), (3, (4, 5, 6), 300), (3, (4, 5, 6), 10**6)]:
        tl, tpos = _im2col.tiles(n, out, pos)
        hit = np.zeros((n,) + out, int)
        for n0, n1, d0, d1, h0, h1 in tl:
            hit[n0:n1, d0:d1, h0:h1, :] += 1
            size = (n1 - n0) * (d1 - d0) * (h1 - h0) * out[2]
            assert size <= max(pos, out[2]) and size <= tpos
            assert h1 - h0 == out[1] or d1 - d0 == 1          # (d, h, w) block contiguous
            assert d1 - d0 == out[0] or n1 - n0 == 1
        assert (hit == 1).all()


def test_default_budget_is_a_module_constant(monkeypatch):
    """MAX_TEMP_BYTES is read at call time."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 2, 6, 6, 6))
    w = rng.standard_normal((2, 2, 3, 3, 3))
    ref = conv3d(x, w, padding=1, algorithm="im2col")
    counts = []
    real_tiles = _im2col.tiles
    monkeypatch.setattr(_im2col, "tiles", lambda *a: counts.append(1) or real_tiles(*a))
    monkeypatch.setattr(_im2col, "MAX_TEMP_BYTES", 64)
    monkeypatch.setattr(_im2col, "MIN_TILE_POSITIONS", 1)
    _, tmp = _traced(lambda: conv3d(x, w, padding=1, algorithm="im2col"))
    # (with the default budget the depth-tap variant ran: the same sum in another order)
    assert rel_err(conv3d(x, w, padding=1, algorithm="im2col"), ref) <= 1e-13
    assert tmp < (2 * 27 + 2) * 6 * 8 + 6 * w.nbytes + 32 * 1024     # one row's tile


@needs_torch
@pytest.mark.parametrize("c", [1, 2, 5])
def test_im2col_thread_counts_agree_and_repeat(c, monkeypatch):
    """The im2col backward splits the input channels among the worker threads (col2im's
    tiles overlap in dx, its channels do not): 1, 2 and 3 workers, channel counts below,
    at and above the worker count, stride 2 and a budget of many tiles, all equal torch
    to 1e-10 in float64, and the same count repeats bit for bit."""
    rng = np.random.default_rng(c)
    x = rng.standard_normal((2, c, 9, 8, 7))
    w = rng.standard_normal((3, c, 3, 2, 3))
    s, p, d = (2, 1, 2), (1, 0, 1), (1, 1, 1)
    out = [window_out_size(n, k, ss, pp, dd) for n, k, ss, pp, dd in zip(x.shape[2:], w.shape[2:], s, p, d)]
    dy = rng.standard_normal((2, 3) + tuple(out))
    _, ref_dx, ref_dw, _ = torch_conv(x, w, rng.standard_normal(3), dy, s, p, d)
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("REFIMPL_THREADS", threads)
        runs = [conv3d_backward(dy, x, w, stride=s, padding=p, max_temp_bytes=4096,
                                algorithm="im2col")[:2] for _ in range(2)]
        for a, b in zip(*runs):
            assert np.array_equal(a, b)
        assert rel_err(runs[0][0], ref_dx) <= RTOL
        assert rel_err(runs[0][1], ref_dw) <= RTOL
        dx_only = conv3d_input_grad(dy, w, x.shape, stride=s, padding=p, max_temp_bytes=4096,
                                    algorithm="im2col")
        assert rel_err(dx_only, ref_dx) <= RTOL


@needs_torch
@pytest.mark.parametrize("n, c, f, size, k, p, d, budget", [
    (1, 3, 4, (7, 6, 5), (3, 3, 3), (1, 1, 1), (1, 1, 1), 64 * 2**20),   # one tile
    (3, 2, 3, (5, 4, 6), (3, 2, 3), (1, 0, 2), (1, 1, 1), 64 * 2**20),   # tiles of several samples
    (2, 2, 3, (9, 6, 5), (3, 3, 1), (2, 1, 0), (2, 1, 1), 20_000),       # dilated depth, plane tiles
    (1, 2, 2, (6, 9, 8), (2, 3, 3), (0, 1, 1), (1, 2, 1), 3_000),        # even kd: one-row tiles
])
def test_depth_taps_match_torch(n, c, f, size, k, p, d, budget, monkeypatch):
    """The depth-tap variant (stride 1 along depth: one buffer of hw-columns serves every
    depth tap) runs for these shapes and equals torch to 1e-10 in float64: forward, the
    weight gradient alone, and the shared pass of conv_transpose3d's backward."""
    monkeypatch.setattr(_im2col, "MIN_TILE_POSITIONS", 1)       # small tiles in small budgets
    rng = np.random.default_rng(sum(size))
    x = rng.standard_normal((n, c) + size)
    w = rng.standard_normal((f, c) + k)
    s = (1, 2, 1)
    out = tuple(window_out_size(a, b, ss, pp, dd) for a, b, ss, pp, dd in zip(size, k, s, p, d))
    assert _im2col._DepthTapPlan.build(np, x.dtype, n, c, f, k, s, d, out, budget, 2) is not None
    dy = rng.standard_normal((n, f) + out)
    y_ref, _, dw_ref, _ = torch_conv(x, w, np.zeros(f), dy, s, p, d)
    y = conv3d(x, w, stride=s, padding=p, dilation=d, max_temp_bytes=budget, algorithm="im2col")
    assert rel_err(y, y_ref) <= RTOL
    dw = conv3d_weight_grad(dy, x, w.shape, stride=s, padding=p, dilation=d, max_temp_bytes=budget,
                            algorithm="im2col")
    assert rel_err(dw, dw_ref) <= RTOL
    # conv_transpose3d of dy (its weight (F, C, k)) has x's shape: its backward is the
    # forward of this conv sharing columns with the weight gradient
    g = rng.standard_normal(x.shape)
    op = tuple(a - ((o - 1) * ss - 2 * pp + dd * (b - 1) + 1) for a, o, ss, pp, dd, b
               in zip(size, out, s, p, d, k))
    _, dg_ref, dwt_ref, _ = torch_conv_t(dy, w, np.zeros(c), g, s, p, op, d)
    dg, dwt, _ = conv_transpose3d_backward(g, dy, w, stride=s, padding=p, output_padding=op,
                                           dilation=d, max_temp_bytes=budget, algorithm="im2col")
    assert rel_err(dg, dg_ref) <= RTOL
    assert rel_err(dwt, dwt_ref) <= RTOL


@needs_torch
@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
@pytest.mark.parametrize("n, c, f, size, k, p, d", [
    (2, 3, 4, (7, 12, 11), (3, 3, 3), (1, 1, 1), (1, 1, 1)),
    (1, 2, 3, (6, 12, 11), (3, 3, 3), (1, 1, 1), (1, 2, 1)),       # dilated rows
    (1, 2, 3, (6, 12, 11), (3, 2, 3), (1, 0, 2), (1, 1, 2)),       # dilated columns
    (2, 4, 3, (5, 9, 10), (2, 2, 2), "same", (1, 1, 1)),           # kernel 2 'same': asymmetric padding
])
def test_plane_gemm_forward_matches_torch(n, c, f, size, k, p, d, monkeypatch):
    """The depth-tap forward with one GEMM per output plane (plane-major hw-columns, here for
    every plane size) runs for these shapes and equals torch to 1e-10 in float64, dilated rows
    and columns included (the planes' im2col keeps the conv's dilation along H and W); so does
    the weight gradient alone, one GEMM per output plane for all depth taps."""
    from refimpl.kernels import routes
    monkeypatch.setattr(routes, "MIN_PLANE_GEMM_POSITIONS", 1)
    ran = []
    real = _im2col._forward_plane_gemms
    monkeypatch.setattr(_im2col, "_forward_plane_gemms", lambda *a: ran.append(1) or real(*a))
    rng = np.random.default_rng(sum(size) + sum(d))
    x = rng.standard_normal((n, c) + size)
    w = rng.standard_normal((f, c) + k)
    y = conv3d(x, w, padding=p, dilation=d, algorithm="im2col")
    xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    yt = torch.nn.functional.conv3d(xt, wt, padding=p, dilation=d)
    assert ran and rel_err(y, yt.detach().numpy()) <= RTOL
    # the weight gradient alone takes the same plane-major hw-columns, one GEMM per output plane
    planes = []
    real_dw = _im2col._weight_grad_depth_taps
    monkeypatch.setattr(_im2col, "_weight_grad_depth_taps",
                        lambda *a: planes.append(a[-1].plane_major) or real_dw(*a))
    dy = rng.standard_normal(y.shape)
    yt.backward(torch.tensor(dy))
    dw = conv3d_weight_grad(dy, x, w.shape, padding=p, dilation=d, algorithm="im2col")
    assert planes == [True] and rel_err(dw, wt.grad.numpy()) <= RTOL


@needs_torch
@pytest.mark.parametrize("n, c, f, size, k, p, d, rows", [
    (2, 3, 4, (9, 7, 6), (3, 3, 3), (1, 1, 1), (1, 1, 1), 2),       # blocks of 3 planes x 2 rows
    (1, 2, 3, (11, 8, 5), (3, 2, 3), (0, 1, 2), (2, 1, 1), 3),      # dilated depth: reach 4
    (2, 2, 2, (7, 5, 4), (2, 3, 1), (1, 1, 0), (1, 1, 1), 1),       # even kd, one-row blocks
])
def test_depth_tap_forward_in_blocks_of_rows(n, c, f, size, k, p, d, rows, monkeypatch):
    """The depth-tap forward's cache-sized tiles: where whole planes do not fit
    FORWARD_TILE_BYTES, blocks of several planes by a few rows, whose block of ``y`` is no
    (F, M) view (each is summed in an accumulator and copied into ``y``): equal to torch to
    1e-10 in float64, and the plan really holds such blocks."""
    planes = 3
    monkeypatch.setattr(_im2col, "DEPTH_TAP_PLANES", planes)
    rng = np.random.default_rng(sum(size) + rows)
    x = rng.standard_normal((n, c) + size)
    w = rng.standard_normal((f, c) + k)
    s = (1, 1, 1)
    out = tuple(window_out_size(a, b, ss, pp, dd) for a, b, ss, pp, dd in zip(size, k, s, p, d))
    reach = (k[0] - 1) * d[0]
    nd = max(planes, 2 * reach)
    kh_kw_rows = c * k[1] * k[2]
    monkeypatch.setattr(_im2col, "FORWARD_TILE_BYTES", nd * rows * out[2] * kh_kw_rows * 8)
    plan = _im2col._DepthTapPlan.build(np, x.dtype, n, c, f, k, s, d, out, 64 * 2**20, 2,
                                       _im2col.FORWARD_TILE_BYTES)
    assert plan is not None
    assert any(not _im2col._y_view(t, out) for t in plan.tiles)       # staged blocks exist
    assert all(t[5] - t[4] <= rows for t in plan.tiles)
    dy = rng.standard_normal((n, f) + out)
    y_ref, _, _, _ = torch_conv(x, w, np.zeros(f), dy, s, p, d)
    for threads in ("1", "2"):
        monkeypatch.setenv("REFIMPL_THREADS", threads)
        y = conv3d(x, w, stride=s, padding=p, dilation=d, algorithm="im2col")
        assert rel_err(y, y_ref) <= RTOL


# ------------------------------------------------- width taps as column offsets (_width_taps)

WIDTH_TAP_CASES = [   # n, c, f, size, k, p, d
    (2, 3, 5, (7, 9, 17), (3, 3, 3), (1, 1, 1), (1, 1, 1)),
    (1, 2, 3, (6, 8, 40), (3, 2, 5), (0, 2, 1), (1, 2, 1)),     # dilated rows, 5 width taps
    (2, 2, 4, (5, 7, 33), (2, 3, 3), (2, 1, 3), (1, 1, 2)),     # dilated columns, depth padding past the reach
    (1, 4, 9, (4, 6, 32), (3, 3, 4), "same", (1, 1, 1)),        # even kw 'same': asymmetric width padding
    (2, 1, 2, (3, 5, 24), (1, 3, 3), (0, 1, 1), (1, 1, 1)),     # one depth tap
    (1, 5, 3, (4, 5, 24), (3, 3, 3), (1, 1, 1), (1, 1, 1)),     # F <= C: dx by the flipped kernel
]


@needs_torch
@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
@pytest.mark.parametrize("n, c, f, size, k, p, d", WIDTH_TAP_CASES)
def test_width_tap_forward_matches_torch(n, c, f, size, k, p, d, monkeypatch):
    """The forward with the width taps as column offsets (one GEMM of kw*F rows per output
    plane over contiguous rows of the padded planes, kw - 1 shifted adds) and the weight
    gradient on the same planes (one GEMM with kw shifted copies of dy per plane) run for these
    shapes and equal torch to 1e-10 in float64: dilated rows and columns, padding wider than
    the kernel's reach (slots of depth padding), asymmetric padding, one depth tap; a backward
    whose dx goes by the flipped kernel takes its dW here too.  Tasks of one plane (slots zeroed
    for padding, then refilled with planes of the next sample) give the same bits, and so do 1,
    2 and 3 worker threads (dW: the same bits for the same count)."""
    from refimpl.kernels import _width_taps
    built = _taken(monkeypatch, _width_taps.ForwardPlan)
    ran = []
    real = _width_taps.weight_grad
    monkeypatch.setattr(_width_taps, "weight_grad", lambda *a: ran.append(1) or real(*a))
    rng = np.random.default_rng(sum(size) + f)
    x = rng.standard_normal((n, c) + size)
    w = rng.standard_normal((f, c) + k)
    y_t = torch.nn.functional.conv3d(xt := torch.tensor(x, requires_grad=True), wt := torch.tensor(w, requires_grad=True),
                                     padding=p, dilation=d)
    dy = rng.standard_normal(tuple(y_t.shape))
    y_t.backward(torch.tensor(dy))
    y_ref, dx_ref, dw_ref = y_t.detach().numpy(), xt.grad.numpy(), wt.grad.numpy()
    runs = []
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("REFIMPL_THREADS", threads)
        del built[:], ran[:]
        y = conv3d(x, w, padding=p, dilation=d, algorithm="im2col")
        assert built and built[-1] is not None, "the width-tap route was not taken"
        dw = conv3d_weight_grad(dy, x, w.shape, padding=p, dilation=d, algorithm="im2col")
        assert ran, "the width-tap weight gradient was not taken"
        assert np.array_equal(dw, conv3d_weight_grad(dy, x, w.shape, padding=p, dilation=d, algorithm="im2col"))
        assert rel_err(dw, dw_ref) <= RTOL
        runs.append(y)
    assert rel_err(runs[0], y_ref) <= RTOL
    assert all(np.array_equal(y, runs[0]) for y in runs)
    del ran[:]
    dx, dw, _ = conv3d_backward(dy, x, w, padding=p, dilation=d, algorithm="im2col")
    assert rel_err(dx, dx_ref) <= RTOL and rel_err(dw, dw_ref) <= RTOL
    assert bool(ran) == (f <= c)              # dx by the flipped kernel: dW alone, here
    monkeypatch.setenv("REFIMPL_THREADS", "1")
    dw_1 = conv3d_weight_grad(dy, x, w.shape, padding=p, dilation=d, algorithm="im2col")
    monkeypatch.setattr(_width_taps, "TASK_BYTES", 1)        # tasks of one output plane
    y = conv3d(x, w, padding=p, dilation=d, algorithm="im2col")
    assert all(task[2] - task[1] == 1 for task in built[-1].tasks)
    assert np.array_equal(y, runs[0])
    assert rel_err(conv3d_weight_grad(dy, x, w.shape, padding=p, dilation=d, algorithm="im2col"), dw_1) <= 1e-13


def test_width_tap_forward_stays_within_the_budget():
    """The route's temporaries (a task's padded planes and one plane's kw*F GEMM output per
    worker) stay below the budget, tasks shrink to fit it, and the route steps aside (the
    depth-tap schedule serves, with the same numbers) where one plane's work does not fit."""
    from refimpl.kernels import _width_taps
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 3, 12, 10, 24))
    w = rng.standard_normal((6, 3, 3, 3, 3))
    y0 = conv3d(x, w, padding=1, algorithm="reference")
    out = (12, 10, 24)
    one_plane = ((1 + 2) * 3 * 3 + 3 * 6) * 10 * 26 * 8       # 3 padded planes (C*kh rows) + Z
    for budget in (one_plane, 3 * one_plane, 64 * 2**20):
        plan = _width_taps.ForwardPlan.build(np, x.dtype, 2, 3, 6, (3, 3, 3), (1, 1, 1), (1, 1, 1),
                                             (1, 1, 1), x.shape[2:], out, budget, 1)
        assert plan is not None and (len(plan.tasks) > 2) == (budget < 64 * 2**20)
        y, tmp = _traced(lambda: conv3d(x, w, padding=1, max_temp_bytes=budget, algorithm="im2col"))
        assert rel_err(y, y0) <= 1e-13
        assert tmp <= budget + 2 * w.nbytes + 32 * 1024, (tmp, budget)
    assert _width_taps.ForwardPlan.build(np, x.dtype, 2, 3, 6, (3, 3, 3), (1, 1, 1), (1, 1, 1),
                                         (1, 1, 1), x.shape[2:], out, one_plane - 8, 1) is None
    assert rel_err(conv3d(x, w, padding=1, max_temp_bytes=one_plane - 8, algorithm="im2col"), y0) <= 1e-13


def test_width_taps_pay_where_measured():
    """routes.width_taps_pay: CosmoFlow's first conv (4 -> 16, k3 at 64^3 and 128^3) and the
    U-Net's (1 -> 4) take the route; F more than 4x C (1 -> 16, 2 -> 32), two width taps, and
    outputs so narrow that the padded width adds more than an eighth of GEMM columns (8 wide)
    do not, nor a weight gradient of more than 32 input channels; stride 2, a dilated depth
    and a gradient covering only the first outputs never build a plan."""
    from refimpl.kernels import _width_taps
    k3 = (3, 3, 3)
    assert routes.width_taps_pay(4, 16, k3, (1, 1, 1), (64, 64, 64))
    assert routes.width_taps_pay(4, 16, k3, (1, 1, 1), (128, 128, 128))
    assert routes.width_taps_pay(1, 4, k3, (1, 1, 1), (64, 64, 64))
    assert not routes.width_taps_pay(1, 16, k3, (1, 1, 1), (64, 64, 64))
    assert not routes.width_taps_pay(2, 32, k3, (1, 1, 1), (64, 64, 64))
    assert not routes.width_taps_pay(4, 16, (2, 2, 2), (1, 1, 1), (64, 64, 64))
    assert not routes.width_taps_pay(64, 64, k3, (1, 1, 1), (8, 8, 8))
    assert not routes.width_taps_pay(4, 16, k3, (1, 1, 2), (24, 24, 24))   # 4 more columns of 24
    assert routes.width_taps_pay(32, 64, k3, (1, 1, 1), (16, 16, 16), weight_grad=True)
    assert not routes.width_taps_pay(64, 128, k3, (1, 1, 1), (16, 16, 16), weight_grad=True)
    assert routes.width_taps_pay(64, 128, k3, (1, 1, 1), (16, 16, 16))
    for stride, dilation in (((2, 2, 2), (1, 1, 1)), ((1, 1, 1), (2, 1, 1))):
        assert _width_taps.ForwardPlan.build(np, np.dtype(np.float64), 1, 4, 16, k3, stride, (1, 1, 1),
                                             dilation, (16, 16, 16), (16, 16, 16), 2**26, 1) is None
    # a gradient covering only the first outputs (conv_transpose3d with output padding)
    assert _width_taps.ForwardPlan.build(np, np.dtype(np.float64), 1, 4, 16, k3, (1, 1, 1), (1, 1, 1),
                                         (1, 1, 1), (16, 16, 16), (15, 16, 16), 2**26, 1) is None


# ------------------------------------------------- 1x1x1 kernels (_pointwise_conv)

@needs_torch
@pytest.mark.parametrize("n, c, f, size", [(2, 3, 5, (4, 5, 6)), (1, 8, 3, (6, 7, 9)), (3, 1, 2, (1, 1, 7))])
def test_pointwise_conv_matches_torch(n, c, f, size, monkeypatch):
    """A 1x1x1 conv of stride 1 without padding runs as GEMMs on views of the arrays (forward,
    dx, dW, each alone and together, and conv_transpose3d's forward, which is dx) and equals
    torch to 1e-10 in float64, in blocks of 7 positions too (several per sample, the last
    short); with the same blocks 1, 2 and 3 worker threads give the same forward and dx bits
    (a block's GEMM does not depend on the thread that runs it), dW to rounding."""
    from refimpl.kernels import _pointwise_conv
    ran = []
    for name in ("forward", "backward"):
        real = getattr(_pointwise_conv, name)
        monkeypatch.setattr(_pointwise_conv, name, lambda *a, _r=real, _n=name, **k: ran.append(_n) or _r(*a, **k))
    rng = np.random.default_rng(sum(size) + c)
    x = rng.standard_normal((n, c) + size)
    w = rng.standard_normal((f, c, 1, 1, 1))
    b = rng.standard_normal(f)
    dy = rng.standard_normal((n, f) + size)
    y_ref, dx_ref, dw_ref, db_ref = torch_conv(x, w, b, dy, (1, 1, 1), (0, 0, 0), (1, 1, 1))
    runs = []
    for threads, columns in (("1", 16384), ("1", 7), ("2", 7), ("3", 7)):
        monkeypatch.setenv("REFIMPL_THREADS", threads)
        monkeypatch.setattr(_pointwise_conv, "COLUMNS", columns)
        y = conv3d(x, w, b, algorithm="im2col")
        dx, dw, db = conv3d_backward(dy, x, w, algorithm="im2col")
        assert rel_err(y, y_ref) <= RTOL and rel_err(dx, dx_ref) <= RTOL
        assert rel_err(dw, dw_ref) <= RTOL and rel_err(db, db_ref) <= RTOL
        assert rel_err(conv3d_input_grad(dy, w, x.shape, algorithm="im2col"), dx_ref) <= RTOL
        assert rel_err(conv3d_weight_grad(dy, x, w.shape, algorithm="im2col"), dw_ref) <= RTOL
        runs.append((y, dx))
    assert all(np.array_equal(y, runs[1][0]) and np.array_equal(dx, runs[1][1]) for y, dx in runs[1:])
    t_ref = torch_conv_t(dy, w, np.zeros(c), x, (1, 1, 1), (0, 0, 0), (0, 0, 0), (1, 1, 1))[0]
    assert rel_err(conv_transpose3d(dy, w, None, algorithm="im2col"), t_ref) <= RTOL
    assert "forward" in ran and "backward" in ran


def test_pointwise_conv_applies_to_1x1x1_stride_1_unpadded_only():
    """``_pointwise_conv.applies``: a 1x1x1 kernel with stride 1 and no padding; a stride, a
    padding or a wider kernel takes the other routes."""
    from refimpl.kernels import _pointwise_conv
    assert _pointwise_conv.applies((1, 1, 1), (1, 1, 1), (0, 0, 0))
    assert not _pointwise_conv.applies((1, 1, 1), (2, 1, 1), (0, 0, 0))
    assert not _pointwise_conv.applies((1, 1, 1), (1, 1, 1), (0, 1, 0))
    assert not _pointwise_conv.applies((1, 1, 3), (1, 1, 1), (0, 0, 0))


# ------------------------------------------------- BLAS held to one thread (_threads)

def _blas_threads():
    from refimpl.kernels import _threads
    return [lib.num_threads for lib in _threads._blas_controller().lib_controllers]


def test_blas_is_held_to_one_thread_inside_the_conv_and_model_passes(monkeypatch):
    """With two workers, the conv entry points and the models' forward and backward run BLAS
    on one thread (a BLAS call on two would leave its threads spinning into the workers'
    next pass), keep the worker count resolved on entry, nest, and restore BLAS's threads
    on the way out, after an exception too."""
    from threadpoolctl import threadpool_limits
    from refimpl.kernels import _threads
    from refimpl.models import build_model
    monkeypatch.delenv("REFIMPL_THREADS", raising=False)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 2, 6, 5, 4))
    w = rng.standard_normal((3, 2, 3, 3, 3))
    with threadpool_limits(2, user_api="blas"):
        assert _threads.thread_count() == 2 and _blas_threads() == [2] * len(_blas_threads())
        seen = []
        for name in ("forward", "backward"):
            real = getattr(_im2col, name)
            monkeypatch.setattr(_im2col, name, lambda *a, _real=real, **k: (
                seen.append((_threads.thread_count(), set(_blas_threads()))), _real(*a, **k))[1])
        y = conv3d(x, w, padding=1, algorithm="im2col")
        conv3d_backward(y, x, w, padding=1, algorithm="im2col")
        conv_transpose3d(y, w, None, padding=1, algorithm="im2col")
        conv_transpose3d_backward(x, y, w, padding=1, algorithm="im2col")
        assert len(seen) >= 4 and all(s == (2, {1}) for s in seen), seen
        assert set(_blas_threads()) == {2}
        with _threads.blas_held_single():
            with _threads.blas_held_single():
                assert set(_blas_threads()) == {1} and _threads.thread_count() == 2
            assert set(_blas_threads()) == {1}
        assert set(_blas_threads()) == {2}
        with pytest.raises(RuntimeError):
            with _threads.blas_held_single():
                raise RuntimeError("boom")
        assert set(_blas_threads()) == {2} and _threads._held is None
        # the models: every layer's pass (a ReLU here, between convs) sees BLAS on one thread
        from refimpl.nn.activation import ReLU
        model = build_model("unet3d", {"input_shape": (1, 8, 8, 8), "levels": 1, "base_width": 2},
                            seed=0, dtype="float64")
        del seen[:]
        for name in ("forward", "backward"):
            real = getattr(ReLU, name)
            monkeypatch.setattr(ReLU, name, lambda self, a, _real=real: (
                seen.append((_threads.thread_count(), set(_blas_threads()))), _real(self, a))[1])
        out = model.forward(rng.standard_normal((1, 1, 8, 8, 8)))
        model.backward(np.ones_like(out))
        assert seen and all(s == (2, {1}) for s in seen), seen
        assert set(_blas_threads()) == {2}
    monkeypatch.setenv("REFIMPL_THREADS", "1")                 # one worker: BLAS keeps its threads
    with threadpool_limits(2, user_api="blas"):
        with _threads.blas_held_single():
            assert set(_blas_threads()) == {2}


# ------------------------------------------- strided convs by input phases (_phase_grid)

@pytest.mark.parametrize("steps", [(1, 1, 1), (2, 3, 1), (3, 2, 2)])
def test_fill_grid_is_a_strided_placement(steps):
    """``fill_grid(dst, src, starts, steps)``: ``dst[..., j] = src[..., start + j*step]`` where
    that index is inside ``src``, zero elsewhere (negative starts, starts past the end, and a
    ``dst`` longer or shorter than what ``src`` holds); a contiguous ``dst`` (zeroed whole
    first) and a strided one (its borders zeroed alone) alike."""
    rng = np.random.default_rng(sum(steps))
    src = rng.standard_normal((2, 7, 6, 5)) + 3.0
    for starts, strided in product([(0, 0, 0), (-3, 2, -1), (5, -7, 4), (1, 1, 9)], (False, True)):
        dst = np.full((2, 4, 6, 6), np.nan)[..., ::2] if strided else np.full((2, 4, 6, 3), np.nan)
        _phase_grid.fill_grid(dst, src, starts, steps)
        ref = np.zeros_like(dst)
        for j in np.ndindex(*dst.shape[1:]):
            i = tuple(st + jj * sp for st, jj, sp in zip(starts, j, steps))
            if all(0 <= ii < n for ii, n in zip(i, src.shape[1:])):
                ref[(slice(None),) + j] = src[(slice(None),) + i]
        assert np.array_equal(dst, ref)


PHASE_CASES = [   # n, c, f, size, k, s, p, d
    (2, 3, 4, (9, 8, 7), (3, 3, 3), (2, 2, 2), (1, 1, 1), (1, 1, 1)),   # the benchmark's row, small
    (1, 2, 3, (11, 9, 12), (5, 3, 4), (3, 2, 2), (2, 0, 3), (1, 1, 1)),  # stride 3, padding past reach
    (2, 2, 2, (10, 7, 9), (3, 2, 3), (2, 1, 3), (1, 1, 0), (2, 1, 1)),   # dilated, mixed strides
    (1, 3, 2, (8, 9, 10), (3, 1, 2), (2, 3, 3), (1, 0, 1), (1, 1, 1)),   # s > k: inputs no tap reads
]


def _taken(monkeypatch, cls):
    """Record the plans ``cls.build`` returns (None: the route was not taken)."""
    built = []
    real = cls.build.__func__

    def build(klass, *a, **k):
        plan = real(klass, *a, **k)
        built.append(plan)
        return plan
    monkeypatch.setattr(cls, "build", classmethod(build))
    return built


@needs_torch
@pytest.mark.parametrize("n, c, f, size, k, s, p, d", PHASE_CASES)
def test_phase_routes_match_torch(n, c, f, size, k, s, p, d, monkeypatch):
    """Convs whose windows overlap along a strided axis take the forward, the input
    gradient and the weight gradient by phases (one stride-1 problem per input phase, columns as contiguous runs of
    flat grids): equal to torch to 1e-10 in float64 for strides 2 and 3, dilation, padding
    past the kernel's reach, inputs that no tap reads (their dx is zero), a dy covering only
    the first outputs, and conv_transpose3d (whose forward is this input gradient); 1, 2 and 3
    worker threads give the same bits (the weight gradient: the same bits for the same count),
    and several slabs and tiles (a small budget) the same result."""
    rng = np.random.default_rng(sum(size) + sum(s))
    x = rng.standard_normal((n, c) + size)
    w = rng.standard_normal((f, c) + k)
    out = tuple(window_out_size(a, b, ss, pp, dd) for a, b, ss, pp, dd in zip(size, k, s, p, d))
    dy = rng.standard_normal((n, f) + out)
    y_ref, dx_ref, dw_ref, _ = torch_conv(x, w, np.zeros(f), dy, s, p, d)
    fwd = _taken(monkeypatch, _phase_grid.ForwardPlan)
    bwd = _taken(monkeypatch, _phase_grid.InputGradPlan)
    runs = {}
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("REFIMPL_THREADS", threads)
        runs[threads] = (conv3d(x, w, stride=s, padding=p, dilation=d, algorithm="im2col"),
                         conv3d_input_grad(dy, w, x.shape, s, p, d, algorithm="im2col"),
                         conv3d_weight_grad(dy, x, w.shape, s, p, d, algorithm="im2col"))
        assert rel_err(runs[threads][2], dw_ref) <= RTOL
        assert np.array_equal(conv3d_weight_grad(dy, x, w.shape, s, p, d, algorithm="im2col"),
                              runs[threads][2])
    assert len(fwd) == 9 and all(plan is not None for plan in fwd)   # forward and dw, 3 + 6
    assert bwd and all(plan is not None for plan in bwd)
    for y, dx, _ in runs.values():
        assert np.array_equal(y, runs["1"][0]) and np.array_equal(dx, runs["1"][1])
    assert rel_err(runs["1"][0], y_ref) <= RTOL
    assert rel_err(runs["1"][1], dx_ref) <= RTOL
    dx, dw, _ = conv3d_backward(dy, x, w, s, p, d, algorithm="im2col")
    assert rel_err(dx, dx_ref) <= RTOL and rel_err(dw, dw_ref) <= RTOL
    # one-plane column tiles, and the largest budget that cuts a sample into several slabs
    monkeypatch.setattr(_im2col, "FORWARD_TILE_BYTES", 1)
    for cls, extent in ((_phase_grid.ForwardPlan, out), (_phase_grid.InputGradPlan, size)):
        budgets = [b for b in (int(2**22 * 0.9**e) for e in range(100))
                   if (lambda plan: plan is not None and len(plan.tasks) > n)(
                       cls.build(np, x.dtype, n, c, f, k, s, p, d, extent, b, 1, 1))]
        assert budgets, "no budget cuts a sample into several slabs"
        monkeypatch.setenv("REFIMPL_THREADS", "1")
        del fwd[:], bwd[:]
        y = conv3d(x, w, stride=s, padding=p, dilation=d, max_temp_bytes=budgets[0],
                   algorithm="im2col")
        dx = conv3d_input_grad(dy, w, x.shape, s, p, d, max_temp_bytes=budgets[0],
                               algorithm="im2col")
        dw = conv3d_weight_grad(dy, x, w.shape, s, p, d, max_temp_bytes=budgets[0],
                                algorithm="im2col")
        assert rel_err(y, y_ref) <= RTOL and rel_err(dx, dx_ref) <= RTOL
        assert rel_err(dw, dw_ref) <= RTOL
        for taken in (fwd if cls is _phase_grid.ForwardPlan else bwd):
            assert taken is not None and len(taken.tasks) > n
    # a dy covering only the first outputs; conv_transpose3d of dy (output padding)
    short = tuple(max(1, o - 1) for o in out)
    full = np.zeros_like(dy)
    full[:, :, :short[0], :short[1], :short[2]] = dy[:, :, :short[0], :short[1], :short[2]]
    _, dx_short_ref, dw_short_ref, _ = torch_conv(x, w, np.zeros(f), full, s, p, d)
    dy_short = np.ascontiguousarray(full[:, :, :short[0], :short[1], :short[2]])
    dx_short = conv3d_input_grad(dy_short, w, x.shape, s, p, d, algorithm="im2col")
    assert rel_err(dx_short, dx_short_ref) <= RTOL
    dw_short = conv3d_weight_grad(dy_short, x, w.shape, s, p, d, algorithm="im2col")
    assert rel_err(dw_short, dw_short_ref) <= RTOL
    op = tuple(a - ((o - 1) * ss - 2 * pp + dd * (b - 1) + 1) for a, o, ss, pp, dd, b
               in zip(size, out, s, p, d, k))
    t_ref = torch_conv_t(dy, w, np.zeros(c), rng.standard_normal(x.shape), s, p, op, d)[0]
    assert rel_err(conv_transpose3d(dy, w, None, s, p, op, d, algorithm="im2col"), t_ref) <= RTOL


def test_phase_routes_stay_within_the_budget():
    """The phase routes' temporaries (phase grids, columns, GEMM output, per worker) stay
    below the budget where they run, and they step aside (im2col's row tiles serve) where
    one output plane's work does not fit."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 13, 12, 11))
    w = rng.standard_normal((4, 3, 3, 3, 3))
    s, p = (2, 2, 2), (1, 1, 1)
    out = tuple(window_out_size(a, 3, 2, 1, 1) for a in x.shape[2:])
    dy = rng.standard_normal((2, 4) + out)
    y0 = conv3d(x, w, stride=s, padding=p, max_temp_bytes=2**30, algorithm="im2col")
    dx0 = conv3d_input_grad(dy, w, x.shape, s, p, max_temp_bytes=2**30, algorithm="im2col")
    dw0 = conv3d_weight_grad(dy, x, w.shape, s, p, max_temp_bytes=2**30, algorithm="im2col")
    plane = (out[1] + 1) * (out[2] + 1) * 8
    for budget in (40 * plane * 8, 200 * plane * 8):
        assert _phase_grid.ForwardPlan.build(np, x.dtype, 2, 3, 4, (3, 3, 3), s, p, (1, 1, 1), out,
                                             budget, 1, budget) is not None
        y, tmp_y = _traced(lambda: conv3d(x, w, stride=s, padding=p, max_temp_bytes=budget,
                                          algorithm="im2col"))
        dx, tmp_dx = _traced(lambda: conv3d_input_grad(dy, w, x.shape, s, p, max_temp_bytes=budget,
                                                       algorithm="im2col"))
        dw, tmp_dw = _traced(lambda: conv3d_weight_grad(dy, x, w.shape, s, p, max_temp_bytes=budget,
                                                        algorithm="im2col"))
        assert rel_err(y, y0) <= 1e-13 and rel_err(dx, dx0) <= 1e-13 and rel_err(dw, dw0) <= 1e-13
        for tmp in (tmp_y, tmp_dx, tmp_dw):
            assert tmp <= budget + 6 * w.nbytes + 32 * 1024, (tmp, budget)
    tiny = plane * 20                                   # less than one plane of columns
    assert _phase_grid.ForwardPlan.build(np, x.dtype, 2, 3, 4, (3, 3, 3), s, p, (1, 1, 1), out,
                                         tiny, 1, tiny) is None
    assert _phase_grid.InputGradPlan.build(np, x.dtype, 2, 3, 4, (3, 3, 3), s, p, (1, 1, 1),
                                           x.shape[2:], tiny, 1, tiny) is None
    assert rel_err(conv3d(x, w, stride=s, padding=p, max_temp_bytes=tiny, algorithm="im2col"),
                   y0) <= 1e-13


# ------------------------------------------------------- the device schedule (CuPy)

@needs_torch
@given(case=st.one_of(conv_case(), conv_case(stride_one=True)), budget=BUDGETS,
       seed=st.integers(0, 2**16), data=st.data())
def test_device_schedule_matches_torch(case, budget, seed, data):
    """``_im2col_device`` (the schedule CuPy arrays run: one padded copy, one strided copy
    per tile, batched GEMMs, col2im by taps or, at stride 1, dx as the conv with the
    flipped kernel) equals torch to 1e-10 in float64 on host arrays: forward, dx, dW, the
    shared forward + dW pass, and a dy covering only the first outputs, for every budget
    from one row per tile to one tile."""
    from refimpl.kernels import _im2col_device as dev
    rng = np.random.default_rng(seed)
    c = case
    x = rng.standard_normal((c["n"], c["c"]) + c["size"])
    w = rng.standard_normal((c["f"], c["c"]) + c["k"])
    short = tuple(data.draw(st.integers(1, o)) for o in c["out"])
    dy = rng.standard_normal((c["n"], c["f"]) + short)
    full = np.zeros((c["n"], c["f"]) + c["out"])
    full[:, :, :short[0], :short[1], :short[2]] = dy
    y_ref, dx_ref, dw_ref, _ = torch_conv(x, w, np.zeros(c["f"]), full, c["s"], c["p"], c["d"])
    args = (c["s"], c["p"], c["d"])
    assert rel_err(dev.forward(x, w, *args, c["out"], budget), y_ref) <= RTOL
    y_short, dw_shared = dev.forward(x, w, *args, short, budget, g=dy)
    assert rel_err(y_short, y_ref[:, :, :short[0], :short[1], :short[2]]) <= RTOL
    assert rel_err(dw_shared, dw_ref) <= RTOL
    dx, dw = dev.backward(dy, x, w, *args, budget)
    assert dx.shape == x.shape and dw.shape == w.shape
    assert rel_err(dx, dx_ref) <= RTOL
    assert rel_err(dw, dw_ref) <= RTOL


def test_device_schedule_runs_for_device_arrays():
    """Device arrays (the strict stand-in) take the device schedule, host arrays the CPU
    one, and both give the same numbers."""
    from refimpl import strict
    from refimpl.kernels import _im2col_device as dev
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 6, 5, 7))
    w = rng.standard_normal((4, 3, 3, 3, 3))
    dy = rng.standard_normal((2, 4, 6, 5, 7))
    calls = []
    real = dev.forward
    try:
        dev.forward = lambda *a, **k: calls.append("forward") or real(*a, **k)
        y = conv3d(strict.xp.asarray(x), strict.xp.asarray(w), padding=1, algorithm="im2col")
        conv3d(x, w, padding=1, algorithm="im2col")
    finally:
        dev.forward = real
    assert calls == ["forward"]
    assert rel_err(strict.to_host(y), conv3d(x, w, padding=1, algorithm="im2col")) <= 1e-13
    dx, dw, _ = conv3d_backward(strict.xp.asarray(dy), strict.xp.asarray(x), strict.xp.asarray(w),
                                padding=1, algorithm="im2col")
    dx_ref, dw_ref, _ = conv3d_backward(dy, x, w, padding=1, algorithm="im2col")
    assert rel_err(strict.to_host(dx), dx_ref) <= 1e-13
    assert rel_err(strict.to_host(dw), dw_ref) <= 1e-13


@needs_torch
@given(case=conv_case(stride_one=True), seed=st.integers(0, 2**16), data=st.data())
def test_host_flipped_kernel_input_grad_matches_torch(case, seed, data):
    """On the host, stride-1 convs with F <= C take dx as the conv of the zero-padded dy with
    the flipped kernel (``flipped_kernel_pays``): equal to torch to 1e-10 in float64, for
    dilations, paddings beyond the kernel's reach and a dy covering only the first outputs."""
    c = case
    assume(c["f"] <= c["c"])
    rng = np.random.default_rng(seed)
    short = tuple(data.draw(st.integers(1, o)) for o in c["out"])
    x = rng.standard_normal((c["n"], c["c"]) + c["size"])
    w = rng.standard_normal((c["f"], c["c"]) + c["k"])
    dy = rng.standard_normal((c["n"], c["f"]) + short)
    assert routes.flipped_kernel_pays(dy, w, x.shape, c["s"], 64 * 2**20)
    full = np.zeros((c["n"], c["f"]) + c["out"])
    full[:, :, :short[0], :short[1], :short[2]] = dy
    _, dx_ref, dw_ref, _ = torch_conv(x, w, np.zeros(c["f"]), full, c["s"], c["p"], c["d"])
    dx, dw = conv3d_backward(full, x, w, c["s"], c["p"], c["d"], algorithm="im2col")[:2]
    assert rel_err(dx, dx_ref) <= RTOL and rel_err(dw, dw_ref) <= RTOL
    assert rel_err(conv3d_input_grad(dy, w, x.shape, c["s"], c["p"], c["d"], algorithm="im2col"),
                   dx_ref) <= RTOL


# ------------------------------------------ windows that tile the input (k = s, no padding)

TILING_CASES = [   # n, c, f, size, k
    (2, 3, 4, (8, 6, 10), (2, 2, 2)),          # the U-Net's k2 s2
    (1, 4, 3, (9, 7, 11), (2, 2, 2)),          # odd extents: the last input plane is read by no window
    (2, 2, 5, (6, 5, 9), (3, 1, 2)),           # a different kernel per axis, one of size 1
    (1, 3, 2, (4, 4, 4), (1, 1, 1)),           # 1x1x1: one GEMM per tile
]


@needs_torch
@pytest.mark.parametrize("n, c, f, size, k", TILING_CASES)
def test_windows_that_tile_the_input_match_torch(n, c, f, size, k, monkeypatch):
    """Where kernel = stride, no padding, no dilation, dx (and conv_transpose3d's forward) is
    written tap by tap from one GEMM per tile: equal to torch to 1e-10 in float64, with 1, 2
    and 3 workers (the same bits), with tiles of single rows (a small budget), and zero where
    no window reads."""
    assert _im2col.windows_tile(k, k, (0, 0, 0), (1, 1, 1))
    assert not _im2col.windows_tile(k, k, (1, 0, 0), (1, 1, 1))
    assert not _im2col.windows_tile((3, 3, 3), (2, 2, 2), (0, 0, 0), (1, 1, 1))
    rng = np.random.default_rng(sum(size) + sum(k))
    x = rng.standard_normal((n, c) + size)
    w = rng.standard_normal((f, c) + k)
    out = tuple(window_out_size(a, b, b, 0, 1) for a, b in zip(size, k))
    dy = rng.standard_normal((n, f) + out)
    _, dx_ref, dw_ref, _ = torch_conv(x, w, np.zeros(f), dy, k, (0, 0, 0), (1, 1, 1))
    runs = {}
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("REFIMPL_THREADS", threads)
        runs[threads] = conv3d_input_grad(dy, w, x.shape, k, 0, algorithm="im2col")
        assert np.array_equal(runs[threads], runs["1"])
    assert rel_err(runs["1"], dx_ref) <= RTOL
    dx, dw, _ = conv3d_backward(dy, x, w, k, 0, algorithm="im2col")
    assert rel_err(dx, dx_ref) <= RTOL and rel_err(dw, dw_ref) <= RTOL
    row = c * k[0] * k[1] * k[2] * out[2] * 8                       # one output row of Z
    assert rel_err(conv3d_input_grad(dy, w, x.shape, k, 0, max_temp_bytes=row), dx_ref) <= RTOL
    t_ref = torch_conv_t(dy, w, np.zeros(c), rng.standard_normal(x.shape), k, (0, 0, 0),
                         tuple(a - o * b for a, o, b in zip(size, out, k)), (1, 1, 1))[0]
    op = tuple(a - o * b for a, o, b in zip(size, out, k))
    assert rel_err(conv_transpose3d(dy, w, None, k, 0, op), t_ref) <= RTOL


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_blocked_transpose_is_the_transpose(monkeypatch, rows):
    """``_im2col.transposed`` (dW^T -> dW in blocks of rows) is ``a.T`` as a C-contiguous copy,
    whatever the block size against the shape."""
    monkeypatch.setattr(_im2col, "TRANSPOSE_ROWS", rows)
    rng = np.random.default_rng(rows)
    for shape in [(1, 1), (5, 3), (130, 7), (64, 64), (7, 200)]:
        a = rng.standard_normal(shape).astype(np.float32)
        t = _im2col.transposed(a)
        assert t.flags.c_contiguous and t.shape == shape[::-1] and np.array_equal(t, a.T)
