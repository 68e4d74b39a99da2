"""``refimpl oracle trace run-torch``: the PyTorch twin of a trace's model runs the trace's steps.

The model for a peer's own writer, and the trace checker's test bench.  The twin
(model_twins.py, the same module names as refimpl's model) takes the trace's initial
parameters by name, runs each step on the trace's batch (with the trace's dropout
masks) globally in torch with autograd, and reports what a partitioned run would: each
layer's ``y`` and ``dx`` cut into every rank's block of the trace's grid (with its
``offset``), every rank's ``dw``/``db``, the loss and the updated parameters, in the
results layout of docs/oracle.md ("Model traces").

Hooks record a layer's input and output: a forward pre-hook hands the layer a copy of
its input, so the gradient at that copy is this layer's ``dx`` alone (the U-Net's
encoder output feeds the pooling and the skip, whose gradients add up in the original).

``--plant KIND:LAYER[:RANK]`` builds one known mistake into one layer (on one rank), the
way a partitioned implementation would make it; the forward mistakes go through
autograd, so their backward is the buggy forward's::

    halo:LAYER:R          rank R computes its block of LAYER with zeros beyond the first internal
                          face its windows read past (the forward halo delivered zeros)
    inner-padding:LAYER   every rank computes its block of LAYER as if its internal faces were the
                          domain's edge (padding instead of a halo)
    adjoint-halo:LAYER:R  rank R's dx of LAYER keeps only the gradient of its own outputs: the ghost
                          gradients its neighbours computed for its cells never arrive; the wrong dx
                          flows on backward
    stride-phase:LAYER:R  rank R's strided windows of LAYER restart at its own input block's first
                          cell instead of the global stride grid
    local-stats:LAYER     the statistics layer LAYER (batch, group or instance norm) normalises each
                          rank's block by that block's own statistics (not reduced over the ranks)
    dw-unsummed:LAYER:R   rank R reports its own contribution to LAYER's dw/db only (no allreduce there)
    dw-count:LAYER        LAYER's dw/db divided by the number of ranks P (averaged over the whole grid
                          instead of summed over the spatial shards), and the update uses them
    loss-count            the loss (and so every gradient) multiplied by P: normalised by one rank's count
    update-skip:LAYER:R   rank R does not apply the update to LAYER's parameters, and computes its block
                          of LAYER with its own (stale) ones in the later steps: the parameters drift
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy

from .trace import (OPTIMIZERS, WINDOW_KINDS, Trace, internal_faces, layer_slices, param_slices, rank_slices,
                    statistics_kinds)

PLANTS = {"halo": "layer:rank", "inner-padding": "layer", "adjoint-halo": "layer:rank", "stride-phase": "layer:rank",
          "local-stats": "layer",
          "dw-unsummed": "layer:rank", "dw-count": "layer", "loss-count": "", "update-skip": "layer:rank"}


@dataclass
class Plant:
    kind: str
    layer: str | None = None
    rank: int | None = None


def parse_plant(text: str | None, trace: Trace) -> Plant | None:
    """``--plant`` checked against the trace (ValueError with what is allowed)."""
    if text is None:
        return None
    parts = text.split(":")
    kind = parts[0]
    usage = ", ".join(f"{k}:{v.upper()}" if v else k for k, v in PLANTS.items())
    if kind not in PLANTS:
        raise ValueError(f"--plant {text}: unknown kind {kind!r}; kinds: {usage}")
    wanted = PLANTS[kind].split(":") if PLANTS[kind] else []
    if len(parts) - 1 != len(wanted):
        raise ValueError(f"--plant {text}: {kind} takes {PLANTS[kind].upper() or 'no argument'} "
                         f"(as {kind}{':' if wanted else ''}{PLANTS[kind].upper()})")
    plant = Plant(kind)
    spec = trace.spec
    if kind == "loss-count" and spec.ranks == 1:
        raise ValueError(f"--plant {text}: the trace's grid {list(spec.grid)} has one rank, so the count cannot be wrong")
    if "layer" in wanted:
        names = [e["name"] for e in trace.layers]
        if parts[1] not in names:
            raise ValueError(f"--plant {text}: no layer {parts[1]!r} in the trace (layers: {', '.join(names)})")
        plant.layer = parts[1]
        entry = trace.layer(plant.layer)
        if kind in ("halo", "inner-padding", "adjoint-halo", "stride-phase") and (
                entry["kind"] not in WINDOW_KINDS
                or not any(halo_faces(trace, plant.layer, r) for r in range(spec.ranks))):
            raise ValueError(f"--plant {text}: {kind} needs a window layer whose windows read past a rank's "
                             f"block on grid {list(spec.grid)}; {plant.layer} is {entry['kind']}"
                             + ("" if entry["kind"] not in WINDOW_KINDS else " with no halo there"))
        if kind == "local-stats" and entry["kind"] not in statistics_kinds():
            raise ValueError(f"--plant {text}: {plant.layer} is {entry['kind']}, not a statistics layer "
                             f"({', '.join(statistics_kinds())})")
        if kind in ("dw-unsummed", "dw-count", "update-skip") and not entry["params"]:
            raise ValueError(f"--plant {text}: {plant.layer} ({entry['kind']}) has no parameters")
        if kind == "dw-unsummed" and len(entry["y_shape"]) != 5:
            raise ValueError(f"--plant {text}: {plant.layer} is in the dense head, whose gradient every rank "
                             f"computes whole; plant it in a conv or batch-norm layer")
        if kind in ("inner-padding", "dw-count") and spec.ranks == 1:
            raise ValueError(f"--plant {text}: the trace's grid {list(spec.grid)} has one rank")
    if "rank" in wanted:
        try:
            plant.rank = int(parts[2])
        except ValueError:
            raise ValueError(f"--plant {text}: RANK must be an integer, got {parts[2]!r}") from None
        if not 0 <= plant.rank < spec.ranks:
            raise ValueError(f"--plant {text}: the trace's grid {list(spec.grid)} has ranks 0..{spec.ranks - 1}")
        if kind == "halo" and not halo_faces(trace, plant.layer, plant.rank):
            raise ValueError(f"--plant {text}: rank {plant.rank}'s windows of {plant.layer} stay inside its own "
                             f"block on grid {list(spec.grid)} (no halo to lose)")
        if kind == "stride-phase" and not _phase_shift(trace, plant.layer, plant.rank):
            raise ValueError(f"--plant {text}: rank {plant.rank}'s first window of {plant.layer} starts at its own "
                             f"block's first cell on grid {list(spec.grid)} (no stride phase to lose)")
        if kind == "adjoint-halo" and not internal_faces(trace.layer(plant.layer)["x_shape"], spec.grid, plant.rank):
            raise ValueError(f"--plant {text}: rank {plant.rank}'s block of {plant.layer}'s input has no "
                             f"internal face on grid {list(spec.grid)} (no ghost gradients to lose)")
    return plant


def _module(trace: Trace, name: str):
    """Layer ``name``'s module in the trace's reference model (its kernel, stride, padding)."""
    from .trace import build_reference, model_layers
    return next(l.module for l in model_layers(trace.spec.model, build_reference(trace.spec)) if l.name == name)


def _pads(module) -> list:
    """(low, high) padding per axis of a window module (3 or 6 compact integers)."""
    pads = list(module.padding)
    return [(p, p) for p in pads] if len(pads) == 3 else list(zip(pads[0::2], pads[1::2]))


def _phase_shift(trace: Trace, name: str, rank: int) -> bool:
    """Whether rank's first window of ``name`` (global stride grid) starts elsewhere than its
    own input block's first cell: where restarting the windows there is a mistake."""
    module, entry = _module(trace, name), trace.layer(name)
    if entry["kind"] == "conv_transpose3d":
        return False
    x_block = layer_slices(entry, "dx", trace.spec.grid, rank)
    y_block = layer_slices(entry, "y", trace.spec.grid, rank)
    pads = _pads(module)
    return any(y_block[2 + a].stop > y_block[2 + a].start and
               module.stride[a] * y_block[2 + a].start - pads[a][0] != x_block[2 + a].start for a in range(3)
               if x_block[2 + a].start > 0)


def halo_faces(trace: Trace, name: str, rank: int) -> list:
    """(axis, side) of each face of rank's input block of layer ``name`` that its outputs'
    windows read past (partition.needed_input_range: the halo it needs from a neighbour)."""
    from ..parallel.partition import needed_input_range, transposed_needed_input_range
    module, entry = _module(trace, name), trace.layer(name)
    x_block = layer_slices(entry, "dx", trace.spec.grid, rank)
    y_block = layer_slices(entry, "y", trace.spec.grid, rank)
    pads = _pads(module)
    faces = []
    for a in range(3):
        k, s, d = module.kernel_size[a], module.stride[a], getattr(module, "dilation", (1, 1, 1))[a]
        o0, o1, n_in = y_block[2 + a].start, y_block[2 + a].stop, entry["x_shape"][2 + a]
        if o0 == o1:
            continue
        if entry["kind"] == "conv_transpose3d":
            i0, i1 = transposed_needed_input_range(o0, o1, k, s, pads[a][0], d, n_in,
                                                   getattr(module, "output_padding", (0, 0, 0))[a])
        else:
            (i0, i1), _ = needed_input_range(o0, o1, k, s, pads[a], d, n_in)
        if i0 < x_block[2 + a].start:
            faces.append((2 + a, "low"))
        if i1 > x_block[2 + a].stop:
            faces.append((2 + a, "high"))
    return faces


def run_trace(trace: Trace, plant: Plant | None = None) -> dict:
    """{dtype: [per step {"layers": {name: {"y", "dx", "dw", "db": per-rank lists}}, "loss",
    "update", "update_ranks"}]}: the twin's steps, cut into the trace grid's blocks."""
    import warnings
    with warnings.catch_warnings():       # torch's note that an even kernel 'same' pads a copy: as meant
        warnings.filterwarnings("ignore", message="Using padding='same' with even kernel")
        return {dtype: _run_dtype(trace, dtype, plant) for dtype in trace.spec.dtypes}


def _run_dtype(trace: Trace, dtype: str, plant):
    import torch

    from .model_twins import load_parameters, torch_model
    spec = trace.spec
    config = spec.config()
    if spec.model == "unet3d" and (config["loss"] != "ce" or config["class_weights"] is not None):
        raise ValueError(f"run-torch: the U-Net twin uses torch's cross-entropy without class weights; the "
                         f"trace's config (preset {spec.preset!r}{' with --model-config' if spec.overrides else ''}) "
                         f"has loss {config['loss']!r}, class_weights {config['class_weights']!r}")
    data = trace.data[dtype]
    masks0 = data["steps"][0]["masks"]
    net = torch_model(spec.model, config, dropout_masks=masks0 or None)
    net = (net.double() if dtype == "float64" else net.float()).train()
    load_parameters(net, data["initial"])
    modules = dict(net.named_modules())
    settings = OPTIMIZERS[spec.optimizer]
    params = list(net.parameters())
    optimizer = torch.optim.SGD(params, lr=settings["lr"], momentum=settings["momentum"]) \
        if spec.optimizer == "sgd" else torch.optim.Adam(params, lr=settings["lr"])
    x = torch.as_tensor(data["x"])
    target = torch.as_tensor(data["target"])
    loss_fn = torch.nn.MSELoss() if spec.model == "cosmoflow" else torch.nn.CrossEntropyLoss()
    state = {"busy": False, "record": {}}
    face = halo_faces(trace, plant.layer, plant.rank)[0] if plant is not None and plant.kind == "halo" else None
    pads = _pads(_module(trace, plant.layer)) if plant is not None and plant.kind == "stride-phase" else None

    def fresh(module, inp):
        """The module on ``inp`` with the hooks silent (a planted rank's recomputation)."""
        state["busy"] = True
        try:
            return module(inp)
        finally:
            state["busy"] = False

    def pre_hook(name):
        def hook(module, args):
            if state["busy"]:
                return None
            inp = args[0].clone()
            if inp.requires_grad:
                if plant is not None and plant.kind == "adjoint-halo" and plant.layer == name:
                    inp.register_hook(lambda g: _without_ghosts(module, inp, g, state, spec.grid, plant.rank, fresh,
                                                                trace.layer(name)))
                inp.retain_grad()
            state["record"][name] = {"x": inp}
            return (inp,)
        return hook

    def post_hook(name):
        def hook(module, args, out):
            if state["busy"]:
                return None
            if plant is not None and plant.layer == name and plant.kind in ("halo", "inner-padding", "local-stats",
                                                                            "stride-phase"):
                out = _planted_forward(plant, spec.grid, module, args[0], out, fresh, trace.layer(name), face, pads)
            if plant is not None and plant.layer == name and state.get("stale") is not None:
                out = _stale_block(module, args[0], out, state["stale"], spec.grid, plant.rank, fresh,
                                   trace.layer(name))
            out.retain_grad()
            if plant is not None and plant.kind == "adjoint-halo" and plant.layer == name:
                out.register_hook(lambda g: state.update(dy=g))      # runs before the input's gradient
            state["record"][name]["y"] = out
            return out
        return hook

    for entry in trace.layers:
        module = modules[entry["name"]]
        module.register_forward_pre_hook(pre_hook(entry["name"]))
        module.register_forward_hook(post_hook(entry["name"]))

    steps = []
    for s in range(spec.steps):
        for name, mask in data["steps"][s]["masks"].items():
            modules[name].mask = torch.as_tensor(mask)
        before = {n: p.detach().clone() for n, p in net.named_parameters()}
        optimizer.zero_grad()
        state["record"] = {}
        out = net(x)
        loss = loss_fn(out, target)
        if plant is not None and plant.kind == "loss-count":
            loss = loss * spec.ranks
        loss.backward()
        layers = {}
        for entry in trace.layers:
            rec, module = state["record"][entry["name"]], modules[entry["name"]]
            y = rec["y"].detach().numpy()
            dx = None if rec["x"].grad is None else rec["x"].grad.numpy()
            grads = {t: getattr(module, attr).grad.detach().numpy().copy()
                     for t, attr in (("dw", "weight"), ("db", "bias")) if t in entry["params"]}
            per_rank = {t: [g] * spec.ranks for t, g in grads.items()}
            if plant is not None and plant.layer == entry["name"]:
                if plant.kind == "dw-unsummed":
                    own = _own_contribution(module, rec, spec.grid, plant.rank, fresh, entry)
                    for t in per_rank:
                        per_rank[t] = list(per_rank[t])
                        per_rank[t][plant.rank] = own[t]
                elif plant.kind == "dw-count":
                    for t, attr in (("dw", "weight"), ("db", "bias")):
                        if t in grads:
                            getattr(module, attr).grad /= spec.ranks          # the update uses them too
                            per_rank[t] = [grads[t] / spec.ranks] * spec.ranks
            layers[entry["name"]] = {"y": _cut(y, spec.grid, entry, "y"),
                                     "dx": None if dx is None else _cut(dx, spec.grid, entry, "dx"),
                                     **{t: _cut_parameter(arrays, spec.grid, entry, t) for t, arrays in per_rank.items()}}
        optimizer.step()
        update = {n: p.detach().numpy().copy() for n, p in net.named_parameters()}
        update_ranks = None
        if plant is not None and plant.kind == "update-skip":
            skipped = set(trace.layer(plant.layer)["params"].values())
            stale = state.get("stale") or {n.rsplit(".", 1)[1]: before[n] for n in skipped}
            state["stale"] = stale        # rank R keeps them: its next steps compute its block with them
            update_ranks = [{n: (stale[n.rsplit(".", 1)[1]].numpy() if r == plant.rank and n in skipped else a)
                             for n, a in update.items()} for r in range(spec.ranks)]
        steps.append({"layers": layers, "loss": float(loss.detach()), "update": update,
                      "update_ranks": update_ranks})
    return steps


def _cut(array, grid, entry, tensor):
    """Every rank's block of a layer's global ``y`` or ``dx``, with its offset."""
    out = []
    for r in range(int(numpy.prod(grid))):
        sl = layer_slices(entry, tensor, grid, r)
        out.append((numpy.ascontiguousarray(array[sl]), [s.start for s in sl]))
    return out


def _cut_parameter(arrays, grid, entry, tensor):
    """Every rank's share of a parameter gradient (``arrays``: each rank's whole one): all of it,
    or its slice where the model axis splits the layer, with its offset."""
    out = []
    for r, array in enumerate(arrays):
        sl = param_slices(entry, tensor, array.shape, grid, r)
        out.append((numpy.ascontiguousarray(array[sl]), [s.start for s in sl]))
    return out


def _planted_forward(plant, grid, module, x, out, fresh, entry, face=None, pads=None):
    """``out`` with the planted ranks' blocks recomputed the buggy way (through autograd)."""
    import torch
    out = out.clone()
    ranks = [plant.rank] if plant.kind in ("halo", "stride-phase") else range(int(numpy.prod(grid)))
    for r in ranks:
        in_sl, out_sl = layer_slices(entry, "dx", grid, r), layer_slices(entry, "y", grid, r)
        if plant.kind == "local-stats":         # its spatial block's statistics, of every channel it holds
            out[out_sl] = fresh(module, x[rank_slices(tuple(x.shape), grid, r)])[:, out_sl[1]]
            continue
        if plant.kind == "stride-phase":             # windows from its own block's first cell on
            starts = [max(in_sl[2 + a].start + pads[a][0], 0) for a in range(3)]
            y_own = fresh(module, x[(in_sl[0], slice(None)) + tuple(slice(a, None) for a in starts)])
            out[out_sl] = y_own[(slice(None), slice(None)) + tuple(slice(0, sl.stop - sl.start) for sl in out_sl[2:])]
            continue
        if plant.kind == "halo":                       # zeros beyond the first face it reads past
            axis, side = face
            keep = [slice(None)] * 5
            keep[axis] = slice(0, in_sl[axis].stop) if side == "low" else slice(in_sl[axis].start, None)
            cut = [slice(None)] * 5
            cut[axis] = slice(0, in_sl[axis].start) if side == "low" else slice(in_sl[axis].stop, None)
            mask = torch.ones_like(x)
            mask[tuple(cut)] = 0
            x_bug = x * mask
        else:                                          # inner padding: only its own block is data
            mask = torch.zeros_like(x)
            mask[in_sl] = 1
            x_bug = x * mask
        out[out_sl] = fresh(module, x_bug)[out_sl]
    return out


def _without_ghosts(module, inp, dx, state, grid, rank, fresh, entry):
    """dx with rank's block replaced by the gradient of rank's own outputs alone."""
    import torch
    dy = state["dy"]
    mask = torch.zeros_like(dy)
    mask[layer_slices(entry, "y", grid, rank)] = 1
    x = inp.detach().requires_grad_(True)
    with torch.enable_grad():
        (own,) = torch.autograd.grad(fresh(module, x), x, grad_outputs=dy * mask)
    out = dx.clone()
    block = layer_slices(entry, "dx", grid, rank)
    out[block] = own[block]
    return out


def _stale_block(module, x, out, stale, grid, rank, fresh, entry):
    """``out`` with rank's block computed with rank's own (stale) parameters of the module."""
    from torch.func import functional_call
    out = out.clone()
    block = layer_slices(entry, "y", grid, rank)
    with_stale = lambda inp: functional_call(module, stale, (inp,))      # noqa: E731
    out[block] = fresh(_Call(with_stale), x)[block]
    return out


class _Call:
    """A callable as a module stand-in for ``fresh`` (which silences the hooks around a call)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, inp):
        return self.fn(inp)


def _own_contribution(module, rec, grid, rank, fresh, entry):
    """dw, db of ``module`` from rank's output block alone: its share before the allreduce."""
    import torch
    x, dy = rec["x"].detach(), rec["y"].grad
    mask = torch.zeros_like(dy)
    mask[layer_slices(entry, "y", grid, rank)] = 1
    params = [p for p in (module.weight, getattr(module, "bias", None)) if p is not None]
    grads = torch.autograd.grad(fresh(module, x), params, grad_outputs=dy * mask)
    return {t: g.numpy() for t, g in zip(("dw", "db"), grads)}


def write_results(path: str, trace: Trace, results: dict) -> None:
    """The results file of ``results`` (run_trace's), in the documented layout, atomically."""

    from ..atomic import atomic_write, hdf5_file

    def write(f):
        with hdf5_file(f) as (h5, _):
            h5.attrs["trace_digest"] = trace.digest
            for dtype, steps in results.items():
                for s, step in enumerate(steps):
                    base = f"{dtype}/step/{s}"
                    h5[f"{base}/loss"] = numpy.asarray(step["loss"], dtype=dtype)
                    for name, tensors in step["layers"].items():
                        for t, blocks in tensors.items():
                            for r, (array, offset) in enumerate(blocks or ()):
                                h5.create_dataset(f"{base}/{name}/rank/{r}/{t}", data=array).attrs["offset"] = offset
                    for pname, array in step["update"].items():
                        h5[f"{base}/update/{pname}"] = array
                    for r, arrays in enumerate(step["update_ranks"] or ()):
                        for pname, array in arrays.items():
                            h5[f"{base}/update/rank/{r}/{pname}"] = array
    atomic_write(path, write, binary=True)


__all__ = ["PLANTS", "Plant", "parse_plant", "run_trace", "write_results", "halo_faces"]
