"""Layer options real models use, against PyTorch (float64, 1e-10).

- conv3d: padding as an int, a 3-tuple, a per-side 6-tuple, 'valid' and 'same' (odd and even
  kernels, dilations), in the reference and every kernel route (the kernels take symmetric
  padding: an asymmetric one runs as an explicit pad of the difference); conv_transpose3d keeps
  PyTorch's int / 3-tuple;
- max / avg pooling: the same padding forms, ceil_mode, count_include_pad, divisor_override;
- the nn layers (Conv3d, MaxPool3d, AvgPool3d) built with them;
- every bad value refused with a ValueError naming the argument.

PyTorch takes symmetric padding only: a per-side padding is checked against ``F.pad`` then the
op unpadded, and (pooling with ceil_mode, whose per-side rule PyTorch has only inside ATen,
``pooling_output_shape_pad_lr``) against a loop over the windows written from the definition.
"""
import warnings
from itertools import product

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from refimpl.functional import pooling as P
from refimpl.functional.args import padding_sides, window_out_size
from refimpl.functional.conv3d import conv3d, conv3d_backward, conv3d_input_grad, conv3d_weight_grad
from refimpl.functional.conv_transpose3d import conv_transpose3d
from refimpl.kernels import pooling as pooling_kernel

torch = pytest.importorskip("torch")
TF = torch.nn.functional
TOL = 1e-10


def rel(a, b):
    """max|a - b| / max|b| over finite entries; equal entries (-inf: a max-pool window wholly in
    the padding) count as no difference."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    with np.errstate(invalid="ignore"):
        diff = np.where(a == b, 0.0, np.abs(a - b))
    finite = np.abs(b[np.isfinite(b)])
    scale = finite.max() if finite.size else 0.0
    return float(diff.max() / scale) if scale > 0 else float(diff.max())


def torch_pad(sides):
    """(lo, hi) per (D, H, W) -> torch's F.pad list (last axis first)."""
    return [v for lohi in reversed(sides) for v in lohi]


def padding_strategy(kernel, pool, stride_one):
    forms = ["int", "triple", "sides", "valid"] + (["same"] if stride_one else [])
    top = [k // 2 if pool else k for k in kernel]
    return st.sampled_from(forms).flatmap(lambda form: {
        "int": st.integers(0, min(top)),
        "triple": st.tuples(*(st.integers(0, t) for t in top)),
        "sides": st.tuples(*(st.integers(0, t) for t in top for _ in range(2))),
        "valid": st.just("valid"), "same": st.just("same")}[form])


# ---------------------------------------------------------------- conv3d

@st.composite
def conv_cases(draw):
    kernel = tuple(draw(st.integers(1, 4)) for _ in range(3))
    stride = tuple(draw(st.integers(1, 2)) for _ in range(3)) if draw(st.booleans()) else (1, 1, 1)
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(3))
    padding = draw(padding_strategy(kernel, False, stride == (1, 1, 1)))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 3))) + tuple(draw(st.integers(1, 7)) for _ in range(3))
    sides = padding_sides(padding, kernel, dilation, stride)
    out = [window_out_size(n, k, s, p, d) for n, k, s, p, d in zip(shape[2:], kernel, stride, sides, dilation)]
    assume(min(out) >= 1)
    return shape, draw(st.integers(1, 3)), kernel, stride, padding, dilation


@given(conv_cases(), st.sampled_from(["reference", "im2col", "auto"]))
def test_conv3d_padding_forms_match_torch(case, algorithm):
    shape, f, kernel, stride, padding, dilation = case
    rng = np.random.default_rng(sum(shape) + f)
    x, w, b = rng.standard_normal(shape), rng.standard_normal((f, shape[1]) + kernel), rng.standard_normal(f)
    xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    sides = padding_sides(padding, kernel, dilation, stride)
    yt = TF.conv3d(TF.pad(xt, torch_pad(sides)), wt, bt, stride, 0, dilation)
    y = conv3d(x, w, b, stride, padding, dilation, algorithm=algorithm)
    assert y.shape == tuple(yt.shape)
    dy = rng.standard_normal(y.shape)
    yt.backward(torch.tensor(dy))
    dx, dw, db = conv3d_backward(dy, x, w, stride, padding, dilation, algorithm=algorithm)
    want = (yt, xt.grad, wt.grad, bt.grad)
    for got, exp in zip((y, dx, dw, db), want):
        assert rel(got, exp.detach().numpy()) <= TOL
    assert rel(conv3d_input_grad(dy, w, x.shape, stride, padding, dilation, algorithm=algorithm),
               xt.grad.numpy()) <= TOL
    assert rel(conv3d_weight_grad(dy, x, w.shape, stride, padding, dilation, algorithm=algorithm),
               wt.grad.numpy()) <= TOL


@pytest.mark.parametrize("kernel, dilation", [((2, 2, 2), 1), ((3, 2, 4), (1, 2, 1)), ((3, 3, 3), 2), (4, 1)])
@pytest.mark.parametrize("algorithm", ["reference", "im2col", "auto"])
def test_conv3d_same_is_torchs_same(kernel, dilation, algorithm):
    """'same' against PyTorch's own padding='same' (even kernels: the odd cell after)."""
    rng = np.random.default_rng(1)
    k = kernel if isinstance(kernel, tuple) else (kernel,) * 3
    x, w = rng.standard_normal((2, 3, 6, 5, 7)), rng.standard_normal((4, 3) + k)
    xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    with warnings.catch_warnings():        # PyTorch warns that even kernels need a padded copy
        warnings.simplefilter("ignore", UserWarning)
        yt = TF.conv3d(xt, wt, None, 1, "same", dilation)
    y = conv3d(x, w, None, 1, "same", dilation, algorithm=algorithm)
    assert y.shape == x.shape[:1] + (4,) + x.shape[2:] == tuple(yt.shape)
    dy = rng.standard_normal(y.shape)
    yt.backward(torch.tensor(dy))
    dx, dw, _ = conv3d_backward(dy, x, w, 1, "same", dilation, algorithm=algorithm)
    assert max(rel(y, yt.detach().numpy()), rel(dx, xt.grad.numpy()), rel(dw, wt.grad.numpy())) <= TOL


def test_conv3d_asymmetric_on_winograd():
    """A 3x3x3 stride-1 conv with a per-side padding runs Winograd on the padded difference."""
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((1, 8, 9, 8, 7)), rng.standard_normal((8, 8, 3, 3, 3))
    pad = (0, 2, 1, 0, 2, 1)
    ref = conv3d(x, w, None, 1, pad, 1, algorithm="reference")
    dy = rng.standard_normal(ref.shape)
    want = conv3d_backward(dy, x, w, 1, pad, 1, algorithm="reference")
    assert rel(conv3d(x, w, None, 1, pad, 1, algorithm="winograd"), ref) <= TOL
    got = conv3d_backward(dy, x, w, 1, pad, 1, algorithm="winograd")
    assert max(rel(g, e) for g, e in zip(got, want)) <= TOL


def test_symmetric_forms_reach_the_kernels_as_three_ints(monkeypatch):
    """(p, p, p, p, p, p) and 'same' with odd kernels are the symmetric padding: the kernels get
    (pd, ph, pw), not pairs, so the symmetric path stays as it was."""
    from refimpl.kernels import conv as kernel
    seen = []
    real = kernel.forward_with_bias
    monkeypatch.setattr(kernel, "forward_with_bias",
                        lambda x, w, s, p, *a, **k: seen.append(p) or real(x, w, s, p, *a, **k))
    x, w = np.ones((1, 1, 5, 5, 5)), np.ones((1, 1, 3, 3, 3))
    for pad in ((1, 1, 2, 2, 0, 0), "same", 1, (1, 2, 0)):
        conv3d(x, w, None, 1, pad, algorithm="im2col")
    assert seen == [(1, 2, 0), (1, 1, 1), (1, 1, 1), (1, 2, 0)]


def test_conv_transpose_keeps_torchs_padding():
    x, w = np.ones((1, 2, 4, 4, 4)), np.ones((2, 3, 2, 2, 2))
    for bad in ("same", "valid", (0, 1, 0, 1, 0, 1)):
        with pytest.raises(ValueError, match="padding"):
            conv_transpose3d(x, w, None, 1, bad)


@pytest.mark.parametrize("kwargs", [dict(padding="full"), dict(padding=(1, 2)), dict(padding=(0, 1, 0, 1, 0, -1)),
                                    dict(padding="same", stride=2), dict(padding=1.5), dict(padding=(1, 1, 1, 1))])
def test_conv3d_bad_padding(kwargs):
    x, w = np.ones((1, 1, 5, 5, 5)), np.ones((1, 1, 2, 2, 2))
    with pytest.raises(ValueError, match="padding"):
        conv3d(x, w, **kwargs)


# ---------------------------------------------------------------- pooling

def brute_pool(x, k, s, sides, d, ceil_mode, op, count_include_pad=True, divisor_override=None):
    """Pooling written from the definition, one window at a time (PyTorch's per-side rules)."""
    n, c = x.shape[:2]
    out = [window_out_size(e, kk, ss, p, dd, ceil_mode) for e, kk, ss, p, dd in zip(x.shape[2:], k, s, sides, d)]
    y = np.zeros((n, c) + tuple(out))
    for o in product(*(range(e) for e in out)):
        starts = [oo * ss - lo for oo, ss, (lo, _) in zip(o, s, sides)]
        cells = [[st_ + t * dd for t in range(kk)] for st_, kk, dd in zip(starts, k, d)]
        inside = [[i for i in ax if 0 <= i < e] for ax, e in zip(cells, x.shape[2:])]
        block = x[(slice(None), slice(None)) + np.ix_(*inside)]
        if op == "max":                     # the padding is -inf: it never wins
            y[(slice(None), slice(None)) + o] = block.max(axis=(2, 3, 4)) if block.size else -np.inf
            continue
        if divisor_override is not None:
            div = divisor_override
        elif count_include_pad:
            div = np.prod([min(st_ + kk, e + hi) - st_ for st_, kk, e, (_, hi) in zip(starts, k, x.shape[2:], sides)])
        else:
            div = np.prod([len(ax) for ax in inside])
        y[(slice(None), slice(None)) + o] = block.sum(axis=(2, 3, 4)) / div
    return y


@st.composite
def pool_cases(draw, op):
    kernel = tuple(draw(st.integers(1, 4)) for _ in range(3))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(3)) if draw(st.booleans()) else None
    dilation = (1, 1, 1) if op == "avg" else tuple(draw(st.integers(1, 2)) for _ in range(3))
    s = kernel if stride is None else stride
    padding = draw(padding_strategy(kernel, True, s == (1, 1, 1)))
    sides = padding_sides(padding, kernel, dilation, s)
    assume(all(max(p) <= k // 2 for p, k in zip(sides, kernel)))
    ceil_mode = draw(st.booleans())
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 3))) + tuple(draw(st.integers(1, 8)) for _ in range(3))
    out = [window_out_size(n, k, ss, p, d, ceil_mode) for n, k, ss, p, d in zip(shape[2:], kernel, s, sides, dilation)]
    assume(min(out) >= 1)
    extra = {}
    if op == "avg":
        extra = dict(count_include_pad=draw(st.booleans()), divisor_override=draw(st.sampled_from([None, 1, 3, -2])))
    return shape, kernel, stride, padding, dilation, ceil_mode, extra


def torch_pool(op, xt, kernel, stride, sides, dilation, ceil_mode, extra):
    """PyTorch's op where it has the padding (symmetric); None where it has not, or refuses the
    shape (its avg_pool3d wants an input at least as large as the kernel, padding or not: refimpl
    pools any input whose padded extent holds one window)."""
    if any(lo != hi for lo, hi in sides):
        return None
    p = tuple(lo for lo, _ in sides)
    try:
        if op == "max":
            return TF.max_pool3d(xt, kernel, stride, p, dilation, ceil_mode)
        return TF.avg_pool3d(xt, kernel, stride, p, ceil_mode, extra["count_include_pad"], extra["divisor_override"])
    except RuntimeError:
        return "refused"


@pytest.mark.parametrize("op", ["max", "avg"])
@given(data=st.data())
def test_pooling_options_match_torch(op, data):
    shape, kernel, stride, padding, dilation, ceil_mode, extra = data.draw(pool_cases(op))
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape)
    s = kernel if stride is None else stride
    sides = padding_sides(padding, kernel, dilation, s)
    if op == "max":
        y = P.max_pool3d(x, kernel, stride, padding, dilation, ceil_mode)
    else:
        y = P.avg_pool3d(x, kernel, stride, padding, ceil_mode, **extra)
    dy = rng.standard_normal(y.shape)
    xt = torch.tensor(x, requires_grad=True)
    yt = torch_pool(op, xt, kernel, s, sides, dilation, ceil_mode, extra)
    if isinstance(yt, str):                 # PyTorch refuses the shape: the definition decides
        yt = None
        want_y = brute_pool(x, kernel, s, sides, dilation, ceil_mode, op, **extra)
    if yt is None and not ceil_mode:        # per-side padding: F.pad, then PyTorch's op unpadded
        xp = TF.pad(xt, torch_pad(sides), value=-np.inf if op == "max" else 0.0)
        assume(all(n >= kk for n, kk in zip(xp.shape[2:], kernel)) or op == "max")
        if op == "max":
            yt = TF.max_pool3d(xp, kernel, s, 0, dilation)
        elif extra["divisor_override"] is not None or extra["count_include_pad"]:
            div = extra["divisor_override"] or int(np.prod(kernel))
            yt = TF.avg_pool3d(xp, kernel, s, 0, divisor_override=1) / div
        else:
            ones = TF.pad(torch.ones_like(xt), torch_pad(sides))
            yt = TF.avg_pool3d(xp, kernel, s, 0, divisor_override=1) / TF.avg_pool3d(ones, kernel, s, 0,
                                                                                      divisor_override=1)
    if yt is not None:
        assert tuple(yt.shape) == y.shape
        want_y, want_dx = yt.detach().numpy(), None
        if not np.isinf(want_y).any():      # a max window wholly in the padding (dilation): PyTorch's
            yt.backward(torch.tensor(dy))   # backward writes its gradient outside the input
            want_dx = xt.grad.numpy()
    else:                                   # per-side padding with ceil_mode: from the definition
        want_y = brute_pool(x, kernel, s, sides, dilation, ceil_mode, op, **extra)
        want_dx = None
    assert rel(y, want_y) <= TOL
    if op == "max":
        dx = P.max_pool3d_backward(dy, x, kernel, stride, padding, dilation, ceil_mode)
    else:
        dx = P.avg_pool3d_backward(dy, x, kernel, stride, padding, ceil_mode, **extra)
    if want_dx is not None:
        assert rel(dx, want_dx) <= TOL
    else:                                   # the adjoint identity <dy, P x> == <P^T dy, x> (avg: linear)
        if op == "avg":
            assert abs(np.vdot(dy, y) - np.vdot(dx, x)) <= TOL * max(1.0, abs(np.vdot(dy, y)))


@pytest.mark.parametrize("ceil_mode, include, divisor, padding", [
    (True, True, None, 1), (True, False, None, (1, 0, 1)), (False, False, None, 1), (True, True, 3, 0),
    (False, True, None, (0, 1, 1, 0, 0, 1)), (True, False, None, (1, 0, 0, 1, 1, 1))])
def test_pooling_blocked_route_equals_reference(monkeypatch, ceil_mode, include, divisor, padding):
    """kernels.pooling (blocks of channels on worker threads) with the new options: bit for bit."""
    from refimpl.functional import reference_only
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 5, 7, 8, 9))
    monkeypatch.setattr(pooling_kernel, "BLOCK_ELEMENTS", 2 * 7 * 8 * 9)
    assert pooling_kernel.applies(x) and len(pooling_kernel.blocks(x)) > 1
    args = (x, 3, 2, padding)

    def passes():
        y = P.avg_pool3d(*args, ceil_mode, include, divisor)
        ym = P.max_pool3d(*args, 1, ceil_mode)
        return (y, P.avg_pool3d_backward(np.ones_like(y), *args, ceil_mode, include, divisor), ym,
                P.max_pool3d_backward(np.ones_like(ym), *args, 1, ceil_mode))
    fast = passes()
    with reference_only():
        ref = passes()
    for a, b in zip(fast, ref):
        np.testing.assert_array_equal(a, b)


def test_ceil_mode_overhang_counts_as_padding():
    """PyTorch's rule: out = ceil(...) + 1, the last window must start inside input or lo padding;
    its overhang is padding (-inf for max, not counted for avg)."""
    x = np.arange(5.0).reshape(1, 1, 5, 1, 1)
    assert P.max_pool3d(x, (2, 1, 1), (2, 1, 1), 0, 1, True).ravel().tolist() == [1, 3, 4]
    assert P.avg_pool3d(x, (2, 1, 1), (2, 1, 1), 0, True).ravel().tolist() == [0.5, 2.5, 4.0]
    assert P.avg_pool3d(x, (3, 1, 1), (3, 1, 1), (1, 0, 0), True).ravel().tolist() == [1 / 3, 3.0]
    # the window that would start in the hi padding is dropped: n=4, k=2, s=2, p=1 -> 3 outputs, not 4
    assert P.max_pool3d(x[:, :, :4], (2, 1, 1), (2, 1, 1), (1, 0, 0), 1, True).shape[2] == 3


@pytest.mark.parametrize("call, name", [
    (lambda x: P.max_pool3d(x, 2, ceil_mode=1), "ceil_mode"),
    (lambda x: P.avg_pool3d(x, 2, ceil_mode="yes"), "ceil_mode"),
    (lambda x: P.avg_pool3d(x, 2, count_include_pad=None), "count_include_pad"),
    (lambda x: P.avg_pool3d(x, 2, divisor_override=0), "divisor_override"),
    (lambda x: P.avg_pool3d(x, 2, divisor_override=1.5), "divisor_override"),
    (lambda x: P.avg_pool3d_backward(np.ones((1, 1, 2, 2, 2)), x, 2, divisor_override="3"), "divisor_override"),
    (lambda x: P.max_pool3d(x, 2, 2, "same"), "padding"),
    (lambda x: P.max_pool3d(x, 2, 1, (0, 2, 0, 0, 0, 0)), "padding"),
    (lambda x: P.avg_pool3d(x, 2, 1, "half"), "padding"),
])
def test_pooling_bad_options(call, name):
    with pytest.raises(ValueError, match=name):
        call(np.ones((1, 1, 4, 4, 4)))


# ---------------------------------------------------------------- nn layers

def test_nn_layers_with_options_match_torch():
    from refimpl.nn import AvgPool3d, Conv3d, MaxPool3d
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 7, 6, 5))
    conv = Conv3d(3, 4, 2, padding="same", rng=np.random.default_rng(0), dtype=np.float64)
    assert conv.padding == (0, 1, 0, 1, 0, 1) and conv.setup((7, 6, 5)) == (7, 6, 5)
    tconv = torch.nn.Conv3d(3, 4, 2, padding="same", dtype=torch.float64)
    with torch.no_grad():
        tconv.weight.copy_(torch.tensor(conv.weight.data))
        tconv.bias.copy_(torch.tensor(conv.bias.data))
    layers = [(conv, tconv),
              (MaxPool3d(3, 2, 1, ceil_mode=True), torch.nn.MaxPool3d(3, 2, 1, ceil_mode=True)),
              (AvgPool3d(3, 2, 1, ceil_mode=True, count_include_pad=False),
               torch.nn.AvgPool3d(3, 2, 1, ceil_mode=True, count_include_pad=False)),
              (AvgPool3d(2, 1, "same", divisor_override=3), None)]
    for ours, theirs in layers:
        y = ours.forward(x)
        dy = rng.standard_normal(y.shape)
        dx = ours.backward(dy)
        assert ours.setup(x.shape[2:]) == y.shape[2:]
        if theirs is None:
            assert rel(y, P.avg_pool3d(x, 2, 1, "same", divisor_override=3)) <= TOL
            continue
        xt = torch.tensor(x, requires_grad=True)
        yt = theirs(xt)
        yt.backward(torch.tensor(dy))
        assert rel(y, yt.detach().numpy()) <= TOL and rel(dx, xt.grad.numpy()) <= TOL
    assert rel(conv.weight.grad, tconv.weight.grad.numpy()) <= TOL


@pytest.mark.parametrize("make, name", [
    (lambda nn: nn.Conv3d(1, 1, 2, stride=2, padding="same", rng=np.random.default_rng(0)), "padding"),
    (lambda nn: nn.ConvTranspose3d(1, 1, 2, padding="same", rng=np.random.default_rng(0)), "padding"),
    (lambda nn: nn.MaxPool3d(2, padding=(0, 2, 0, 0, 0, 0)), "padding"),
    (lambda nn: nn.MaxPool3d(2, ceil_mode="no"), "ceil_mode"),
    (lambda nn: nn.AvgPool3d(2, count_include_pad=0), "count_include_pad"),
    (lambda nn: nn.AvgPool3d(2, divisor_override=0), "divisor_override"),
    (lambda nn: nn.Conv3d(4, 6, 2, groups=4, rng=np.random.default_rng(0)), "groups"),
    (lambda nn: nn.ConvTranspose3d(4, 6, 2, groups=0, rng=np.random.default_rng(0)), "groups"),
])
def test_nn_layers_refuse_bad_options(make, name):
    import refimpl.nn as nn
    with pytest.raises(ValueError, match=name):
        make(nn)


def test_check_layer_flags_parse_every_padding_form():
    """check-layer's --padding 'same' / '1,0,2' / '0,1,0,1,0,1' and the pooling flags."""
    import argparse
    from refimpl.commands import check_layer
    parser = argparse.ArgumentParser()
    check_layer.add_arguments(parser)

    def parse(*argv):
        return check_layer.parse_check(parser.parse_args(list(argv)), 1)
    base = ("--input", "1,2,6,6,6", "--grid", "1,1,1,1")
    assert parse("conv3d", *base, "--kernel", "2", "--padding", "same").padding == (0, 1, 0, 1, 0, 1)
    assert parse("conv3d", *base, "--padding", "1,0,2").padding == (1, 0, 2)
    assert parse("conv3d", *base, "--padding", "0,1,0,1,0,1").padding == (0, 1, 0, 1, 0, 1)
    assert parse("conv3d", *base, "--padding", "1,1,2,2,0,0").padding == (1, 2, 0)
    assert parse("conv3d", *base, "--padding", "valid").padding == (0, 0, 0)
    check = parse("avg_pool3d", *base, "--kernel", "3", "--stride", "2", "--padding", "1", "--ceil-mode",
                  "--no-count-include-pad", "--divisor-override", "5")
    assert (check.ceil_mode, check.count_include_pad, check.divisor_override) == (True, False, 5)
    grouped = parse("conv3d", "--input", "1,4,6,6,6", "--grid", "1,1,1,1", "--out-channels", "6", "--groups", "2")
    assert grouped.groups == 2 and grouped.kind.parameter_shapes(grouped)[0] == (6, 2, 3, 3, 3)
    for argv, name in ((("conv3d", *base, "--padding", "same", "--stride", "2"), "padding"),
                       (("conv3d", *base, "--padding", "1,2"), "padding"),
                       (("conv3d", *base, "--ceil-mode"), "--ceil-mode"),
                       (("max_pool3d", *base, "--no-count-include-pad"), "count-include-pad"),
                       (("max_pool3d", *base, "--divisor-override", "2"), "divisor-override"),
                       (("avg_pool3d", *base, "--divisor-override", "0"), "divisor-override"),
                       (("conv_transpose3d", *base, "--padding", "same"), "padding"),
                       (("conv3d", *base, "--groups", "0"), "groups"),
                       (("conv3d", *base, "--out-channels", "3", "--groups", "2"), "groups"),
                       (("avg_pool3d", *base, "--groups", "2"), "groups")):
        with pytest.raises(ValueError, match=name):
            parse(*argv)


# ---------------------------------------------------------------- groups

@pytest.mark.parametrize("algorithm", ["reference", "im2col", "auto"])
@pytest.mark.parametrize("groups, c, f", [(1, 4, 6), (2, 4, 6), (3, 6, 9), (4, 4, 4)])
def test_grouped_conv3d_matches_torch(algorithm, groups, c, f):
    rng = np.random.default_rng(groups + c)
    x, w = rng.standard_normal((2, c, 6, 5, 7)), rng.standard_normal((f, c // groups, 3, 2, 3))
    b = rng.standard_normal(f)
    xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    yt = TF.conv3d(xt, wt, bt, (1, 2, 1), (1, 0, 1), (2, 1, 1), groups)
    y = conv3d(x, w, b, (1, 2, 1), (1, 0, 1), (2, 1, 1), groups, algorithm=algorithm)
    dy = rng.standard_normal(y.shape)
    yt.backward(torch.tensor(dy))
    dx, dw, db = conv3d_backward(dy, x, w, (1, 2, 1), (1, 0, 1), (2, 1, 1), groups, algorithm=algorithm)
    for got, want in zip((y, dx, dw, db), (yt, xt.grad, wt.grad, bt.grad)):
        assert rel(got, want.detach().numpy()) <= TOL
    assert rel(conv3d_input_grad(dy, w, x.shape, (1, 2, 1), (1, 0, 1), (2, 1, 1), groups, algorithm=algorithm),
               xt.grad.numpy()) <= TOL
    assert rel(conv3d_weight_grad(dy, x, w.shape, (1, 2, 1), (1, 0, 1), (2, 1, 1), groups, algorithm=algorithm),
               wt.grad.numpy()) <= TOL


@pytest.mark.parametrize("algorithm", ["reference", "im2col", "auto"])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_grouped_conv_transpose3d_matches_torch(algorithm, groups):
    from refimpl.functional.conv_transpose3d import conv_transpose3d_backward
    rng = np.random.default_rng(groups)
    c, f = 6, 3 * groups
    x, w = rng.standard_normal((2, c, 4, 5, 3)), rng.standard_normal((c, f // groups, 3, 2, 2))
    b = rng.standard_normal(f)
    xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    yt = TF.conv_transpose3d(xt, wt, bt, 2, 1, 1, groups, 1)          # PyTorch: groups before dilation
    y = conv_transpose3d(x, w, b, 2, 1, 1, 1, groups, algorithm=algorithm)
    dy = rng.standard_normal(y.shape)
    yt.backward(torch.tensor(dy))
    dx, dw, db = conv_transpose3d_backward(dy, x, w, 2, 1, 1, 1, groups, algorithm=algorithm)
    for got, want in zip((y, dx, dw, db), (yt, xt.grad, wt.grad, bt.grad)):
        assert rel(got, want.detach().numpy()) <= TOL


def test_grouped_nn_layers_match_torch():
    from refimpl.nn import Conv3d, ConvTranspose3d
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 6, 5, 6, 4))
    for ours, theirs in [
            (Conv3d(6, 9, 3, padding="same", groups=3, rng=np.random.default_rng(0), dtype=np.float64),
             torch.nn.Conv3d(6, 9, 3, padding="same", groups=3, dtype=torch.float64)),
            (ConvTranspose3d(6, 4, 2, stride=2, groups=2, rng=np.random.default_rng(0), dtype=np.float64),
             torch.nn.ConvTranspose3d(6, 4, 2, stride=2, groups=2, dtype=torch.float64))]:
        assert ours.weight.shape == tuple(theirs.weight.shape)
        with torch.no_grad():
            theirs.weight.copy_(torch.tensor(ours.weight.data))
            theirs.bias.copy_(torch.tensor(ours.bias.data))
        y = ours.forward(x)
        dy = rng.standard_normal(y.shape)
        dx = ours.backward(dy)
        xt = torch.tensor(x, requires_grad=True)
        yt = theirs(xt)
        yt.backward(torch.tensor(dy))
        assert rel(y, yt.detach().numpy()) <= TOL and rel(dx, xt.grad.numpy()) <= TOL
        assert rel(ours.weight.grad, theirs.weight.grad.numpy()) <= TOL


@pytest.mark.parametrize("call", [
    lambda: conv3d(np.ones((1, 4, 3, 3, 3)), np.ones((6, 2, 1, 1, 1)), None, 1, 0, 1, 3),      # 6 % 3 ok, 4 != 2*3
    lambda: conv3d(np.ones((1, 4, 3, 3, 3)), np.ones((5, 2, 1, 1, 1)), None, 1, 0, 1, 2),      # 5 % 2
    lambda: conv3d(np.ones((1, 4, 3, 3, 3)), np.ones((4, 4, 1, 1, 1)), None, 1, 0, 1, 0),
    lambda: conv3d(np.ones((1, 4, 3, 3, 3)), np.ones((4, 2, 1, 1, 1)), None, 1, 0, 1, 2.0),
    lambda: conv_transpose3d(np.ones((1, 4, 3, 3, 3)), np.ones((4, 2, 1, 1, 1)), None, 1, 0, 0, 1, 3),
])
def test_bad_groups_name_the_argument(call):
    with pytest.raises(ValueError, match="groups|channel"):
        call()
