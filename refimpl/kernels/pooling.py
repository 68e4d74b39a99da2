"""The fast route of max and average pooling: the reference math, block by block, on worker threads.

``refimpl/functional/pooling.py`` holds the math (separable 1-D stages along W, H,
D; their adjoints in reverse order).  Samples and channels are independent, so
here the same stages run on blocks of the input -- one sample, as many channels
as make about ``BLOCK_ELEMENTS`` inputs (one channel when a channel's volume is
larger) -- shared among the worker threads of ``_threads``: a block's few passes
then stay in the cache, and the blocks run on every core.  Each block computes
exactly what the reference computes on it, so the results equal the reference's
bit for bit (tests/test_reference_ops.py).  The reference's per-pass functions are passed
in by ``refimpl/functional/pooling.py`` (the kernels never import the reference).

On a GPU (CuPy arrays) each pass is one CUDA kernel instead (``DEVICE_SOURCE``, launched by
``_cuda``), one thread per output (forward) or per input (backward), in the reference's order
of operations (the derivation is at ``DEVICE_SOURCE``): the same values bit for bit, zeros of
either sign compared equal.  Max pooling's forward records, per output, the tap of its first
maximum (-1 for a window holding a NaN), and the backward gathers, per input, the gradients
of the windows whose first maximum it is; no atomics, so the order of the additions is fixed.

Small NumPy arrays of a 2 x 2 x 2 max pool whose windows tile the input (stride 2, no
padding, even extents: CosmoFlow's deepest pools) take a third route, ``pair_tap_forward`` /
``pair_tap_backward``: the forward records the flat index of each window's first maximum,
the backward scatters dy to those inputs.  On so small a block every stage's pass runs over rows
of a few elements, where NumPy's per-row cost dominates the reference's six products of the
backward; one scatter by index costs about what writing dx does (docs/benchmarks.md, "Kernel
choices").  The values are the reference's, zeros of either sign
compared equal (as on the GPU); a non-finite dy reaches its window's maximum alone (PyTorch's
rule), where the reference's products spread a NaN over the window.

The one dispatch rule (``applies``): NumPy arrays of more than ``BLOCK_ELEMENTS``
elements and CuPy arrays of float32 or float64 take this route, outside ``refimpl.functional.reference_only()``;
so do smaller NumPy arrays of a max pool whose 2 x 2 x 2 windows tile them (``tiles_in_pairs``);
other small NumPy arrays (one block) and the strict stand-in take the reference.

Max pooling's masks from this route are a list with one entry per block, in ``blocks(x)``
order: on the host the reference's stage masks (a small array's tiling pair window: one block,
``pair_tap_forward``'s first-maximum indices), on a GPU one block, the
(N, C, Do, Ho, Wo) int32 array of first-maximum taps.
"""
from __future__ import annotations

import numpy

from ..backend import array_module
from . import _cuda, _threads

#: Inputs per block (1 MiB of float32; one channel when a channel's volume is larger).
BLOCK_ELEMENTS = 1 << 18


def applies(x, window=None) -> bool:
    """Whether pooling ``x`` runs here: a NumPy array of more than one block, a float32 /
    float64 CuPy array (``_cuda.takes``), or a smaller NumPy array of a max pool whose
    ``window`` = (k, s, p, d) tiles it in 2 x 2 x 2 blocks (``tiles_in_pairs``)."""
    if _cuda.on_device(x):
        return _cuda.takes(x)
    if array_module(x) is not numpy:                    # the strict stand-in: the reference
        return False
    return x.size > BLOCK_ELEMENTS or (window is not None and x.size > 0 and tiles_in_pairs(x.shape, *window))


def tiles_in_pairs(shape, k, s, p, d) -> bool:
    """A 2 x 2 x 2 window, stride 2, dilation 1, no padding, on even extents: every input lies
    in exactly one window (``pair_tap_forward`` applies)."""
    return (_pair_window(k, p) and tuple(s) == (2, 2, 2) and tuple(d) == (1, 1, 1)
            and all(n % 2 == 0 for n in shape[2:]))


def _small(x) -> bool:
    """One block (not more than BLOCK_ELEMENTS): the tap route's arrays."""
    return x.size <= BLOCK_ELEMENTS


def blocks(x):
    """(sample, channel-range) index pairs covering ``x`` (N, C, ...): see the module doc."""
    n, c = x.shape[:2]
    volume = max(1, x[0, 0].size) if x.size else 1
    per = max(1, BLOCK_ELEMENTS // volume)
    return [(slice(i, i + 1), slice(c0, min(c0 + per, c))) for i in range(n) for c0 in range(0, c, per)]


def _per_block(fn, x, out_shape, dtype):
    """``out[b] = fn(b, x[b])[0]`` for every block ``b`` of ``blocks(x)``, over the worker
    threads; returns ``out`` (``out_shape``) and the list of the second results of ``fn``."""
    out = numpy.empty(out_shape, dtype=dtype)
    index = blocks(x)
    extra = [None] * len(index)

    def one(_, i):
        result, extra[i] = fn(i, index[i])
        out[index[i]] = result
    _threads.run(one, list(range(len(index))), _threads.thread_count(numpy))
    return out, extra


#: The separable stages' axes in the reference's order (W, H, D): ``pair_max_forward`` keeps it.
STAGE_AXES = (4, 3, 2)


def _pair_stage(x, axis, s, d, out):
    """One separable stage of a 2-tap window along ``axis``: ``(y, [first0, first1])`` with
    y = max(x0, x1), first0 = x0 >= x1 and first1 = x1 > x0, in three passes.

    Why it equals the reference's stage (``functional.pooling._max_along``: copy x0, max in
    x1, then first_t = (x_t == y) and no earlier tap's, eight passes): for numbers,
    x0 == max(x0, x1) exactly when x0 >= x1 (so a tie goes to x0, the first), and x1 is the
    first maximum exactly when x1 > x0; a NaN in either tap makes y NaN and both comparisons
    false, as ``== NaN`` is in the reference; -0 and +0 compare equal in both."""
    lead = (slice(None),) * axis
    x0 = x[lead + (slice(0, s * (out - 1) + 1, s),)]
    x1 = x[lead + (slice(d, d + s * (out - 1) + 1, s),)]
    return numpy.maximum(x0, x1), [numpy.greater_equal(x0, x1), numpy.greater(x1, x0)]


def pair_max_forward(x, s, d, out, with_masks):
    """The reference's ``max_pool_forward`` for a 2 x 2 x 2 window without padding: the same
    ``(y, stages)`` (``_pair_stage`` per axis in ``STAGE_AXES`` order)."""
    y, stages = x, []
    for axis in STAGE_AXES:
        a = axis - 2
        n_in = y.shape[axis]
        y, first = _pair_stage(y, axis, s[a], d[a], out[a])
        stages.append((first if with_masks else None, n_in))
    return y, stages


def pair_max_backward(dy, stages, s, d, dx):
    """The reference's ``max_pool_backward`` for a 2 x 2 x 2 window without padding whose windows
    do not overlap (``s > d`` on every axis), written into ``dx`` (the block's view of the
    whole gradient); ``stages`` as ``pair_max_forward`` (or the reference) returns them.

    The same products ``g * first_t`` land in the same places as the reference's
    (``functional.pooling._spread_along``), so the values are equal bit for bit; two of the
    reference's passes are left out: the zero fill of a stage whose two taps write every input
    (``s == 2``, ``d == 1`` and an even extent: CosmoFlow's and the U-Net's pools), and the
    copy of a block's own gradient into the whole one (the last stage writes there)."""
    g = dy
    order = list(reversed(list(zip(STAGE_AXES, stages))))
    for i, (axis, (first, n_in)) in enumerate(order):
        a, n_out = axis - 2, g.shape[axis]
        shape = g.shape[:axis] + (n_in,) + g.shape[axis + 1:]
        target = dx if i == len(order) - 1 else numpy.empty(shape, dtype=g.dtype)
        if not (s[a] == 2 and d[a] == 1 and n_in == 2 * n_out):    # some input no tap writes
            target[...] = 0
        lead = (slice(None),) * axis
        for t in range(2):
            tap = lead + (slice(t * d[a], t * d[a] + s[a] * (n_out - 1) + 1, s[a]),)
            numpy.multiply(g, first[t], out=target[tap])
        g = target
    return dx


def pair_tap_forward(x):
    """``(y, (first, dropped))`` of a max pool whose 2 x 2 x 2 windows tile ``x``
    (``tiles_in_pairs``): y as the reference's (the same ``numpy.maximum`` stages along W, H,
    D); ``first``, per output, the flat index into ``x`` of its window's first maximum in
    (d, h, w) order (intp); ``dropped``, the outputs whose window holds a NaN (bool), or None
    when there is none.

    Why it is the reference's choice: the reference keeps, along W, the first tap equal to the
    maximum (x1 only where x1 > x0: a tie goes to the first; -0 and +0 tie), then the first
    row of those maxima along H, then the first plane along D; so its element is the first of
    the window's maxima in (d, h, w) order.  The D stage's choice picks which plane's H choice
    counts, and the plane and row chosen pick which W choice counts: read from the W stage's
    array by index (its flat index ``i``; the input's is then ``2 i + tw``, as W = 2 Wo).  A
    NaN makes the stage maximum NaN and every later comparison false, so the reference's
    masks drop the whole window: ``dropped``."""
    n, c, d, h, w = x.shape
    wo = w // 2
    x0, x1 = x[..., 0::2], x[..., 1::2]
    y = numpy.maximum(x0, x1)                           # (N, C, D, H, Wo)
    tw = numpy.greater(x1, x0)
    y0, y1 = y[:, :, :, 0::2], y[:, :, :, 1::2]
    th = numpy.greater(y1, y0)                          # (N, C, D, Ho, Wo)
    y = numpy.maximum(y0, y1)
    y0, y1 = y[:, :, 0::2], y[:, :, 1::2]
    td = numpy.greater(y1, y0)                          # (N, C, Do, Ho, Wo)
    y = numpy.maximum(y0, y1)
    th = numpy.where(td, th[:, :, 1::2], th[:, :, 0::2])
    # flat index into tw (N, C, D, H, Wo) of the chosen plane's chosen row, at column ow
    row = (numpy.arange(n * c, dtype=numpy.intp).reshape(n, c, 1, 1, 1) * (d * h * wo)
           + numpy.arange(0, d, 2, dtype=numpy.intp)[:, None, None] * (h * wo)
           + (numpy.arange(0, h, 2, dtype=numpy.intp)[:, None] * wo + numpy.arange(wo, dtype=numpy.intp)))
    row += td * (h * wo)
    row += th * wo
    first = row * 2
    first += tw.reshape(-1)[row]
    nan = numpy.isnan(y)
    return y, (first, nan if nan.any() else None)


def pair_tap_backward(dy, first, x_shape):
    """dx of ``pair_tap_forward``: dy scattered to each window's first maximum (``first``
    as it returns it), zeros elsewhere and over a dropped window."""
    index, dropped = first
    dx = numpy.zeros(x_shape, dtype=dy.dtype)
    g = dy if dropped is None else numpy.where(dropped, numpy.zeros((), dy.dtype), dy)
    dx.reshape(-1)[index.reshape(-1)] = g.reshape(-1)
    return dx


def _pair_window(k, p):
    """Whether the window is 2 x 2 x 2 without padding (``pair_max_forward`` applies)."""
    return tuple(k) == (2, 2, 2) and all(lo == 0 and hi == 0 for lo, hi in p)


def _block_forward(forward, k, s, p, d, out):
    """``fn(x_block, with_masks) -> (y, stages)``: ``pair_max_forward`` for a 2 x 2 x 2 window
    without padding, else the reference's ``forward``."""
    if _pair_window(k, p):
        return lambda xb, with_masks: pair_max_forward(xb, s, d, out, with_masks)
    return lambda xb, with_masks: forward(xb, k, s, p, d, out, with_masks)


def max_pool3d(forward, x, k, s, p, d, out, with_masks):
    """``(y, per-block masks or None)``: ``forward`` (the reference's ``max_pool_forward``,
    passed in: kernels never import the reference) per block; a 2 x 2 x 2 window without
    padding (CosmoFlow's and the U-Net's pools) by ``pair_max_forward``, the same values in
    fewer passes."""
    if _cuda.on_device(x):
        return device_max_pool3d(x, k, s, p, d, out, with_masks)
    if _small(x):                                       # applies(): windows that tile x in pairs
        y, first = pair_tap_forward(x)
        return y, ([first] if with_masks else None)
    block_forward = _block_forward(forward, k, s, p, d, out)

    def block(_, idx):
        return block_forward(x[idx], with_masks)
    y, masks = _per_block(block, x, tuple(x.shape[:2]) + out, x.dtype)
    return y, (masks if with_masks else None)


def max_pool3d_backward(forward, backward, dy, x, k, s, p, d, out, masks):
    """dx: the reference's ``max_pool_backward`` (``backward``) per block, with this route's
    ``masks`` or, without them, the masks ``forward`` finds again."""
    if _cuda.on_device(x):
        return device_max_pool3d_backward(dy, x, k, s, p, d, out, masks)
    index = [None] if _small(x) else blocks(x)           # the tap route's one block, or the blocks
    if masks is not None and len(masks) != len(index):
        raise ValueError(f"masks has {len(masks)} blocks, x has {len(index)}: pass the masks of "
                         "max_pool3d(x, ..., return_masks=True) for this very x")
    if _small(x):
        first = pair_tap_forward(x)[1] if masks is None else masks[0]
        return pair_tap_backward(dy, first, x.shape)

    block_forward = _block_forward(forward, k, s, p, d, out)

    def stages_of(i, xb):
        return block_forward(xb, True)[1] if masks is None else masks[i]
    if _pair_window(k, p) and all(si > di for si, di in zip(s, d)):       # windows apart
        dx = numpy.empty(x.shape, dtype=dy.dtype)

        def into(_, i):
            idx = index[i]
            pair_max_backward(dy[idx], stages_of(i, x[idx]), s, d, dx[idx])
        _threads.run(into, list(range(len(index))), _threads.thread_count(numpy))
        return dx

    def block(i, idx):
        xb = x[idx]
        return backward(dy[idx], xb.shape, k, s, p, d, stages_of(i, xb)), None
    return _per_block(block, x, x.shape, dy.dtype)[0]


def avg_pool3d(forward, x, k, s, p, out, divisor):
    """y: the reference's ``avg_pool_forward`` (``forward``) per block (``divisor``: a number or
    (1, 1, Do, Ho, Wo), the same for every block)."""
    if _cuda.on_device(x):
        return device_avg_pool3d(x, k, s, p, out, divisor)
    return _per_block(lambda _, idx: (forward(x[idx], k, s, p, out, divisor), None),
                      x, tuple(x.shape[:2]) + out, x.dtype)[0]


def avg_pool3d_backward(backward, dy, x, k, s, p, divisor):
    """dx: the reference's ``avg_pool_backward`` (``backward``) per block."""
    if _cuda.on_device(x):
        return device_avg_pool3d_backward(dy, x, k, s, p, divisor)
    return _per_block(lambda _, idx: (backward(dy[idx], x[idx].shape, k, s, p, divisor), None),
                      x, x.shape, dy.dtype)[0]



# ---------------------------------------------------------------- the CUDA kernels (CuPy arrays)
#
# Shapes: x (N*C, D, H, W) and y (N*C, Do, Ho, Wo), C-contiguous; output o's window starts at
# o*s - lo per axis (lo: the padding before the input), tap t at t*dl past that; cells outside
# the input are padding (-inf for max, 0 for avg).  Why each result equals the reference's:
#
# - max forward: the reference's separable maximum is order-free except for NaN and ties; a
#   scan of the window in (d, h, w) order keeping the first strict maximum keeps the element
#   the reference keeps (its stages keep the first maximum along W, then H, then D: the
#   lexicographically first), and a NaN makes y NaN as numpy.maximum does.  ``arg``: that
#   element's tap, (td*kh + th)*kw + tw (a padding cell's tap when it wins: its gradient is
#   dropped, as the reference's unpadding drops it), or -1 where y is NaN (the reference's
#   masks, ``x == y``, are then all false).
# - max backward: the reference spreads dy through the stages D, H, W in turn, each adding the
#   taps' contributions in tap order, so an input's gradient is the nested sum
#   sum_tw( sum_th( sum_td( dy[od, oh, ow] where the window's first maximum is this tap ))),
#   every partial sum starting from zero; the gather below adds the same terms in that nesting
#   (where windows do not overlap, ``disjoint``, there is one term at most, found by division).
# - avg forward: the separable sum is sum_td( sum_th( sum_tw x )), each stage starting from its
#   first tap's value, then divided by the divisor (a number, or one per output).
# - avg backward: g = dy / divisor, spread D, H, W: sum_tw( sum_th( sum_td g )) from zeros.
#   Both backward passes are one gather (``pool_backward``); ``pool_term`` is their difference.
DEVICE_SOURCE = r"""
#define POOL_ARGS long long nc, long long D, long long H, long long W, \
    long long Do, long long Ho, long long Wo, long long kd, long long kh, long long kw, \
    long long sd, long long sh, long long sw, long long pd, long long ph, long long pw, \
    long long dd, long long dh, long long dw

extern "C" __global__ void max_pool_forward(const T* x, T* y, int* arg, POOL_ARGS, T neg_inf) {
    long long total = nc * Do * Ho * Wo;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)blockDim.x * gridDim.x) {
        long long ow = i % Wo, oh = (i / Wo) % Ho, od = (i / (Wo * Ho)) % Do, b = i / (Wo * Ho * Do);
        const T* xb = x + b * D * H * W;
        T m = neg_inf;
        int best = 0, t = 0, nan = 0;
        for (long long td = 0; td < kd; ++td) {
            long long z = od * sd - pd + td * dd;
            for (long long th = 0; th < kh; ++th) {
                long long r = oh * sh - ph + th * dh;
                for (long long tw = 0; tw < kw; ++tw, ++t) {
                    long long c = ow * sw - pw + tw * dw;
                    T v = (z >= 0 && z < D && r >= 0 && r < H && c >= 0 && c < W)
                          ? xb[(z * H + r) * W + c] : neg_inf;
                    if (v != v) { nan = 1; m = v; }
                    else if (t == 0 || v > m) { m = v; best = t; }
                }
            }
        }
        y[i] = m;
        if (arg) arg[i] = nan ? -1 : best;
    }
}

// Windows that do not overlap along an axis (s > (k-1)*dl: CosmoFlow's and the U-Net's k2 s2):
// input position p is read by at most one tap t of one output o; its (o, t), or false.
__device__ __forceinline__ bool only_tap(long long p, long long pad, long long s, long long dl, long long k,
                                         long long n_out, long long* o, long long* t) {
    long long q = p + pad;
    *o = q / s;
    long long r = q - *o * s;
    if (r % dl != 0) return false;
    *t = r / dl;
    return *t < k && *o < n_out;
}

extern "C" __global__ void avg_pool_forward(const T* x, const T* divisor, T* y, POOL_ARGS,
                                            long long per_output) {
    long long total = nc * Do * Ho * Wo;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)blockDim.x * gridDim.x) {
        long long ow = i % Wo, oh = (i / Wo) % Ho, od = (i / (Wo * Ho)) % Do, b = i / (Wo * Ho * Do);
        const T* xb = x + b * D * H * W;
        T acc_d = (T)0;
        for (long long td = 0; td < kd; ++td) {
            long long z = od * sd - pd + td * dd;
            T acc_h = (T)0;
            for (long long th = 0; th < kh; ++th) {
                long long r = oh * sh - ph + th * dh;
                T acc_w = (T)0;
                for (long long tw = 0; tw < kw; ++tw) {
                    long long c = ow * sw - pw + tw * dw;
                    T v = (z >= 0 && z < D && r >= 0 && r < H && c >= 0 && c < W)
                          ? xb[(z * H + r) * W + c] : (T)0;
                    acc_w = tw == 0 ? v : ADD(acc_w, v);
                }
                acc_h = th == 0 ? acc_w : ADD(acc_h, acc_w);
            }
            acc_d = td == 0 ? acc_h : ADD(acc_d, acc_h);
        }
        y[i] = DIV(acc_d, divisor[per_output ? i % (Do * Ho * Wo) : 0]);
    }
}

// The gradient output o (q: its index within the sample) sends back through tap ``tap`` of
// its window, into ``*g``; false when it sends none.  Max pooling (``arg`` given): dy where the
// window's first maximum is this tap.  Average pooling (``arg`` null): dy / divisor.
__device__ __forceinline__ bool pool_term(T* g, const T* dy, const int* arg, const T* divisor,
                                          long long per_output, long long o, long long q, int tap) {
    if (arg) {
        if (arg[o] != tap) return false;
        *g = dy[o];
        return true;
    }
    *g = DIV(dy[o], divisor[per_output ? q : 0]);
    return true;
}

extern "C" __global__ void pool_backward(const T* dy, const int* arg, const T* divisor, T* dx, POOL_ARGS,
                                         long long per_output, long long disjoint) {
    long long total = nc * D * H * W;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)blockDim.x * gridDim.x) {
        long long c = i % W, r = (i / W) % H, z = (i / (W * H)) % D, b = i / (W * H * D);
        if (disjoint) {              // one term at most: the nested sums below reduce to it
            long long od, oh, ow, td, th, tw;
            T g = (T)0, term;
            if (only_tap(z, pd, sd, dd, kd, Do, &od, &td) && only_tap(r, ph, sh, dh, kh, Ho, &oh, &th)
                && only_tap(c, pw, sw, dw, kw, Wo, &ow, &tw)) {
                long long q = (od * Ho + oh) * Wo + ow;
                if (pool_term(&term, dy, arg, divisor, per_output, b * Do * Ho * Wo + q, q,
                              (int)((td * kh + th) * kw + tw))) g = term;
            }
            dx[i] = g;
            continue;
        }
        T acc_w = (T)0, term;
        for (long long tw = 0; tw < kw; ++tw) {
            long long nw = c + pw - tw * dw;
            if (nw < 0 || nw % sw != 0 || nw / sw >= Wo) continue;
            T acc_h = (T)0;
            for (long long th = 0; th < kh; ++th) {
                long long nh = r + ph - th * dh;
                if (nh < 0 || nh % sh != 0 || nh / sh >= Ho) continue;
                T acc_d = (T)0;
                for (long long td = 0; td < kd; ++td) {
                    long long nd = z + pd - td * dd;
                    if (nd < 0 || nd % sd != 0 || nd / sd >= Do) continue;
                    long long q = ((nd / sd) * Ho + nh / sh) * Wo + nw / sw;
                    if (pool_term(&term, dy, arg, divisor, per_output, b * Do * Ho * Wo + q, q,
                                  (int)((td * kh + th) * kw + tw))) acc_d = ADD(acc_d, term);
                }
                acc_h = ADD(acc_h, acc_d);
            }
            acc_w = ADD(acc_w, acc_h);
        }
        dx[i] = acc_w;
    }
}
"""

#: Each kernel's argument kinds (``_cuda.arguments``): arrays, the 19 shape numbers, then its own.
_POOL = ("i64",) * 19
SIGNATURES = {
    "max_pool_forward": ("ptr", "ptr", "ptr") + _POOL + ("T",),
    "avg_pool_forward": ("ptr", "ptr", "ptr") + _POOL + ("i64",),
    "pool_backward": ("ptr", "ptr", "ptr", "ptr") + _POOL + ("i64", "i64"),
}


def pool_numbers(x_shape, out, k, s, p, d) -> tuple:
    """The 19 shape numbers every pooling kernel takes: N*C, (D, H, W), out, k, s, the low
    padding of each axis, dilation."""
    return ((x_shape[0] * x_shape[1],) + tuple(x_shape[2:]) + tuple(out) + tuple(k) + tuple(s)
            + tuple(lo for lo, _ in p) + tuple(d))


def disjoint(k, s, d) -> int:
    """1 when no two windows overlap along any axis (s > (k-1)*dl): each input then gets at most
    one tap's gradient, which the backward kernels find by division instead of a loop."""
    return int(all(si > (ki - 1) * di for ki, si, di in zip(k, s, d)))


def _device_launch(name, arrays, numbers, extra, dtype, total):
    _cuda.launch(DEVICE_SOURCE, name, SIGNATURES[name], tuple(arrays) + numbers + tuple(extra), dtype, total)


def _divisor_array(xp, divisor, dtype):
    """``(divisor as a device array, per_output)``: one value, or one per output point."""
    if isinstance(divisor, (int, float, numpy.integer, numpy.floating)):
        return xp.full((1,), divisor, dtype=dtype), 0
    return xp.ascontiguousarray(divisor, dtype=dtype), 1


def device_max_pool3d(x, k, s, p, d, out, with_masks):
    xp = array_module(x)
    x = xp.ascontiguousarray(x)
    y = xp.empty(tuple(x.shape[:2]) + tuple(out), dtype=x.dtype)
    arg = xp.empty(y.shape, dtype=xp.int32) if with_masks else None
    _device_launch("max_pool_forward", (x, y, arg), pool_numbers(x.shape, out, k, s, p, d), (-numpy.inf,),
                   x.dtype, y.size)
    return y, ([arg] if with_masks else None)


def device_max_pool3d_backward(dy, x, k, s, p, d, out, masks):
    xp = array_module(dy, x)
    if masks is None:
        arg = device_max_pool3d(x, k, s, p, d, out, True)[1][0]
    elif (len(masks) != 1 or getattr(masks[0], "dtype", None) != xp.int32
          or tuple(masks[0].shape) != tuple(dy.shape)):
        raise ValueError("masks must be the masks of max_pool3d(x, ..., return_masks=True) for this very "
                         "x on the device: one int32 array of the output's shape")
    else:
        arg = masks[0]
    dx = xp.empty(x.shape, dtype=dy.dtype)
    _device_launch("pool_backward", (xp.ascontiguousarray(dy), arg, None, dx),
                   pool_numbers(x.shape, out, k, s, p, d), (0, disjoint(k, s, d)), dy.dtype, dx.size)
    return dx


def device_avg_pool3d(x, k, s, p, out, divisor):
    xp = array_module(x)
    x = xp.ascontiguousarray(x)
    y = xp.empty(tuple(x.shape[:2]) + tuple(out), dtype=x.dtype)
    div, per_output = _divisor_array(xp, divisor, x.dtype)
    _device_launch("avg_pool_forward", (x, div, y), pool_numbers(x.shape, out, k, s, p, (1, 1, 1)),
                   (per_output,), x.dtype, y.size)
    return y


def device_avg_pool3d_backward(dy, x, k, s, p, divisor):
    xp = array_module(dy)
    dx = xp.empty(x.shape, dtype=dy.dtype)
    div, per_output = _divisor_array(xp, divisor, dy.dtype)
    _device_launch("pool_backward", (xp.ascontiguousarray(dy), None, div, dx),
                   pool_numbers(x.shape, dy.shape[2:], k, s, p, (1, 1, 1)), (per_output, disjoint(k, s, (1, 1, 1))),
                   dy.dtype, dx.size)
    return dx

__all__ = ["BLOCK_ELEMENTS", "applies", "blocks", "pair_max_forward", "pair_max_backward", "max_pool3d",
           "max_pool3d_backward", "avg_pool3d", "avg_pool3d_backward", "DEVICE_SOURCE", "SIGNATURES", "pool_numbers"]
