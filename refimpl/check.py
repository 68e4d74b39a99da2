"""One partitioned layer against the unpartitioned reference, on every rank of a communicator.

``LayerCheck`` is the request: a layer kind of refimpl/layers and its arguments, a process
grid, a dtype and a seed, validated when it is made (identically on every rank, before any
message).  ``check_layer(check, comm)`` runs it: every rank draws the same global input,
parameters and output gradient from the seed and takes its block (samples split over Pn, the
volume over Pd x Ph x Pw, channels over Pm where the layer is model-parallel), runs the
partitioned layer forward and backward; rank 0 gathers y and dx, sums dw and db over the
ranks (the unpartitioned gradient sums over the whole batch) and compares each with the
kind's reference on the whole tensor by ``max|a - b| / max|b|``.

A bad request raises on every rank before any message.  The partitioned layer's forward and
backward exchange messages, so an exception there on some ranks alone would leave the others
waiting in an exchange for ever: on a communicator of several ranks it ends every rank
(``MPI_Abort``, exit 70) after printing the failing rank's traceback (``_every_rank_or_abort``).

``refimpl check-layer`` (refimpl/commands/check_layer.py) is this plus its flags;
tests/mpi/ drives it directly over Hypothesis-drawn layers and grids.  Field names, and the
error messages, are check-layer's flags (``--kernel``, ...).
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy

from . import layers, settings
from .functional.args import compact_padding, padding_sides, triple
from .functional.conv3d import ALGORITHMS, ENV_ALGORITHM
from .layers.options import HasOptions
from .parallel.grid import check_dims

TOLERANCE = {"float64": 1e-10, "float32": 1e-5}
#: the largest request a layer check (or an oracle case) accepts, checked before anything is
#: allocated: a check holds every global array whole on every rank, and an oracle case file
#: has a group per rank
MAX_RANKS = 4096
MAX_ELEMENTS = 2 ** 27          # per array: 1 GiB in float64
MAX_TAPS = 4096                 # kd·kh·kw: the reference takes one strided slice per tap
#: float32 tolerance where a conv may run Winograd: its rounding depends on where the
#: 4x4x4 tiles fall, which differs between a rank's block and the whole volume
#: (refimpl/kernels/winograd.py documents ~1e-4 of a typical output).
WINOGRAD_FLOAT32_TOLERANCE = 1e-3


def _text(values) -> str:
    return ",".join(str(v) for v in values)


def _window_padding(value, kind, kernel, dilation, stride):
    """--padding: an int, 1, 3 or 6 ints ('p', 'pd,ph,pw', 'd_lo,d_hi,h_lo,h_hi,w_lo,w_hi'),
    'valid' or 'same' -> (pd, ph, pw) when symmetric, else the 6-tuple (``compact_padding``).
    A kind whose ``padding_forms`` is 'symmetric' (conv_transpose3d, as PyTorch) takes 1 or 3."""
    values = value if isinstance(value, str) else (value,) if isinstance(value, int) else tuple(value)
    if isinstance(values, tuple) and len(values) == 1:
        values = values[0]
    if kind.padding_forms == "symmetric" and (isinstance(values, str) or len(values if isinstance(values, tuple)
                                                                                 else (values,)) not in (1, 3)):
        raise ValueError(f"--padding of {kind.name} takes 1 or 3 comma-separated integers (as PyTorch's "
                         f"{kind.name}), got {value!r}")
    return compact_padding(padding_sides(values, kernel, dilation, stride, "--padding"))


def _window_triple(value, name, minimum):
    """An int, or 1 or 3 ints (check-layer's 'k' or 'kd,kh,kw'), as a validated 3-tuple."""
    values = (value,) if isinstance(value, int) else tuple(value)
    if len(values) not in (1, 3):
        raise ValueError(f"--{name} needs 3 comma-separated integers, got {_text(values)!r}")
    return triple(values[0] if len(values) == 1 else values, name, minimum)


@dataclass(frozen=True, init=False)
class LayerCheck(HasOptions):
    """A validated check: window arguments normalised to 3-tuples (``padding``: a 3-tuple when
    symmetric, else the per-side 6-tuple (d_lo, d_hi, h_lo, h_hi, w_lo, w_hi); 'same' and
    'valid' resolved), ``stride`` None -> the kind's default (1; pooling: the kernel),
    ``out_channels`` None -> C.  ``options``: the kind's own options (``LayerKind.options``),
    given as ``options={...}`` or as keywords (``ceil_mode=True``), each checked by its
    ``Option`` and completed with its default; read as ``check.options[name]`` or
    ``check.<name>``.  An option of another kind with a value other than its default is refused."""
    layer: str
    input: tuple                     # global (N, C, D, H, W)
    grid: tuple                      # (Pn, Pd, Ph, Pw[, Pm]); comm must hold their product
    out_channels: int | None = None
    kernel: int | tuple = 3
    stride: int | tuple | None = None
    padding: int | tuple = 0
    dilation: int | tuple = 1
    output_padding: int | tuple = 0
    model_parallel: str = "none"
    dtype: str = "float64"
    seed: int = 0
    algorithm: str | None = None     # the partitioned conv's (None: $REFIMPL_CONV_ALGORITHM)
    options: dict = field(default_factory=dict, hash=False)

    def __init__(self, layer, input, grid, out_channels=None, kernel=3, stride=None, padding=0, dilation=1,
                 output_padding=0, model_parallel="none", dtype="float64", seed=0, algorithm=None, options=None,
                 **more_options):
        for name, value in (("layer", layer), ("input", input), ("grid", grid), ("out_channels", out_channels),
                            ("kernel", kernel), ("stride", stride), ("padding", padding), ("dilation", dilation),
                            ("output_padding", output_padding), ("model_parallel", model_parallel),
                            ("dtype", dtype), ("seed", seed), ("algorithm", algorithm),
                            ("options", {**(options or {}), **more_options})):
            object.__setattr__(self, name, value)
        self.__post_init__()

    def __post_init__(self):
        from .backend import resolve_dtype

        def normalise(name, value):
            object.__setattr__(self, name, value)
        kind = self.kind
        shape = (self.input,) if isinstance(self.input, int) else tuple(self.input)
        if len(shape) != 5:
            raise ValueError(f"--input needs 5 comma-separated integers, got {_text(shape)!r}")
        if min(shape) < 1:
            raise ValueError(f"--input must be 5 positive integers N,C,D,H,W, got {_text(shape)!r}")
        normalise("input", shape)
        normalise("grid", check_dims(self.grid))
        normalise("dtype", numpy.dtype(resolve_dtype(self.dtype)).name)
        normalise("kernel", _window_triple(self.kernel, "kernel", 1))
        normalise("stride", kind.default_stride(self.kernel) if self.stride is None
                  else _window_triple(self.stride, "stride", 1))
        normalise("dilation", _window_triple(self.dilation, "dilation", 1))
        normalise("padding", _window_padding(self.padding, kind, self.kernel, self.dilation, self.stride))
        known = layers.all_options()
        unknown = sorted(set(self.options) - set(known))
        if unknown:
            raise TypeError(f"LayerCheck: unknown option(s) {unknown}; the layer kinds take: {', '.join(known)}")
        given = {name: known[name].check(value) for name, value in self.options.items()}
        normalise("options", {**{o.name: o.default for o in kind.options}, **given})
        normalise("output_padding", _window_triple(self.output_padding, "output-padding", 0))
        normalise("out_channels", shape[1] if self.out_channels is None else self.out_channels)
        if self.out_channels < 1:
            raise ValueError(f"--out-channels must be >= 1, got {self.out_channels}")
        kind.validate(self)                # refuses another kind's option set away from its default
        normalise("options", {name: self.options[name] for name in kind.option_names()})
        if shape[0] < self.grid[0]:
            raise ValueError(f"--grid puts {self.grid[0]} sample groups on a batch of {shape[0]}: "
                             "every data-parallel rank needs at least one sample")
        if self.model_parallel not in kind.model_modes:
            raise ValueError(f"--model-parallel {self.model_parallel} does not apply to {self.layer} "
                             f"(it takes: {', '.join(kind.model_modes)})")
        pm = self.grid[4] if len(self.grid) == 5 else 1
        split = {"filter": kind.output_channels(self), "channel": shape[1]}.get(self.model_parallel)
        if split is not None and pm > split:
            raise ValueError(f"--grid puts Pm={pm} model ranks on a layer that splits {split} channels "
                             f"(--model-parallel {self.model_parallel}): at most one rank per channel")
        if self.algorithm not in (None,) + ALGORITHMS:
            raise ValueError(f"--algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")
        self._bound_sizes()

    def _bound_sizes(self) -> None:
        """Refuse a request over ``MAX_RANKS`` ranks or ``MAX_ELEMENTS`` elements in any array the
        check holds whole (input, padded input, output, weight), computed from the arguments
        alone: a typo (a padding of 99999999999, a grid of 10^10 ranks) is one line of exit 2,
        not a MemoryError or an hour of building layouts."""
        ranks = int(numpy.prod(self.grid, dtype=object))
        if ranks > MAX_RANKS:
            raise ValueError(f"--grid {_text(self.grid)} makes {ranks:,} ranks; a layer check takes at most "
                             f"{MAX_RANKS:,}")
        taps = int(numpy.prod(self.kernel, dtype=object))
        if taps > MAX_TAPS:
            raise ValueError(f"--kernel {_text(self.kernel)} has {taps:,} taps; a layer check takes at most "
                             f"{MAX_TAPS:,} (the reference computes one strided slice per tap)")
        n, c = self.input[:2]
        sides = padding_sides(self.padding, self.kernel, self.dilation, self.stride, "--padding")
        padded = [m + lo + hi for m, (lo, hi) in zip(self.input[2:], sides)]
        f = self.kind.output_channels(self)
        arrays = [("the input (--input)", (n, c) + tuple(self.input[2:])),
                  ("the padded input (--input, --padding)", (n, c) + tuple(padded))]
        params = self.kind.parameter_shapes(self)
        if params is not None:
            arrays.append(("the weight (channels, --kernel)", params[0]))
        try:
            arrays.append(("the output (--input, --kernel, --stride, --padding)",
                           (n, f) + tuple(self.kind.output_extent(self))))
        except (ValueError, TypeError, NotImplementedError):
            pass
        for what, shape in arrays:
            size = int(numpy.prod([int(v) for v in shape], dtype=object))
            if size > MAX_ELEMENTS:
                raise ValueError(f"{what} would hold {size:,} elements ({'x'.join(str(v) for v in shape)}); a "
                                 f"layer check holds each array whole, at most {MAX_ELEMENTS:,} elements")

    @property
    def kind(self) -> layers.LayerKind:
        return layers.lookup(self.layer)

    @property
    def tolerance(self) -> float:
        """Of max|a - b| / max|b|: float64 1e-10, float32 1e-5, 1e-3 where a conv may run Winograd."""
        algorithm = self.algorithm if self.algorithm is not None else settings.env_setting(ENV_ALGORITHM)
        if self.dtype == "float32" and self.kind.may_use_winograd(self, algorithm):
            return WINOGRAD_FLOAT32_TOLERANCE
        return TOLERANCE[self.dtype]


def rel_err(a, b):
    """max|a - b| / max|b| over finite entries; equal entries (a max-pool window lying
    wholly in the padding is -inf in both) count as no difference."""
    if b is None:
        return None
    if not b.size:
        return 0.0
    with numpy.errstate(invalid="ignore"):
        diff = numpy.where(a == b, 0.0, numpy.abs(a - b))
    finite = numpy.abs(b[numpy.isfinite(b)])
    scale = float(finite.max()) if finite.size else 0.0
    worst = float(diff.max())
    return worst / scale if scale > 0 else worst


@contextmanager
def _conv_algorithm(algorithm):
    """$REFIMPL_CONV_ALGORITHM set to ``algorithm`` (None: left as it is) while the partitioned
    layer runs: refimpl's convs read the variable at each call."""
    if algorithm is None:
        yield
        return
    before = os.environ.get(ENV_ALGORITHM)
    os.environ[ENV_ALGORITHM] = algorithm
    try:
        yield
    finally:
        if before is None:
            del os.environ[ENV_ALGORITHM]
        else:
            os.environ[ENV_ALGORITHM] = before


def _every_rank_or_abort(comm, what: str, fn, *args):
    """``fn(*args)``; if it raises on a communicator of several ranks, print this rank's
    traceback and end every rank (the others may be waiting in one of ``fn``'s messages, and
    no agreement could reach them there).  On one rank the exception propagates."""
    try:
        return fn(*args)
    except Exception:
        if comm.Get_size() == 1:
            raise
        import sys
        import traceback
        from .errors import EXIT_INTERNAL
        from .watchdog import abort
        sys.stderr.write(f"check_layer: rank {comm.Get_rank()} of {comm.Get_size()} raised in the partitioned "
                         f"layer's {what}; ending every rank (the others could be waiting in its messages):\n"
                         f"{traceback.format_exc()}")
        sys.stderr.flush()
        abort(EXIT_INTERNAL)


def check_layer(check: LayerCheck, comm, keep_arrays: bool = False):
    """Run ``check`` on ``comm`` (collective); the report dict on rank 0, None elsewhere.
    ``keep_arrays``: the report also holds the gathered global arrays (x, dy, y, dx, w, b, dw, db)."""
    with _conv_algorithm(check.algorithm):
        return _run(check, comm, keep_arrays)


def _run(check, comm, keep_arrays):
    from .backend import asarray, to_host
    from .parallel.channels import channel_range
    from .parallel.collectives import allreduce
    from .parallel.grid import ProcessGrid
    from .parallel.partition import block_range

    kind, dtype = check.kind, numpy.dtype(check.dtype)
    grid = ProcessGrid(comm, check.grid)   # ValueError on every rank if the sizes differ
    layer = kind.partitioned(check, grid=grid, rng=numpy.random.default_rng(check.seed), dtype=dtype.type)
    out_dhw = layer.setup(check.input[2:])      # pure index math; raises the same on every rank

    rng = numpy.random.default_rng([check.seed, 1])
    x = rng.standard_normal(check.input).astype(dtype)                     # (N, C, D, H, W) global
    params = [p for p in (getattr(layer, "weight", None), getattr(layer, "bias", None)) if p is not None]
    for p in params:    # drawn whole (the same on every rank), then this rank's slice
        full = kind.check_init(rng, (p.shard[3],) if p.shard else p.shape)
        if full is not None:
            full = full.astype(dtype)
            p.data[...] = asarray(full[p.shard[1]:p.shard[2]] if p.shard else full)
    n_out = kind.output_channels(check)
    # dy has mean 1: db sums dy over the whole batch, and a sum that cancels to near zero
    # would make its float32 relative error measure luck rather than correctness
    dy = (1.0 + rng.standard_normal((check.input[0], n_out) + tuple(out_dhw))).astype(dtype)

    samples = slice(*block_range(check.input[0], grid.dims[0], grid.sample_coord))
    pm, m = grid.model_dims, grid.model_coord
    split_in = check.model_parallel != "none"                   # every mode here takes split input
    in_channels = slice(*channel_range(check.input[1], pm, m)) if split_in else slice(None)
    out_channels = slice(*channel_range(n_out, pm, m)) if split_in else slice(None)
    in_block = (samples, in_channels) + tuple(grid.local_block(check.input[2:]))
    out_block = (samples, out_channels) + tuple(grid.local_block(out_dhw))
    y_local = _every_rank_or_abort(comm, "forward", layer.forward, asarray(x[in_block]))
    dx_local = _every_rank_or_abort(comm, "backward", layer.backward, asarray(dy[out_block]))

    def whole(p, a):
        """A parameter-shaped array of this rank placed into the unsplit shape (zeros elsewhere)."""
        if p.shard is None:
            return a
        axis, start, stop, size = p.shard
        out = numpy.zeros(a.shape[:axis] + (size,) + a.shape[axis + 1:], dtype)
        out[(slice(None),) * axis + (slice(start, stop),)] = to_host(a)
        return asarray(out)

    grads, values = [], []
    for p in params:   # the unpartitioned gradient sums over every sample and voxel
        g = p.grad if p.grad is not None else asarray(numpy.zeros(p.shape, dtype))
        # slices of a split parameter are disjoint: summed over the whole grid they make the
        # whole; an unsplit one is the same on every model rank: summed over one copy's ranks
        grads.append(to_host(allreduce(whole(p, g), grid.comm if p.shard else grid.batch_comm)))
        values.append(to_host(allreduce(whole(p, p.data.copy()), grid.model_comm)) if p.shard else
                      to_host(p.data))
    pieces = grid.comm.gather((in_block, out_block, to_host(y_local), to_host(dx_local)), root=0)
    if grid.rank != 0:
        return None
    y = numpy.zeros(dy.shape, dtype)
    dx = numpy.zeros(x.shape, dtype)
    for ib, ob, yl, dxl in pieces:
        y[ob], dx[ib] = yl, dxl
    w = values[0] if params else None
    b = values[1] if len(params) > 1 else None
    dw, db = (grads + [None, None])[:2]
    ref = kind.reference(check, x, w, b, dy)
    errors = {k: rel_err(got, want) for k, got, want in zip(("y", "dx", "dw", "db"), (y, dx, dw, db), ref)}
    tolerance = check.tolerance
    report = {"layer": check.layer, "input": list(check.input), "grid": list(grid.dims),
              "model_parallel": check.model_parallel, "dtype": dtype.name, "tolerance": tolerance,
              "conv_algorithm": os.environ.get(ENV_ALGORITHM, "auto"), "max_rel_err": errors,
              "ok": all(e is None or e <= tolerance for e in errors.values())}
    if keep_arrays:
        arrays = dict(x=x, dy=dy, y=y, dx=dx)
        arrays.update({k: v for k, v in (("w", w), ("b", b), ("dw", dw), ("db", db)) if v is not None})
        report["arrays"] = arrays
    return report


__all__ = ["LayerCheck", "check_layer", "rel_err", "TOLERANCE", "WINOGRAD_FLOAT32_TOLERANCE", "ALGORITHMS"]
