"""The planner: predicted cost of one training step, per rank, for a model on a process grid.

Pure math (no messages): for CosmoFlow or the 3D U-Net (any preset or config) on a grid
(Pn, Pd, Ph, Pw, Pm), per layer and per rank:

- FLOPs: a conv's forward is ``2 N_r F C k^3 V_out`` (N_r local samples, V_out the
  rank's output voxels); its backward twice that (dW and dX; the first layer has no dX);
  a dense layer ``2 N_r d_out d_in`` likewise;
- halo exchanges: the bytes and messages of every send, forward and adjoint, read off
  the *same* ``partition.conv_halo_plan`` / ``transposed_conv_halo_plan`` objects the
  layers execute (``plan.sends(coords, axis)``: one message per piece, its volume times
  channels times local samples times the item size) — ``HaloExchange.bytes_sent`` and
  ``messages_sent`` of a real run equal them exactly (tests/mpi/test_plan_mpi.py);
- model-axis collectives: ``partition.moved_bytes`` of every channel allgather /
  reduce-scatter (as ``parallel/channels.py`` counts them), allreduces of replicated
  gradients over the model group;
- the gradient allreduce: the parameters packed into buckets by ``partition.pack_buckets``
  (as ``GradientSynchronizer`` packs them) and each bucket's alpha-beta-gamma time from
  ``allreduce.predicted_time`` for the chosen algorithm over the Pn x Ps ranks holding a
  copy of the parameter slice;
- memory: saved activations (each layer keeps its input, halo included), the largest
  transient (halo work array + the output being produced), weights, gradients, the
  gradient buckets (one more copy) and the optimizer state (SGD momentum: 1 copy; Adam: 2).

The layers are the model class's own list (``Model.describe``: registry kinds, channels,
extents, splits) and each layer's share is charged by its kind's hooks in the layer registry
(``LayerKind.plan_cost`` and the other ``plan_*``, refimpl/layers): this module names no layer
kind; it adds the parameters, the gradient allreduce and the memory, and searches the grids.

Time of the step = compute (a conv's FLOPs at the rate measured for its shape and block
size, dense layers at the GEMM rate, batch norm / activations / pooling per element:
``Machine``) + every message's ``alpha + bytes * beta`` (intra- or inter-node constants by
where the peers sit: ranks ``r // ranks_per_node`` share a node) + the halo exchanges'
copies (work array, pieces packed per axis) + the gradient allreduce and its bucket copies
(not overlapped: an upper bound; refimpl overlaps it with backward).  The slowest rank
decides the step.

The cost formulas follow Gholami et al. (SPAA'18): a conv layer's domain-parallel cost is
its halo ``alpha + beta * halo words``, a 1.5-D dense layer's the allgather /
reduce-scatter of ``d_in B/Pn`` words over Pm plus the allreduce of ``d_out d_in / Pm``
gradient words over Pn; collective costs after Thakur, Rabenseifner & Gropp (2005)
(``allreduce.predicted_time``).  docs/planner.md derives them and compares with runs.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field

from .parallel.partition import block_range, grid_coords, grid_rank, moved_bytes, pack_buckets
from .progress import phase

GRAD_BUCKET_BYTES = 25 * 2 ** 20          # GradientSynchronizer's defaults
FIRST_BUCKET_BYTES = 1 * 2 ** 20
UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
         "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_bytes(text) -> int:
    """'16GiB', '512 MB', '1.5e9' -> bytes; ValueError for anything else."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"a memory size must be a positive number with an optional unit "
                         f"(B, KB, MB, GB, KiB, MiB, GiB, TiB), got {text!r}")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


# ---------------------------------------------------------------- the machine

@dataclass(frozen=True)
class Machine:
    """Rates and alpha-beta-gamma constants of one rank (defaults: a typical GPU-less
    cluster node; ``refimpl plan --calibrate`` measures this machine).

    Compute time per layer kind (``rank_costs``): a conv is ``flops / rate`` with the rate
    measured for its shape (``conv_gflops``: a narrow conv runs at a fraction of a wide
    one's rate, and Winograd's effective rate exceeds the GEMM's), ``gflops`` for a shape
    not measured; a dense layer ``flops / gemm_gflops``; a memory-bound kind (normalisations,
    activations, pooling) elements / its rate (forward + backward): ``element_rates`` holds
    the rates measured per kind, a kind not measured costs its declared default
    (``LayerKind.plan_element_rate``): the machine holds no kind's rate by name, so a new
    kind is priced and calibrated by its own declaration.  A halo exchange also copies: the block into the work array and back
    (``mem_bandwidth``) and every piece packed into / out of its message buffer at the
    pack bandwidth of its axis (a D face is one contiguous run per sample and channel, a
    W face one element per row: ``pack_bandwidth_w`` is the slowest)."""
    gflops: float = 50.0                  # float32 GFLOP/s of a conv's arithmetic
    alpha: float = 1.0e-6                 # s per message, both ranks on one node
    beta: float = 1 / 10e9                # s per byte, on one node
    gamma: float = 1 / 20e9               # s per byte reduced
    alpha_inter: float = 5.0e-6           # s per message between nodes
    beta_inter: float = 1 / 12.5e9        # s per byte between nodes (100 Gb/s)
    ranks_per_node: int = 4
    mem_per_rank: int | None = None       # bytes; None: no limit
    conv_gflops: tuple = ()               # ((conv_key(layer), GFLOP/s), ...) measured per conv shape
    gemm_gflops: float = 100.0            # float32 GFLOP/s of a dense layer's GEMMs
    mem_bandwidth: float = 10e9           # bytes/s copied: halo work arrays
    pack_bandwidth_d: float = 10e9        # bytes/s packing a halo piece cut across depth
    pack_bandwidth_h: float = 8e9         # ... across height
    pack_bandwidth_w: float = 2e9         # ... across width (strided: one element per row)
    element_rates: tuple = ()             # ((kind name, elements/s), ...) measured, forward + backward

    def summary(self) -> str:
        """The constants in one line (``conv_gflops`` as its count of measured shapes)."""
        parts = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                 for k, v in self.__dict__.items() if k not in ("conv_gflops", "element_rates") and v is not None]
        parts += [f"{name}={rate:.4g}/s" for name, rate in self.element_rates]
        return "Machine(" + ", ".join(parts) + f", conv_gflops: {len(self.conv_gflops)} measured)"

    def element_rate(self, kind) -> float:
        """Elements/s of one forward + backward of layer kind ``kind`` (``refimpl.layers.LayerKind``):
        as measured (``element_rates``), else the kind's declared ``plan_element_rate``."""
        measured = dict(self.element_rates).get(kind.name)
        if measured is not None:
            return measured
        if kind.plan_element_rate is None:
            raise ValueError(f"layer kind {kind.name} declares no plan_element_rate")
        return kind.plan_element_rate

    def conv_rate(self, layer, voxels) -> float:
        """GFLOP/s of ``layer`` when one call convolves ``voxels`` input voxels (samples x
        block): interpolated in log-log between the rates measured for its shape
        (``conv_key``) at other voxel counts, the nearest one outside their range; for a
        shape never measured, the nearest measured shape of the same kind, kernel, stride
        and input gradient (nearest in log C + log F); else ``gflops``."""
        kind, _, tail, _ = _parse_conv_key(conv_key(layer, (1, 1, 1)))
        measured = _rate_table(self.conv_gflops).get((kind, tail))   # (C, F) -> [(log voxels, log rate)]
        if not measured:
            return self.gflops
        c, f = min(measured, key=lambda cf: (abs(math.log2(cf[0] / layer.c_in)) +
                                             abs(math.log2(cf[1] / layer.c_out)), cf))
        points = measured[(c, f)]
        x = math.log(max(voxels, 1))
        if x <= points[0][0]:
            return math.exp(points[0][1])
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if x <= x1:
                return math.exp(y0 + (y1 - y0) * (x - x0) / (x1 - x0)) if x1 > x0 else math.exp(y1)
        return math.exp(points[-1][1])

    def link(self, a: int, b: int) -> tuple[float, float]:
        """(alpha, beta) between world ranks a and b."""
        same = a // self.ranks_per_node == b // self.ranks_per_node
        return (self.alpha, self.beta) if same else (self.alpha_inter, self.beta_inter)

    def group_link(self, group) -> tuple[float, float]:
        """(alpha, beta) of a collective over ``group`` = (size, lowest rank, highest rank)."""
        _, lo, hi = group
        same = lo // self.ranks_per_node == hi // self.ranks_per_node
        return (self.alpha, self.beta) if same else (self.alpha_inter, self.beta_inter)


MACHINE_KEYS = {f for f in Machine.__dataclass_fields__}


def _calibrated_labels() -> tuple:
    """The ``plan_label`` of every kind whose rate ``--calibrate`` measures per shape: what a
    ``conv_key`` starts with."""
    from . import layers
    kinds = (*layers.REGISTRY.values(), *layers.PLAN_ONLY.values())
    return tuple(dict.fromkeys(k.plan_label for k in kinds if k.plan_calibrated))


def _conv_key_pattern(labels):
    return re.compile(rf"^({'|'.join(map(re.escape, labels))}) (\d+)->(\d+) (k\d+x\d+x\d+ s\d+x\d+x\d+)( no-dx)?"
                      r" @(\d+)x(\d+)x(\d+)$")


def conv_key(layer, in_dhw=None) -> str:
    """``'conv 16->32 k3x3x3 s1x1x1'`` (+ ``' no-dx'`` for a layer without an input gradient):
    a conv's shape; with ``in_dhw`` also ``' @DxHxW'``, the one-sample input a rate of
    ``Machine.conv_gflops`` was measured on."""
    k, st = "x".join(map(str, layer.kernel)), "x".join(map(str, layer.stride))
    key = f"{layer.kind} {layer.c_in}->{layer.c_out} k{k} s{st}" + ("" if layer.input_grad else " no-dx")
    return key if in_dhw is None else key + " @" + "x".join(map(str, in_dhw))


@functools.lru_cache(maxsize=64)
def _rate_table(conv_gflops) -> dict:
    """``Machine.conv_gflops`` parsed once: (kind, 'kAxBxC sAxBxC[ no-dx]') -> (C, F) -> the
    sorted (log input voxels, log rate) points measured for that shape."""
    table = {}
    for key, rate in conv_gflops:
        kind, cf, tail, voxels = _parse_conv_key(key)
        table.setdefault((kind, tail), {}).setdefault(cf, []).append((math.log(voxels), math.log(rate)))
    for shapes in table.values():
        for points in shapes.values():
            points.sort()
    return table


def _parse_conv_key(key):
    """(kind, (C, F), 'kAxBxC sAxBxC[ no-dx]', input voxels) of a measured ``conv_key``;
    ValueError if malformed."""
    labels = _calibrated_labels()
    m = _conv_key_pattern(labels).match(key)
    if not m:
        raise ValueError(f"conv rate key {key!r} is not like '{labels[0]} 16->32 k3x3x3 s1x1x1 @32x32x32' "
                         f"(kind {' or '.join(labels)}, ' no-dx' before the @ for a layer without dX)")
    return (m.group(1), (int(m.group(2)), int(m.group(3))), m.group(4) + (m.group(5) or ""),
            int(m.group(6)) * int(m.group(7)) * int(m.group(8)))


def _element_rate_kinds() -> dict:
    """name -> kind of every registered kind that declares a ``plan_element_rate``."""
    from .layers import PLAN_ONLY, REGISTRY
    return {k.name: k for k in (*REGISTRY.values(), *PLAN_ONLY.values()) if k.plan_element_rate is not None}


def _load_element_rates(path, value) -> tuple:
    """A machine file's ``[element_rates]`` table (kind name = elements/s) as ``Machine.element_rates``."""
    known = _element_rate_kinds()
    if not isinstance(value, dict):
        raise ValueError(f"--machine {path}: element_rates must be a table of kind name = elements/s, got {value!r}")
    for name, rate in value.items():
        if name not in known:
            raise ValueError(f"--machine {path}: [element_rates] {name!r} is not a layer kind with an element rate "
                             f"(known: {', '.join(known)}; a kind from REFIMPL_KINDS needs it set as when calibrating)")
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
            raise ValueError(f"--machine {path}: [element_rates] {name!r} must be a positive number, got {rate!r}")
    return tuple((name, float(rate)) for name, rate in value.items())


def load_machine(path: str) -> Machine:
    """A machine TOML file (keys of ``Machine``; mem_per_rank may be '16GiB'); ValueError naming
    the file and key."""
    from .config import load_toml
    table = load_toml(path, "--machine")
    unknown = sorted(set(table) - MACHINE_KEYS)
    moved = [key for key in unknown if key.endswith("_rate")]
    if moved:
        raise ValueError(f"--machine {path}: {', '.join(moved)}: a kind's rate is no longer a machine key; the "
                         f"[element_rates] table holds one per kind name ({', '.join(_element_rate_kinds())}): run "
                         "`refimpl plan --calibrate --save-machine FILE` again, or rename the keys")
    if unknown:
        raise ValueError(f"--machine {path}: unknown key(s) {unknown}; known: {sorted(MACHINE_KEYS)}")
    values = {}
    for key, value in table.items():
        if key == "element_rates":
            values[key] = _load_element_rates(path, value)
            continue
        if key == "conv_gflops":
            if not isinstance(value, dict):
                raise ValueError(f"--machine {path}: conv_gflops must be a table of "
                                 f"'conv C->F kKxKxK sSxSxS @DxHxW' = GFLOP/s, got {value!r}")
            for shape, rate in value.items():
                try:
                    _parse_conv_key(shape)
                except ValueError as err:
                    raise ValueError(f"--machine {path}: [conv_gflops] {err}") from None
                if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
                    raise ValueError(f"--machine {path}: [conv_gflops] {shape!r} must be a positive number, "
                                     f"got {rate!r}")
            values[key] = tuple((shape, float(rate)) for shape, rate in value.items())
        elif key == "mem_per_rank":
            values[key] = parse_bytes(value)
        elif key == "ranks_per_node":
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--machine {path}: ranks_per_node must be a positive integer, got {value!r}")
            values[key] = value
        else:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"--machine {path}: {key} must be a positive number, got {value!r}")
            values[key] = float(value)
    return Machine(**values)


# ---------------------------------------------------------------- the model's layers

@dataclass(frozen=True)
class Layer:
    """One layer as the planner sees it (global extents; the grid is applied later): an entry
    of the model's ``describe()`` (refimpl/models), priced by its kind's hooks (refimpl/layers)."""
    name: str
    kind: str               # the kind's plan_label: conv | conv_transpose | pool | bn | act | linear | ...
    c_in: int
    c_out: int
    in_dhw: tuple
    out_dhw: tuple
    kernel: tuple = (1, 1, 1)
    stride: tuple = (1, 1, 1)
    padding: tuple = (0, 0, 0)
    output_padding: tuple = (0, 0, 0)
    weights: int = 0        # parameters of the whole layer (weight + bias)
    split: str = "none"     # model axis: none | filter | filter-replicated | channel | row | row-split
    split_in: bool = False  # its input is channel-split over the model group
    input_grad: bool = True
    op: str = ""            # the registry kind (conv3d, max_pool3d, ...); '' : the first one labelled ``kind``
    options: tuple = ()     # ((name, value), ...): the kind's declared options (group norm's num_groups) given

    def option(self, name):
        """The value of the kind's option ``name`` (refimpl/layers/options.py), its declared
        default where the ``describe()`` entry gave none."""
        given = dict(self.options)
        if name in given:
            return given[name]
        return {o.name: o for o in layer_kind(self).options}[name].default


def _kind_named(name):
    from .layers import plan_kind
    return plan_kind(name)


def layer_kind(layer: Layer):
    """The registry descriptor (``refimpl.layers.LayerKind``) whose ``plan_*`` hooks price ``layer``."""
    return _kind_named(layer.op or layer.kind)


def layer_of(entry: dict) -> Layer:
    """The planner's record of one entry of a model's ``describe()``."""
    fields = dict(entry)
    op = fields.pop("kind")
    kind = _kind_named(op)
    options = {name: fields.pop(name) for name in kind.option_names() if name in fields}
    unknown = sorted(set(fields) - set(Layer.__dataclass_fields__))
    if unknown:
        raise ValueError(f"describe() entry {fields.get('name')!r}: {unknown} are neither planner fields nor options "
                         f"of kind {op} ({', '.join(kind.option_names()) or 'it has none'})")
    by_name = {o.name: o for o in kind.options}
    checked = tuple((name, by_name[name].check(value)) for name, value in options.items())
    return Layer(kind=kind.plan_label, op=op, options=checked, **fields)


def model_layers(model: str, config) -> list[Layer]:
    """The layer list of CosmoFlow or the U-Net: the model class's own ``describe()`` of the
    layers it builds (tests/test_plan.py compares it with the built model)."""
    from .models import MODELS, resolve_config
    config = resolve_config(model, config)            # ValueError for an unknown model or preset
    return [layer_of(entry) for entry in MODELS[model].describe(config)]


# ---------------------------------------------------------------- per-rank costs

@dataclass
class LayerCost:
    """One layer's share of a step on one rank."""
    name: str
    kind: str
    flops: float = 0.0
    halo_bytes: int = 0            # forward + adjoint halo exchange, bytes this rank sends
    halo_messages: int = 0
    model_bytes: int = 0           # channel allgathers / reduce-scatters (parallel/channels.py's TRAFFIC)
    model_messages: int = 0
    model_allreduce_bytes: int = 0  # replicated input gradients allreduced over the model group
    allreduce_bytes: int = 0       # every buffer the layer allreduces (flatten, batch norm, model group)
    spatial_bytes: int = 0         # the flatten layer's allreduce of partial products
    saved_bytes: int = 0           # activations kept for backward
    transient_bytes: int = 0       # work arrays alive while the layer runs
    weight_bytes: int = 0          # this rank's slice of the layer's parameters
    param_bytes: list = field(default_factory=list)   # per parameter (weight, bias), as the module holds them
    compute_s: float = 0.0
    halo_s: float = 0.0
    comm_s: float = 0.0            # every other message of the layer


def grid5(dims) -> tuple:
    dims = tuple(int(d) for d in dims)
    return dims + (1,) * (5 - len(dims))


def _allreduce_s(n_bytes, group, machine, algorithm="native"):
    from .parallel.allreduce import predicted_time
    alpha, beta = machine.group_link(group)
    return predicted_time(algorithm, n_bytes, group[0], alpha, beta, machine.gamma)


def _group(dims, coords, axes):
    """(size, lowest rank, highest rank) of the ranks that differ from ``coords`` only on ``axes``."""
    lo = grid_rank(tuple(0 if a in axes else c for a, c in enumerate(coords)), dims)
    hi = grid_rank(tuple(dims[a] - 1 if a in axes else c for a, c in enumerate(coords)), dims)
    return math.prod(dims[a] for a in axes), lo, hi


def _halo(plan, coords3, dims, coords, channels, samples, itemsize, adjoint, machine):
    """(bytes, messages, seconds) this rank sends in one halo exchange of ``plan``."""
    nbytes = messages = 0
    seconds = 0.0
    me = grid_rank(coords, dims)
    for axis in range(3):
        pieces = plan.recvs(coords3, axis) if adjoint else plan.sends(coords3, axis)
        for m in pieces:
            size = m.volume * channels * samples * itemsize
            peer = grid_rank(coords[:1] + tuple(m.peer) + coords[4:], dims)
            alpha, beta = machine.link(me, peer)
            nbytes, messages, seconds = nbytes + size, messages + 1, seconds + alpha + size * beta
    return nbytes, messages, seconds


def _volume(ranges):
    return math.prod(b - a for a, b in ranges)


def _halo_copies_s(plan, coords3, channels, samples, itemsize, adjoint, machine):
    """Seconds one halo exchange (forward or adjoint) spends copying on this rank, as
    ``HaloExchange`` does: the work array (the hull of the owned and needed ranges) zeroed
    and the owned block (adjoint: the needed range's gradient) copied in, then every piece
    it sends packed and every piece it receives unpacked, at its axis' pack bandwidth.
    Nothing where the exchange is the identity (one rank, no ghosts)."""
    owned, needed = plan.owned(coords3), plan.needed(coords3)
    pieces = [(axis, m) for axis in range(3) for m in plan.sends(coords3, axis) + plan.recvs(coords3, axis)]
    if needed == owned and not pieces:
        return 0.0
    per_voxel = channels * samples * itemsize
    frame = [(min(a, c), max(b, d)) for (a, b), (c, d) in zip(owned, needed)]
    block = _volume(needed if adjoint else owned)
    seconds = (_volume(frame) + 2 * block) * per_voxel / machine.mem_bandwidth
    pack = (machine.pack_bandwidth_d, machine.pack_bandwidth_h, machine.pack_bandwidth_w)
    return seconds + sum(m.volume * per_voxel / pack[axis] for axis, m in pieces)


def param_sizes(layer: Layer, pm: int = 1, m: int = 0) -> list[int]:
    """Elements of each parameter (weight, then bias if any) model rank ``m`` of ``pm`` holds
    (the kind's ``plan_param_sizes``: the slices ``nn/model_parallel.py`` keeps)."""
    return layer_kind(layer).plan_param_sizes(layer, pm, m, lambda channels: _width(channels, pm, m))


def _width(channels, pm, m):
    a, b = block_range(channels, pm, m)
    return b - a


def gradient_buckets(costs, bucket_bytes=GRAD_BUCKET_BYTES, first_bucket_bytes=FIRST_BUCKET_BYTES) -> list[int]:
    """Bytes of each gradient bucket of one rank: its parameters in backward order (the layers
    reversed, each module's parameters reversed) packed by ``partition.pack_buckets``, exactly
    as ``GradientSynchronizer(model.parameters(), ...)`` packs them."""
    sizes = [b for c in reversed(costs) for b in reversed(c.param_bytes)]
    return [sum(sizes[i] for i in group) for group in
            pack_buckets(sizes, [0] * len(sizes), bucket_bytes, first_bucket_bytes)]


@functools.lru_cache(maxsize=4096)
def halo_plan_of(layer: Layer, spatial_dims: tuple):
    """The halo plan the layer builds on a (Pd, Ph, Pw) grid (the same function the layer calls)."""
    return layer_kind(layer).plan_halo(layer, spatial_dims)


class RankView:
    """One rank of a grid as the kinds' ``plan_cost`` hooks see it: its samples ``n_r``, the
    grid ``dims`` / ``coords`` (5 entries; ``sdims`` / ``scoords`` the spatial ones, ``pm`` /
    ``m`` the model axis), its model and spatial groups, and the prices of its messages."""

    def __init__(self, dims, coords, batch, itemsize, machine):
        self.dims, self.coords, self.itemsize, self.machine = dims, coords, itemsize, machine
        self.pm, self.m = dims[4], coords[4]
        self.sdims, self.scoords = dims[1:4], coords[1:4]
        lo, hi = block_range(batch, dims[0], coords[0])
        self.n_r = hi - lo
        self.model_group = _group(dims, coords, (4,))
        self.spatial_group = _group(dims, coords, (1, 2, 3))

    volume = staticmethod(_volume)

    def group(self, axes):
        """(size, lowest rank, highest rank) of the ranks that differ from this one only on ``axes``."""
        return _group(self.dims, self.coords, axes)

    def width(self, channels):
        """This rank's share of ``channels`` split over the model axis."""
        return _width(channels, self.pm, self.m)

    def c_local(self, layer):
        """Input channels the rank holds."""
        return self.width(layer.c_in) if layer.split_in else layer.c_in

    def f_local(self, layer):
        """Output channels the rank computes: its slice when the layer is split, or when a
        channel-wise layer keeps its channel-split input."""
        if layer.split != "none" or (layer_kind(layer).plan_channelwise and layer.split_in):
            return self.width(layer.c_out)
        return layer.c_out

    def block_voxels(self, layer):
        """Voxels of the rank's block of the layer's input (1 for the dense head)."""
        return _volume([block_range(n, p, c) for n, p, c in zip(layer.in_dhw, self.sdims, self.scoords)]) \
            if layer.in_dhw else 1

    def halo_plan(self, layer):
        return halo_plan_of(layer, self.sdims)

    def halo(self, plan, channels, adjoint):
        """(bytes, messages, seconds) this rank sends in one halo exchange of ``plan``."""
        return _halo(plan, self.scoords, self.dims, self.coords, channels, self.n_r, self.itemsize, adjoint,
                     self.machine)

    def halo_copies_s(self, plan, channels, adjoint):
        """Seconds one halo exchange spends copying on this rank (``_halo_copies_s``)."""
        return _halo_copies_s(plan, self.scoords, channels, self.n_r, self.itemsize, adjoint, self.machine)

    def moved_bytes(self, channels, per_channel):
        """Bytes this rank sends in a channel allgather / reduce-scatter over the model axis."""
        return moved_bytes(channels, self.pm, self.m, per_channel, self.itemsize)

    def allreduce_s(self, n_bytes, group):
        return _allreduce_s(n_bytes, group, self.machine)


def rank_costs(layers, dims, coords, batch, itemsize, machine) -> list[LayerCost]:
    """Every layer's cost on the rank at ``coords`` (5 entries) of grid ``dims``: what its
    kind's ``plan_cost`` charges, plus the parameter slices it holds."""
    dims, coords = grid5(dims), tuple(coords) + (0,) * (5 - len(coords))
    rank = RankView(dims, coords, batch, itemsize, machine)
    costs = []
    for layer in layers:
        cost = LayerCost(layer.name, layer.kind)
        compute_s = layer_kind(layer).plan_cost(layer, rank, cost)
        if layer.weights:
            # (the flatten layer keeps its whole weight on every spatial rank, and allreduces the
            # whole gradient, zero outside its columns: nn/spatial.py SpatialFlattenLinear)
            cost.param_bytes = [n * itemsize for n in param_sizes(layer, rank.pm, rank.m)]
            cost.weight_bytes = sum(cost.param_bytes)
        cost.allreduce_bytes += cost.spatial_bytes + cost.model_allreduce_bytes
        cost.compute_s = compute_s
        costs.append(cost)
    return costs


# ---------------------------------------------------------------- a grid's prediction

OPTIMIZER_COPIES = {"sgd": 1, "adam": 2}


@dataclass
class GridPlan:
    dims: tuple
    feasible: bool
    why: str
    step_s: float = 0.0
    compute_s: float = 0.0
    halo_s: float = 0.0
    model_s: float = 0.0
    allreduce_s: float = 0.0
    memory_bytes: int = 0
    grad_bytes: int = 0
    buckets: int = 0
    critical_rank: int = 0
    layers: list = field(default_factory=list)     # LayerCost of the critical rank

    @property
    def family(self) -> str:
        pn, pd, ph, pw, pm = self.dims
        ps = pd * ph * pw
        kinds = [name for name, p in (("data", pn), ("spatial", ps), ("model", pm)) if p > 1]
        return "one rank" if not kinds else kinds[0] if len(kinds) == 1 else "hybrid " + "+".join(kinds)

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "layers"}
        out["family"] = self.family
        out["layers"] = [c.__dict__ for c in self.layers]
        return out


def _representatives(dims):
    """Rank coordinates to evaluate: the first and last sample group and model rank (the
    largest slices; the smallest slice, which moves the most channel bytes; other nodes),
    and per spatial axis the first, second and last coordinate (the largest block, an
    interior one with halos on both sides, the last)."""
    axes = [sorted({0, dims[0] - 1})] + [sorted({0, min(1, p - 1), p - 1}) for p in dims[1:4]] + \
        [sorted({0, dims[4] - 1})]
    out = [()]
    for choices in axes:
        out = [c + (x,) for c in out for x in choices]
    return out


def plan_grid(layers, dims, batch, machine=Machine(), *, itemsize=4, optimizer="sgd", algorithm="native",
              bucket_bytes=GRAD_BUCKET_BYTES, first_bucket_bytes=FIRST_BUCKET_BYTES, every_rank=False,
              optimizer_sharding=False) -> GridPlan:
    """Predicted step of ``layers`` on grid ``dims`` for a global ``batch`` (float32 by default).

    ``optimizer_sharding``: the distributed weight update (parallel/sharded_update.py): the
    optimizer state is this rank's 1/|G| block of it (G: the ranks holding the same parameters);
    its reduce-scatter + allgather move the allreduce's bytes."""
    dims = grid5(dims)
    pn, pd, ph, pw, pm = dims
    why = feasibility(layers, dims, batch)
    if why:
        return GridPlan(dims, False, why)
    coords_list = [grid_coords(r, dims) for r in range(math.prod(dims))] if every_rank else _representatives(dims)
    best, peak = None, 0
    for coords in coords_list:
        costs = rank_costs(layers, dims, coords, batch, itemsize, machine)
        # gradient allreduce: the rank's parameter slices in backward order, bucketed, over the
        # ranks holding the same slice (data x spatial group)
        buckets = gradient_buckets(costs, bucket_bytes, first_bucket_bytes)
        members = _group(dims, coords, (0, 1, 2, 3))
        ar = sum(_allreduce_s(n, members, machine, algorithm) for n in buckets)
        if members[0] > 1:             # each bucket packed from the gradients and unpacked back
            ar += 2 * sum(buckets) / machine.mem_bandwidth
        weights = sum(buckets)
        state = weights * OPTIMIZER_COPIES[optimizer]
        if optimizer_sharding:
            state = -(-state // members[0])                    # this rank's block of the state
        memory = sum(c.saved_bytes for c in costs) + max((c.transient_bytes for c in costs), default=0) + \
            weights * 3 + state                                # + gradient + bucket copy + optimizer
        compute = sum(c.compute_s for c in costs)
        halo = sum(c.halo_s for c in costs)
        comm = sum(c.comm_s for c in costs)
        step = compute + halo + comm + ar
        plan = GridPlan(dims, True, "", step, compute, halo, comm, ar, memory, weights, len(buckets),
                        grid_rank(coords, dims), costs)
        peak = max(peak, memory)
        if best is None or (plan.step_s, plan.memory_bytes) > (best.step_s, best.memory_bytes):
            best = plan
    best.memory_bytes = peak            # the slowest rank's time, the fullest rank's memory
    if machine.mem_per_rank is not None and best.memory_bytes > machine.mem_per_rank:
        best.feasible = False
        best.why = (f"needs {format_bytes(best.memory_bytes)} per rank, more than the "
                    f"{format_bytes(machine.mem_per_rank)} available")
    return best


def feasibility(layers, dims, batch) -> str:
    """Why ``dims`` cannot run these layers at all ('' if it can)."""
    pn, pd, ph, pw, pm = grid5(dims)
    if batch % pn:
        return f"Pn = {pn} sample groups do not divide the batch of {batch}"
    first = layers[0]
    for p, n, axis in zip((pd, ph, pw), first.in_dhw, "DHW"):
        if p > n:
            return f"P{axis.lower()} = {p} ranks on an extent of {n}"
    if pm > 1:
        split = [lay for lay in layers if layer_kind(lay).plan_splits(lay)]
        if not split:
            return f"Pm = {pm} but the model splits no layer (set model_parallel = 'filter' or 'channel')"
        # a filter / row split divides the outputs, a channel split or a gather the inputs
        narrow = min(layer_kind(lay).plan_split_channels(lay) for lay in split)
        if pm > narrow:
            return f"Pm = {pm} exceeds the {narrow} channels of the narrowest split layer"
    return ""


#: The most ranks ``search`` takes: the grids of any count up to 2^20 (at most 1,102,500
#: ordered 5-tuples, for 997920) are enumerated and screened in about two seconds.
MAX_RANKS = 2 ** 20
#: The grids ``search`` prices in full by default: each takes 10 to 250 ms (more ranks on
#: every axis, more layers: longer), so a search answers in a few seconds.
MAX_PRICED = 24


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending (trial division up to sqrt(n))."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def factorizations(p: int, parts: int):
    """Every ordered tuple of ``parts`` positive integers whose product is p (a generator).

    Each entry is a divisor of p, so only p's divisors are tried: the work is that of the
    tuples themselves (1365 5-tuples for p = 2048, 5 for a prime), never a count up to p."""
    of_p = divisors(p)
    below = {m: [d for d in of_p if m % d == 0] for m in of_p}      # m | p -> the divisors of m

    def split(m, parts):
        if parts == 1:
            yield (m,)
            return
        for d in below[m]:
            for rest in split(m // d, parts - 1):
                yield (d,) + rest
    return split(p, parts)


def cut_faces(dims, in_dhw, batch) -> float:
    """Voxels on the faces of a rank's input block cut by the grid, times its samples: the
    grid's halo traffic to first order, cheap enough to order every grid by (``search``)."""
    spatial = grid5(dims)[1:4]
    block = [n / p for n, p in zip(in_dhw, spatial)]
    return batch / dims[0] * sum(math.prod(block) / block[a] for a, p in enumerate(spatial) if p > 1)


class GridSearch(list):
    """The grids ``search`` lists, best first (GridPlan), and how many it looked at:
    ``grids`` enumerated, ``runnable`` of them that can run the model at all (``feasibility``),
    ``priced`` of those predicted in full (the rest were left out by ``max_grids``)."""

    def __init__(self, plans, grids: int, runnable: int, priced: int):
        super().__init__(plans)
        self.grids, self.runnable, self.priced = grids, runnable, priced


def search(layers, ranks, batch, machine=Machine(), *, layers_mp=None, top=None, max_grids=MAX_PRICED,
           progress=None, **kw) -> GridSearch:
    """The grids of ``ranks`` ranks, feasible ones first, by predicted step time.

    ``layers_mp``: the model with its model-parallel layers, used on grids with Pm > 1
    (None: no model axis).  Spatial splits are taken in canonical order Pd >= Ph >= Pw
    when the sample is cubic: the others are rotations of it, which differ only in which
    faces their halos pack, and the canonical one puts the most splits on depth, whose
    faces are the cheapest to pack (``Machine.pack_bandwidth_d``).

    Pricing a grid takes tens of milliseconds and a large rank count has tens of thousands
    of runnable grids, so at most ``max_grids`` of them are priced: those whose ranks cut
    the fewest voxels (``cut_faces``; the narrower model axis first among equals).  For one
    model axis Pm, every split of the other P/Pm ranks into Pn x Ps gives a rank about the
    same compute, memory and gradient allreduce group (its samples times its block's
    voxels is batch x sample / (P/Pm)); what sets them apart is mostly the halo, which
    grows with the cut faces.  The grids that cannot run are listed after the priced
    ones, at most ``max_grids`` of them (with why).  ValueError above ``MAX_RANKS``.
    ``progress(done, total)``, if given, is called before each grid is priced and once at the end."""
    if not 1 <= ranks <= MAX_RANKS:
        raise ValueError(f"the planner searches the grids of 1 to {MAX_RANKS} ranks, not {ranks}")
    cubic = len(set(layers[0].in_dhw)) == 1
    grids, runnable, unrunnable = 0, [], []
    for dims in factorizations(ranks, 5):
        pn, pd, ph, pw, pm = dims
        if (cubic and not pd >= ph >= pw) or (pm > 1 and layers_mp is None):
            continue
        grids += 1
        why = feasibility(layers if pm == 1 else layers_mp, dims, batch)
        if not why:
            runnable.append(dims)
        elif len(unrunnable) < max_grids:
            unrunnable.append(GridPlan(dims, False, why))
    runnable.sort(key=lambda dims: (cut_faces(dims, layers[0].in_dhw, batch), dims[4]))
    priced, chosen = [], runnable[:max_grids]
    for dims in chosen:
        phase(f"pricing grid {dims}")
        if progress is not None:
            progress(len(priced), len(chosen))
        priced.append(plan_grid(layers if dims[4] == 1 else layers_mp, dims, batch, machine, **kw))
    if progress is not None:
        progress(len(priced), len(chosen))
    plans = sorted(priced + unrunnable,
                   key=lambda g: (not g.feasible, not g.memory_bytes, g.step_s if g.feasible else g.memory_bytes))
    return GridSearch(plans[:top] if top else plans, grids, len(runnable), min(len(runnable), max_grids))


# ---------------------------------------------------------------- calibration

def save_machine(machine: Machine) -> str:
    """The machine as a TOML file ``load_machine`` reads back."""
    lines = ["# refimpl plan machine constants (refimpl plan --calibrate; docs/planner.md)"]
    for key, value in machine.__dict__.items():
        if value is not None and key not in ("conv_gflops", "element_rates"):
            lines.append(f"{key} = {value!r}" if not isinstance(value, str) else f'{key} = "{value}"')
    if machine.element_rates:
        lines += ["", "[element_rates]    # measured per layer kind (elements/s of forward + backward)"]
        lines += [f"{name} = {rate!r}" for name, rate in machine.element_rates]
    if machine.conv_gflops:
        lines += ["", "[conv_gflops]      # measured per conv shape (GFLOP/s of forward + backward)"]
        lines += [f'"{shape}" = {rate!r}' for shape, rate in machine.conv_gflops]
    return "\n".join(lines) + "\n"


#: The float32 input (N, C, D, H, W) on which ``calibrate`` measures every kind's element rate.
CALIBRATION_BLOCK = (2, 16, 32, 32, 32)

#: Most FLOPs of one calibration run of a conv shape (forward + backward): its extent is
#: cut down (to at most 32, at least 4) until it fits, so calibration takes seconds.
CALIBRATION_FLOPS = 4e9


def _best_time(fn, repeats):
    import time
    fn()                                             # warm-up: allocations, thread pool
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def calibration_layers(layers):
    """The distinct conv shapes (``conv_key``) of ``layers``, each at two calibration inputs
    of one sample: the layer's extent cut to at most 32 and to ``CALIBRATION_FLOPS``, and
    that with half the depth (a rate depends on the block a rank holds)."""
    from dataclasses import replace
    out, seen = [], set()
    for layer in layers:
        kind = layer_kind(layer)
        if not kind.plan_calibrated or conv_key(layer) in seen:
            continue
        seen.add(conv_key(layer))
        per_voxel = 2.0 * layer.c_in * layer.c_out * math.prod(layer.kernel) * (3 if layer.input_grad else 2)
        size = max(4, min(32, int((CALIBRATION_FLOPS / per_voxel) ** (1 / 3)), max(layer.in_dhw)))
        for in_dhw in ((size,) * 3, (max(1, size // 2), size, size)):
            out_dhw = kind.plan_output_extent(layer, in_dhw)
            out.append(replace(layer, in_dhw=in_dhw, out_dhw=out_dhw, split="none", split_in=False))
    return out


def _time_conv(layer, repeats, rng):
    """Seconds of one forward + backward of ``layer`` (one sample, float32) by refimpl's functions
    (its kind's ``plan_time``)."""
    return layer_kind(layer).plan_time(layer, repeats, rng, _best_time)


def calibrate(machine: Machine = Machine(), repeats: int = 3, layers=(), report=None, comm=None) -> Machine | None:
    """Measure this machine with short microbenchmarks of refimpl's own functions:

    - ``conv_gflops``: forward + backward of every conv shape of ``layers`` (the model to
      plan) on two inputs (``calibration_layers``), the planner's FLOPs over the time;
      the machine's own entries are kept unless measured again (so calibrating for one
      model, then another, accumulates both); ``gflops``: their median (the rate of a shape
      never measured);
    - ``gemm_gflops``: a 512^3 float32 matmul; ``element_rates``: every registered kind that
      declares a ``plan_element_rate`` (normalisations, activations, pooling) times its own
      forward + backward on the (2, 16, 32^3) block ``CALIBRATION_BLOCK``
      (``LayerKind.plan_measure_rate``);
    - ``mem_bandwidth``: a 32 MiB copy; ``pack_bandwidth_d/h/w``: one-voxel faces of a
      (2, 16, 34^3) block copied into contiguous buffers, as the halo exchange packs them;
    - with ``comm`` of 2 or more ranks (under mpiexec), alpha and beta from a ping-pong
      between its ranks 0 and 1 (small messages: alpha; 8 MiB: beta).  Every rank computes
      at once, as in training.

    Each measurement is a phase of the fail-stop watchdog (``progress.phase``), so a rank
    that stops answering is named with what the others were measuring.  ``report(line)``
    receives one line per measurement.  Returns the machine on rank 0 of ``comm``, None on
    its other ranks."""
    import statistics

    import numpy

    say = report or (lambda line: None)
    rng = numpy.random.default_rng(0)

    def normal(*shape):
        return rng.standard_normal(shape, dtype=numpy.float32)

    def timed(what, fn, times=repeats):
        phase(f"calibration: {what}")
        return _best_time(fn, times)

    if comm is not None:
        comm.Barrier()     # every rank starts measuring together (none still starting up beside it)
    rates = dict(machine.conv_gflops)
    for layer in calibration_layers(layers):
        key = conv_key(layer, layer.in_dhw)
        phase(f"calibration: {key}")
        seconds = _time_conv(layer, repeats, rng)
        (cost,) = rank_costs([layer], (1,) * 5, (0,) * 5, 1, 4, machine)
        rates[key] = cost.flops / seconds / 1e9
        say(f"{key}: {seconds * 1e3:.2f} ms, {rates[key]:.1f} GFLOP/s")
    gflops = statistics.median(rates.values()) if rates else machine.gflops
    a, b = normal(512, 512), normal(512, 512)
    gemm = 2 * 512 ** 3 / timed("GEMM", lambda: a @ b) / 1e9
    x = normal(*CALIBRATION_BLOCK)
    element_rates = dict(machine.element_rates)
    for name, kind in _element_rate_kinds().items():
        element_rates[name] = kind.plan_measure_rate(x, rng, lambda fn, what=name: timed(what, fn))
    big, dst = normal(8 * 2 ** 20), numpy.empty(8 * 2 ** 20, numpy.float32)
    mem_bandwidth = big.nbytes / timed("copy", lambda: numpy.copyto(dst, big))
    block = normal(2, 16, 34, 34, 34)
    faces = [block[:, :, 1:2], block[:, :, :, 1:2], block[:, :, :, :, 1:2]]
    packs = [face.nbytes / timed(f"halo packing across {axis}", lambda f=face: numpy.ascontiguousarray(f),
                                 repeats * 10) for axis, face in zip("DHW", faces)]
    say(f"GEMM {gemm:.1f} GFLOP/s; G elements/s: "
        + ", ".join(f"{name} {rate / 1e9:.3f}" for name, rate in element_rates.items())
        + f"; copy {mem_bandwidth / 1e9:.2f} GB/s; "
        f"halo faces packed at {', '.join(f'{p / 1e9:.2f}' for p in packs)} GB/s (d, h, w)")
    values = dict(machine.__dict__, gflops=gflops, conv_gflops=tuple(rates.items()), gemm_gflops=gemm,
                  element_rates=tuple(element_rates.items()), mem_bandwidth=mem_bandwidth,
                  pack_bandwidth_d=packs[0], pack_bandwidth_h=packs[1], pack_bandwidth_w=packs[2])
    if comm is not None and comm.Get_size() > 1:
        from .parallel.collectives import ping_pong
        phase("calibration: ping-pong between ranks 0 and 1")
        times = {nbytes: ping_pong(comm, nbytes, reps) for nbytes, reps in ((8, 50), (8 * 2 ** 20, 5))}
        if comm.Get_rank() != 0:
            return None
        times = {nbytes: statistics.median(t) for nbytes, t in times.items()}
        alpha = times[8]
        beta = max((times[8 * 2 ** 20] - alpha) / (8 * 2 ** 20), 1e-12)
        # gamma (reducing a byte) is not measured: half a byte's transfer; links between nodes
        # cannot be measured on one node: never faster than the measured one
        values.update(alpha=alpha, beta=beta, gamma=beta / 2, alpha_inter=max(machine.alpha_inter, alpha),
                      beta_inter=max(machine.beta_inter, beta))
    return Machine(**values)


__all__ = ["Machine", "load_machine", "Layer", "layer_kind", "layer_of", "RankView", "model_layers", "rank_costs",
           "plan_grid", "search", "GridPlan", "parse_bytes", "format_bytes", "factorizations", "feasibility",
           "calibrate", "calibration_layers", "conv_key", "save_machine", "MAX_RANKS", "MAX_PRICED", "divisors",
           "cut_faces", "GridSearch"]
