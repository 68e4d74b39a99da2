"""Layer options real models use, partitioned, equal the unpartitioned reference (mpiexec).

Padding forms (int, 3-tuple, per-side 6-tuple, 'valid', 'same' with odd and even kernels) for
conv3d and max / avg pooling; pooling's ceil_mode (the last window hanging past the domain
lives on the last rank), avg pooling's count_include_pad and divisor_override; the convs' groups.  Each case is
``check_layer`` (forward, dx, dw, db gathered and compared with refimpl.functional on the whole
tensor, float64 <= 1e-10) on a grid of the world size, with uneven and empty blocks, and
halos wider than a neighbour's block.  Hypothesis draws with the derandomized "mpi" profile:
every rank draws the same example.
"""
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from refimpl.check import LayerCheck, check_layer
from refimpl.functional.args import padding_sides, window_out_size

from test_spatial_layers import grids_for

POOLS = ("max_pool3d", "avg_pool3d")
EXAMPLES = 12           # per layer kind and world size: the suite runs at 1, 2, 3, 4, 6 and 8 ranks


def run(comm, all_ranks_agree, **case):
    report = comm.bcast(check_layer(LayerCheck(**case), comm), root=0)
    all_ranks_agree(report["ok"], f"{case}: {report['max_rel_err']}")


@st.composite
def padding_forms(draw, kernel, stride, dilation, pool):
    """One padding in a drawn form; pooling keeps every side <= k // 2."""
    form = draw(st.sampled_from(["int", "triple", "sides", "valid", "same"]))
    top = [k // 2 if pool else k for k in kernel]
    if form == "int":
        return draw(st.integers(0, min(top)))
    if form == "triple":
        return tuple(draw(st.integers(0, t)) for t in top)
    if form == "sides":
        return tuple(draw(st.integers(0, t)) for t in top for _ in range(2))
    if form == "same":
        assume(stride == (1, 1, 1))
        if pool:
            assume(all(max(lohi) <= k // 2 for lohi, k in zip(padding_sides("same", kernel, dilation), kernel)))
    return form


@st.composite
def option_cases(draw, comm_size, layer):
    grid = draw(st.sampled_from(grids_for(comm_size)))
    pool = layer in POOLS
    kernel = tuple(draw(st.integers(1, 5)) for _ in range(3))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(3)) if draw(st.booleans()) else (1, 1, 1)
    dilation = (1, 1, 1) if layer == "avg_pool3d" else tuple(draw(st.integers(1, 2)) for _ in range(3))
    padding = draw(padding_forms(kernel, stride, dilation, pool))
    ceil_mode = draw(st.booleans()) if pool else False
    extent = tuple(draw(st.sampled_from([1, 2, 3, 5, 7, 11])) for _ in range(3))
    pads = padding_sides(padding, kernel, dilation, stride)
    out = [window_out_size(e, k, s, p, d, ceil_mode) for e, k, s, p, d in zip(extent, kernel, stride, pads, dilation)]
    assume(min(out) >= 1 and out[0] * out[1] * out[2] <= 3000)
    case = dict(layer=layer, input=(draw(st.integers(grid[0], grid[0] + 1)), draw(st.integers(1, 3))) + extent,
                grid=grid, kernel=kernel, stride=stride, padding=padding, dilation=dilation)
    if layer == "conv3d":
        groups = draw(st.sampled_from([1, 1, 2, 3]))
        case["input"] = case["input"][:1] + (groups * draw(st.integers(1, 2)),) + extent
        case["out_channels"], case["groups"] = groups * draw(st.integers(1, 2)), groups
    if pool:
        case["ceil_mode"] = ceil_mode
    if layer == "avg_pool3d":
        case["count_include_pad"] = draw(st.booleans())
        case["divisor_override"] = draw(st.sampled_from([None, None, 1, 5]))
    return case


def test_conv3d_padding_forms(comm, all_ranks_agree):
    @settings(max_examples=EXAMPLES)
    @given(option_cases(comm.size, "conv3d"))
    def check(case):
        run(comm, all_ranks_agree, **case)
    check()


@st.composite
def grouped_transpose_cases(draw, comm_size):
    grid = draw(st.sampled_from(grids_for(comm_size)))
    groups = draw(st.integers(1, 3))
    kernel = tuple(draw(st.integers(1, 4)) for _ in range(3))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(3))
    padding = tuple(draw(st.integers(0, k - 1)) for k in kernel)
    extent = tuple(draw(st.sampled_from([1, 2, 3, 5, 7])) for _ in range(3))
    assume(all((n - 1) * s - 2 * p + k >= 1 for n, s, p, k in zip(extent, stride, padding, kernel)))
    return dict(layer="conv_transpose3d", input=(grid[0], groups * draw(st.integers(1, 2))) + extent, grid=grid,
                kernel=kernel, stride=stride, padding=padding, out_channels=groups * draw(st.integers(1, 2)),
                groups=groups)


def test_grouped_conv_transpose(comm, all_ranks_agree):
    @settings(max_examples=EXAMPLES)
    @given(grouped_transpose_cases(comm.size))
    def check(case):
        run(comm, all_ranks_agree, **case)
    check()


def test_max_pool_options(comm, all_ranks_agree):
    @settings(max_examples=EXAMPLES)
    @given(option_cases(comm.size, "max_pool3d"))
    def check(case):
        run(comm, all_ranks_agree, **case)
    check()


def test_avg_pool_options(comm, all_ranks_agree):
    @settings(max_examples=EXAMPLES)
    @given(option_cases(comm.size, "avg_pool3d"))
    def check(case):
        run(comm, all_ranks_agree, **case)
    check()


def test_fixed_cases(comm, all_ranks_agree):
    """Cases drawing might miss, on the split that makes them hard at this world size."""
    p = comm.size
    split_d = (1, p, 1, 1)
    cases = [
        # 'same' with an even kernel (0 before, 1 after) on 1-voxel blocks, the MLPerf conv
        dict(layer="conv3d", input=(1, 2, p, 3, 4), grid=split_d, kernel=2, padding="same", out_channels=3),
        # ... by Winograd F(4, 2) (its zeros before the input as the offset, those after from its
        # tile buffer), on blocks of 1-2 voxels and on a block split across two axes
        dict(layer="conv3d", input=(1, 3, 2 * p - 1, 5, 6), grid=split_d, kernel=2, padding="same",
             out_channels=4, algorithm="winograd"),
        dict(layer="conv3d", input=(2, 2, p + 3, 4, 5), grid=(1, 1, p, 1) if p < 4 else (1, 2, p // 2, 1),
             kernel=2, padding=(1, 0, 0, 1, 1, 1), out_channels=3, algorithm="winograd"),
        # an asymmetric pad whose halo reaches several owners away (kernel 7, dilation 2)
        dict(layer="conv3d", input=(1, 2, p + 1, 3, 3), grid=split_d, kernel=(7, 1, 1),
             padding=(9, 3, 0, 0, 0, 0), dilation=(2, 1, 1), out_channels=2),
        dict(layer="conv3d", input=(1, 1, 2 * p + 1, 3, 3), grid=split_d, kernel=(4, 3, 2),
             padding=(0, 3, 1, 1, 1, 0), stride=(2, 1, 1), out_channels=2),
        # W padding p before a W extent of p, kernel 1 in W: the first ranks' outputs read padding
        # alone (an empty needed range), so SpatialConv3d pads their block instead of passing it on
        # (grouped: conv3d_input_grad takes no empty input shape)
        dict(layer="conv3d", input=(1, 4, 3, 3, p), grid=(1, 1, 1, p), kernel=(3, 2, 1),
             padding=(1, 1, 0, 1, p, 0), out_channels=2, groups=2),
        # ceil_mode: the last window hangs past the domain, on the last rank
        dict(layer="max_pool3d", input=(1, 2, 2 * p + 1, 5, 4), grid=split_d, kernel=2, stride=2, ceil_mode=True),
        dict(layer="avg_pool3d", input=(1, 2, 3 * p + 2, 5, 4), grid=split_d, kernel=3, stride=3, padding=1,
             ceil_mode=True),
        dict(layer="avg_pool3d", input=(1, 2, 3 * p + 2, 5, 4), grid=split_d, kernel=3, stride=2, padding=(1, 0, 1),
             ceil_mode=True, count_include_pad=False),
        dict(layer="avg_pool3d", input=(1, 1, 2 * p + 3, 4, 4), grid=split_d, kernel=(4, 2, 2), stride=(3, 1, 1),
             padding=(0, 2, 1, 0, 0, 1), ceil_mode=True, divisor_override=3),
        dict(layer="max_pool3d", input=(1, 1, p + 2, 4, 4), grid=split_d, kernel=(3, 2, 3), stride=1,
             padding="same", dilation=(1, 2, 1)),
        dict(layer="max_pool3d", input=(1, 1, p + 2, 4, 4), grid=split_d, kernel=2, padding="valid", stride=1),
    ]
    for case in cases:
        run(comm, all_ranks_agree, **case)


def test_bad_options_fail_on_every_rank(comm, all_ranks_agree):
    """Every new argument refuses a bad value with a ValueError naming it, on every rank,
    before any message."""
    base = dict(input=(comm.size, 1, 5, 5, 5), grid=(comm.size, 1, 1, 1), kernel=2)
    bad = [
        (dict(layer="conv3d", padding="same", stride=2), "padding"),
        (dict(layer="conv3d", padding=(1, 2)), "padding"),
        (dict(layer="conv3d", padding="full"), "padding"),
        (dict(layer="conv3d", padding=(0, 1, 0, 1, 0, -1)), "padding"),
        (dict(layer="conv_transpose3d", padding="same"), "padding"),
        (dict(layer="conv_transpose3d", padding=(0, 1, 0, 1, 0, 1)), "padding"),
        (dict(layer="conv3d", ceil_mode=True), "ceil-mode"),
        (dict(layer="max_pool3d", ceil_mode="yes"), "ceil-mode"),
        (dict(layer="max_pool3d", padding=(0, 2, 0, 0, 0, 0)), "padding"),
        (dict(layer="max_pool3d", count_include_pad=False), "count-include-pad"),
        (dict(layer="avg_pool3d", divisor_override=0), "divisor-override"),
        (dict(layer="avg_pool3d", count_include_pad=1), "count-include-pad"),
        (dict(layer="conv3d", groups=0), "groups"),
        (dict(layer="conv3d", groups=2, out_channels=3), "groups"),
        (dict(layer="max_pool3d", groups=2), "groups"),
    ]
    for case, name in bad:
        try:
            check_layer(LayerCheck(**base, **case), comm)
            raised = ""
        except ValueError as err:
            raised = str(err)
        all_ranks_agree(name in raised, f"{case}: {raised!r} does not name {name}")
