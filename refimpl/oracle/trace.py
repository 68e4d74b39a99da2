"""Whole-model step traces: one training step of CosmoFlow or the U-Net, layer by layer.

A layer case (casefile.py) checks one layer on random inputs.  A peer whose spatially
parallel model trains differently on 8 ranks than on 1 needs the same check on its own
model: which layer, which rank, which cell.  A **trace** is refimpl's unpartitioned
reference of K training steps of a model: the initial parameters, the batch, and per
step and per layer the forward output ``y``, the gradient at the layer's input ``dx``,
the parameter gradients ``dw``/``db``, the loss and the parameters after the update;
each ``y``/``dx`` also cut into every rank's block of a process grid, with its
``offset``, by the balanced-block rule of ``refimpl/parallel/partition.py``.  A grid of
5 entries (Pn, Pd, Ph, Pw, Pm) adds the model axis: with ``model_parallel`` "filter" or
"channel" the model's split layers hold a channel slice (``channel_range``) of their
output, and their parameters' gradients are sliced likewise (``param_slices``); the
model's ``gather`` layers (identities unpartitioned) bring the channels back together.

The layers are the model's leaf modules in forward order, under their module names
(``features.0``, ``enc1.3``, ``up0``: the names of ``state_dict``).  A layer reads the
outputs of the layers in its ``inputs``, concatenated on the channel axis ("input" is
the batch): a chain, except the U-Net's decoder, whose first conv also reads its
level's skip (``dec{i}.0`` <- ``up{i}``, the last layer of ``enc{i}``: ``enc{i}.5``, or
``enc{i}.6``, its gather, where the model axis splits the level).

The reference of a layer is refimpl's unpartitioned module (grid None) run with the
math of ``refimpl/functional`` alone (``reference_math``), so the checker
(trace_check.py) can recompute any single layer on any input.  Dropout is the one
layer with hidden state (its mask): the trace stores each step's keep-mask, drawn from
the model's seed as a refimpl run draws it, and applies it by hand.

File layout (HDF5, no pickle; docs/oracle.md "Model traces")::

    /  attrs  format = "refimpl-oracle-trace", format_version, refimpl_version, digest,
              about, trace (JSON: TraceSpec fields, and the layers: name, kind, inputs,
              y_shape, x_shape, params)
    /<dtype>/initial/<parameter name>           parameters before step 0 (global)
    /<dtype>/input/{x, target}                  the global batch (the same every step)
    /<dtype>/step/<s>/loss                      scalar
    /<dtype>/step/<s>/<layer>/global/{y, dx, dw, db}
    /<dtype>/step/<s>/<layer>/rank/<r>/{y, dx}  rank r's blocks, attribute ``offset``
    /<dtype>/step/<s>/<layer>/mask              dropout layers: the keep-mask (uint8)
    /<dtype>/step/<s>/update/<parameter name>   parameters after the step's update
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field

import numpy

from .. import __version__
from ..parallel.partition import block_slices, channel_range, grid_coords

FORMAT = "refimpl-oracle-trace"
FORMAT_VERSION = 2
DTYPES = ("float64", "float32")
OPTIMIZERS = {"sgd": {"lr": 0.01, "momentum": 0.9}, "adam": {"lr": 1e-3}}
PARAM_TENSORS = {"weight": "dw", "bias": "db"}      # parameter attribute -> its gradient's tensor name
#: the layer kinds of leaf modules that ``describe()`` leaves out (activations, dropout)
KIND_OF_CLASS = {"LeakyReLU": "leaky_relu", "ReLU": "relu", "ScaledTanh": "scaled_tanh", "Tanh": "tanh",
                 "Dropout": "dropout", "SpatialDropout": "dropout"}
MAX_STEPS = 100
MAX_TRACE_BYTES = 8 * 2 ** 30       # a trace past this is a mistake of --input (the file holds every activation)
WINDOW_KINDS = ("conv3d", "conv_transpose3d", "max_pool3d", "avg_pool3d")   # layers whose windows need halos
MODEL_MODES = ("none", "filter", "channel")


def statistics_kinds() -> tuple:
    """The registered layer kinds that declare statistics (refimpl/layers: ``LayerKind.statistics``):
    their output depends on sums over many voxels, which a partitioned layer must reduce."""
    from .. import layers
    return tuple(name for name, kind in layers.REGISTRY.items() if kind.statistics)
NORMS = ("batch", "group", "instance")


# ---------------------------------------------------------------- what a trace is of

@dataclass
class TraceSpec:
    """Everything a trace is computed from; validated by ``check_spec`` (ValueError, one line)."""
    model: str
    preset: str
    input: tuple                 # (N, C, D, H, W) global batch
    grid: tuple                  # (Pn, Pd, Ph, Pw) or (Pn, Pd, Ph, Pw, Pm)
    steps: int = 1
    dtypes: tuple = DTYPES
    seed: int = 0
    optimizer: str = "sgd"
    model_parallel: str = "none"     # the model's split over the model axis Pm (docs/model_parallel.md)
    model_parallel_blocks: int = 1   # CosmoFlow: how many of its last conv blocks are split
    norm: str = "batch"              # the U-Net's normalisation: batch | group | instance
    overrides: dict = field(default_factory=dict)   # model config keys over the preset's (--model-config)

    @property
    def ranks(self) -> int:
        return int(numpy.prod(self.grid))

    @property
    def model_dims(self) -> int:
        """Pm: the model axis (1 on a 4-entry grid)."""
        return self.grid[4] if len(self.grid) == 5 else 1

    def as_json(self) -> dict:
        """The spec as JSON values; ``overrides`` only where there are some (a trace without
        them keeps the digest it had before the field existed)."""
        out = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        if not out["overrides"]:
            del out["overrides"]
        return out

    def config(self) -> dict:
        """The model's full config: the preset's with the trace's overrides, at the trace's
        input, split as the trace says."""
        return model_config(self.model, self.preset, self.input, self.model_parallel, self.model_parallel_blocks,
                            self.norm, self.overrides)


#: Config keys a trace sets by flags of their own, not by ``--model-config``.
OWN_FLAGS = {"input_shape": "--input", "model_parallel": "--model-parallel",
             "model_parallel_blocks": "--model-parallel-blocks", "norm": "--norm"}


def model_config(model: str, preset: str, input_shape=None, model_parallel=None, model_parallel_blocks=None,
                 norm=None, overrides=None) -> dict:
    """The full config of ``preset`` of ``model`` with ``overrides`` (a dict of its config keys:
    ``--model-config``), its input (C, D, H, W) replaced by ``input_shape[1:]`` when given and
    its model-axis split by ``model_parallel`` (and, for CosmoFlow, ``model_parallel_blocks``);
    ValueError naming the model, preset or key."""
    from ..models import CHECK_CONFIG, DEFAULTS, resolve_config
    config = resolve_config(model, preset)
    known = DEFAULTS[model]
    for key, value in (overrides or {}).items():
        if key in OWN_FLAGS:
            raise ValueError(f"--model-config sets {key!r}: give it with {OWN_FLAGS[key]}")
        if key not in known:
            raise ValueError(f"--model-config: {model} has no config key {key!r}; its keys: "
                             f"{', '.join(k for k in sorted(known) if k not in OWN_FLAGS)}")
        config[key] = value
    if input_shape is not None:
        config["input_shape"] = tuple(input_shape[1:])
    if model_parallel is not None:
        config["model_parallel"] = model_parallel
    if model_parallel_blocks is not None and model == "cosmoflow":
        config["model_parallel_blocks"] = model_parallel_blocks
    if norm is not None and model == "unet3d":
        config["norm"] = norm
    where = f"{model} preset {preset!r}" + (" with --model-config" if overrides else "")
    return CHECK_CONFIG[model](config, where=where)


def default_input(model: str, preset: str) -> tuple:
    """(N, C, D, H, W): the preset's sample shape and a batch of 2."""
    return (2,) + tuple(model_config(model, preset)["input_shape"])


def check_spec(spec: TraceSpec) -> TraceSpec:
    """``spec`` with its fields normalised, or ValueError naming the flag that is wrong."""
    if spec.model_parallel not in MODEL_MODES:
        raise ValueError(f"--model-parallel must be one of {', '.join(MODEL_MODES)}, got {spec.model_parallel!r}")
    blocks = spec.model_parallel_blocks
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
        raise ValueError(f"--model-parallel-blocks must be a positive integer, got {blocks!r}")
    if spec.model != "cosmoflow" and blocks != 1:
        raise ValueError(f"--model-parallel-blocks is CosmoFlow's (the U-Net's split levels: "
                         "--model-config's model_parallel_levels), "
                         f"got {blocks} for {spec.model}")
    if spec.norm not in NORMS:
        raise ValueError(f"--norm must be one of {', '.join(NORMS)}, got {spec.norm!r}")
    if spec.model != "unet3d" and spec.norm != "batch":
        raise ValueError(f"--norm is the U-Net's (CosmoFlow has no normalisation layers), got {spec.norm!r}")
    grid = tuple(spec.grid)
    if len(grid) not in (4, 5) or any(isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in grid):
        raise ValueError(f"--grid must be 4 or 5 positive integers Pn,Pd,Ph,Pw[,Pm], got {spec.grid!r}")
    if not isinstance(spec.overrides, dict):
        raise ValueError(f"--model-config must be a table of model config keys, got {type(spec.overrides).__name__}")
    config = model_config(spec.model, spec.preset, spec.input, spec.model_parallel, blocks, spec.norm,
                          spec.overrides)
    pm = grid[4] if len(grid) == 5 else 1
    if spec.model_parallel != "none":
        narrowest = min((e["c_out"], e["name"]) for e in split_layers(spec.model, config))
        if pm > narrowest[0]:
            raise ValueError(f"--grid Pm={pm}: layer {narrowest[1]} splits {narrowest[0]} channels over the model "
                             f"axis, at most one rank per channel (lower Pm)")
    n = spec.input[0]
    if n % grid[0]:
        raise ValueError(f"--input batch N={n} must be divisible by the grid's sample groups Pn={grid[0]}")
    if not (isinstance(spec.steps, int) and 1 <= spec.steps <= MAX_STEPS):
        raise ValueError(f"--steps must be an integer in [1, {MAX_STEPS}], got {spec.steps!r}")
    dtypes = tuple(spec.dtypes)
    if not dtypes or len(set(dtypes)) != len(dtypes) or any(d not in DTYPES for d in dtypes):
        raise ValueError(f"--dtype must be a comma-separated list of {', '.join(DTYPES)} (each once), "
                         f"got {','.join(dtypes)!r}")
    if isinstance(spec.seed, bool) or not isinstance(spec.seed, int) or not 0 <= spec.seed < 2 ** 32:
        raise ValueError(f"--seed must be an integer in [0, 2^32), got {spec.seed!r}")
    if spec.optimizer not in OPTIMIZERS:
        raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {spec.optimizer!r}")
    size = trace_bytes(spec.model, spec.preset, spec.input, spec.steps, dtypes, spec.overrides)
    if size > MAX_TRACE_BYTES:
        raise ValueError(f"a trace of {spec.model} {spec.preset} with input {list(spec.input)} would hold about "
                         f"{size / 2 ** 30:.0f} GiB ({spec.steps} step{'s' * (spec.steps != 1)}, {', '.join(dtypes)}), more than "
                         f"{MAX_TRACE_BYTES / 2 ** 30:.0f} GiB: give a smaller --input (the preset's sizes "
                         f"are for training, a trace checks the same layers at any size the model allows)")
    return TraceSpec(spec.model, spec.preset, tuple(spec.input), grid, spec.steps, dtypes, spec.seed,
                     spec.optimizer, spec.model_parallel, blocks, spec.norm, dict(spec.overrides))


def split_layers(model: str, config: dict) -> list[dict]:
    """The ``describe()`` entries of the layers whose output the model axis splits."""
    from ..models import MODELS
    return [e for e in MODELS[model].describe(config) if e["split"] != "none"]


def trace_bytes(model: str, preset: str, input_shape, steps: int, dtypes, overrides=None) -> int:
    """About the bytes of a trace: y and dx of every layer, globally and in rank blocks,
    per step and dtype (from ``describe()``: nothing is built)."""
    from ..models import MODELS
    config = model_config(model, preset, input_shape, overrides=overrides)
    n, cells = input_shape[0], int(numpy.prod(input_shape[1:]))
    for entry in MODELS[model].describe(config):
        out = entry["c_out"] * int(numpy.prod(entry["out_dhw"] or (1,)))
        cells += 2 * out if entry["kind"] in ("conv3d", "batch_norm3d") else out   # + its activation
    per_dtype = sum(numpy.dtype(d).itemsize for d in dtypes)
    return int(4 * n * cells * steps * per_dtype)                   # y and dx, global and blocks


def digest(spec: TraceSpec) -> str:
    """Identifies a trace: its spec and the refimpl version that computed it."""
    text = json.dumps({"spec": spec.as_json(), "version": __version__, "format": FORMAT_VERSION},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


# ---------------------------------------------------------------- the model's layers

@dataclass
class Layer:
    """One leaf module of the model, as the trace sees it."""
    name: str
    kind: str                    # a layer-registry kind (conv3d, max_pool3d, ...) or an activation
    inputs: tuple                # the layers whose outputs it reads, channel-concatenated ("input": the batch)
    module: object = field(repr=False, default=None)
    params: dict = field(default_factory=dict)      # "dw"/"db" -> the parameter's full name
    split: str = "none"          # describe()'s split over the model axis (none | filter | channel | row | ...)
    x_split: bool = False        # its input is channel-split over the model axis
    y_split: bool = False        # its output is channel-split over the model axis

    @property
    def has_params(self) -> bool:
        return bool(self.params)


def reference_model(name: str, preset: str, input_shape=None, seed: int = 0, dtype="float64",
                    model_parallel=None, model_parallel_blocks=None, norm=None, overrides=None):
    """refimpl's unpartitioned model (grid None) ``name`` of ``preset``, in ``dtype``, every
    layer computing its input gradient (the trace records dx of the first layer too).  A
    model-parallel config builds the same layers and weights (drawn whole), its ``gather``
    layers empty (identities), so the trace's layer names are the split model's."""
    from ..models import build_model
    config = model_config(name, preset, input_shape, model_parallel, model_parallel_blocks, norm, overrides)
    model = build_model(name, config, grid=None, seed=seed, dtype=dtype)
    model.needs_input_grad = True
    return model


def build_reference(spec: TraceSpec, dtype="float64"):
    """The reference model of a trace (its weights depend on the seed only)."""
    return reference_model(spec.model, spec.preset, spec.input, spec.seed, dtype, spec.model_parallel,
                           spec.model_parallel_blocks, spec.norm, spec.overrides)


def model_layers(name: str, model) -> list[Layer]:
    """The leaf modules of ``model`` in forward order (registration order: the models add
    their modules in the order the forward runs them), each with its kind, inputs and
    split over the model axis: ``describe()``'s for the layers it lists; a ``gather``
    replicates its output; a layer it leaves out (activation, dropout) keeps its input's."""
    described = {entry["name"]: entry for entry in type(model).describe(model.config)}
    out, previous, split_out, last_of_block = [], "input", {"input": False}, {}
    for module_name, module in model.named_modules():
        if not module_name or (module.children() and module_name not in described):
            continue
        entry = described.get(module_name, {})
        kind = entry.get("kind") or KIND_OF_CLASS.get(type(module).__name__)
        if kind is None:
            raise ValueError(f"layer {module_name}: no trace kind for {type(module).__name__}")
        inputs = (previous,)
        skip = re.fullmatch(r"dec(\d+)\.0", module_name) if name == "unet3d" else None
        if skip:
            inputs = (previous, last_of_block[f"enc{skip.group(1)}"])   # concat (up_i, skip_i) on the channels
        params = {PARAM_TENSORS[attr]: p.name for attr, p in module._parameters.items()}
        x_split = any(split_out[s] for s in inputs)
        split = entry.get("split", "none")
        y_split = False if kind == "gather" else (split != "none" or x_split)
        out.append(Layer(module_name, kind, inputs, module, params, split, x_split, y_split))
        split_out[module_name] = y_split
        previous = last_of_block[module_name.split(".")[0]] = module_name
    return out


def layer_table(model: str, preset: str, input_shape=None, model_parallel=None, model_parallel_blocks=None,
                norm=None, overrides=None) -> list[dict]:
    """``trace layers``: name, kind, inputs and global output shape of every layer, from the
    model's ``describe()`` where it lists the layer, else the shape of the layer before it
    (activations and dropout keep their input's shape), and whether the model axis splits
    its output.  The model is built unpartitioned in float32 for its module names (the
    presets build in a second or less)."""
    from ..models import MODELS
    config = model_config(model, preset, input_shape, model_parallel, model_parallel_blocks, norm, overrides)
    n = (input_shape or default_input(model, preset))[0]
    described = {e["name"]: e for e in MODELS[model].describe(config)}
    built = reference_model(model, preset, (n,) + tuple(config["input_shape"]), dtype="float32",
                            model_parallel=model_parallel, model_parallel_blocks=model_parallel_blocks, norm=norm,
                            overrides=overrides)
    rows, shape = [], (n,) + tuple(config["input_shape"])
    for layer in model_layers(model, built):
        entry = described.get(layer.name)
        if entry is not None:
            shape = (n, entry["c_out"]) + tuple(entry["out_dhw"])
        rows.append({"name": layer.name, "kind": layer.kind, "inputs": list(layer.inputs),
                     "shape": list(shape), "params": sorted(layer.params.values()), "split": layer.y_split})
    return rows


# ---------------------------------------------------------------- blocks of a grid

def rank_slices(shape, grid, rank: int, split: bool = False) -> tuple:
    """Rank ``rank``'s block of a global tensor on grid (Pn, Pd, Ph, Pw[, Pm]): samples in
    equal parts, D, H, W in balanced blocks (partition.block_slices), channels whole, or,
    where the model axis splits the tensor (``split``), model rank m's ``channel_range``; a (N, F)
    tensor (the dense head) is split by samples (and features where split), replicated over
    the spatial ranks.  Ranks are row-major with the model axis fastest (parallel/grid.py)."""
    n, d, h, w, m = tuple(grid_coords(rank, grid)) + ((0,) if len(grid) == 4 else ())
    pm = grid[4] if len(grid) == 5 else 1
    if len(shape) == 5:
        out = block_slices(shape, (grid[0], 1) + tuple(grid[1:4]), (n, 0, d, h, w))
    elif len(shape) == 2:
        out = block_slices(shape, (grid[0], 1), (n, 0))
    else:
        raise ValueError(f"no rank blocks for a tensor of shape {tuple(shape)}")
    if split:
        out = (out[0], slice(*channel_range(shape[1], pm, m))) + out[2:]
    return out


def layer_slices(entry: dict, tensor: str, grid, rank: int) -> tuple:
    """Rank's block of a layer's ``y`` (its output) or ``dx`` (its input's shape and split)."""
    if tensor == "y":
        return rank_slices(entry["y_shape"], grid, rank, entry.get("y_split", False))
    return rank_slices(entry["x_shape"], grid, rank, entry.get("x_split", False))


def param_slices(entry: dict, tensor: str, shape, grid, rank: int) -> tuple:
    """Rank's slice of a layer's parameter gradient ``tensor`` (dw / db) of ``shape``: whole,
    or the model rank's share where the model axis splits the layer (the slices
    refimpl/nn/model_parallel.py keeps: filters / rows on axis 0; a channel-parallel conv's
    weight its input channels on axis 1, its bias the output's)."""
    whole = tuple(slice(0, n) for n in shape)
    split = entry.get("split", "none")
    if split == "none" or len(grid) == 4:
        return whole
    m, pm = rank % grid[4], grid[4]
    axis = 1 if (split == "channel" and entry["kind"] == "conv3d" and tensor == "dw") else 0
    return whole[:axis] + (slice(*channel_range(shape[axis], pm, m)),) + whole[axis + 1:]


def internal_faces(shape, grid, rank):
    """(axis, side) of each face of rank's block of a 5-d tensor that borders another rank."""
    faces = []
    for axis, sl in zip((2, 3, 4), rank_slices(shape, grid, rank)[2:]):
        if sl.start > 0:
            faces.append((axis, "low"))
        if sl.stop < shape[axis]:
            faces.append((axis, "high"))
    return faces


def offset_of(slices) -> list:
    return [s.start for s in slices]


# ---------------------------------------------------------------- the reference math of one layer

@contextlib.contextmanager
def reference_math():
    """Every op computes with refimpl/functional's math, never a fast kernel (the oracle's rule)."""
    from ..functional import reference_only
    from ..functional.conv3d import ENV_ALGORITHM
    saved = os.environ.get(ENV_ALGORITHM)
    os.environ[ENV_ALGORITHM] = "reference"
    try:
        with reference_only():
            yield
    finally:
        if saved is None:
            os.environ.pop(ENV_ALGORITHM, None)
        else:
            os.environ[ENV_ALGORITHM] = saved


def dropout_mask(layer: Layer, shape, step: int):
    """The keep-mask a refimpl run draws at ``step`` for the whole (N, F) tensor."""
    from ..functional.dropout import dropout_mask as mask, fold_seed
    return mask(tuple(shape), layer.module.p, fold_seed(layer.module.seed, step))


def forward(layer: Layer, x, mask=None):
    """y of ``layer`` on the global input ``x`` (its dropout ``mask`` given)."""
    with reference_math():
        if layer.kind == "dropout":
            return _apply_mask(x, mask, layer.module.p)
        layer.module.zero_grad()
        y = layer.module.forward(x.copy())          # a layer may write y over its x (LeakyReLU's in_place)
        layer.module._cache = None
        return y


def backward(layer: Layer, x, dy, mask=None):
    """(dx, {"dw": ..., "db": ...}) of ``layer`` at input ``x`` for output gradient ``dy``."""
    with reference_math():
        if layer.kind == "dropout":
            return _apply_mask(dy, mask, layer.module.p), {}
        layer.module.zero_grad()
        layer.module.forward(x.copy())
        dx = layer.module.backward(dy.copy())       # a layer may write dx over its dy (LeakyReLU's reuse_grad)
        grads = {t: parameter(layer, t).grad for t in layer.params}
        layer.module.zero_grad()
        return dx, grads


def _apply_mask(a, mask, p):
    """Inverted dropout with a given keep-mask: a * mask / (1 - p) (its own adjoint)."""
    from ..functional.dropout import dropout_backward
    return a if p == 0.0 else dropout_backward(a, mask.astype(bool), p)


def parameter(layer: Layer, tensor: str):
    """The Parameter of ``layer`` whose gradient is ``tensor`` ("dw": weight, "db": bias)."""
    attr = {v: k for k, v in PARAM_TENSORS.items()}[tensor]
    return layer.module._parameters[attr]


def load_parameters(model, params: dict) -> None:
    """Set every parameter of ``model`` from ``params`` ({name: array}), cast to its dtype."""
    for name, p in model.named_parameters():
        p.data[...] = numpy.asarray(params[name], dtype=p.data.dtype)


# ---------------------------------------------------------------- the reference step

def batch(spec: TraceSpec, config: dict):
    """The global batch: x ~ N(0, 1); CosmoFlow targets U(-1, 1), U-Net labels in [0, K)."""
    rng = numpy.random.default_rng([spec.seed, 1])
    x = rng.standard_normal(spec.input)
    if spec.model == "cosmoflow":
        target = rng.uniform(-1.0, 1.0, (spec.input[0], config["num_outputs"]))
    else:
        target = rng.integers(0, config["num_classes"], (spec.input[0],) + tuple(spec.input[2:]))
    return x, target


def make_optimizer(name: str, params):
    from .. import optim
    settings = OPTIMIZERS[name]
    if name == "sgd":
        return optim.SGD(params, settings["lr"], momentum=settings["momentum"])
    return optim.Adam(params, settings["lr"])


def run_step(model, layers, x, target, step: int, masks=None):
    """One forward + backward of ``model`` walked layer by layer: per layer y, dx and its
    parameter gradients, the masks drawn, the loss and d loss / d output."""
    acts, masks = {"input": x}, dict(masks or {})
    for layer in layers:
        xin = _concat([acts[s] for s in layer.inputs])
        if layer.kind == "dropout" and layer.name not in masks:
            masks[layer.name] = dropout_mask(layer, xin.shape, step)
        acts[layer.name] = forward(layer, xin, masks.get(layer.name))
    loss, dout, _ = model.loss(acts[layers[-1].name], target)
    douts = {layers[-1].name: dout}
    out = {}
    for layer in reversed(layers):
        xin = _concat([acts[s] for s in layer.inputs])
        dx, grads = backward(layer, xin, douts.pop(layer.name), masks.get(layer.name))
        out[layer.name] = {"y": acts[layer.name], "dx": dx, **grads}
        start = 0
        for source in layer.inputs:
            width = acts[source].shape[1]
            if source != "input":
                part = dx[:, start:start + width]
                douts[source] = part.copy() if source not in douts else douts[source] + part
            start += width
    return out, float(loss), masks


def _concat(arrays):
    return arrays[0] if len(arrays) == 1 else numpy.concatenate(arrays, axis=1)


def compute(spec: TraceSpec):
    """The trace's content: {dtype: {"initial", "x", "target", "steps": [{layer: tensors},
    loss, masks, update]}} and the layer list (of the float64 model)."""
    spec = check_spec(spec)
    config = spec.config()
    x, target = batch(spec, config)
    params0 = {name: p.data.copy() for name, p in build_reference(spec).named_parameters()}   # float64
    content, layers64 = {}, None
    for dtype in spec.dtypes:
        model = build_reference(spec, dtype=dtype)
        load_parameters(model, params0)
        layers = model_layers(spec.model, model)
        layers64 = layers64 or layers
        xd = x.astype(dtype)
        td = target.astype(dtype) if spec.model == "cosmoflow" else target
        optimizer = make_optimizer(spec.optimizer, model.parameters())
        steps = []
        for s in range(spec.steps):
            tensors, loss, masks = run_step(model, layers, xd, td, s)
            for layer in layers:
                for t in layer.params:
                    parameter(layer, t).grad = tensors[layer.name][t]
            optimizer.step()
            optimizer.zero_grad()
            steps.append({"tensors": tensors, "loss": loss, "masks": masks,
                          "update": {n: p.data.copy() for n, p in model.named_parameters()}})
        content[dtype] = {"initial": {n: a.astype(dtype) for n, a in params0.items()}, "x": xd, "target": td,
                          "steps": steps}
    return spec, layers64, content


def layer_json(layers, content) -> list[dict]:
    first = next(iter(content.values()))
    tensors = first["steps"][0]["tensors"]
    out = []
    for layer in layers:
        y = tensors[layer.name]["y"]
        x_shape = [first["x"].shape[0], 0] + list(first["x"].shape[2:])
        for source in layer.inputs:
            src = first["x"] if source == "input" else tensors[source]["y"]
            x_shape = [src.shape[0], x_shape[1] + src.shape[1]] + list(src.shape[2:])
        out.append({"name": layer.name, "kind": layer.kind, "inputs": list(layer.inputs),
                    "y_shape": list(y.shape), "x_shape": x_shape, "params": dict(layer.params),
                    "split": layer.split, "x_split": layer.x_split, "y_split": layer.y_split})
    return out


def write_trace(spec: TraceSpec, path: str) -> dict:
    """Compute the trace of ``spec`` and write it to ``path`` atomically; returns a summary."""

    from ..atomic import atomic_write, hdf5_file
    spec, layers, content = compute(spec)
    meta = {**spec.as_json(), "layers": layer_json(layers, content)}
    entries = {e["name"]: e for e in meta["layers"]}

    def write(f):
        with hdf5_file(f) as (h5, _):
            h5.attrs.update({"format": FORMAT, "format_version": FORMAT_VERSION, "refimpl_version": __version__,
                             "digest": digest(spec), "trace": json.dumps(meta),
                             "about": "refimpl oracle trace: see docs/oracle.md, Model traces "
                                      "(refimpl oracle trace check)"})
            for dtype, c in content.items():
                g = h5.create_group(dtype)
                for name, array in c["initial"].items():
                    g[f"initial/{name}"] = array
                g["input/x"], g["input/target"] = c["x"], c["target"]
                for s, step in enumerate(c["steps"]):
                    sg = g.create_group(f"step/{s}")
                    sg["loss"] = numpy.asarray(step["loss"], dtype=dtype)
                    for layer in layers:
                        lg = sg.create_group(layer.name)
                        for t, array in step["tensors"][layer.name].items():
                            if array is not None:
                                lg[f"global/{t}"] = array
                        for t in ("y", "dx"):
                            array = step["tensors"][layer.name].get(t)
                            if array is None:
                                continue
                            for r in range(spec.ranks):
                                sl = layer_slices(entries[layer.name], t, spec.grid, r)
                                lg.create_dataset(f"rank/{r}/{t}", data=array[sl]).attrs["offset"] = offset_of(sl)
                        if layer.name in step["masks"]:
                            lg["mask"] = step["masks"][layer.name].astype(numpy.uint8)
                    for name, array in step["update"].items():
                        sg[f"update/{name}"] = array
    atomic_write(path, write, binary=True)
    return {"layers": len(layers), "params": len(content[spec.dtypes[0]]["initial"]), "spec": spec}


# ---------------------------------------------------------------- reading a trace back

@dataclass
class Trace:
    """A loaded trace file (validated: format, version, digest, every dataset's dtype and shape)."""
    path: str
    spec: TraceSpec
    digest: str
    layers: list                 # the layer dicts of the file (name, kind, inputs, y_shape, x_shape, params)
    data: dict                   # dtype -> {"initial", "x", "target", "steps": [...]}

    def layer(self, name):
        return next(entry for entry in self.layers if entry["name"] == name)

    @property
    def param_names(self) -> list:
        return list(next(iter(self.data.values()))["initial"])


def load_trace(path: str) -> Trace:
    """Read and validate a trace file; UnusableInput (a ValueError) naming what is wrong."""
    from .casefile import UnusableInput, _open, _read
    what = "trace file"
    h5 = _open(path, what)
    with h5:
        attrs = dict(h5.attrs)
        if attrs.get("format") != FORMAT:
            raise UnusableInput(f"{what} {path}: not a refimpl oracle trace (format {attrs.get('format')!r}; "
                                f"write one with 'refimpl oracle trace generate')")
        version = attrs.get("refimpl_version")
        if attrs.get("format_version") != FORMAT_VERSION or version != __version__:
            raise UnusableInput(f"{what} {path}: generated by refimpl {version} (format "
                                f"{attrs.get('format_version')}); this is refimpl {__version__} (format "
                                f"{FORMAT_VERSION}): regenerate the trace with this version")
        try:
            meta = json.loads(attrs["trace"])
            spec = check_spec(TraceSpec(meta["model"], meta["preset"], tuple(meta["input"]), tuple(meta["grid"]),
                                        meta["steps"], tuple(meta["dtypes"]), meta["seed"], meta["optimizer"],
                                        meta["model_parallel"], meta["model_parallel_blocks"], meta["norm"],
                                        meta.get("overrides", {})))
        except (KeyError, TypeError, ValueError) as err:
            raise UnusableInput(f"{what} {path}: its 'trace' attribute is not a valid trace spec ({err})") from None
        if attrs.get("digest") != digest(spec):
            raise UnusableInput(f"{what} {path}: digest {attrs.get('digest')!r} does not match its spec "
                                f"(edited or damaged): regenerate it")
        # the layer list and every shape come from the spec (the model rebuilt), never from the file
        computed = _expected_shapes(spec)
        layers, params = computed["layers"], computed["params"]
        data = {}
        for dtype in spec.dtypes:
            int_target = spec.model == "unet3d"
            d = {"initial": {n: _read(h5, f"{dtype}/initial/{n}", path, what, dtype, shape)
                             for n, shape in params.items()},
                 "x": _read(h5, f"{dtype}/input/x", path, what, dtype, spec.input),
                 "target": _read(h5, f"{dtype}/input/target", path, what,
                                 numpy.dtype("int64") if int_target else dtype, computed["target"]),
                 "steps": []}
            for s in range(spec.steps):
                step = {"loss": float(_read(h5, f"{dtype}/step/{s}/loss", path, what, dtype, ())),
                        "tensors": {}, "masks": {},
                        "update": {n: _read(h5, f"{dtype}/step/{s}/update/{n}", path, what, dtype, shape)
                                   for n, shape in params.items()}}
                for entry in layers:
                    base = f"{dtype}/step/{s}/{entry['name']}"
                    t = {"y": _read(h5, f"{base}/global/y", path, what, dtype, entry["y_shape"])}
                    if f"{base}/global/dx" in h5:
                        t["dx"] = _read(h5, f"{base}/global/dx", path, what, dtype, entry["x_shape"])
                    for tensor, pname in entry["params"].items():
                        t[tensor] = _read(h5, f"{base}/global/{tensor}", path, what, dtype, params[pname])
                    step["tensors"][entry["name"]] = t
                    if entry["kind"] == "dropout":
                        step["masks"][entry["name"]] = _read(h5, f"{base}/mask", path, what,
                                                             numpy.dtype("uint8"), entry["y_shape"])
                d["steps"].append(step)
            data[dtype] = d
    return Trace(path, spec, attrs["digest"], layers, data)


def _expected_shapes(spec: TraceSpec) -> dict:
    """The layers (with y / x shapes) and parameter shapes of ``spec``'s model, from a
    forward of a zero batch through the rebuilt model (cheap at trace sizes)."""
    model = build_reference(spec)
    layers = model_layers(spec.model, model)
    shapes, acts = {}, {"input": spec.input}
    for layer in layers:
        src = [acts[s] for s in layer.inputs]
        x_shape = (src[0][0], sum(s[1] for s in src)) + tuple(src[0][2:])
        y = forward(layer, numpy.zeros(x_shape), numpy.ones((x_shape), dtype=bool)
                    if layer.kind == "dropout" else None)
        acts[layer.name] = tuple(y.shape)
        shapes[layer.name] = {"name": layer.name, "kind": layer.kind, "inputs": list(layer.inputs),
                              "y_shape": list(y.shape), "x_shape": list(x_shape), "params": dict(layer.params),
                              "split": layer.split, "x_split": layer.x_split, "y_split": layer.y_split}
    config = spec.config()
    target = (spec.input[0], config["num_outputs"]) if spec.model == "cosmoflow" else \
        (spec.input[0],) + tuple(spec.input[2:])
    return {"layers": list(shapes.values()), "target": target,
            "params": {n: tuple(p.data.shape) for n, p in model.named_parameters()}}


__all__ = ["TraceSpec", "Trace", "Layer", "check_spec", "model_config", "model_layers", "layer_table",
           "write_trace", "load_trace", "compute", "rank_slices", "layer_slices", "param_slices", "forward",
           "backward", "reference_math"]
