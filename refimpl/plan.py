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
  ``collectives.predicted_time`` for the chosen algorithm over the Pn x Ps ranks holding a
  copy of the parameter slice;
- memory: saved activations (each layer keeps its input, halo included), the largest
  transient (halo work array + the output being produced), weights, gradients, the
  gradient buckets (one more copy) and the optimizer state (SGD momentum: 1 copy; Adam: 2).

Time of the step = compute (FLOPs / rate) + every message's ``alpha + bytes * beta``
(intra- or inter-node constants by where the peers sit: ranks ``r // ranks_per_node``
share a node) + the gradient allreduce (not overlapped: an upper bound; refimpl overlaps
it with backward).  The slowest rank decides the step.

The cost formulas follow Gholami et al. (SPAA'18): a conv layer's domain-parallel cost is
its halo ``alpha + beta * halo words``, a 1.5-D dense layer's the allgather /
reduce-scatter of ``d_in B/Pn`` words over Pm plus the allreduce of ``d_out d_in / Pm``
gradient words over Pn; collective costs after Thakur, Rabenseifner & Gropp (2005)
(``collectives.predicted_time``).  docs/planner.md derives them and compares with runs.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field

from .parallel.partition import (block_range, conv_halo_plan, grid_coords, grid_rank, moved_bytes, pack_buckets,
                                 transposed_conv_halo_plan)

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
    cluster node; ``refimpl plan --calibrate`` measures this machine)."""
    gflops: float = 50.0                  # sustained float32 GFLOP/s of a conv / GEMM
    alpha: float = 1.0e-6                 # s per message, both ranks on one node
    beta: float = 1 / 10e9                # s per byte, on one node
    gamma: float = 1 / 20e9               # s per byte reduced
    alpha_inter: float = 5.0e-6           # s per message between nodes
    beta_inter: float = 1 / 12.5e9        # s per byte between nodes (100 Gb/s)
    ranks_per_node: int = 4
    mem_per_rank: int | None = None       # bytes; None: no limit

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


def load_machine(path: str) -> Machine:
    """A machine TOML file (keys of ``Machine``; mem_per_rank may be '16GiB'); ValueError naming
    the file and key."""
    from .config import load_toml
    table = load_toml(path, "--machine")
    unknown = sorted(set(table) - MACHINE_KEYS)
    if unknown:
        raise ValueError(f"--machine {path}: unknown key(s) {unknown}; known: {sorted(MACHINE_KEYS)}")
    values = {}
    for key, value in table.items():
        if key == "mem_per_rank":
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
    """One layer as the planner sees it (global extents; the grid is applied later)."""
    name: str
    kind: str               # conv | conv_transpose | pool | bn | act | flatten_linear | linear | gather
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


def _conv_out(n, k, p):
    return tuple(n_ + 2 * p_ - k_ + 1 for n_, k_, p_ in zip(n, k, p))


def model_layers(model: str, config) -> list[Layer]:
    """The layer list of CosmoFlow or the U-Net (the same architecture refimpl.models builds;
    tests/test_plan.py compares the two)."""
    from .models import CHECK_CONFIG, resolve_config
    config = resolve_config(model, config)            # ValueError for an unknown model or preset
    config = CHECK_CONFIG[model](config)
    return _cosmoflow(config) if model == "cosmoflow" else _unet(config)


def _cosmoflow(cfg) -> list[Layer]:
    n_layers, width, k = cfg["n_conv_layers"], cfg["conv_size"], cfg["kernel_size"]
    mode = cfg["model_parallel"]
    split_from = n_layers - cfg["model_parallel_blocks"] if mode != "none" else n_layers
    c_in, dhw = cfg["input_shape"][0], tuple(cfg["input_shape"][1:])
    kk, pad = (k,) * 3, (k // 2,) * 3
    layers, split_in = [], False
    for i in range(n_layers):
        c_out = width * 2 ** i
        split = "none" if i < split_from else ("filter-replicated" if i == split_from else
                                               "channel" if mode == "channel" else "filter")
        layers.append(Layer(f"features.{3 * i}", "conv", c_in, c_out, dhw, dhw, kk, (1, 1, 1), pad,
                            weights=c_out * c_in * k ** 3 + c_out, split=split, split_in=split_in,
                            input_grad=i > 0))
        split_in = split != "none"
        layers.append(Layer(f"features.{3 * i + 1}", "act", c_out, c_out, dhw, dhw, split_in=split_in))
        half = tuple(n // 2 for n in dhw)
        layers.append(Layer(f"features.{3 * i + 2}", "pool", c_out, c_out, dhw, half, (2, 2, 2), (2, 2, 2),
                            split_in=split_in))
        c_in, dhw = c_out, half
    if mode != "none":
        layers.append(Layer(f"features.{3 * n_layers}", "gather", c_in, c_in, dhw, dhw, split_in=True))
    flat = c_in * math.prod(dhw)
    fc1, fc2, out = cfg["fc1_size"], cfg["fc2_size"], cfg["num_outputs"]
    row = mode != "none"
    head = [Layer("head.0", "flatten_linear", flat, fc1, dhw, (), weights=fc1 * flat + fc1,
                  split="row" if row else "none"),
            Layer("head.3", "linear", fc1, fc2, (), (), weights=fc2 * fc1 + fc2, split="row-split" if row else "none",
                  split_in=row)]
    if row:
        head.append(Layer("head.6", "gather", fc2, fc2, (), (), split_in=True))
    head.append(Layer(f"head.{7 if row else 6}", "linear", fc2, out, (), (), weights=out * fc2 + out))
    return layers + head


def _unet(cfg) -> list[Layer]:
    levels, base, classes = cfg["levels"], cfg["base_width"], cfg["num_classes"]
    c, dhw = cfg["input_shape"][0], tuple(cfg["input_shape"][1:])
    mode = cfg["model_parallel"]
    layers = []

    def block(prefix, c_in, c_out, dhw, first_grad, split=("none", "none")):
        out = []
        for j, (ci, sp) in enumerate(zip((c_in, c_out), split)):
            split_in = j == 1 and split[0] != "none"
            out.append(Layer(f"{prefix}.{3 * j}", "conv", ci, c_out, dhw, dhw, (3, 3, 3), (1, 1, 1), (1, 1, 1),
                             weights=c_out * ci * 27, split=sp, split_in=split_in,
                             input_grad=first_grad or j > 0))
            bn_split = sp != "none"
            out.append(Layer(f"{prefix}.{3 * j + 1}", "bn", c_out, c_out, dhw, dhw, weights=2 * c_out, split_in=bn_split,
                             split="channel" if bn_split else "none"))
            out.append(Layer(f"{prefix}.{3 * j + 2}", "act", c_out, c_out, dhw, dhw, split_in=bn_split))
        return out

    widths = [base * 2 ** i for i in range(levels + 1)]
    shapes = [tuple(n // 2 ** i for n in dhw) for i in range(levels + 1)]
    c_in = c
    for i in range(levels):
        layers += block(f"enc{i}", c_in, widths[i], shapes[i], first_grad=i > 0)
        layers.append(Layer(f"pool{i}", "pool", widths[i], widths[i], shapes[i], shapes[i + 1], (2, 2, 2), (2, 2, 2)))
        c_in = widths[i]
    split = ("none", "none") if mode == "none" else ("filter-replicated", "channel" if mode == "channel" else "filter")
    layers += block("bottleneck", c_in, widths[levels], shapes[levels], True, split)
    if mode != "none":
        layers.append(Layer("bottleneck.6", "gather", widths[levels], widths[levels], shapes[levels],
                            shapes[levels], split_in=True))
    c_in = widths[levels]
    for i in reversed(range(levels)):
        layers.append(Layer(f"up{i}", "conv_transpose", c_in, widths[i], shapes[i + 1], shapes[i], (2, 2, 2),
                            (2, 2, 2), weights=c_in * widths[i] * 8 + widths[i]))
        layers += block(f"dec{i}", 2 * widths[i], widths[i], shapes[i], True)
        c_in = widths[i]
    layers.append(Layer("out", "conv", c_in, classes, shapes[0], shapes[0], weights=classes * c_in + classes))
    return layers


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
    from .parallel.collectives import predicted_time
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


def param_sizes(layer: Layer, pm: int = 1, m: int = 0) -> list[int]:
    """Elements of each parameter (weight, then bias if any) model rank ``m`` of ``pm`` holds:
    the slices ``nn/model_parallel.py`` keeps (filter / row splits: the output rows; channel
    splits: the input columns of the weight and the output slice of the bias)."""
    kvol = math.prod(layer.kernel) if layer.kind in ("conv", "conv_transpose") else 1
    if layer.kind == "bn":
        c = layer.c_out if layer.split == "none" or pm == 1 else _width(layer.c_out, pm, m)
        return [c, c]
    weight = layer.c_out * layer.c_in * kvol
    has_bias = layer.weights > weight
    f, c = layer.c_out, layer.c_in
    if layer.split != "none" and pm > 1:
        if layer.split == "channel":
            c = _width(layer.c_in, pm, m)
        f_bias = _width(layer.c_out, pm, m)
        if layer.split != "channel":
            f = f_bias
    else:
        f_bias = f
    return [f * c * kvol] + ([f_bias] if has_bias else [])


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
    if layer.kind == "conv_transpose":
        return transposed_conv_halo_plan(layer.in_dhw, spatial_dims, layer.kernel, layer.stride, layer.padding, 1,
                                         layer.output_padding)
    return conv_halo_plan(layer.in_dhw, spatial_dims, layer.kernel, layer.stride, layer.padding, 1)


def rank_costs(layers, dims, coords, batch, itemsize, machine) -> list[LayerCost]:
    """Every layer's cost on the rank at ``coords`` (5 entries) of grid ``dims``."""
    dims, coords = grid5(dims), tuple(coords) + (0,) * (5 - len(coords))
    pm, m = dims[4], coords[4]
    sdims, scoords = dims[1:4], coords[1:4]
    n_r = block_range(batch, dims[0], coords[0])
    n_r = n_r[1] - n_r[0]
    model_group = _group(dims, coords, (4,))
    spatial_group = _group(dims, coords, (1, 2, 3))
    costs = []
    for layer in layers:
        cost = LayerCost(layer.name, layer.kind)
        c_local = _width(layer.c_in, pm, m) if layer.split_in else layer.c_in
        f_local = layer.c_out
        if layer.split in ("filter", "filter-replicated", "channel", "row", "row-split") or \
                (layer.kind in ("bn", "act", "pool") and layer.split_in):
            f_local = _width(layer.c_out, pm, m)
        # voxels of the rank's block of the layer's input (1 for the dense head)
        v_block = _volume([block_range(n, p, c) for n, p, c in zip(layer.in_dhw, sdims, scoords)]) \
            if layer.in_dhw else 1
        if layer.kind in ("conv", "conv_transpose", "pool"):
            plan = halo_plan_of(layer, sdims)
            v_in, v_out = _volume(plan.owned(scoords)), _volume(plan.outputs(scoords))
            v_need = _volume([(min(a, c), max(b, d)) for (a, b), (c, d) in
                              zip(plan.owned(scoords), plan.needed(scoords))])
            # channels the halo carries: the whole input after a filter-parallel conv's allgather
            c_halo = layer.c_in if layer.split in ("filter", "filter-replicated") else c_local
            for adjoint in (False, True) if layer.input_grad else (False,):
                b, msgs, s = _halo(plan, scoords, dims, coords, c_halo, n_r, itemsize, adjoint, machine)
                cost.halo_bytes += b
                cost.halo_messages += msgs
                cost.halo_s += s
            if layer.kind == "pool":
                cost.flops = 2.0 * n_r * f_local * v_out * math.prod(layer.kernel)
            else:
                c_mac = c_local if layer.split == "channel" else layer.c_in
                f_mac = layer.c_out if layer.split == "channel" else f_local
                macs = n_r * f_mac * c_mac * math.prod(layer.kernel) * (v_out if layer.kind == "conv" else v_in)
                cost.flops = 2.0 * macs * (3 if layer.input_grad else 2)
            cost.saved_bytes = n_r * c_halo * v_need * itemsize
            cost.transient_bytes = n_r * (c_halo * v_need + f_local * v_out) * itemsize
            # model-axis collectives
            if layer.split == "filter" and pm > 1:            # allgather x, reduce-scatter dx
                b = 2 * moved_bytes(layer.c_in, pm, m, n_r * v_in, itemsize)
                cost.model_bytes, cost.model_messages = b, 2 * (pm - 1)
            elif layer.split == "filter-replicated" and pm > 1 and layer.input_grad:   # dx allreduced
                n_bytes = n_r * layer.c_in * v_in * itemsize
                cost.model_allreduce_bytes = n_bytes
                cost.comm_s += _allreduce_s(n_bytes, model_group, machine)
            elif layer.split == "channel" and pm > 1:         # reduce-scatter y, allgather dy
                b = 2 * moved_bytes(layer.c_out, pm, m, n_r * v_out, itemsize)
                cost.model_bytes, cost.model_messages = b, 2 * (pm - 1)
            if layer.split in ("filter", "channel") and pm > 1:
                alpha, beta = machine.group_link(model_group)
                cost.comm_s += cost.model_messages * alpha + cost.model_bytes * beta
        elif layer.kind == "bn":
            cost.flops = 10.0 * n_r * f_local * v_block
            cost.saved_bytes = n_r * f_local * v_block * itemsize
            everyone = _group(dims, coords, (0, 1, 2, 3))     # statistics of the whole batch
            # forward: the element count and the (2, C) float64 sums; backward: the (2, C) gradient sums
            cost.comm_s = _allreduce_s(8, everyone, machine) + 2 * _allreduce_s(16 * f_local, everyone, machine)
            cost.allreduce_bytes = 2 * 16 * f_local if everyone[0] > 1 else 0
        elif layer.kind == "act":
            cost.flops = 2.0 * n_r * f_local * v_block
            cost.saved_bytes = n_r * f_local * v_block * itemsize
        elif layer.kind == "gather":
            per_channel = n_r * v_block
            if pm > 1:
                cost.model_bytes = moved_bytes(layer.c_in, pm, m, per_channel, itemsize)
                cost.model_messages = pm - 1
                alpha, beta = machine.group_link(model_group)
                cost.comm_s = cost.model_messages * alpha + cost.model_bytes * beta
        elif layer.kind in ("flatten_linear", "linear"):
            d_in = layer.c_in if layer.kind == "linear" else layer.c_in // math.prod(layer.in_dhw) * v_block
            cost.flops = 2.0 * n_r * f_local * d_in * 3
            cost.saved_bytes = n_r * d_in * itemsize
            if layer.kind == "flatten_linear" and math.prod(sdims) > 1:
                n_bytes = n_r * f_local * itemsize
                cost.spatial_bytes = n_bytes
                cost.comm_s += _allreduce_s(n_bytes, spatial_group, machine)
            if layer.split == "row-split" and pm > 1:
                b = 2 * moved_bytes(layer.c_in, pm, m, n_r, itemsize)
                cost.model_bytes, cost.model_messages = b, 2 * (pm - 1)
                alpha, beta = machine.group_link(model_group)
                cost.comm_s += cost.model_messages * alpha + b * beta
            elif layer.split == "row" and pm > 1:              # dx of the replicated input allreduced
                n_bytes = n_r * d_in * itemsize
                cost.model_allreduce_bytes = n_bytes
                cost.comm_s += _allreduce_s(n_bytes, model_group, machine)
        if layer.weights:
            # (the flatten layer keeps its whole weight on every spatial rank, and allreduces the
            # whole gradient, zero outside its columns: nn/spatial.py SpatialFlattenLinear)
            cost.param_bytes = [n * itemsize for n in param_sizes(layer, pm, m)]
            cost.weight_bytes = sum(cost.param_bytes)
        cost.allreduce_bytes += cost.spatial_bytes + cost.model_allreduce_bytes
        cost.compute_s = cost.flops / (machine.gflops * 1e9)
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
              bucket_bytes=GRAD_BUCKET_BYTES, first_bucket_bytes=FIRST_BUCKET_BYTES, every_rank=False) -> GridPlan:
    """Predicted step of ``layers`` on grid ``dims`` for a global ``batch`` (float32 by default)."""
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
        weights = sum(buckets)
        memory = sum(c.saved_bytes for c in costs) + max((c.transient_bytes for c in costs), default=0) + \
            weights * (3 + OPTIMIZER_COPIES[optimizer])    # + gradient + bucket copy + optimizer
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
        split = [lay for lay in layers if lay.split != "none" or lay.kind == "gather"]
        if not split:
            return f"Pm = {pm} but the model splits no layer (set model_parallel = 'filter' or 'channel')"
        # a filter / row split divides the outputs, a channel split or a gather the inputs
        narrow = min(lay.c_in if lay.split == "channel" and lay.kind != "bn" or lay.kind == "gather" else lay.c_out
                     for lay in split)
        if pm > narrow:
            return f"Pm = {pm} exceeds the {narrow} channels of the narrowest split layer"
    return ""


def factorizations(p: int, parts: int) -> list[tuple]:
    """Every ordered tuple of ``parts`` positive integers whose product is p."""
    if parts == 1:
        return [(p,)]
    return [(d,) + rest for d in range(1, p + 1) if p % d == 0 for rest in factorizations(p // d, parts - 1)]


def search(layers, ranks, batch, machine=Machine(), *, layers_mp=None, top=None, **kw) -> list[GridPlan]:
    """Every grid of ``ranks`` ranks, feasible ones first, by predicted step time.

    ``layers_mp``: the model with its model-parallel layers, used on grids with Pm > 1
    (None: no model axis).  Spatial splits are taken in canonical order Pd >= Ph >= Pw
    when the sample is cubic (the others are the same up to a rotation)."""
    plans = []
    cubic = len(set(layers[0].in_dhw)) == 1
    for dims in factorizations(ranks, 5):
        pn, pd, ph, pw, pm = dims
        if (cubic and not pd >= ph >= pw) or (pm > 1 and layers_mp is None):
            continue
        plans.append(plan_grid(layers if pm == 1 else layers_mp, dims, batch, machine, **kw))
    plans.sort(key=lambda g: (not g.feasible, not g.memory_bytes, g.step_s if g.feasible else g.memory_bytes))
    return plans[:top] if top else plans


# ---------------------------------------------------------------- calibration

def save_machine(machine: Machine) -> str:
    """The machine as a TOML file ``load_machine`` reads back."""
    lines = ["# refimpl plan machine constants (refimpl plan --calibrate; docs/planner.md)"]
    for key, value in machine.__dict__.items():
        if value is not None:
            lines.append(f"{key} = {value!r}" if not isinstance(value, str) else f'{key} = "{value}"')
    return "\n".join(lines) + "\n"


def calibrate(machine: Machine = Machine(), repeats: int = 3) -> Machine | None:
    """Measure this machine: the compute rate of refimpl's own forward + backward of a small
    CosmoFlow (the planner's FLOPs over the measured time), and — when started under mpiexec with 2 or more ranks — alpha and beta
    from a ping-pong between ranks 0 and 1 (small messages: alpha; 8 MiB: beta).  Returns
    the machine on rank 0, None on the other ranks."""
    import statistics
    import time

    import numpy

    from .cli import launcher_size
    from .models import build_model
    # the compute rate of a whole step of refimpl's own layers (convs, pooling, activations,
    # the head): the planner's FLOPs of a small CosmoFlow over its measured forward + backward
    config = {"input_shape": (4, 32, 32, 32), "conv_size": 16, "n_conv_layers": 3, "fc1_size": 64,
              "fc2_size": 32}
    batch = 2
    model = build_model("cosmoflow", config, None, seed=0)
    x = numpy.random.default_rng(0).standard_normal((batch, 4, 32, 32, 32)).astype(numpy.float32)
    flops = sum(c.flops for c in rank_costs(model_layers("cosmoflow", config), (1, 1, 1, 1, 1), (0,) * 5,
                                            batch, 4, machine))
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        model.zero_grad()
        out = model.forward(x)
        model.backward(numpy.ones_like(out))
        best = min(best, time.perf_counter() - start)
    values = dict(machine.__dict__, gflops=flops / best / 1e9)
    if launcher_size() > 1:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        from .parallel.collectives import ping_pong
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


__all__ = ["Machine", "load_machine", "Layer", "model_layers", "rank_costs", "plan_grid", "search",
           "GridPlan", "parse_bytes", "format_bytes", "factorizations", "feasibility", "calibrate", "save_machine"]
