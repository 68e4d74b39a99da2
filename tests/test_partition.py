"""Index math of spatial partitioning, checked by brute force over window taps.

Covers DESIGN.md's "index math everyone gets wrong": balanced and empty blocks,
output extents, needed input ranges with clipped padding (incl. windows wholly in
the padding), transposed-conv input ranges, needs past the direct neighbour, and
the halo plan's routes (a serial emulation of the axis-by-axis exchange).
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refimpl.parallel.partition import (block_range, block_slices, bytes_sent, conv_halo_plan,
                                        grid_coords, grid_rank, halo_plan, needed_input_range,
                                        transposed_conv_halo_plan, transposed_needed_input_range,
                                        transposed_output_extent, window_output_extent)


@st.composite
def window(draw, max_n=24):
    """(n, k, s, p, d) of a valid 1-D window op: kernels 1-7 (even ones too), padding 0..k."""
    k = draw(st.integers(1, 7))
    s = draw(st.integers(1, 3))
    d = draw(st.integers(1, 3))
    p = draw(st.integers(0, k))
    n = draw(st.integers(max(1, d * (k - 1) + 1 - 2 * p), max(max_n, d * (k - 1) + 1)))
    return n, k, s, p, d


@given(n=st.integers(0, 60), p=st.integers(1, 16))
def test_blocks_cover_disjointly_and_balance(n, p):
    ranges = [block_range(n, p, i) for i in range(p)]
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, disjoint, ordered
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert [s == 0 for s in sizes] == [i >= n for i in range(p)]  # empty exactly when p > n


def test_block_range_rejects_bad_arguments():
    for args, name in (((5, 0, 0), "p"), ((5, 2, 2), "i"), ((-1, 2, 0), "n")):
        with pytest.raises(ValueError, match=name):
            block_range(*args)


@given(rank=st.integers(0, 10_000), dims=st.lists(st.integers(1, 5), min_size=1, max_size=4))
def test_grid_rank_is_row_major(rank, dims):
    size = int(np.prod(dims))
    rank %= size
    coords = grid_coords(rank, dims)
    assert grid_rank(coords, dims) == rank
    assert coords == np.unravel_index(rank, dims)  # numpy's C order is row-major


@given(window())
def test_output_extents_by_brute_force(w):
    n, k, s, p, d = w
    fits = [o for o in range(n + 2 * p) if s * o + d * (k - 1) <= n + 2 * p - 1]
    assert window_output_extent(n, k, s, p, d) == len(fits)


@given(window(), st.data())
def test_needed_range_is_exactly_the_touched_inputs_and_padding(w, data):
    """The clipped interval between the first and last tap; gaps only when s > k or d > 1."""
    n, k, s, p, d = w
    n_out = window_output_extent(n, k, s, p, d)
    o0 = data.draw(st.integers(0, n_out))
    o1 = data.draw(st.integers(o0, n_out))
    (i0, i1), (low, high) = needed_input_range(o0, o1, k, s, p, d, n)
    touched = {s * o - p + j * d for o in range(o0, o1) for j in range(k)}
    inside = {i for i in touched if 0 <= i < n}
    if not touched:
        assert i0 == i1 and (low, high) == (0, 0)
        return
    first, last = min(touched), max(touched)  # the window's first and last taps
    assert (i0, i1) == (min(max(first, 0), n), max(min(last + 1, n), min(max(first, 0), n)))
    assert inside <= set(range(i0, i1))  # every touched input is fetched ...
    if d == 1 and s <= k:  # ... and, when the taps leave no gaps, nothing else
        assert set(range(i0, i1)) == inside
    # the clipped parts are exactly the window positions outside the domain: padding
    assert low + (i1 - i0) + high == last - first + 1
    if first < n and last >= 0:
        assert (low, high) == (len(range(first, 0)), len(range(n, last + 1)))


@given(window(), st.data())
def test_local_window_op_on_clipped_range_with_explicit_padding(w, data):
    """The contract: op(pad(x[i0:i1], (low, high)), padding=0) == outputs [o0, o1) of op(x, p)."""
    n, k, s, p, d = w
    n_out = window_output_extent(n, k, s, p, d)
    o0 = data.draw(st.integers(0, n_out))
    o1 = data.draw(st.integers(o0, n_out))
    rng = np.random.default_rng(n * 1000 + k * 100 + s * 10 + p + d)
    x, taps = rng.standard_normal(n), rng.standard_normal(k)

    def correlate(xp_, count):  # 1-D strided dilated correlation, no padding
        return np.array([sum(taps[j] * xp_[s * o + j * d] for j in range(k)) for o in range(count)])

    full = correlate(np.pad(x, p), n_out)
    (i0, i1), (low, high) = needed_input_range(o0, o1, k, s, p, d, n)
    local = correlate(np.pad(x[i0:i1], (low, high)), o1 - o0)
    np.testing.assert_allclose(local, full[o0:o1], rtol=0, atol=1e-12)


@given(window(max_n=16), st.data())
def test_transposed_needed_range_contains_every_contributing_input(w, data):
    n, k, s, p, d = w
    op = data.draw(st.integers(0, max(s, d) - 1))
    full = (n - 1) * s + d * (k - 1) + 1  # unpadded transposed output: positions i*s + j*d
    if full - 2 * p + op < 1:
        with pytest.raises(ValueError, match="padding"):
            transposed_output_extent(n, k, s, p, d, op)
        return
    n_out = transposed_output_extent(n, k, s, p, d, op)
    assert n_out == full - 2 * p + op
    o0 = data.draw(st.integers(0, n_out))
    o1 = data.draw(st.integers(o0, n_out))
    i0, i1 = transposed_needed_input_range(o0, o1, k, s, p, d, n, op)
    contributors = {i for i in range(n) for j in range(k) if o0 <= i * s - p + j * d < o1}
    assert 0 <= i0 <= i1 <= n
    assert contributors <= set(range(i0, i1))
    if s == 1 and d == 1 and contributors:  # dense taps: the bounding interval is tight
        assert (i0, i1) == (min(contributors), max(contributors) + 1)
    if o0 == o1:
        assert i0 == i1


def test_extent_arguments_are_checked():
    with pytest.raises(ValueError, match="stride"):
        window_output_extent(8, 3, 0, 1, 1)
    with pytest.raises(ValueError, match="kernel"):
        window_output_extent(2, 5, 1, 0, 1)
    with pytest.raises(ValueError, match="output_padding"):
        transposed_output_extent(4, 3, 2, 0, 1, 2)
    with pytest.raises(ValueError, match="output range"):
        needed_input_range(0, 9, 3, 1, 1, 1, 8)


# ---------------------------------------------------------------- halo plans

@st.composite
def conv_plans(draw):
    ws = [draw(window(max_n=12)) for _ in range(3)]
    dims = tuple(draw(st.integers(1, 5)) for _ in range(3))
    shape = tuple(w[0] for w in ws)
    k, s, p, d = (tuple(w[i] for w in ws) for i in range(1, 5))
    return conv_halo_plan(shape, dims, k, s, p, d)


@settings(max_examples=40)
@given(conv_plans())
def test_axis_transfers_cover_each_need_exactly_once(plan):
    for ax in plan.axes:
        for c in range(ax.parts):
            count = np.zeros(ax.n, int)
            n0, n1 = ax.needed[c]
            o0, o1 = ax.owned[c]
            count[max(n0, o0):min(n1, o1)] += 1  # own part: local copy
            for src, a, b in ax.recvs(c):
                assert ax.owned[src][0] <= a < b <= ax.owned[src][1]
                assert (c, a, b) in ax.sends(src)  # what src sends to c is what c expects
                count[a:b] += 1
            assert (count[n0:n1] == 1).all() and count.sum() == n1 - n0
            if o0 == o1:  # an empty block sends nothing
                assert ax.sends(c) == []


@settings(max_examples=40)
@given(conv_plans())
def test_serial_emulation_of_the_exchange_fills_every_needed_input(plan):
    """Run the axis-by-axis exchange with numpy on all ranks at once: ghosts hold the right data."""
    dims, shape = plan.grid_dims, plan.global_shape
    truth = np.arange(int(np.prod(shape)), dtype=float).reshape(shape) + 1
    ranks = [grid_coords(r, dims) for r in range(int(np.prod(dims)))]
    have = {c: np.zeros(shape) for c in ranks}  # what each rank holds, in global coordinates
    for c in ranks:
        have[c][block_slices(shape, dims, c)] = truth[block_slices(shape, dims, c)]
    for axis in range(3):
        for c in ranks:
            sends = plan.sends(c, axis)
            for m in sends:
                expected = [r for r in plan.recvs(m.peer, axis) if r.peer == c]
                assert [r.region for r in expected] == [m.region]  # both sides agree
        snapshot = {c: have[c].copy() for c in ranks}
        for c in ranks:
            for m in plan.sends(c, axis):
                index = tuple(slice(a, b) for a, b in m.region)
                assert (snapshot[c][index] != 0).all()  # the sender holds what it sends
                have[m.peer][index] = snapshot[c][index]
    for c in ranks:
        index = tuple(slice(a, b) for a, b in plan.needed(c))
        np.testing.assert_array_equal(have[c][index], truth[index])
    predicted = bytes_sent(plan, itemsize=8, channels=2, batch=3)
    returned = bytes_sent(plan, itemsize=8, channels=2, batch=3, adjoint=True)
    for r, c in enumerate(ranks):
        volume = sum(m.volume for a in range(3) for m in plan.sends(c, a))
        assert predicted[r] == volume * 8 * 2 * 3
    assert sum(predicted) == sum(returned)  # the adjoint sends every piece back


def test_need_past_the_neighbour_is_served_by_every_owner():
    # 6 inputs over 6 ranks, k=7 with 'same' padding: every rank needs (almost) all inputs
    plan = conv_halo_plan((6, 1, 1), (6, 1, 1), (7, 1, 1), 1, (3, 0, 0), 1)
    ax = plan.axes[0]
    assert ax.needed[0] == (0, 4) and ax.padding[0] == (3, 0)
    assert {src for src, _, _ in ax.recvs(0)} == {1, 2, 3}
    assert any(abs(src - dst) > 1 for src, dst, _, _ in ax.transfers)


def test_empty_blocks_neither_send_nor_receive():
    plan = conv_halo_plan((3, 2, 1), (5, 4, 1), 3, 1, 1, 1)
    for c in range(3, 5):
        assert plan.axes[0].owned[c][0] == plan.axes[0].owned[c][1]
        assert plan.axes[0].sends(c) == [] and plan.axes[0].recvs(c) == []
    assert bytes_sent(plan, 4, 1, 1)[grid_rank((4, 3, 0), (5, 4, 1))] == 0


def test_stride_larger_than_kernel_skips_inputs():
    # k=1, s=3: rank needs only every third input; its needed range may exclude part of its block
    plan = conv_halo_plan((9, 1, 1), (3, 1, 1), 1, (3, 1, 1), 0, 1)
    assert [plan.axes[0].needed[c] for c in range(3)] == [(0, 1), (3, 4), (6, 7)]
    assert plan.axes[0].transfers == ()


def test_transposed_plan_and_generic_plan_agree():
    shape, dims = (5, 4, 3), (2, 3, 1)
    tplan = transposed_conv_halo_plan(shape, dims, 4, 2, 1, 1, 1)
    generic = halo_plan(shape, dims, lambda a, c: tplan.axes[a].needed[c])
    assert [ax.transfers for ax in generic.axes] == [ax.transfers for ax in tplan.axes]
    assert tplan.axes[0].outputs[-1][1] == transposed_output_extent(5, 4, 2, 1, 1, 1)


def test_plan_arguments_are_checked():
    with pytest.raises(ValueError, match="grid_dims"):
        conv_halo_plan((4, 4, 4), (1, 0, 1), 3)
    with pytest.raises(ValueError, match="needed range"):
        halo_plan((4, 4, 4), (2, 1, 1), lambda a, c: (0, 5))
    with pytest.raises(ValueError, match="padding"):
        halo_plan((4, 4, 4), (2, 1, 1), lambda a, c: (0, 4)).padding((0, 0, 0))
