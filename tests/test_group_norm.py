"""Group norm and instance norm vs PyTorch float64, finite differences, and the split API.

The split test mimics the spatially partitioned layer without MPI: the local sums of
slabs (along D, H or W, some empty) are added (what Allreduce does) and each slab
finishes with the global sums.
"""
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from refimpl import functional as F
from refimpl.functional.group_norm import (
    group_norm3d, group_norm3d_backward, group_norm_backward, group_norm_backward_local_sums,
    group_norm_forward, group_norm_local_sums, group_norm_stats, instance_norm3d,
    instance_norm3d_backward)

torch = pytest.importorskip("torch", reason="PyTorch absent: pip install 'refimpl[oracle]'")


def rel_err(a, b, floor=1e-300):
    """max|a - b| / max(max|b|, floor)."""
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(np.max(np.abs(b)), floor))


def make_case(shape, seed):
    """x with a different scale and offset per channel (never all zeros), gamma, beta, dy."""
    rng = np.random.default_rng(seed)
    c = shape[1]
    x = rng.standard_normal(shape) * rng.uniform(0.5, 3, (1, c, 1, 1, 1)) + rng.uniform(-2, 2, (1, c, 1, 1, 1))
    return x, rng.uniform(0.5, 1.5, c), rng.standard_normal(c), rng.standard_normal(shape)


def dx_scale(x, gamma, dy, groups):
    """The size of dx's terms (they can nearly cancel when a group holds 2 values)."""
    n, c = x.shape[:2]
    var = x.reshape(n, groups, -1).var(axis=-1)
    return np.max(np.abs(dy)) * np.max(gamma) / np.sqrt(np.min(var) + 1e-5)


@st.composite
def group_cases(draw):
    groups = draw(st.integers(1, 4))
    c = groups * draw(st.integers(1, 3))
    shape = (draw(st.integers(1, 3)), c) + tuple(draw(st.integers(1, 5)) for _ in range(3))
    # PyTorch refuses N*D*H*W == 1 ("more than 1 value per channel"); a group of one value
    # (test_one_value_groups) normalises to 0 exactly here, to rounding noise there
    assume(shape[0] * np.prod(shape[2:]) >= 2 and c // groups * np.prod(shape[2:]) >= 2)
    return shape, groups, draw(st.integers(0, 2 ** 31))


def _torch_grads(fn, x, gamma, beta, dy):
    xt, gt, bt = (torch.tensor(a, requires_grad=True) for a in (x, gamma, beta))
    yt = fn(xt, gt, bt)
    yt.backward(torch.tensor(dy))
    return yt.detach().numpy(), xt.grad.numpy(), gt.grad.numpy(), bt.grad.numpy()


def _check(ours, theirs, scale):
    (y, dx, dw, db), (yt, dxt, dwt, dbt) = ours, theirs
    assert rel_err(y, yt) <= 1e-12
    assert rel_err(dx, dxt, floor=scale) <= 1e-12
    assert rel_err(dw, dwt) <= 1e-12
    assert rel_err(db, dbt) <= 1e-12


@given(group_cases())
def test_group_norm3d_matches_torch(case):
    shape, groups, seed = case
    x, gamma, beta, dy = make_case(shape, seed)
    y, cache = group_norm3d(x, groups, gamma, beta, 1e-5)
    dx, dw, db = group_norm3d_backward(dy, cache)
    theirs = _torch_grads(lambda xt, gt, bt: torch.nn.functional.group_norm(xt, groups, gt, bt, 1e-5),
                          x, gamma, beta, dy)
    _check((y, dx, dw, db), theirs, dx_scale(x, gamma, dy, groups))


@given(st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 5), st.integers(1, 5),
                 st.integers(1, 5)).filter(lambda s: s[2] * s[3] * s[4] >= 2),
       st.integers(0, 2 ** 31))
def test_instance_norm3d_matches_torch(shape, seed):
    x, gamma, beta, dy = make_case(shape, seed)
    y, cache = instance_norm3d(x, gamma, beta, 1e-5)
    dx, dw, db = instance_norm3d_backward(dy, cache)
    theirs = _torch_grads(lambda xt, gt, bt: torch.nn.functional.instance_norm(
        xt, None, None, gt, bt, use_input_stats=True, eps=1e-5), x, gamma, beta, dy)
    _check((y, dx, dw, db), theirs, dx_scale(x, gamma, dy, shape[1]))


@pytest.mark.parametrize("shape,groups", [((2, 6, 3, 4, 5), 3), ((1, 8, 7, 1, 3), 2), ((3, 5, 2, 3, 2), 1),
                                          ((2, 4, 5, 3, 4), 4)])
def test_uneven_shapes_exact(shape, groups):
    """Fixed uneven shapes with an offset of 50 std (the float64 sums keep it exact)."""
    x, gamma, beta, dy = make_case(shape, 3)
    x = x + 50.0
    y, cache = group_norm3d(x, groups, gamma, beta, 1e-5)
    dx, dw, db = group_norm3d_backward(dy, cache)
    theirs = _torch_grads(lambda xt, gt, bt: torch.nn.functional.group_norm(xt, groups, gt, bt, 1e-5),
                          x, gamma, beta, dy)
    _check((y, dx, dw, db), theirs, dx_scale(x, gamma, dy, groups))


def test_without_affine_parameters():
    x, _, _, dy = make_case((2, 6, 3, 2, 4), 5)
    y, cache = group_norm3d(x, 3)
    dx, dw, db = group_norm3d_backward(dy, cache)
    xt = torch.tensor(x, requires_grad=True)
    yt = torch.nn.functional.group_norm(xt, 3, eps=1e-5)
    yt.backward(torch.tensor(dy))
    assert rel_err(y, yt.detach().numpy()) <= 1e-12
    assert rel_err(dx, xt.grad.numpy()) <= 1e-12
    assert dw is None and db is None


def test_one_value_groups():
    """A group of one value: xhat = 0, so y = beta, dx = 0 and dgamma = 0 exactly."""
    x, gamma, beta, dy = make_case((3, 4, 1, 1, 1), 4)
    y, cache = group_norm3d(x, 4, gamma, beta)
    dx, dw, db = group_norm3d_backward(dy, cache)
    assert np.array_equal(y, np.broadcast_to(beta.reshape(1, 4, 1, 1, 1), y.shape))
    assert not dx.any() and not dw.any() and rel_err(db, dy.sum(axis=(0, 2, 3, 4))) <= 1e-15


def test_float32_is_float32_and_close():
    x, gamma, beta, dy = (a.astype(np.float32) for a in make_case((2, 4, 3, 4, 5), 9))
    y, cache = group_norm3d(x, 2, gamma, beta)
    dx, dw, db = group_norm3d_backward(dy, cache)
    assert {a.dtype for a in (y, dx, dw, db)} == {np.dtype(np.float32)}
    y64, c64 = group_norm3d(x.astype(np.float64), 2, gamma.astype(np.float64), beta.astype(np.float64))
    assert rel_err(y, y64) < 1e-5
    assert rel_err(dx, group_norm3d_backward(dy.astype(np.float64), c64)[0]) < 1e-5


def test_exported_from_functional():
    assert F.group_norm3d is group_norm3d and F.instance_norm3d is instance_norm3d
    assert F.group_norm3d_backward is group_norm3d_backward


@pytest.mark.parametrize("axis", [2, 3, 4])
def test_split_sums_equal_unpartitioned(axis):
    """Sum the slabs' local sums (as Allreduce would, one slab empty), finish per slab, compare."""
    shape, groups = (2, 6, 7, 5, 4), 3
    x, gamma, beta, dy = make_case(shape, 11)
    n = shape[axis]
    cuts = [0, 2, 2, n - 1, n]                      # slabs [0,2), [2,2) empty, [2,n-1), [n-1,n)
    slabs = [tuple([slice(None)] * axis + [slice(a, b)]) for a, b in zip(cuts, cuts[1:])]
    sums = [group_norm_local_sums(x[s], groups) for s in slabs]
    count = sum(c for c, _, _ in sums)
    s1, s2 = sum(s[1] for s in sums), sum(s[2] for s in sums)
    mean, var, inv_std = group_norm_stats(count, s1, s2, 1e-5)
    outs = [group_norm_forward(x[s], groups, mean, inv_std, gamma, beta) for s in slabs]
    back = [group_norm_backward_local_sums(dy[s], cache) for s, (_, cache) in zip(slabs, outs)]
    sg, sgx = sum(b[0] for b in back), sum(b[1] for b in back)
    grads = [group_norm_backward(dy[s], cache, sg, sgx, count) for s, (_, cache) in zip(slabs, outs)]
    y_ref, cache_ref = group_norm3d(x, groups, gamma, beta)
    dx_ref, dw_ref, db_ref = group_norm3d_backward(dy, cache_ref)
    y = np.concatenate([o[0] for o in outs], axis=axis)
    dx = np.concatenate([g[0] for g in grads], axis=axis)
    assert rel_err(y, y_ref) <= 1e-13 and rel_err(dx, dx_ref) <= 1e-12
    assert rel_err(sum(g[1] for g in grads), dw_ref) <= 1e-12
    assert rel_err(sum(g[2] for g in grads), db_ref) <= 1e-12
    assert count == shape[1] // groups * np.prod(shape[2:])


def test_shifted_sums_give_the_same_statistics():
    x, *_ = make_case((2, 4, 3, 3, 3), 2)
    shift = np.full((2, 2), 1.5)
    c0, a1, a2 = group_norm_local_sums(x, 2)
    c1, b1, b2 = group_norm_local_sums(x, 2, shift)
    m0, v0, _ = group_norm_stats(c0, a1, a2)
    m1, v1, _ = group_norm_stats(c1, b1, b2, shift=shift)
    assert rel_err(m1, m0) < 1e-13 and rel_err(v1, v0) < 1e-13
    assert a1.shape == (2, 2) and a1.dtype == np.float64


@pytest.mark.parametrize("groups", [3, 5, 0, -1, 2.0, True, "2"])
def test_num_groups_must_divide_channels(groups):
    x = make_case((1, 4, 2, 2, 2), 0)[0]
    with pytest.raises(ValueError, match="num_groups"):
        group_norm3d(x, groups)


def test_bad_arguments_are_refused():
    x, gamma, beta, dy = make_case((1, 4, 2, 2, 2), 0)
    with pytest.raises(ValueError, match="gamma has 3 channels"):
        group_norm3d(x, 2, gamma[:3], beta)
    with pytest.raises(ValueError, match="eps"):
        group_norm3d(x, 2, gamma, beta, -1.0)
    with pytest.raises(ValueError, match="x must"):
        group_norm3d(x[0], 2)
    _, cache = group_norm3d(x, 2, gamma, beta)
    with pytest.raises(ValueError, match="dy must have x's shape"):
        group_norm3d_backward(dy[:, :2], cache)
    with pytest.raises(ValueError, match="cache"):
        group_norm3d_backward(dy, (cache, 1))


@pytest.mark.parametrize("layer_kind", ["group", "instance"])
def test_layers_equal_functional(layer_kind):
    """nn.GroupNorm3d / nn.InstanceNorm3d: the functional op, gradients accumulated, eval alike."""
    from refimpl.nn import GroupNorm3d, InstanceNorm3d
    x, gamma, beta, dy = make_case((2, 6, 3, 4, 2), 8)
    layer = GroupNorm3d(3, 6, dtype="float64") if layer_kind == "group" else InstanceNorm3d(6, dtype="float64")
    groups = 3 if layer_kind == "group" else 6
    layer.weight.data[...], layer.bias.data[...] = gamma, beta
    y_ref, cache = group_norm3d(x, groups, gamma, beta)
    dx_ref, dw_ref, db_ref = group_norm3d_backward(dy, cache)
    assert rel_err(layer.forward(x), y_ref) == 0 and rel_err(layer.backward(dy), dx_ref) == 0
    assert rel_err(layer.weight.grad, dw_ref) == 0 and rel_err(layer.bias.grad, db_ref) == 0
    layer.training = False
    assert rel_err(layer.forward(x), y_ref) == 0
    with pytest.raises(ValueError, match="num_groups=4 must divide"):
        GroupNorm3d(4, 6)
    with pytest.raises(ValueError, match="expects 6"):
        layer.forward(x[:, :4])
