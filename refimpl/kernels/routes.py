"""Which fast route computes each op, and the thresholds that pick it: the one table.

``refimpl/functional/`` holds the math (``algorithm="reference"``); everything in
``refimpl/kernels/`` computes the same sums faster and is tested against it
(tests/test_reference.py, tests/test_reference_ops.py, tests/test_conv.py,
tests/test_winograd.py).  Every choice *between* routes is made here, from the
thresholds below; a route's own tuning (tile and block sizes) stays with the route.
The measurement behind each threshold is in docs/benchmarks.md, "Kernel thresholds".

| op                        | route                           | module             | taken when (decided by)                                      |
|---------------------------|---------------------------------|--------------------|--------------------------------------------------------------|
| conv3d, conv_transpose3d  | the reference                   | functional.conv3d  | ``algorithm="reference"`` / ``REFIMPL_CONV_ALGORITHM``        |
|                           | im2col, host schedule           | ``_im2col``        | NumPy arrays (``_im2col.device_schedule``, ``REFIMPL_CONV_SCHEDULE``) |
|                           | im2col, device schedule         | ``_im2col_device`` | CuPy arrays (the same switch)                                 |
|                           | ... its columns by one kernel   | ``_im2col_device`` | CuPy arrays (``takes``: ``DEVICE_SOURCE``, ``_cuda``)          |
|                           | depth taps sharing columns      | ``_im2col``        | stride 1 along depth, kd > 1 (``_im2col.depth_tap_tiles``)    |
|                           | ... one GEMM per output plane   | ``_im2col``        | a forward or dW alone, depth dilation 1, ``plane_gemms_pay``  |
|                           | width taps as column offsets    | ``_width_taps``    | a forward or dW alone, stride 1, depth dilation 1, ``width_taps_pay`` |
|                           | 1x1x1 kernels: GEMMs on views   | ``_pointwise_conv``| kernel 1, stride 1, no padding, on the host (``applies``)     |
|                           | strided convs by input phases   | ``_phase_grid``    | stride > 1 on the host (its plans' ``build``)                 |
|                           | dx as the flipped-kernel conv   | ``_im2col``        | ``flipped_kernel_pays``                                       |
|                           | Winograd F(4x4x4, 3x3x3)        | ``winograd``       | ``resolve_algorithm``: ``applicable`` and ``worthwhile``      |
|                           | Winograd F(4x4x4, 2x2x2)        | ``winograd``       | the same, with kernel 2's bars (``KERNEL_2_*``)               |
| max/avg pooling           | blocked passes on threads       | ``pooling``        | NumPy arrays of more than one block, unless the reference is asked for (``functional._route``) |
|                           | max: first-max index, scatter   | ``pooling``        | smaller NumPy arrays whose 2x2x2 stride-2 windows tile them (``tiles_in_pairs``) |
|                           | one CUDA kernel per pass        | ``pooling``        | CuPy arrays (``DEVICE_SOURCE``, launched by ``_cuda``)        |
| batch norm                | blocked passes on threads       | ``batch_norm``     | NumPy arrays of more than one block (the same rule)          |
|                           | one CUDA kernel per pass        | ``batch_norm``     | CuPy arrays (``DEVICE_SOURCE``)                               |
| group / instance norm     | blocked passes on threads       | ``group_norm``     | NumPy arrays of more than one batch norm block (the same rule) |
|                           | one CUDA kernel per pass        | ``group_norm``     | CuPy arrays (``DEVICE_SOURCE``; the sums by ``bn_sums``)      |
| activations               | blockwise elementwise passes    | ``pointwise``      | NumPy arrays; CuPy arrays: one fused ElementwiseKernel       |
| losses                    | blocked softmax / picks         | ``losses``         | NumPy logits of few classes (``losses.applies``)              |
|                           | one CUDA kernel per pass        | ``losses``         | CuPy logits (``DEVICE_SOURCE``)                               |
| dropout                   | one CUDA kernel per pass        | ``dropout``        | CuPy arrays; NumPy arrays take the reference                  |

This module imports no other kernel: the routes import it.
"""
from __future__ import annotations

from .. import settings

ENV_ALGORITHM = "REFIMPL_CONV_ALGORITHM"
ALGORITHMS = ("auto", "im2col", "winograd")      # the routes picked here; "reference" is functional's own

# ---------------------------------------------------------------- Winograd F(4x4x4, 3x3x3) against im2col

#: Outputs per Winograd tile and axis (F(4, 3): 4 outputs from a 6-wide input tile).
WINOGRAD_TILE = 4
#: "auto" takes Winograd only where C*F/(C+F) reaches this: its transforms cost memory
#: traffic in proportion to C + F, its GEMMs save flops in proportion to C*F.
MIN_CHANNEL_PRODUCT_RATIO = 4.0
#: ... and against im2col's flipped-kernel input gradient (``flipped_kernel_pays``), from these
#: ratios on, by the route Winograd's own dx takes: its adjoint, or its forward with the flipped kernel.
MIN_CHANNEL_PRODUCT_RATIO_VS_FLIPPED = {"adjoint": 6.0, "forward": 3.0}
#: ... and a weight gradient also wherever F <= this x C: Winograd transforms the x tiles (C)
#: and the dy tiles (F), im2col builds columns of 27 C rows.
MAX_FILTER_RATIO_WEIGHT_GRAD = 2.0
#: ... and only for at least this many tiles: on one tile the weight transform outweighs the GEMMs.
MIN_TILES = 2
#: Against an im2col pass that takes the width taps as column offsets (``width_taps_pay``: a
#: forward, the flipped-kernel input gradient, which is a forward, or a weight gradient), every
#: pass needs C*F/(C+F) at least this: those passes copy kw x less than the depth-tap schedule.
MIN_CHANNEL_PRODUCT_RATIO_VS_WIDTH_TAPS = 10.0


# ---------------------------------------------------------------- Winograd F(4x4x4, 2x2x2) against im2col
#
# MLPerf's CosmoFlow convolves with 2x2x2 kernels ('same' padding): F(4, 2) computes 4 outputs
# per axis from 5 inputs, 125 products per 4x4x4 tile where im2col spends 8 x 64 = 512 (4.1x
# fewer, against F(4, 3)'s 8x), while its transforms move (5/4)^3 values per output and channel
# (F(4, 3): (6/4)^3).  One bar for every pass (measured: docs/benchmarks.md, "Kernel thresholds"):

#: C*F/(C+F) at least this ...
KERNEL_2_MIN_CHANNEL_PRODUCT_RATIO = 12.0
#: ... and at least this many tiles in the batch: the transformed weights, 125 C F (15.6x the
#: weight), cost what the GEMMs save on fewer tiles.
KERNEL_2_MIN_TILES = 16

#: The kernel extents Winograd computes (``winograd.SCHEMES``' keys): F(4, 3) and F(4, 2).
WINOGRAD_KERNELS = (3, 2)


def winograd_applicable(kernel, stride, dilation):
    """True when Winograd computes this conv: a 3x3x3 (F(4,3)) or 2x2x2 (F(4,2)) kernel,
    stride 1, dilation 1."""
    kernel = tuple(kernel)
    return (kernel in tuple((k,) * 3 for k in WINOGRAD_KERNELS) and tuple(stride) == (1, 1, 1)
            and tuple(dilation) == (1, 1, 1))


def winograd_tiles(out_spatial):
    """Winograd tiles per axis: ceil(o / 4)."""
    return tuple(-(-o // WINOGRAD_TILE) for o in out_spatial)


def winograd_products_per_output(out_spatial, r=3):
    """Products per output and channel pair: (4 + r - 1)^3 per 4x4x4 tile (216 for r = 3),
    over the outputs the tiles really hold (a 5-wide output needs two tiles per axis, most of
    one wasted)."""
    td, th, tw = winograd_tiles(out_spatial)
    return (WINOGRAD_TILE + r - 1) ** 3 * td * th * tw / (out_spatial[0] * out_spatial[1] * out_spatial[2])


def wide_enough(c, f, versus_flipped=None, weight_grad=False, versus_width_taps=False, r=3):
    """The channel part of ``worthwhile``: C*F/(C+F) at least the threshold of the pass, or
    for a weight gradient F <= C x ``MAX_FILTER_RATIO_WEIGHT_GRAD``; against im2col's width
    taps (``versus_width_taps``) ``MIN_CHANNEL_PRODUCT_RATIO_VS_WIDTH_TAPS`` for every pass.
    Kernel 2 (``r=2``): ``KERNEL_2_MIN_CHANNEL_PRODUCT_RATIO`` for every pass."""
    if r == 2:
        return c * f / (c + f) >= KERNEL_2_MIN_CHANNEL_PRODUCT_RATIO
    if versus_width_taps:
        return c * f / (c + f) >= MIN_CHANNEL_PRODUCT_RATIO_VS_WIDTH_TAPS
    least = (MIN_CHANNEL_PRODUCT_RATIO if versus_flipped is None
             else MIN_CHANNEL_PRODUCT_RATIO_VS_FLIPPED[versus_flipped])
    return c * f / (c + f) >= least or (weight_grad and f <= MAX_FILTER_RATIO_WEIGHT_GRAD * c)


def worthwhile(out_spatial, c, f, n_batch=1, versus_flipped=None, weight_grad=False, versus_width_taps=False,
               r=3):
    """"auto" takes Winograd when it needs at most half of im2col's r^3 products per output
    (27 for r = 3, 8 for r = 2), the channels are wide enough (``wide_enough``), and
    there are ``MIN_TILES`` tiles or more (deep layers of few tiles run by channel blocks,
    ``winograd.by_channel_blocks``).  Kernel 2 (``r=2``): ``KERNEL_2_*``'s bars."""
    td, th, tw = winograd_tiles(out_spatial)
    least_tiles = KERNEL_2_MIN_TILES if r == 2 else MIN_TILES
    return (winograd_products_per_output(out_spatial, r) <= r ** 3 / 2
            and n_batch * td * th * tw >= least_tiles
            and wide_enough(c, f, versus_flipped, weight_grad, versus_width_taps, r))


def im2col_takes_width_taps(weight_shape, dilation, out_spatial, forward=False, versus_flipped=None,
                            weight_grad=False):
    """Whether the im2col pass a choice is weighed against runs the width taps (``_width_taps``):
    a ``forward``, the flipped-kernel input gradient (``versus_flipped``: the forward of the
    F -> C conv) or a ``weight_grad``, where ``width_taps_pay`` says so."""
    f, c, kernel = weight_shape[0], weight_shape[1], tuple(weight_shape[2:])
    return ((forward and width_taps_pay(c, f, kernel, dilation, out_spatial))
            or (versus_flipped is not None and width_taps_pay(f, c, kernel, dilation, out_spatial))
            or (weight_grad and width_taps_pay(c, f, kernel, dilation, out_spatial, weight_grad=True)))


def resolve_algorithm(algorithm, weight_shape, stride, dilation, out_spatial, full_dy=True,
                      n_batch=1, on_device=False, versus_flipped=None, weight_grad=False, forward=False):
    """``"im2col"`` or ``"winograd"`` for this conv (weight ``(F, C, kd, kh, kw)``):
    ``algorithm`` (None: the ``REFIMPL_CONV_ALGORITHM`` variable, default "auto")
    validated against the shape.

    ``full_dy=False`` when a gradient covers only the first outputs per axis (the
    building blocks of transposed conv with output_padding): im2col only.
    ``versus_flipped`` ("adjoint" or "forward": Winograd's route for it) when the choice is for
    an input gradient that im2col would compute as the conv with the flipped kernel
    (``flipped_kernel_pays``): "auto" then asks Winograd to beat that; ``weight_grad=True``
    when it is for a weight gradient (its own threshold); ``forward=True`` when it is for a
    forward alone.  Where the im2col pass so named takes the width taps
    (``im2col_takes_width_taps``) the bar is ``MIN_CHANNEL_PRODUCT_RATIO_VS_WIDTH_TAPS``.  On a device "auto" is im2col:
    Winograd's many small passes lose 10-20x there (docs/gpu.md).
    """
    source = "algorithm"
    if algorithm is None:
        algorithm, source = settings.env_setting(ENV_ALGORITHM), ENV_ALGORITHM
    if algorithm == "reference":
        raise ValueError("the reference conv is refimpl.functional.conv3d's own; the kernels compute "
                         f"{', '.join(ALGORITHMS)}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    kernel = tuple(weight_shape[2:])
    fits = winograd_applicable(kernel, stride, dilation) and full_dy
    if algorithm == "winograd" and not fits:
        raise ValueError(f"{source}='winograd' computes 3x3x3 and 2x2x2 convs with stride 1 and dilation 1 "
                         f"(and a gradient covering every output); got kernel {tuple(kernel)}, "
                         f"stride {tuple(stride)}, dilation {tuple(dilation)}: use 'im2col' or 'auto'")
    if algorithm == "auto":
        if on_device:
            return "im2col"
        width = fits and im2col_takes_width_taps(weight_shape, dilation, out_spatial, forward, versus_flipped,
                                                 weight_grad)
        wide = worthwhile(out_spatial, weight_shape[1], weight_shape[0], n_batch, versus_flipped,
                          weight_grad, width, kernel[0])
        return "winograd" if fits and wide else "im2col"
    return algorithm


# ---------------------------------------------------------------- depth taps: one GEMM per plane

#: The depth-tap forward runs one GEMM per output plane (plane-major hw-columns) from this many
#: positions per plane on: below it the per-plane GEMMs are too short for their call overhead.
MIN_PLANE_GEMM_POSITIONS = 4096


def plane_gemms_pay(plane_positions):
    """Whether the depth-tap forward's output planes of ``plane_positions`` (Ho*Wo) positions
    are each one GEMM of kd*C*kh*kw rows (``_im2col``) rather than kd GEMMs per tile and
    kd - 1 passes adding their products."""
    return plane_positions >= MIN_PLANE_GEMM_POSITIONS


# ---------------------------------------------------------------- width taps as column offsets

#: The forward of a stride-1 conv computes its width taps as shifted GEMM outputs
#: (``_width_taps``) where F is at most this many times C: its columns copy C*kh per output
#: instead of the depth-tap schedule's C*kh*kw, while its GEMM output (and the shifted adds over
#: it) is kw*F per output; with F >= 8 C the adds cost what the copies saved.
MAX_WIDTH_TAPS_FILTER_RATIO = 4
#: ... and where the padded width adds at most this fraction of GEMM columns (Wp / Wo - 1):
#: an 8-wide output of a 3-wide kernel computes 25 % more columns than it keeps, and lost.
MAX_WIDTH_TAPS_EXTRA_COLUMNS = 1 / 8


#: ... and a weight gradient only for at most this many input channels: with more, its GEMM
#: (every column of the padded width computed) outweighs the copies saved.
MAX_WIDTH_TAPS_WEIGHT_GRAD_CHANNELS = 32


def width_taps_pay(c, f, k, dilation, out, weight_grad=False):
    """Whether the forward (or with ``weight_grad`` the weight gradient) of a stride-1 conv
    (``c`` -> ``f`` channels, kernel ``k``, output ``out``) takes ``_width_taps`` rather than
    the depth-tap schedule: at least 3 width taps (with 2 the copies saved are half),
    ``f <= MAX_WIDTH_TAPS_FILTER_RATIO * c``, a padded width of at most
    ``1 + MAX_WIDTH_TAPS_EXTRA_COLUMNS`` times the output's (``(k[2] - 1) * dilation[2]`` more
    columns), and for a weight gradient ``c <= MAX_WIDTH_TAPS_WEIGHT_GRAD_CHANNELS``."""
    return (k[2] >= 3 and f <= MAX_WIDTH_TAPS_FILTER_RATIO * c
            and (k[2] - 1) * dilation[2] <= MAX_WIDTH_TAPS_EXTRA_COLUMNS * out[2]
            and (not weight_grad or c <= MAX_WIDTH_TAPS_WEIGHT_GRAD_CHANNELS))


# ---------------------------------------------------------------- im2col's input gradient

def flipped_kernel_pays(dy, w, input_shape, stride, budget, on_device=False):
    """Whether ``dx`` is computed as the conv with the flipped kernel (``_im2col``'s
    ``input_grad_by_flipped_kernel``) rather than by col2im: stride 1, and on a device always
    (one gather and one GEMM per tile instead of kd*kh*kw strided adds); on the host where it
    measured faster, no more output than input channels (its columns have F*k rows, col2im's
    C*k), and where the zero-padded copy of ``dy`` it needs fits ``budget``."""
    if tuple(stride) != (1, 1, 1):
        return False
    if on_device:
        return True
    if w.shape[0] > w.shape[1]:
        return False
    padded = dy.shape[0] * dy.shape[1] * dy.dtype.itemsize
    for n, kk in zip(input_shape[2:], w.shape[2:]):
        padded *= n + kk - 1
    return padded <= budget


__all__ = ["ALGORITHMS", "ENV_ALGORITHM", "MIN_CHANNEL_PRODUCT_RATIO", "MIN_CHANNEL_PRODUCT_RATIO_VS_FLIPPED",
           "MAX_FILTER_RATIO_WEIGHT_GRAD", "MIN_TILES", "MIN_CHANNEL_PRODUCT_RATIO_VS_WIDTH_TAPS",
           "im2col_takes_width_taps", "winograd_applicable", "winograd_tiles",
           "winograd_products_per_output", "wide_enough", "worthwhile", "resolve_algorithm",
           "flipped_kernel_pays", "MIN_PLANE_GEMM_POSITIONS", "plane_gemms_pay",
           "MAX_WIDTH_TAPS_FILTER_RATIO", "MAX_WIDTH_TAPS_EXTRA_COLUMNS",
           "MAX_WIDTH_TAPS_WEIGHT_GRAD_CHANNELS", "width_taps_pay"]
