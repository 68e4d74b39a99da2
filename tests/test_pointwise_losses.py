"""Activations, dropout, linear/flatten and losses vs PyTorch float64 and finite differences."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from refimpl.functional.activations import (
    leaky_relu, leaky_relu_backward, relu, relu_backward, scaled_tanh, scaled_tanh_backward, tanh,
    tanh_backward)
from refimpl.functional.dropout import dropout, dropout_backward, dropout_mask, fold_seed
from refimpl.functional.linear import flatten, flatten_backward, linear, linear_backward
from refimpl.functional.losses import (
    cross_entropy_backward, cross_entropy_local_sums, dice_score, mae_loss, mean_finish, mse_loss,
    SoftmaxParts, soft_dice_backward, soft_dice_finish, soft_dice_local_sums, soft_dice_loss,
    softmax_cross_entropy)

torch = pytest.importorskip("torch", reason="PyTorch absent: pip install 'refimpl[oracle]'")
F = torch.nn.functional


def rel_err(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(np.max(np.abs(b)), 1e-300))


def directional_fd_err(f, x, dx, dy=1.0, h=1e-6, seed=0):
    """|<dy, (f(x+hv) - f(x-hv)) / 2h> - <dx, v>| relative, for a random direction v."""
    v = np.random.default_rng(seed).standard_normal(x.shape)
    lhs = np.sum(dy * (np.asarray(f(x + h * v)) - np.asarray(f(x - h * v)))) / (2 * h)
    rhs = np.sum(dx * v)
    return abs(lhs - rhs) / max(abs(rhs), 1e-12)


def torch_grad(fn, *arrays, dy=None):
    """(output, grads) of a torch function of float64 arrays."""
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    out = fn(*ts)
    out.backward(None if dy is None else torch.tensor(dy))
    return out.detach().numpy(), [t.grad.numpy() for t in ts]


shapes5 = st.tuples(st.integers(1, 2), st.integers(1, 4), st.integers(1, 4), st.integers(1, 4),
                    st.integers(1, 4))


# ---------------------------------------------------------------- activations
@given(shapes5, st.integers(0, 2**31), st.floats(0.0, 0.5))
def test_activations_match_torch(shape, seed, slope):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    x.flat[::3] = 0.0                       # the kink: torch's conventions at x == 0
    dy = rng.standard_normal(shape)
    cases = [
        (lambda t: F.relu(t), relu(x), relu_backward(dy, x)),
        (lambda t: F.leaky_relu(t, slope), leaky_relu(x, slope), leaky_relu_backward(dy, x, slope)),
        (lambda t: torch.tanh(t), tanh(x), tanh_backward(dy, tanh(x))),
        (lambda t: 1.2 * torch.tanh(t), scaled_tanh(x, 1.2)[0],
         scaled_tanh_backward(dy, scaled_tanh(x, 1.2)[1], 1.2)),
    ]
    for fn, y, dx in cases:
        y_ref, (dx_ref,) = torch_grad(fn, x, dy=dy)
        assert rel_err(y, y_ref) <= 1e-10
        assert rel_err(dx, dx_ref) <= 1e-10


def test_activations_finite_differences():
    rng = np.random.default_rng(1)
    x, dy = rng.standard_normal((2, 3, 3, 2, 2)), rng.standard_normal((2, 3, 3, 2, 2))
    assert directional_fd_err(relu, x, relu_backward(dy, x), dy) < 1e-7
    assert directional_fd_err(lambda z: leaky_relu(z, 0.2), x, leaky_relu_backward(dy, x, 0.2), dy) < 1e-7
    assert directional_fd_err(lambda z: scaled_tanh(z)[0], x, scaled_tanh_backward(dy, tanh(x)), dy) < 1e-7


# ---------------------------------------------------------------- linear, flatten
@given(st.integers(1, 4), st.integers(1, 6), st.integers(1, 5), st.booleans(), st.integers(0, 2**31))
def test_linear_matches_torch(n, fin, fout, bias, seed):
    rng = np.random.default_rng(seed)
    x, w, b = rng.standard_normal((n, fin)), rng.standard_normal((fout, fin)), rng.standard_normal(fout)
    dy = rng.standard_normal((n, fout))
    if bias:
        y_ref, grads = torch_grad(lambda a, c, d: F.linear(a, c, d), x, w, b, dy=dy)
    else:
        y_ref, grads = torch_grad(lambda a, c: F.linear(a, c), x, w, dy=dy)
    assert rel_err(linear(x, w, b if bias else None), y_ref) <= 1e-10
    dx, dw, db = linear_backward(dy, x, w)
    for mine, ref in zip((dx, dw, db), grads):
        assert rel_err(mine, ref) <= 1e-10


def test_linear_finite_differences_and_flatten():
    rng = np.random.default_rng(2)
    x5 = rng.standard_normal((2, 3, 2, 2, 2))
    x = flatten(x5)
    assert x.shape == (2, 24) and np.array_equal(flatten_backward(x, x5.shape), x5)
    w, b, dy = rng.standard_normal((5, 24)), rng.standard_normal(5), rng.standard_normal((2, 5))
    dx, dw, db = linear_backward(dy, x, w)
    assert directional_fd_err(lambda z: linear(z, w, b), x, dx, dy) < 1e-7
    assert directional_fd_err(lambda z: linear(x, z, b), w, dw, dy) < 1e-7
    assert directional_fd_err(lambda z: linear(x, w, z), b, db, dy) < 1e-7


# ---------------------------------------------------------------- dropout
def test_dropout_sub_block_equals_slice_of_full_mask():
    shape = (3, 2, 9, 7, 11)
    full = dropout_mask(shape, 0.3, seed=12345)
    rng = np.random.default_rng(0)
    for _ in range(10):
        ranges = [tuple(sorted(rng.integers(0, n + 1, 2))) for n in shape]
        block = dropout_mask(shape, 0.3, 12345, ranges)
        assert np.array_equal(block, full[tuple(slice(a, b) for a, b in ranges)])
    x = rng.standard_normal(shape)
    ranges = [(1, 3), (0, 2), (2, 5), (0, 7), (4, 11)]
    y_block, _ = dropout(x[1:3, :, 2:5, :, 4:11], 0.3, 12345, shape, ranges)
    y_full, _ = dropout(x, 0.3, 12345)
    assert np.array_equal(y_block, y_full[1:3, :, 2:5, :, 4:11])


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keeps_about_one_minus_p_and_scales(p):
    x = np.random.default_rng(1).standard_normal((4, 4, 16, 16, 16))  # 65536 elements
    y, mask = dropout(x, p, seed=7)
    assert abs(mask.mean() - (1 - p)) < 4 * np.sqrt(p * (1 - p) / mask.size)
    assert np.allclose(y[mask], x[mask] / (1 - p)) and np.all(y[~mask] == 0)
    dy = np.random.default_rng(2).standard_normal(x.shape)
    dx = dropout_backward(dy, mask, p)
    assert np.allclose(dx[mask], dy[mask] / (1 - p)) and np.all(dx[~mask] == 0)


def test_dropout_seeds_and_edge_probabilities():
    shape = (2, 3, 8, 8, 8)
    assert np.array_equal(dropout_mask(shape, 0.5, 3), dropout_mask(shape, 0.5, 3))
    assert not np.array_equal(dropout_mask(shape, 0.5, 3), dropout_mask(shape, 0.5, 4))
    assert fold_seed(3, 0) != fold_seed(3, 1)
    assert dropout_mask(shape, 0.0, 3).all() and not dropout_mask(shape, 1.0, 3).any()
    x = np.ones(shape, np.float32)
    assert dropout(x, 1.0, 3)[0].sum() == 0 and dropout(x, 0.5, 3)[0].dtype == np.float32


# ---------------------------------------------------------------- losses
@given(st.tuples(st.integers(1, 3), st.integers(1, 5)), st.integers(0, 2**31))
def test_regression_losses_match_torch(shape, seed):
    rng = np.random.default_rng(seed)
    pred, target = rng.standard_normal(shape), rng.standard_normal(shape)
    for mine, fn in ((mse_loss, F.mse_loss), (mae_loss, F.l1_loss)):
        loss, dpred = mine(pred, target)
        ref, (dref, _) = torch_grad(fn, pred, target)
        assert rel_err(loss, ref) <= 1e-10 and rel_err(dpred, dref) <= 1e-10
        assert directional_fd_err(lambda z: mine(z, target)[0], pred, dpred) < 1e-6


# class counts on both sides of kernels.losses.MASKED_PICK_CLASSES (the kernel vs take_along_axis)
classification = st.tuples(st.integers(1, 2), st.sampled_from([2, 3, 4, 8, 9, 12]), st.integers(1, 3), st.integers(1, 3),
                           st.integers(1, 3), st.booleans(), st.integers(0, 2**31))


def labelled(case):
    n, k, d, h, w, weighted, seed = case
    rng = np.random.default_rng(seed)
    logits = 2 * rng.standard_normal((n, k, d, h, w))
    labels = rng.integers(0, k, (n, d, h, w))
    weights = rng.uniform(0.2, 2.0, k) if weighted else None
    return logits, labels, weights


@given(classification)
def test_cross_entropy_matches_torch(case):
    logits, labels, weights = labelled(case)
    loss, dlogits = softmax_cross_entropy(logits, labels, weights)
    wt = None if weights is None else torch.tensor(weights)
    ref, (dref,) = torch_grad(lambda z: F.cross_entropy(z, torch.tensor(labels), weight=wt), logits)
    assert rel_err(loss, ref) <= 1e-10 and rel_err(dlogits, dref) <= 1e-10


@given(classification)
def test_shared_softmax_gives_the_same_loss(case):
    """The pieces of a loss fed one ``SoftmaxParts`` (as the U-Net's loss does) equal the same
    pieces computing their own softmax, and torch; large logits (a class far ahead: a
    probability that underflows) keep a finite cross-entropy."""
    logits, labels, weights = labelled(case)
    logits[(0, 0) + (0,) * (logits.ndim - 2)] = 800.0 if logits.shape[1] > 1 else 0.0
    parts = SoftmaxParts(logits)
    ce = cross_entropy_local_sums(logits, labels, weights, parts)
    assert rel_err(ce, cross_entropy_local_sums(logits, labels, weights)) <= 1e-12
    assert np.isfinite(ce).all()
    wt = None if weights is None else torch.tensor(weights)
    ref, (dref,) = torch_grad(lambda z: F.cross_entropy(z, torch.tensor(labels), weight=wt), logits)
    assert rel_err(mean_finish(ce), ref) <= 1e-10
    assert rel_err(cross_entropy_backward(logits, labels, ce, weights, parts=parts), dref) <= 1e-10
    dice = soft_dice_local_sums(logits, labels, parts)
    assert rel_err(dice, soft_dice_local_sums(logits, labels)) <= 1e-12
    assert rel_err(soft_dice_backward(logits, labels, dice, parts=parts),
                   soft_dice_backward(logits, labels, dice)) <= 1e-12
    assert np.array_equal(parts.p, SoftmaxParts(logits).p)     # not modified by the pieces


@pytest.mark.parametrize("k, weighted", [(2, False), (3, True), (8, False)])
def test_blocked_class_passes_equal_the_whole_array_passes(k, weighted, monkeypatch):
    """On the host with few classes the softmax, the cross-entropy sums and gradient and the
    hard Dice counts run class plane by class plane over blocks of voxels on the worker
    threads (``kernels.losses.applies``): the same numbers as the whole-array passes (a Fortran-ordered
    copy takes those; the sums of a softmax's three exponentials may round apart) over many
    blocks, and bit for bit the same at 1, 2 and 3 threads; labels validated once by ``SoftmaxParts(logits, labels)``, which still refuses a
    label out of range."""
    from refimpl.functional import losses
    from refimpl.kernels import losses as kernel
    monkeypatch.setattr(kernel, "CLASS_BLOCK_VOXELS", 37)            # many blocks, a ragged last one
    rng = np.random.default_rng(k)
    logits = 3 * rng.standard_normal((2, k, 5, 6, 7))
    labels = rng.integers(0, k, (2, 5, 6, 7))
    weights = rng.uniform(0.2, 2.0, k) if weighted else None
    whole = np.asfortranarray(logits)
    assert kernel.applies(logits) and not kernel.applies(whole)
    ref = SoftmaxParts(whole)
    ce_ref = cross_entropy_local_sums(whole, labels, weights, ref)
    grad_ref = cross_entropy_backward(whole, labels, ce_ref, weights, 2.0, ref)
    runs = []
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("REFIMPL_THREADS", threads)
        parts = SoftmaxParts(logits, labels)
        ce = cross_entropy_local_sums(logits, labels, weights, parts)
        runs.append((parts.p, parts.lse, ce, cross_entropy_backward(logits, labels, ce, weights, 2.0, parts),
                     losses.dice_score_local_sums(logits, labels, parts)))
    for run in runs[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(run, runs[0]))
    p, lse, ce, grad, counts = runs[0]
    assert rel_err(p, ref.p) <= 1e-15 and rel_err(lse, ref.lse) <= 1e-15
    assert rel_err(ce, ce_ref) <= 1e-14
    assert rel_err(grad, grad_ref) <= 1e-14
    assert np.array_equal(counts, losses.dice_score_local_sums(whole, labels))
    bad = labels.copy()
    bad[1, 2, 3, 4] = k
    with pytest.raises(ValueError, match="labels must lie in"):
        SoftmaxParts(logits, bad)


def torch_soft_dice(z, labels, eps):
    p = torch.softmax(z, 1)
    t = F.one_hot(torch.tensor(labels), z.shape[1]).movedim(-1, 1).to(z.dtype)
    axes = (0,) + tuple(range(2, z.ndim))
    inter, psum, tsum = (p * t).sum(axes), p.sum(axes), t.sum(axes)
    return 1 - ((2 * inter + eps) / (psum + tsum + eps)).mean()


@given(classification, st.sampled_from([1e-5, 1.0]))
def test_soft_dice_matches_torch_autograd(case, eps):
    logits, labels, _ = labelled(case)
    loss, dlogits = soft_dice_loss(logits, labels, eps)
    ref, (dref,) = torch_grad(lambda z: torch_soft_dice(z, labels, eps), logits)
    assert rel_err(loss, ref) <= 1e-10 and rel_err(dlogits, dref) <= 1e-10


def test_classification_losses_finite_differences():
    logits, labels, weights = labelled((2, 3, 2, 3, 2, True, 5))
    dce = softmax_cross_entropy(logits, labels, weights)[1]
    assert directional_fd_err(lambda z: softmax_cross_entropy(z, labels, weights)[0], logits, dce) < 1e-6
    ddice = soft_dice_loss(logits, labels)[1]
    assert directional_fd_err(lambda z: soft_dice_loss(z, labels)[0], logits, ddice) < 1e-6


def test_loss_sums_split_over_blocks():
    """Local sums over D-slabs added (as Allreduce would) give the global loss and gradient."""
    logits, labels, weights = labelled((2, 3, 5, 2, 2, True, 9))
    slabs = [slice(0, 2), slice(2, 2), slice(2, 5)]
    ce = sum(cross_entropy_local_sums(logits[:, :, s], labels[:, s], weights) for s in slabs)
    loss, dref = softmax_cross_entropy(logits, labels, weights)
    assert abs(mean_finish(ce) - loss) <= 1e-12 * abs(loss)
    grad = np.concatenate([cross_entropy_backward(logits[:, :, s], labels[:, s], ce, weights)
                           for s in slabs], axis=2)
    assert rel_err(grad, dref) <= 1e-12
    dice = sum(soft_dice_local_sums(logits[:, :, s], labels[:, s]) for s in slabs)
    loss, dref = soft_dice_loss(logits, labels)
    assert abs(soft_dice_finish(dice) - loss) <= 1e-12 * abs(loss)
    grad = np.concatenate([soft_dice_backward(logits[:, :, s], labels[:, s], dice) for s in slabs], axis=2)
    assert rel_err(grad, dref) <= 1e-12


@pytest.mark.parametrize("classes", [2, 4, 9])       # both sides of MASKED_PICK_CLASSES
def test_dice_score(classes):
    logits, labels, _ = labelled((2, classes, 3, 3, 3, False, 3))
    logits[0, 1] = logits[0, 0]                            # ties: the first maximum wins (argmax)
    pred = logits.argmax(1)
    expected = []
    for k in range(classes):
        a, b = pred == k, labels == k
        expected.append(1.0 if a.sum() + b.sum() == 0 else 2 * (a & b).sum() / (a.sum() + b.sum()))
    assert np.allclose(dice_score(logits, labels), expected)
    perfect = np.eye(3)[labels % 3].transpose(0, 4, 1, 2, 3)  # logits whose argmax are the labels
    assert np.allclose(dice_score(perfect, labels % 3), 1.0)


# ---------------------------------------------------------------- argument errors
@pytest.mark.parametrize("call, match", [
    (lambda: linear(np.ones((2, 3)), np.ones((4, 2))), "x has 3 features"),
    (lambda: linear(np.ones((2, 3, 1)), np.ones((4, 3))), "x must be 2-D"),
    (lambda: linear(np.ones((2, 3)), np.ones((4, 3), np.float32)), "dtype mismatch"),
    (lambda: linear(np.ones((2, 3)), np.ones((4, 3)), np.ones(3)), "b must have shape"),
    (lambda: relu_backward(np.ones(3, np.float32), np.ones(3)), "dtype mismatch"),
    (lambda: dropout(np.ones((2, 2)), 1.5, 0), "p must be in"),
    (lambda: dropout(np.ones((2, 2)), 0.5, -1), "seed must be"),
    (lambda: dropout_mask((4, 4), 0.5, 0, [(0, 5), (0, 4)]), "outside global_shape"),
    (lambda: dropout(np.ones((2, 2)), 0.5, 0, (4, 4), [(0, 2), (0, 3)]), "block of shape"),
    (lambda: mse_loss(np.ones(3), np.ones(4)), "target has shape"),
    (lambda: mae_loss(np.ones(3), np.ones(3, np.float32)), "dtype mismatch"),
    (lambda: softmax_cross_entropy(np.ones((2, 3, 2)), np.zeros((2, 3), int)), "labels must have shape"),
    (lambda: softmax_cross_entropy(np.ones((2, 3)), np.zeros(2)), "labels must be an integer"),
    (lambda: softmax_cross_entropy(np.ones((2, 3)), np.array([0, 3])), r"labels must lie in \[0, 3\)"),
    (lambda: softmax_cross_entropy(np.ones((2, 3)), np.zeros(2, int), np.ones(2)), "class_weights must"),
    (lambda: soft_dice_loss(np.ones(3), np.zeros(3, int)), "logits must be"),
])
def test_bad_arguments_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_relu_backwards_equal_the_where_form_bit_for_bit():
    """The mask-arithmetic backwards equal np.where(x > 0, dy, slope * dy) exactly
    (zeros, negative zeros and ties at 0 included)."""
    from refimpl.functional import leaky_relu_backward, relu_backward
    rng = np.random.default_rng(7)
    for dtype in (np.float32, np.float64):
        x = rng.standard_normal(1000).astype(dtype)
        x[::7], x[1::11] = 0.0, -0.0
        dy = rng.standard_normal(1000).astype(dtype)
        for slope in (0.01, 0.3, 1.0, 0.0, 1.5, -0.2):          # max(m, slope) form; the other
            got = leaky_relu_backward(dy, x, slope)
            assert got.dtype == dtype
            np.testing.assert_array_equal(got, np.where(x > 0, dy, dy * dtype(slope)))
        np.testing.assert_array_equal(relu_backward(dy, x), np.where(x > 0, dy, 0))
