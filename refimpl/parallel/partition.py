"""Pure index math for spatial partitioning (no MPI).

Balanced blocks: an extent ``n`` split over ``p`` ranks gives block ``i`` the
half-open range ``[start, start + size)`` with
``start = (n // p) * i + min(i, n % p)`` and ``size = n // p + (i < n % p)``:
the first ``n % p`` blocks get one extra element; blocks are empty when p > n.
The same map is used by compute, HDF5 hyperslab reads and gathers, and ranks
are numbered row-major over the grid coordinates (``grid_rank``).

Window ops (conv, pool) partition their OUTPUT in balanced blocks; a rank that
computes outputs ``[o0, o1)`` needs the inputs ``[s*o0 - p_lo, s*(o1-1) - p_lo + d(k-1)]``
(inclusive, in unpadded coordinates; ``p_lo`` the padding before the input, which with
the padding after, ``p_hi``, and ``ceil_mode`` fixes the output extent).  The part of that interval outside
``[0, n)`` is the op's padding, never a neighbour's data: ``needed_input_range``
clips it and returns the clipped amount as explicit per-side padding, so the
local op runs on ``pad(x[i0:i1], (pad_low, pad_high))`` with no padding of its own.

A ``HaloPlan`` says, for every rank of a (Pd, Ph, Pw) spatial grid, which input
range it needs per axis and which global sub-range every owner sends to every
needer.  Halos are exchanged one axis at a time (D, then H, then W): at the
exchange along axis ``a`` a message covers the *needed* range on the earlier
axes (their ghosts are already there, so corners travel), the transferred
piece on axis ``a`` and the *owned* block on the later axes.  A need that
reaches past the direct neighbour is served by every owner that holds a piece.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..functional.args import padding_sides, sides, transposed_out_size, triple, window_out_size

Range = tuple[int, int]  # half-open [start, stop)


def block_range(n: int, p: int, i: int) -> tuple[int, int]:
    """Half-open [start, stop) of block ``i`` when ``n`` elements split over ``p`` blocks."""
    if p < 1:
        raise ValueError(f"number of blocks p must be >= 1, got {p}")
    if not 0 <= i < p:
        raise ValueError(f"block index i must be in [0, {p}), got {i}")
    if n < 0:
        raise ValueError(f"extent n must be >= 0, got {n}")
    q, r = divmod(n, p)
    start = q * i + min(i, r)
    return start, start + q + (1 if i < r else 0)


# ---------------------------------------------------------------- rank <-> coordinates

def ceil_block_range(n: int, p: int, i: int) -> tuple[int, int]:
    """Half-open [start, stop) of block ``i`` of ``torch.chunk``'s split of ``n`` over ``p``:
    ceil(n/p) each, so the last blocks are short or empty (W = 6 over 4: 2, 2, 2, 0) where
    ``block_range`` gives 2, 2, 1, 1.  Peers (DTensor, ShardTensor) split this way; the oracle
    recognises their layouts by it."""
    if p < 1 or not 0 <= i < p or n < 0:
        raise ValueError(f"ceil_block_range needs n >= 0, p >= 1, 0 <= i < p; got n={n}, p={p}, i={i}")
    size = -(-n // p)
    return min(i * size, n), min((i + 1) * size, n)


def grid_rank(coords, dims) -> int:
    """Row-major rank of ``coords`` in a grid of shape ``dims``: ((c0*P1 + c1)*P2 + c2)..."""
    rank = 0
    for c, p in zip(coords, dims, strict=True):
        if not 0 <= c < p:
            raise ValueError(f"coords {tuple(coords)} outside grid dims {tuple(dims)}")
        rank = rank * p + c
    return rank


def grid_coords(rank: int, dims) -> tuple[int, ...]:
    """Inverse of ``grid_rank``: the row-major coordinates of ``rank``."""
    size = 1
    for p in dims:
        size *= p
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside a grid of {size} ranks (dims {tuple(dims)})")
    coords = []
    for p in reversed(tuple(dims)):
        rank, c = divmod(rank, p)
        coords.append(c)
    return tuple(reversed(coords))


def block_slices(shape, dims, coords) -> tuple[slice, ...]:
    """Slices of the balanced block at ``coords`` of an array of ``shape`` split over ``dims``."""
    return tuple(slice(*block_range(n, p, c)) for n, p, c in zip(shape, dims, coords, strict=True))


# ---------------------------------------------------------------- extents and needed ranges

def _check_window(k, s, p, d) -> None:
    """``p``: an int (both sides) or a ``(lo, hi)`` pair."""
    pads = (("padding", q, 0) for q in ((p,) if hasattr(p, "__index__") else tuple(p)))
    for name, value, low in (("kernel", k, 1), ("stride", s, 1), *pads, ("dilation", d, 1)):
        if int(value) != value or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def window_output_extent(n: int, k: int, s: int, p, d: int, ceil_mode: bool = False) -> int:
    """Output extent of a conv/pool window: floor((n + lo + hi - d(k-1) - 1)/s) + 1, ``p`` an int
    (lo = hi = p) or a ``(lo, hi)`` pair; ``ceil_mode``: PyTorch's pooling rule
    (``functional.args.window_out_size``)."""
    _check_window(k, s, p, d)
    out = window_out_size(n, k, s, sides(p), d, ceil_mode)
    if out < 1:
        raise ValueError(f"kernel (dilated extent {d * (k - 1) + 1}) is larger than the padded "
                         f"input extent {n + sum(sides(p))}")
    return out


def transposed_output_extent(n: int, k: int, s: int, p: int, d: int, output_padding: int = 0) -> int:
    """Output extent of a transposed conv: (n-1)s - 2p + d(k-1) + output_padding + 1."""
    _check_window(k, s, p, d)
    if not 0 <= output_padding < max(s, d):
        raise ValueError(f"output_padding must be in [0, max(stride, dilation)) = [0, {max(s, d)}), "
                         f"got {output_padding}")
    out = transposed_out_size(n, k, s, p, d, output_padding)
    if out < 1:
        raise ValueError(f"padding {p} leaves an empty transposed-conv output (extent {out})")
    return out


def _check_output_range(o0: int, o1: int, n_out: int) -> None:
    if not 0 <= o0 <= o1 <= n_out:
        raise ValueError(f"output range [o0, o1) = [{o0}, {o1}) must lie within [0, {n_out})")


def _clip(lo: int, stop: int, n: int) -> Range:
    """[lo, stop) clipped to [0, n); an interval outside the domain becomes empty at its edge."""
    start = min(max(lo, 0), n)
    return start, max(min(stop, n), start)


def needed_input_range(o0: int, o1: int, k: int, s: int, p, d: int,
                       n_in: int, ceil_mode: bool = False) -> tuple[Range, Range]:
    """Inputs of a window op (conv/pool) that outputs ``[o0, o1)`` read.

    ``p``: an int (the same padding on both sides) or a ``(p_lo, p_hi)`` pair.  Outputs
    ``[o0, o1)`` read the padded-input interval ``[s*o0 - p_lo, s*(o1-1) - p_lo + d(k-1)]``
    (inclusive, unpadded coordinates); ``p_hi`` and ``ceil_mode`` only fix how many outputs
    there are.  Returns ``((i0, i1), (pad_low, pad_high))``: the half-open part inside
    ``[0, n_in)`` and the zero padding (or -inf for max pooling) the clip removed on each
    side, with ``pad_low + (i1 - i0) + pad_high`` the interval's length (with ``ceil_mode``
    the last window may reach past ``n_in + p_hi``: ``pad_high`` counts that overhang too,
    never a cell past the domain).  A window lying wholly in the padding gives an empty
    ``[i0, i1)`` and all of its length as padding.  An empty output range needs nothing:
    ``(c, c), (0, 0)``.
    """
    _check_output_range(o0, o1, window_output_extent(n_in, k, s, p, d, ceil_mode))
    p_lo = sides(p)[0]
    if o0 == o1:
        start = _clip(s * o0 - p_lo, s * o0 - p_lo, n_in)[0]
        return (start, start), (0, 0)
    lo, stop = s * o0 - p_lo, s * (o1 - 1) - p_lo + d * (k - 1) + 1
    i0, i1 = _clip(lo, stop, n_in)
    pad_low = min(max(-lo, 0), stop - lo)
    return (i0, i1), (pad_low, (stop - lo) - pad_low - (i1 - i0))


def transposed_needed_input_range(o0: int, o1: int, k: int, s: int, p: int, d: int,
                                  n_in: int, output_padding: int = 0) -> Range:
    """Inputs a transposed conv needs to compute outputs ``[o0, o1)``.

    Output ``o`` gathers input ``i`` through tap ``j`` when ``i*s - p + j*d == o``, so
    outputs ``[o0, o1)`` need inputs within ``[ceil((o0 + p - d(k-1))/s), floor((o1 - 1 + p)/s)]``,
    clipped to ``[0, n_in)``.  A bounding interval: with s or d > 1 and a narrow output
    range its ends may carry no tap.  Returned half-open; empty output -> empty range.
    """
    _check_output_range(o0, o1, transposed_output_extent(n_in, k, s, p, d, output_padding))
    if o0 == o1:
        return (0, 0)
    lo = -((-(o0 + p - d * (k - 1))) // s)  # ceil division
    hi = (o1 - 1 + p) // s
    return _clip(lo, hi + 1, n_in)


# ---------------------------------------------------------------- halo plans

@dataclass(frozen=True)
class AxisHaloPlan:
    """Halo plan along one axis split over ``parts`` ranks (index ``c`` = grid coordinate).

    ``transfers`` lists ``(src, dst, start, stop)``: owner ``src`` sends the global range
    ``[start, stop) = owned[src] ∩ needed[dst]`` to ``dst != src``; the part of
    ``needed[dst]`` that ``dst`` owns itself is a local copy.  ``outputs`` and
    ``padding`` are filled by the per-op constructors (output block and clipped padding).
    """
    n: int
    parts: int
    owned: tuple[Range, ...]
    needed: tuple[Range, ...]
    transfers: tuple[tuple[int, int, int, int], ...]
    outputs: tuple[Range, ...] | None = None
    padding: tuple[Range, ...] | None = None

    def sends(self, c: int) -> list[tuple[int, int, int]]:
        """(dst, start, stop) for every piece coordinate ``c`` sends."""
        return [(dst, a, b) for src, dst, a, b in self.transfers if src == c]

    def recvs(self, c: int) -> list[tuple[int, int, int]]:
        """(src, start, stop) for every piece coordinate ``c`` receives."""
        return [(src, a, b) for src, dst, a, b in self.transfers if dst == c]


def axis_halo_plan(n: int, parts: int, needed: list[Range], outputs=None, padding=None) -> AxisHaloPlan:
    """Owners (balanced input blocks) and transfers for one axis, given each coordinate's need."""
    owned = tuple(block_range(n, parts, c) for c in range(parts))
    transfers = []
    for dst, (n0, n1) in enumerate(needed):
        if not 0 <= n0 <= n1 <= n:
            raise ValueError(f"needed range [{n0}, {n1}) of coordinate {dst} is outside [0, {n})")
        for src, (b0, b1) in enumerate(owned):
            a, b = max(n0, b0), min(n1, b1)
            if src != dst and a < b:
                transfers.append((src, dst, a, b))
    return AxisHaloPlan(n, parts, owned, tuple(needed), tuple(transfers),
                        None if outputs is None else tuple(outputs),
                        None if padding is None else tuple(padding))


@dataclass(frozen=True)
class Message:
    """One halo message at the exchange along ``axis``: ``region`` holds three global ranges."""
    axis: int
    peer: tuple[int, int, int]
    region: tuple[Range, Range, Range]

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(b - a for a, b in self.region)

    @property
    def volume(self) -> int:
        d, h, w = self.shape
        return d * h * w


@dataclass(frozen=True)
class HaloPlan:
    """Halo plan of the three spatial axes (D, H, W) over a (Pd, Ph, Pw) grid."""
    axes: tuple[AxisHaloPlan, AxisHaloPlan, AxisHaloPlan]

    @property
    def grid_dims(self) -> tuple[int, int, int]:
        return tuple(ax.parts for ax in self.axes)

    @property
    def global_shape(self) -> tuple[int, int, int]:
        return tuple(ax.n for ax in self.axes)

    def owned(self, coords) -> tuple[Range, Range, Range]:
        return tuple(ax.owned[c] for ax, c in zip(self.axes, coords))

    def needed(self, coords) -> tuple[Range, Range, Range]:
        return tuple(ax.needed[c] for ax, c in zip(self.axes, coords))

    def outputs(self, coords) -> tuple[Range, Range, Range]:
        """The output block (per axis) the rank at ``coords`` computes (per-op plans only)."""
        if any(ax.outputs is None for ax in self.axes):
            raise ValueError("this plan was built from needed ranges alone: it has no output blocks")
        return tuple(ax.outputs[c] for ax, c in zip(self.axes, coords))

    def padding(self, coords) -> tuple[Range, Range, Range]:
        """(low, high) zero padding per axis the local window op adds (conv_halo_plan only)."""
        if any(ax.padding is None for ax in self.axes):
            raise ValueError("only conv_halo_plan records the clipped padding")
        return tuple(ax.padding[c] for ax, c in zip(self.axes, coords))

    def _region(self, coords, axis, piece) -> tuple[Range, Range, Range]:
        """Needed range on axes before ``axis``, ``piece`` on it, owned block after it."""
        return tuple(self.axes[a].needed[c] if a < axis else piece if a == axis else self.axes[a].owned[c]
                     for a, c in enumerate(coords))

    def _peer(self, coords, axis, c) -> tuple[int, int, int]:
        return tuple(c if a == axis else x for a, x in enumerate(coords))

    def sends(self, coords, axis) -> list[Message]:
        """Messages the rank at ``coords`` sends during the exchange along ``axis``."""
        return [Message(axis, self._peer(coords, axis, dst), self._region(coords, axis, (a, b)))
                for dst, a, b in self.axes[axis].sends(coords[axis])]

    def recvs(self, coords, axis) -> list[Message]:
        """Messages the rank at ``coords`` receives during the exchange along ``axis``."""
        return [Message(axis, self._peer(coords, axis, src), self._region(coords, axis, (a, b)))
                for src, a, b in self.axes[axis].recvs(coords[axis])]


def halo_plan(global_in_shape, grid_dims, needed_ranges_fn: Callable[[int, int], Range]) -> HaloPlan:
    """Plan from ``needed_ranges_fn(axis, coord) -> (start, stop)`` (a rank's need per axis)."""
    shape = triple(global_in_shape, "global_in_shape")
    dims = triple(grid_dims, "grid_dims", minimum=1)
    return HaloPlan(tuple(axis_halo_plan(shape[a], dims[a], [needed_ranges_fn(a, c) for c in range(dims[a])])
                          for a in range(3)))


def conv_halo_plan(global_in_shape, grid_dims, kernel, stride=1, padding=0, dilation=1,
                   ceil_mode=False) -> HaloPlan:
    """Halo plan of a conv/pool window: OUTPUT split in balanced blocks, inputs derived.
    ``padding``: any form of ``functional.args.padding_sides`` (int, 3-tuple, per-side
    6-tuple, 'valid', 'same'); ``ceil_mode``: pooling's."""
    shape = triple(global_in_shape, "global_in_shape")
    dims = triple(grid_dims, "grid_dims", minimum=1)
    k, s = triple(kernel, "kernel", 1), triple(stride, "stride", 1)
    d = triple(dilation, "dilation", 1)
    p = padding_sides(padding, k, d, s)
    axes = []
    for a in range(3):
        n_out = window_output_extent(shape[a], k[a], s[a], p[a], d[a], ceil_mode)
        outputs = [block_range(n_out, dims[a], c) for c in range(dims[a])]
        needs = [needed_input_range(o0, o1, k[a], s[a], p[a], d[a], shape[a], ceil_mode) for o0, o1 in outputs]
        axes.append(axis_halo_plan(shape[a], dims[a], [r for r, _ in needs], outputs, [q for _, q in needs]))
    return HaloPlan(tuple(axes))


def transposed_conv_halo_plan(global_in_shape, grid_dims, kernel, stride=1, padding=0, dilation=1,
                              output_padding=0) -> HaloPlan:
    """Halo plan of a transposed conv: OUTPUT split in balanced blocks, input bounding ranges derived."""
    shape = triple(global_in_shape, "global_in_shape")
    dims = triple(grid_dims, "grid_dims", minimum=1)
    k, s = triple(kernel, "kernel", 1), triple(stride, "stride", 1)
    p, d = triple(padding, "padding", 0), triple(dilation, "dilation", 1)
    op = triple(output_padding, "output_padding", 0)
    axes = []
    for a in range(3):
        n_out = transposed_output_extent(shape[a], k[a], s[a], p[a], d[a], op[a])
        outputs = [block_range(n_out, dims[a], c) for c in range(dims[a])]
        needs = [transposed_needed_input_range(o0, o1, k[a], s[a], p[a], d[a], shape[a], op[a])
                 for o0, o1 in outputs]
        axes.append(axis_halo_plan(shape[a], dims[a], needs, outputs))
    return HaloPlan(tuple(axes))


def bytes_sent(plan: HaloPlan, itemsize: int, channels: int, batch: int, adjoint: bool = False) -> list[int]:
    """Bytes each spatial rank (row-major) sends in one halo exchange.

    Forward: the owned pieces it serves; adjoint: the ghost gradients it returns,
    i.e. what it received in the forward exchange (the same routes, reversed).
    """
    dims = plan.grid_dims
    per_rank = []
    for rank in range(dims[0] * dims[1] * dims[2]):
        coords = grid_coords(rank, dims)
        messages = plan.recvs if adjoint else plan.sends
        volume = sum(m.volume for axis in range(3) for m in messages(coords, axis))
        per_rank.append(volume * itemsize * channels * batch)
    return per_rank


# ---------------------------------------------------------------- channel slices (the model axis)

def channel_range(channels: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of model rank ``index``'s slice of ``channels`` over ``parts`` ranks."""
    return block_range(channels, parts, index)


def channel_counts(channels: int, parts: int) -> list[int]:
    return [b - a for a, b in (channel_range(channels, parts, m) for m in range(parts))]


def moved_bytes(channels: int, parts: int, index: int, others: int, itemsize: int) -> int:
    """Bytes rank ``index`` exchanges in one channel allgather or reduce-scatter:
    ``(C - c_m) * others * itemsize``, ``others`` = the elements per channel (N * voxels)."""
    start, stop = channel_range(channels, parts, index)
    return (channels - (stop - start)) * others * itemsize if parts > 1 else 0


# ---------------------------------------------------------------- gradient buckets

def pack_buckets(sizes, kinds, bucket_bytes: int, first_bucket_bytes: int) -> list[list[int]]:
    """Indices of the items (parameters in backward order, ``sizes`` in bytes) in each bucket.

    A bucket is closed when the next item would take it past its cap (``first_bucket_bytes``
    for the first, ``bucket_bytes`` after) or is of another kind (dtype, array module); an
    item larger than the cap gets a bucket of its own.  ``GradientSynchronizer`` packs its
    buckets with it, and the planner predicts them with it.
    """
    groups, current, size = [], [], 0
    for i, (nbytes, kind) in enumerate(zip(sizes, kinds)):
        cap = first_bucket_bytes if not groups else bucket_bytes
        if current and (size + nbytes > cap or kind != kinds[current[0]]):
            groups.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current:
        groups.append(current)
    return groups


def chunk_ranges(length: int, itemsize: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` element ranges cutting a buffer of ``length`` items into pieces of at most
    ``chunk_bytes`` (at least one item each; ``chunk_bytes`` 0: one piece, the whole buffer).

    A prioritised gradient exchange reduces a large bucket piece by piece, so that the bucket
    the next forward needs first can be started between two of its pieces."""
    if chunk_bytes <= 0 or length == 0:
        return [(0, length)]
    step = max(1, chunk_bytes // itemsize)
    return [(lo, min(lo + step, length)) for lo in range(0, length, step)]
