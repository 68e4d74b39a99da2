"""Winograd F(4x4x4, 3x3x3) and F(4x4x4, 2x2x2) (refimpl/kernels/winograd.py).

- the 1-D F(4, 3) and F(4, 2) identities, exactly, and the transforms as Kronecker products;
- conv3d / conv_transpose3d with ``algorithm="winograd"`` vs PyTorch float64 (<= 1e-10)
  over Hypothesis shapes, kernels 3 and 2, paddings (0..3 per axis; kernel 2 also (lo, hi)
  per side and 'same') and budgets (chunks of samples, of depth rows, one row); the input
  gradient by the flipped kernel's forward where it is taken;
- the float32 error bound ``FLOAT32_BOUND`` of the module docstring, forward and backward;
- worker threads: any ``REFIMPL_THREADS`` gives the same numbers; the same count gives the
  same bits; bad values refused;
- ``algorithm=`` / ``REFIMPL_CONV_ALGORITHM``: what "auto" picks, and clear errors;
- the temporary-memory bound.
"""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from refimpl.kernels import _threads, winograd
from refimpl.functional.conv3d import conv3d, conv3d_backward, conv3d_input_grad, conv3d_weight_grad
from refimpl.kernels.routes import resolve_algorithm, winograd_tiles
from refimpl.functional.conv_transpose3d import conv_transpose3d, conv_transpose3d_backward
from test_conv import RTOL, _traced, needs_torch, rel_err, torch  # the conv tests' helpers

W = "winograd"


# ------------------------------------------------------------------------ the algebra

@pytest.mark.parametrize("r", [3, 2])
def test_one_dimensional_identity_is_exact(r):
    from refimpl.kernels.routes import WINOGRAD_KERNELS
    assert sorted(winograd.SCHEMES) == sorted(WINOGRAD_KERNELS)
    """y = A^T [(G g) * (B^T d)] is the r-tap correlation of d (4 + r - 1 inputs -> 4 outputs)."""
    bt, g_mat, at = winograd.SCHEMES[r]
    assert bt.shape == (3 + r, 3 + r) and g_mat.shape == (3 + r, r) and at.shape == (4, 3 + r)
    rng = np.random.default_rng(0)
    for _ in range(20):
        g, d = rng.standard_normal(r), rng.standard_normal(3 + r)
        y = at @ ((g_mat @ g) * (bt @ d))
        direct = np.array([g @ d[i:i + r] for i in range(4)])
        np.testing.assert_allclose(y, direct, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("r", [3, 2])
@pytest.mark.parametrize("columns", [1, 7, 180, 4096])
def test_transform_is_the_kronecker_product(monkeypatch, columns, r):
    """... whichever way the passes cut their columns into GEMMs (``TRANSFORM_COLUMNS``: one
    column each, blocks with a leftover, exactly one block of axis 0's 36 x 5, one call)."""
    monkeypatch.setattr(winograd, "TRANSFORM_COLUMNS", columns)
    bt = winograd.SCHEMES[r][0]
    alpha = bt.shape[0]
    rng = np.random.default_rng(1)
    rest = 5
    src = rng.standard_normal(alpha ** 3 * rest)
    dst = np.empty_like(src)
    got = winograd._transform(bt, src.copy(), dst, rest).reshape(alpha ** 3, rest)
    kron = np.kron(np.kron(bt, bt), bt)                                    # (216, 216)
    np.testing.assert_allclose(got, kron @ src.reshape(alpha ** 3, rest), rtol=1e-13, atol=1e-12)


def test_column_blocks_give_the_same_conv(monkeypatch):
    """The forward and both gradients with the transform GEMMs cut into 7-column blocks equal
    those of one call per pass (float64: the same dot products, up to BLAS's rounding)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 9, 7, 10))
    w = rng.standard_normal((5, 3, 3, 3, 3))
    dy = rng.standard_normal((2, 5, 9, 7, 10))
    results = []
    for columns in (7, 10 ** 9):
        monkeypatch.setattr(winograd, "TRANSFORM_COLUMNS", columns)
        y = conv3d(x, w, padding=1, algorithm=W)
        dx, dw, _ = conv3d_backward(dy, x, w, padding=1, algorithm=W)
        results.append((y, dx, dw))
    for blocked, whole in zip(*results):
        np.testing.assert_allclose(blocked, whole, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("c, hw", [(40, (16, 17)), (16, (16, 16)), (33, (3, 5))])
def test_channels_last_copy_is_the_transpose(c, hw, workers):
    """``to_channels_last`` in pieces of ``CHANNELS_LAST_GROUP`` channels (40: two whole pieces
    and a part; 16: one piece; a small plane: no pieces) into a padded view, bit for bit; a conv
    through it equals the reference."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, c, 3) + hw)
    buf = np.zeros((2, 5, hw[0] + 2, hw[1] + 2, c))
    winograd.to_channels_last(buf[:, 1:4, 1:-1, 1:-1], x, workers)
    assert np.array_equal(buf[:, 1:4, 1:-1, 1:-1], x.transpose(0, 2, 3, 4, 1))
    assert not buf[:, 0].any() and not buf[:, 4].any() and not buf[:, :, 0].any()
    w = rng.standard_normal((8, c, 3, 3, 3))
    assert rel_err(conv3d(x, w, padding=1, algorithm=W), conv3d(x, w, padding=1, algorithm="reference")) <= RTOL


# ------------------------------------------------------------------ PyTorch oracle

@st.composite
def wino_case(draw):
    return dict(n=draw(st.integers(1, 3)), c=draw(st.integers(1, 4)), f=draw(st.integers(1, 4)),
                k=draw(st.sampled_from([3, 2])),
                size=tuple(draw(st.integers(1, 13)) for _ in range(3)),
                p=tuple(draw(st.integers(0, 3)) for _ in range(3)),
                budget=draw(st.sampled_from([1, 20_000, 200_000, 64 * 2**20])),
                seed=draw(st.integers(0, 2**16)))


def _arrays(case, dtype=np.float64):
    rng = np.random.default_rng(case["seed"])
    x = rng.standard_normal((case["n"], case["c"]) + case["size"]).astype(dtype)
    w = rng.standard_normal((case["f"], case["c"]) + (case["k"],) * 3).astype(dtype)
    b = rng.standard_normal(case["f"]).astype(dtype)
    return rng, x, w, b


@needs_torch
@given(case=wino_case())
def test_conv3d_winograd_matches_torch(case):
    rng, x, w, b = _arrays(case)
    out = tuple(n + 2 * p - case["k"] + 1 for n, p in zip(case["size"], case["p"]))
    if min(out) < 1:
        with pytest.raises(ValueError, match="kernel of w is larger"):
            conv3d(x, w, b, 1, case["p"], algorithm=W)
        return
    dy = rng.standard_normal((case["n"], case["f"]) + out)
    xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    yt = torch.nn.functional.conv3d(xt, wt, bt, 1, case["p"])
    yt.backward(torch.tensor(dy))
    budget = case["budget"]
    y = conv3d(x, w, b, 1, case["p"], max_temp_bytes=budget, algorithm=W)
    dx, dw, db = conv3d_backward(dy, x, w, 1, case["p"], max_temp_bytes=budget, algorithm=W)
    assert rel_err(y, yt.detach().numpy()) <= RTOL
    assert rel_err(dx, xt.grad.numpy()) <= RTOL
    assert rel_err(dw, wt.grad.numpy()) <= RTOL
    assert rel_err(db, bt.grad.numpy()) <= RTOL
    # the building blocks take the same path
    assert rel_err(conv3d_input_grad(dy, w, x.shape, 1, case["p"], algorithm=W), dx) <= 1e-13
    assert rel_err(conv3d_weight_grad(dy, x, w.shape, 1, case["p"], algorithm=W), dw) <= 1e-13


@needs_torch
@given(case=wino_case())
def test_conv_transpose3d_winograd_matches_torch(case):
    """k=3 or 2, stride 1: the transposed conv is Winograd's input-adjoint; its backward
    is Winograd's forward (dx) and weight gradient (dw)."""
    rng = np.random.default_rng(case["seed"])
    n, c_in, c_out, k = case["n"], case["c"], case["f"], case["k"]
    p = tuple(min(pp, k - 1) for pp in case["p"])
    out = tuple(m - 2 * pp + k - 1 for m, pp in zip(case["size"], p))
    if min(out) < 1:
        return
    x = rng.standard_normal((n, c_in) + case["size"])
    w = rng.standard_normal((c_in, c_out) + (k,) * 3)
    b = rng.standard_normal(c_out)
    dy = rng.standard_normal((n, c_out) + out)
    xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    yt = torch.nn.functional.conv_transpose3d(xt, wt, bt, 1, p)
    yt.backward(torch.tensor(dy))
    y = conv_transpose3d(x, w, b, 1, p, max_temp_bytes=case["budget"], algorithm=W)
    dx, dw, db = conv_transpose3d_backward(dy, x, w, 1, p, max_temp_bytes=case["budget"], algorithm=W)
    for got, ref in ((y, yt), (dx, xt.grad), (dw, wt.grad), (db, bt.grad)):
        assert rel_err(got, ref.detach().numpy()) <= RTOL


@needs_torch
@given(n=st.integers(1, 2), c=st.integers(1, 4), f=st.integers(1, 4),
       size=st.tuples(*[st.integers(1, 11)] * 3),
       sides=st.one_of(st.just("same"), st.tuples(*[st.integers(0, 3)] * 6)),
       budget=st.sampled_from([1, 200_000, 64 * 2**20]), seed=st.integers(0, 2**16))
def test_kernel_2_asymmetric_padding_matches_torch(n, c, f, size, sides, budget, seed):
    """A 2x2x2 kernel with (lo, hi) padding per axis ('same': 0 before, 1 after) takes Winograd
    with ``lo`` as its padding and no padded copy (``kernels.conv.before``); the dx of the
    flipped-kernel route is taken only where neither side exceeds 1 (else the adjoint)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c) + size)
    w = rng.standard_normal((f, c, 2, 2, 2))
    pairs = ((0, 1),) * 3 if sides == "same" else tuple(zip(sides[0::2], sides[1::2]))
    out = tuple(m + lo + hi - 1 for m, (lo, hi) in zip(size, pairs))
    if min(out) < 1:
        return
    dy = rng.standard_normal((n, f) + out)
    xt, wt = (torch.tensor(a, requires_grad=True) for a in (x, w))
    torch_pad = tuple(q for lo, hi in reversed(pairs) for q in (lo, hi))    # (W lo, W hi, H ..., D ...)
    yt = torch.nn.functional.conv3d(torch.nn.functional.pad(xt, torch_pad), wt)
    yt.backward(torch.tensor(dy))
    y = conv3d(x, w, padding=sides, max_temp_bytes=budget, algorithm=W)
    dx, dw, _ = conv3d_backward(dy, x, w, padding=sides, max_temp_bytes=budget, algorithm=W)
    assert rel_err(y, yt.detach().numpy()) <= RTOL
    assert rel_err(dx, xt.grad.numpy()) <= RTOL
    assert rel_err(dw, wt.grad.numpy()) <= RTOL
    assert rel_err(conv3d_input_grad(dy, w, x.shape, padding=sides, algorithm=W), dx) <= 1e-13


# --------------------------------------------------------------- float32 error bound

def float32_errors(n, c, f, size, seed=0, k=3):
    """max|err| / max(sum |w x|) of y, dx, dw in float32 against float64 (module docstring);
    a ``k``-wide kernel with 'same' padding (k = 3: 1 on each side; k = 2: 0 before, 1 after)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c) + (size,) * 3)
    w = rng.standard_normal((f, c, k, k, k))
    dy = rng.standard_normal((n, f) + (size,) * 3)
    p = "same"
    ref = (conv3d(x, w, padding=p, algorithm="im2col"),) + \
        conv3d_backward(dy, x, w, padding=p, algorithm="im2col")[:2]
    scale = (conv3d(np.abs(x), np.abs(w), padding=p, algorithm="im2col"),) + \
        conv3d_backward(np.abs(dy), np.abs(x), np.abs(w), padding=p, algorithm="im2col")[:2]
    x32, w32, dy32 = (a.astype(np.float32) for a in (x, w, dy))
    out = {}
    for algorithm in ("im2col", W):
        got = (conv3d(x32, w32, padding=p, algorithm=algorithm),) + \
            conv3d_backward(dy32, x32, w32, padding=p, algorithm=algorithm)[:2]
        out[algorithm] = [float(np.abs(g - r).max() / s.max()) for g, r, s in zip(got, ref, scale)]
    return out


@pytest.mark.parametrize("k", [3, 2])
@pytest.mark.parametrize("n, c, f, size", [(2, 4, 8, 12), (1, 32, 16, 9), (1, 64, 32, 8)])
def test_float32_error_within_the_documented_bound(n, c, f, size, k):
    errs = float32_errors(n, c, f, size, k=k)
    assert max(errs[W]) <= winograd.FLOAT32_BOUND, errs
    # and it is a real float32 error, not zero (the bound is not vacuous)
    assert min(errs[W]) > 1e-9, errs


# ------------------------------------------------------------------ worker threads

def test_thread_counts_agree_and_repeat_bit_for_bit(monkeypatch):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 3, 9, 10, 11)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3, 3)).astype(np.float32)
    dy = rng.standard_normal((3, 4, 9, 10, 11)).astype(np.float32)
    budget = 30_000                                    # many chunks, both kinds
    results = {}
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("REFIMPL_THREADS", threads)
        runs = [(conv3d(x, w, padding=1, max_temp_bytes=budget, algorithm=W),)
                + conv3d_backward(dy, x, w, padding=1, max_temp_bytes=budget, algorithm=W)
                for _ in range(2)]
        for a, b in zip(*runs):
            assert np.array_equal(a, b)                # same thread count: same bits
        results[threads] = runs[0]
    for threads in ("2", "3"):
        np.testing.assert_array_equal(results[threads][0], results["1"][0])   # forward: exact
        np.testing.assert_array_equal(results[threads][1], results["1"][1])   # dx: exact
        # dw: the chunks' sums are added in another order (float32 rounding)
        assert rel_err(results[threads][2], results["1"][2]) <= 1e-5


@needs_torch
def test_few_tiles_are_shared_among_the_workers(monkeypatch):
    """A deep layer of few tiles (fewer than ``MIN_CHUNK_TILES``) is still cut into one chunk
    per worker, so the workers share its GEMMs: the chunks cover every tile once, and 1, 2 and
    3 workers give results equal to torch's in float64."""
    assert winograd.chunks(4, (2, 2, 2), 1, 2**30, workers=1) == [(0, 4, 0, 2)]
    for workers in (2, 3, 4, 8):
        cut = winograd.chunks(4, (2, 2, 2), 1, 2**30, workers=workers)
        assert len(cut) >= min(workers, 4 * 2)           # 8 rows of tiles (sample, depth)
        hit = np.zeros((4, 2), int)
        for n0, n1, d0, d1 in cut:
            hit[n0:n1, d0:d1] += 1
        assert (hit == 1).all()
    rng = np.random.default_rng(9)
    x = rng.standard_normal((4, 6, 8, 8, 8))
    w = rng.standard_normal((5, 6, 3, 3, 3))
    dy = rng.standard_normal((4, 5, 8, 8, 8))
    xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    y_ref = torch.nn.functional.conv3d(xt, wt, padding=1)
    y_ref.backward(torch.tensor(dy))
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("REFIMPL_THREADS", threads)
        assert rel_err(conv3d(x, w, padding=1, algorithm=W), y_ref.detach().numpy()) <= 1e-10
        dx, dw, _ = conv3d_backward(dy, x, w, padding=1, algorithm=W)
        assert rel_err(dx, xt.grad.numpy()) <= 1e-10 and rel_err(dw, wt.grad.numpy()) <= 1e-10


@pytest.mark.parametrize("n_batch, tiles, budget_tiles", [(4, (2, 2, 2), 64), (4, (2, 2, 2), 8),
                                                          (3, (5, 2, 2), 8), (2, (7, 3, 3), 9)])
def test_overlap_waves_keep_neighbours_apart_and_run_whole_samples_together(n_batch, tiles,
                                                                            budget_tiles):
    """dx's chunks run in waves: every chunk in exactly one wave, no two chunks of one wave
    next to each other along depth in the same sample (their 6-wide tiles would add into the
    same planes), and chunks of whole samples all in the first wave (both workers busy)."""
    cut = winograd.chunks(n_batch, tiles, 1, budget_tiles, workers=2)
    waves = winograd.overlap_waves(cut)
    assert sorted(ch for wave in waves for ch in wave) == sorted(cut)
    for wave in waves:
        for a in wave:
            for b in wave:
                if a is not b and a[:2] == b[:2]:
                    assert a[3] != b[2] and b[3] != a[2], (a, b)
    if all(ch[2] == 0 and ch[3] == tiles[0] for ch in cut):
        assert waves == [cut]


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", "+2", " 2x"])    # empty: unset
def test_bad_thread_count_is_refused(monkeypatch, value):
    monkeypatch.setenv("REFIMPL_THREADS", value)
    with pytest.raises(ValueError, match="REFIMPL_THREADS must be a positive integer"):
        _threads.thread_count()


@pytest.mark.parametrize("failing", [2, 3])
def test_worker_exception_propagates(failing):
    """A task's exception reaches the caller, whether it ran on the calling thread (worker 0:
    even tasks) or on a pool thread; the other worker has finished its tasks by then."""
    done = []

    def fail(worker, task):
        if task == failing:
            raise RuntimeError(f"chunk {task} failed")
        done.append(task)
    with pytest.raises(RuntimeError, match=f"chunk {failing} failed"):
        _threads.run(fail, list(range(6)), 2)
    other = [t for t in range(6) if t % 2 != failing % 2]
    assert set(other) <= set(done)


# --------------------------------------------------------------- choosing the algorithm

def test_auto_choice():
    w = (16, 8, 3, 3, 3)                                # F=16, C=8: C*F/(C+F) = 5.3
    s1, d1 = (1, 1, 1), (1, 1, 1)
    assert resolve_algorithm("auto", w, s1, d1, (16, 16, 16)) == W
    assert resolve_algorithm("auto", w, s1, d1, (3, 3, 3), n_batch=2) == W   # 216/27 = 8 per output
    assert resolve_algorithm("auto", w, s1, d1, (2, 2, 2)) == "im2col"   # 216/8 = 27: no gain
    assert resolve_algorithm("auto", (16, 4, 3, 3, 3), s1, d1, (16,) * 3) == "im2col"   # too narrow
    assert resolve_algorithm("auto", (8, 8, 3, 3, 3), s1, d1, (16,) * 3) == W           # 4.0
    assert resolve_algorithm("auto", (8, 6, 3, 3, 3), s1, d1, (16,) * 3) == "im2col"    # 3.4 < 4
    # a weight gradient also takes Winograd for narrow layers whose dy is not much wider than x
    # (8 wide: im2col's dW takes no width taps there)
    assert resolve_algorithm("auto", (8, 4, 3, 3, 3), s1, d1, (8,) * 3, weight_grad=True) == W
    assert resolve_algorithm("auto", (2, 2, 3, 3, 3), s1, d1, (8,) * 3, weight_grad=True) == W
    assert resolve_algorithm("auto", (8, 1, 3, 3, 3), s1, d1, (8,) * 3, weight_grad=True) == "im2col"
    assert resolve_algorithm("auto", (32, 4, 3, 3, 3), s1, d1, (8,) * 3, weight_grad=True) == "im2col"
    # an input gradient against im2col's flipped-kernel dx (F <= C) needs C*F/(C+F) >= 3 where
    # Winograd's dx is its forward with the flipped kernel, >= 6 where it is the adjoint
    assert resolve_algorithm("auto", (6, 6, 3, 3, 3), s1, d1, (8,) * 3) == "im2col"    # 3.0
    assert resolve_algorithm("auto", (6, 6, 3, 3, 3), s1, d1, (8,) * 3,
                             versus_flipped="forward") == W
    assert resolve_algorithm("auto", (4, 8, 3, 3, 3), s1, d1, (8,) * 3,
                             versus_flipped="forward") == "im2col"                      # 2.7
    assert resolve_algorithm("auto", (8, 16, 3, 3, 3), s1, d1, (8,) * 3,
                             versus_flipped="adjoint") == "im2col"                      # 5.3
    assert resolve_algorithm("auto", (16, 16, 3, 3, 3), s1, d1, (8,) * 3,
                             versus_flipped="adjoint") == W                             # 8.0
    # against an im2col pass that takes the width taps (a forward, the flipped-kernel dx, a dW
    # of at most 32 input channels; F <= 4C, 16 wide or more) every pass needs 10
    assert resolve_algorithm("auto", (8, 8, 3, 3, 3), s1, d1, (16,) * 3, forward=True) == "im2col"    # 4.0
    assert resolve_algorithm("auto", (16, 16, 3, 3, 3), s1, d1, (16,) * 3, forward=True) == "im2col"  # 8.0
    assert resolve_algorithm("auto", (16, 32, 3, 3, 3), s1, d1, (16,) * 3, forward=True) == W         # 10.7
    assert resolve_algorithm("auto", (8, 8, 3, 3, 3), s1, d1, (8,) * 3, forward=True) == W            # 8 wide
    assert resolve_algorithm("auto", (16, 16, 3, 3, 3), s1, d1, (16,) * 3,
                             versus_flipped="adjoint") == "im2col"                                   # 8.0
    assert resolve_algorithm("auto", (8, 32, 3, 3, 3), s1, d1, (16,) * 3, weight_grad=True) == "im2col"  # 6.4
    assert resolve_algorithm("auto", (8, 40, 3, 3, 3), s1, d1, (16,) * 3, weight_grad=True) == W       # C > 32
    assert resolve_algorithm("auto", (40, 8, 3, 3, 3), s1, d1, (16,) * 3, forward=True) == W          # F > 4C
    assert resolve_algorithm("auto", w, (2, 1, 1), d1, (16, 16, 16)) == "im2col"
    assert resolve_algorithm("auto", w, s1, (1, 2, 1), (16, 16, 16)) == "im2col"
    assert resolve_algorithm("auto", (16, 8, 3, 3, 1), s1, d1, (16, 16, 16)) == "im2col"
    assert resolve_algorithm("auto", w, s1, d1, (16, 16, 16), full_dy=False) == "im2col"
    assert resolve_algorithm("im2col", w, s1, d1, (16, 16, 16)) == "im2col"
    assert resolve_algorithm(W, (16, 4, 3, 3, 3), s1, d1, (16,) * 3) == W   # asked for: given
    # wide layers on one tile: the weight transform would outweigh the GEMMs' savings
    big = (512, 256, 3, 3, 3)                            # C*F/(C+F) = 171
    assert resolve_algorithm("auto", big, s1, d1, (4, 4, 4), n_batch=1) == "im2col"     # 1 tile
    assert resolve_algorithm("auto", big, s1, d1, (4, 4, 4), n_batch=2) == W            # 2 tiles
    assert resolve_algorithm("auto", big, s1, d1, (8, 8, 8), n_batch=1) == W            # 8 tiles


def test_auto_choice_kernel_2():
    """F(4, 2) against im2col's 8 products per output: C*F/(C+F) >= 12 and 16 tiles or more."""
    s1, d1 = (1, 1, 1), (1, 1, 1)
    assert resolve_algorithm("auto", (64, 32, 2, 2, 2), s1, d1, (32,) * 3) == W            # 21.3
    assert resolve_algorithm("auto", (24, 24, 2, 2, 2), s1, d1, (16,) * 3) == W            # 12.0
    assert resolve_algorithm("auto", (32, 16, 2, 2, 2), s1, d1, (32,) * 3) == "im2col"     # 10.7
    assert resolve_algorithm("auto", (32, 4, 2, 2, 2), s1, d1, (64,) * 3) == "im2col"      # CosmoFlow's first
    big = (512, 256, 2, 2, 2)
    assert resolve_algorithm("auto", big, s1, d1, (4,) * 3, n_batch=8) == "im2col"        # 8 tiles
    assert resolve_algorithm("auto", big, s1, d1, (4,) * 3, n_batch=16) == W              # 16 tiles
    assert resolve_algorithm("auto", big, s1, d1, (2,) * 3, n_batch=64) == "im2col"       # 125 / 8 per output
    assert resolve_algorithm("auto", (64, 32, 2, 2, 1), s1, d1, (32,) * 3) == "im2col"
    assert resolve_algorithm("auto", (64, 32, 2, 2, 2), (1, 2, 1), d1, (32,) * 3) == "im2col"
    assert resolve_algorithm(W, (4, 4, 2, 2, 2), s1, d1, (8,) * 3) == W                  # asked for: given


def test_algorithm_errors(monkeypatch):
    x, w = np.ones((1, 2, 8, 8, 8)), np.ones((3, 2, 3, 3, 3))
    with pytest.raises(ValueError, match="algorithm must be one of auto, im2col, winograd"):
        conv3d(x, w, algorithm="fft")
    with pytest.raises(ValueError, match="winograd.*stride 1 and dilation 1"):
        conv3d(x, w, stride=2, algorithm=W)
    with pytest.raises(ValueError, match="winograd.*stride 1 and dilation 1"):
        conv3d_backward(np.ones((1, 3, 4, 4, 4)), x, w, dilation=2, algorithm=W)
    with pytest.raises(ValueError, match="winograd"):
        conv_transpose3d(np.ones((1, 3, 8, 8, 8)), w, stride=1, dilation=2, algorithm=W)
    monkeypatch.setenv("REFIMPL_CONV_ALGORITHM", "Winograd")
    with pytest.raises(ValueError, match="REFIMPL_CONV_ALGORITHM must be one of"):
        conv3d(x, w)
    monkeypatch.setenv("REFIMPL_CONV_ALGORITHM", "im2col")
    assert resolve_algorithm(None, (8, 8, 3, 3, 3), (1, 1, 1), (1, 1, 1), (8, 8, 8)) == "im2col"


def test_environment_picks_the_algorithm_of_the_layers(monkeypatch):
    """The layers call with algorithm=None: the variable switches them, same numbers."""
    from refimpl.nn import Conv3d
    layer = Conv3d(8, 16, 3, padding=1, rng=np.random.default_rng(0), dtype=np.float64)
    x = np.random.default_rng(1).standard_normal((2, 8, 7, 6, 5))
    calls = []
    real = winograd.forward
    monkeypatch.setattr(winograd, "forward", lambda *a: calls.append(1) or real(*a))
    y_auto = layer.forward(x)
    monkeypatch.setenv("REFIMPL_CONV_ALGORITHM", "im2col")
    y_plain = layer.forward(x)
    assert len(calls) == 1
    np.testing.assert_allclose(y_auto, y_plain, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------- memory bound

def test_temporaries_bounded(monkeypatch):
    """Work buffers within the budget (at least one row of tiles), plus the channels-last
    copies of the input and output (x, y / dy, dx) and the transformed weights."""
    monkeypatch.setenv("REFIMPL_THREADS", "1")
    rng = np.random.default_rng(2)
    n, c, f, size = 2, 4, 6, 20
    x = rng.standard_normal((n, c, size, size, size))
    w = rng.standard_normal((f, c, 3, 3, 3))
    dy = rng.standard_normal((n, f, size, size, size))
    budget = 2 * 216 * 25 * 6 * 8 * 3                  # two rows of tiles (5 x 5 tiles each)
    tiles = (size + 3) // 4
    padded = n * (4 * tiles + 2) ** 3
    copies = padded * (c + f) * 8 + n * (4 * tiles) ** 3 * f * 8     # x, y or dy; dx (as x)
    bound = budget + copies + padded * c * 8 + 2 * 216 * c * f * 8 + 64 * 1024
    unchunked = 3 * 216 * n * tiles ** 3 * max(c, f) * 8
    assert bound < unchunked                           # the test can fail

    for fn in (lambda: conv3d(x, w, padding=1, max_temp_bytes=budget, algorithm=W),
               lambda: conv3d_backward(dy, x, w, padding=1, max_temp_bytes=budget, algorithm=W)):
        assert _traced(fn)[1] <= bound


def test_auto_picks_im2col_on_a_device():
    """Measured on an H100, Winograd's many small passes run 10-20x slower than the device
    schedule of im2col: "auto" picks im2col for device arrays, Winograd for the same conv on
    the host; an explicit "winograd" is still honoured."""
    w_shape = (32, 32, 3, 3, 3)
    assert resolve_algorithm("auto", w_shape, (1,) * 3, (1,) * 3, (16,) * 3, n_batch=2) == "winograd"
    assert resolve_algorithm("auto", w_shape, (1,) * 3, (1,) * 3, (16,) * 3, n_batch=2,
                             on_device=True) == "im2col"
    assert resolve_algorithm("winograd", w_shape, (1,) * 3, (1,) * 3, (16,) * 3,
                             on_device=True) == "winograd"


def test_forward_and_backward_choose_apart(monkeypatch):
    """6 -> 6 (C*F/(C+F) = 3.0, F <= C): the forward runs im2col (below 4), the backward
    Winograd for dx (against im2col's flipped kernel: from 3) and dw together; 4 -> 2 (1.3):
    the forward and dx im2col (dx by the flipped kernel), dw Winograd, each on its own (and so
    does the weight gradient alone).  Same numbers as the plain sum in float64."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 6, 9, 8, 7))
    w = rng.standard_normal((6, 6, 3, 3, 3))
    dy = rng.standard_normal((2, 6, 9, 8, 7))
    calls = []
    real_forward, real_backward = winograd.forward, winograd.backward

    def forward(*a, **k):
        calls.append("forward")
        return real_forward(*a, **k)

    def backward(dy, x, w, padding, budget, need_dx=True, need_dw=True):
        calls.append(("backward", need_dx, need_dw))        # which gradients Winograd computes
        return real_backward(dy, x, w, padding, budget, need_dx, need_dw)
    monkeypatch.setattr(winograd, "forward", forward)
    monkeypatch.setattr(winograd, "backward", backward)
    y = conv3d(x, w, padding=1)
    assert calls == []
    dx, dw, _ = conv3d_backward(dy, x, w, padding=1)
    # (dx by the flipped kernel's Winograd forward, then dw alone: F <= C)
    assert calls == [("backward", True, True), "forward", ("backward", False, True)]
    assert rel_err(y, conv3d(x, w, padding=1, algorithm="im2col")) <= 1e-12
    dx_ref, dw_ref, _ = conv3d_backward(dy, x, w, padding=1, algorithm="im2col")
    assert rel_err(dx, dx_ref) <= 1e-12 and rel_err(dw, dw_ref) <= 1e-12
    del calls[:]
    narrow_w = rng.standard_normal((2, 4, 3, 3, 3))
    y = conv3d(x[:, :4], narrow_w, padding=1)
    dx, dw, _ = conv3d_backward(dy[:, :2], x[:, :4], narrow_w, padding=1)
    assert calls == [("backward", False, True)]
    dw_alone = conv3d_weight_grad(dy[:, :2], x[:, :4], narrow_w.shape, padding=1)
    assert calls[1:] == [("backward", False, True)]
    dx_ref, dw_ref, _ = conv3d_backward(dy[:, :2], x[:, :4], narrow_w, padding=1, algorithm="im2col")
    assert rel_err(dx, dx_ref) <= 1e-12 and rel_err(dw, dw_ref) <= 1e-12
    assert rel_err(dw_alone, dw_ref) <= 1e-12


@needs_torch
@pytest.mark.parametrize("n, c, f, size", [(1, 8, 12, 4), (2, 16, 20, 8), (1, 16, 8, 7), (3, 10, 10, 4)])
def test_deep_layers_by_channel_blocks_match_torch(monkeypatch, n, c, f, size):
    """Few tiles, many channels (tiles <= min(C, F)): forward, dx and dw by channel blocks,
    equal to torch's in float64 for 1, 2 and 3 workers and for blocks of one channel up."""
    tiles = winograd_tiles((size,) * 3)
    assert winograd.by_channel_blocks(n, tiles, c, f)
    rng = np.random.default_rng(c * f + size)
    x = rng.standard_normal((n, c, size, size, size))
    w = rng.standard_normal((f, c, 3, 3, 3))
    b = rng.standard_normal(f)
    dy = rng.standard_normal((n, f, size, size, size))
    xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    y_ref = torch.nn.functional.conv3d(xt, wt, torch.tensor(b), padding=1)
    y_ref.backward(torch.tensor(dy))
    for threads, block_bytes in (("1", 4 * 2**20), ("2", 1), ("3", 216 * 8 * 3)):
        monkeypatch.setenv("REFIMPL_THREADS", threads)
        monkeypatch.setattr(winograd, "CHANNEL_BLOCK_BYTES", block_bytes)
        assert rel_err(conv3d(x, w, b, padding=1, algorithm=W), y_ref.detach().numpy()) <= 1e-10
        dx, dw, _ = conv3d_backward(dy, x, w, padding=1, algorithm=W)
        assert rel_err(dx, xt.grad.numpy()) <= 1e-10 and rel_err(dw, wt.grad.numpy()) <= 1e-10
        dx_only, none = winograd.backward(dy, x, w, (1, 1, 1), 2**26, need_dw=False)
        none2, dw_only = winograd.backward(dy, x, w, (1, 1, 1), 2**26, need_dx=False)
        assert none is None and none2 is None
        # dx alone may take the flipped kernel's forward (dx_by_flipped_kernel): same numbers
        assert rel_err(dx_only, xt.grad.numpy()) <= 1e-10 and np.array_equal(dw_only, dw)


@needs_torch
@pytest.mark.parametrize("n, c, f, size, p, need_dw, flipped", [
    (2, 6, 4, (9, 10, 11), (1, 1, 1), True, True),      # F < C, both gradients
    (1, 3, 6, (8, 7, 9), (0, 1, 2), False, True),       # dx alone, F = 2C, paddings 0..2
    (1, 16, 8, (7, 7, 7), (1, 1, 1), True, True),       # few tiles: the forward by filter blocks
    (1, 4, 6, (8, 8, 8), (1, 1, 1), True, False),       # F > C with dw: dM shared (adjoint)
    (1, 3, 7, (8, 8, 8), (1, 1, 1), False, False),      # dx alone, F > 2C: the adjoint
    (1, 6, 4, (8, 8, 8), (3, 1, 1), True, False),       # padding 3: the adjoint
    (1, 6, 4, (10, 9, 9), (0, 1, 1), True, False)])     # 3 tiles of x's depth, 2 of dy's: the adjoint
def test_input_grad_by_flipped_kernel_matches_torch(monkeypatch, n, c, f, size, p, need_dw, flipped):
    """``dx`` as Winograd's forward conv of ``dy`` with the flipped kernel where
    ``dx_by_flipped_kernel`` says so (and only there), equal to torch's in float64 for 1 and 2
    workers, with ``dw`` (when wanted) as before."""
    rng = np.random.default_rng(c * f + sum(p))
    x = rng.standard_normal((n, c) + size)
    w = rng.standard_normal((f, c, 3, 3, 3))
    xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    y_ref = torch.nn.functional.conv3d(xt, wt, padding=p)
    dy = rng.standard_normal(tuple(y_ref.shape))
    y_ref.backward(torch.tensor(dy))
    assert winograd.dx_by_flipped_kernel(c, f, p, need_dw, size, y_ref.shape[2:]) == flipped
    forwards = []
    real_forward = winograd.forward

    def forward(*a, **k):
        forwards.append(a[1].shape)
        return real_forward(*a, **k)
    monkeypatch.setattr(winograd, "forward", forward)
    for threads in ("1", "2"):
        monkeypatch.setenv("REFIMPL_THREADS", threads)
        del forwards[:]
        dx, dw = winograd.backward(dy, x, w, p, 2**26, need_dw=need_dw)
        assert forwards == ([(c, f, 3, 3, 3)] if flipped else [])
        assert rel_err(dx, xt.grad.numpy()) <= 1e-10
        assert (dw is None) if not need_dw else rel_err(dw, wt.grad.numpy()) <= 1e-10
