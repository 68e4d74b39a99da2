#!/usr/bin/env python
"""Per-layer profile of one training step: refimpl vs the same network in PyTorch (CPU or GPU, one process).

One step is forward, loss and backward (no optimiser) of CosmoFlow and / or the
3D U-Net on one fixed synthetic batch (``bench_train.synthetic_batch``), float32,
in one process with ``--threads`` threads on both sides (OMP / OPENBLAS /
MKL_NUM_THREADS set before numpy is imported, which also sizes refimpl's worker
threads unless ``REFIMPL_THREADS`` is set; ``torch.set_num_threads``).  The
torch network and loss are bench_train's twins (``torch_model``), built from
the same configuration (``bench_train.model_config`` of the preset's sizes);
the parameter counts are checked to be equal before anything is timed.

Method:

- refimpl: every leaf layer (a Module without sub-modules) gets its bound
  ``forward`` / ``backward`` wrapped by an instance attribute that calls
  ``time.perf_counter`` around the original, so the containers and the model
  call the wrapper.  The loss is ``model.loss`` (it returns the loss and
  dL/dout in one call: all of it is in the loss row's fwd column).
- torch: forward pre / post hooks and full backward pre / post hooks on every
  leaf module.  A backward runs from its pre hook (gradient of the output
  ready) to its post hook (gradient of the input computed).  For the first
  layer, whose input needs no gradient, torch fires both hooks before the
  layer's backward runs, so its backward ends when ``loss.backward()`` returns.
  The loss row: ``loss_fn(out, y)`` (fwd), and from the call of
  ``loss.backward()`` to the first layer's backward pre hook (bwd: the loss's
  backward and autograd start-up).  Calls of a shared module (the torch U-Net's
  one MaxPool3d) are told apart by order: backward runs in reverse.
- Rows are matched in the models' written order (refimpl's rows sorted by its leaves'
  registration order); torch's Flatten is folded into the Linear after it (refimpl's
  FlattenLinear is one layer).  The layer kinds and output shapes of every
  pair are checked, except the output shape of an activation that refimpl's
  ``Sequential`` runs after the max pool behind it (``run_order``: the same output, on
  the pooled block): its row is labelled "after the pool" and shows the block it ran on.
- ``other``: the forward (zero_grad, forward) minus its layers' times, and the
  backward minus its layers' (and torch's loss backward) times: zero_grad, the
  U-Net's concatenation / gradient split and skip addition, container and hook
  overhead, autograd bookkeeping.

Order of the runs: one warm-up step each; ``--repeats`` plain steps (no
instrumentation), refimpl and torch alternately; then ``--repeats``
instrumented steps, alternately.  Each row keeps its best (smallest) time over
the instrumented steps, as do the two ``other`` parts.

Columns (ms): ours fwd / bwd / f+b: refimpl's layer forward, backward and their
sum; torch fwd / bwd / f+b: the same for PyTorch; torch/ours: torch f+b /
ours f+b (> 1: refimpl is faster); ours % / torch %: the row's share of the
side's sum of rows.  Totals: ``sum of rows`` (every row's best: layers, loss,
other), ``step instrumented`` (the best whole instrumented step) and ``step
plain`` (the best step without instrumentation: the step time to quote).

Configuration: ``--preset`` (default small) of refimpl.models.PRESETS, through
``bench_train.model_config`` (the U-Net's loss is cross-entropy, the twin's
CrossEntropyLoss, whatever the preset says: the header notes a change);
``--size`` overrides its extent D=H=W; ``--batch`` defaults to 4 for CosmoFlow
and 2 for the U-Net.  ``--json FILE``: the settings, and per model the config,
the rows and the totals, times in seconds.

    python scripts/profile_step.py [--model cosmoflow|unet3d] [--preset small] [--batch B]
                                   [--size S] [--threads 2] [--repeats 3] [--json FILE]
    python scripts/profile_step.py --model cosmoflow --json profile_cosmoflow_small.json
    python scripts/profile_step.py --model unet3d --json profile_unet3d_small.json
    python scripts/profile_step.py --preset tiny --repeats 1            # a smoke run, seconds
    python scripts/profile_step.py --model cosmoflow --gemm-floor       # + each conv's GEMM floor

``--gemm-floor`` adds a table below the model's: for each conv row, numpy's GEMMs alone for
the products an im2col route computes (``gemm_floor``), and torch's f+b over that floor, the
best ratio such a route can reach on this machine.

On a GPU (``--device cuda``, issue 39): refimpl on CuPy against the twin on the same GPU
(cuDNN), full float32 on both sides unless ``--tf32 on`` (then TF32 on both: refimpl's
``REFIMPL_TF32`` / ``CUPY_TF32``, torch's ``allow_tf32``), every clock read after both sides'
queued kernels have finished (``backend.synchronize``, ``torch.cuda.synchronize``): each row is
then the layer's own device time plus one synchronisation.  ``--device strict`` runs refimpl on
the host stand-in of a device array against torch on the CPU (a smoke run of the device path).

    python scripts/profile_step.py --device cuda --model cosmoflow --preset mlperf --batch 4
    python scripts/profile_step.py --device cuda --model unet3d --size 128 --batch 2

The refimpl profiled is the first on ``sys.path`` (the checkout this script
lives in when none is found), so ``PYTHONPATH`` profiles another version of
refimpl with this script and bench_train's torch twins, e.g. an older commit:

    git worktree add /tmp/before 8b6138e
    PYTHONPATH=/tmp/before python scripts/profile_step.py --model cosmoflow
    git worktree remove /tmp/before

(run it as a script: ``python -c`` / ``-m`` would put the current directory,
maybe this checkout, ahead of PYTHONPATH).  The header names the refimpl used.
A refimpl without ``backend.tune_allocator`` runs with the allocator untouched
(the header says so; torch then shares that malloc).  torch is optional:
without it (or with ``--no-torch``) its columns read n/a.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import warnings
from collections import Counter, defaultdict

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(SCRIPTS, "..")
MODELS = ("cosmoflow", "unet3d")
DEFAULT_BATCH = {"cosmoflow": 4, "unet3d": 2}
WEIGHTED = ("Conv3d", "ConvTranspose3d", "Linear")   # labels show their channels as in->out
FOLDED = ("Flatten",)             # torch leaves folded into the next row (refimpl's FlattenLinear)
#: The loss row's label.  The U-Net's row holds more than the twin's CrossEntropyLoss: refimpl's
#: ``UNet3D.loss`` also counts the hard Dice score of every step (argmax and confusion counts,
#: the metric it reports), a third or so of the row.
LOSS_LABEL = {"cosmoflow": "loss MSE", "unet3d": "loss cross-entropy + Dice metric"}


# ---------------------------------------------------------------------------- imports

_SYNCS = []                       # what each clock read waits for (a device's queued kernels)


def now() -> float:
    """``time.perf_counter()`` after every side's queued device work has finished."""
    for sync in _SYNCS:
        sync()
    return time.perf_counter()


def set_threads(threads: int) -> None:
    """BLAS (and refimpl worker) threads: must run before numpy is imported."""
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)


def import_refimpl():
    """refimpl from sys.path (so PYTHONPATH picks the checkout), else the one beside this script."""
    if importlib.util.find_spec("refimpl") is None:
        sys.path.insert(0, ROOT)
    import refimpl
    return refimpl


def import_bench_train():
    """scripts/bench_train.py as a module; its sys.path insert of the repo root is undone
    (refimpl is imported before, so its functions use the refimpl chosen above)."""
    saved = list(sys.path)
    sys.path.insert(0, SCRIPTS)
    try:
        import bench_train
    finally:
        sys.path[:] = saved
    return bench_train


def tune_allocator_if_any() -> str:
    """``refimpl.backend.tune_allocator()`` when this refimpl has it (older versions do not)."""
    try:
        from refimpl.backend import tune_allocator
    except ImportError:
        return "untouched (this refimpl has no backend.tune_allocator)"
    return "tuned (tune_allocator)" if tune_allocator() else "untouched (tune_allocator: system / not glibc)"


def refimpl_threads():
    """refimpl's worker threads for its chunked passes (None before refimpl had them)."""
    try:
        from refimpl.kernels import thread_count
    except ImportError:
        return None
    return thread_count()


# ---------------------------------------------------------------------------- configuration

def model_setup(bench_train, name: str, preset: str, size):
    """(config, notes): bench_train.model_config of the preset's sizes (the configuration the
    torch twin is written for), checked against every other key the preset sets."""
    from refimpl.models import PRESETS
    if preset not in PRESETS[name]:
        raise SystemExit(f"profile_step: no {name} preset {preset!r}; presets: {sorted(PRESETS[name])}")
    p = dict(PRESETS[name][preset])
    shape = tuple(p["input_shape"])
    sizes = argparse.Namespace(size=size or shape[1], width=p.get("conv_size", 1),
                               layers=p.get("n_conv_layers", 1), fc1=p.get("fc1_size", 1),
                               fc2=p.get("fc2_size", 1), unet_width=p.get("base_width", 1),
                               unet_layers=p.get("levels", 1), kernel=p.get("kernel_size", 3))
    config = bench_train.model_config(sizes, name)
    notes = []
    if size is None and len(set(shape[1:])) != 1:
        raise SystemExit(f"profile_step: preset {preset} has a non-cubic input {shape}: give --size")
    if shape[0] != config["input_shape"][0]:
        raise SystemExit(f"profile_step: preset {preset} has {shape[0]} input channels, the torch twin "
                         f"{config['input_shape'][0]}")
    if p.get("loss", config.get("loss")) != config.get("loss"):
        notes.append(f"loss {config['loss']} instead of the preset's {p['loss']} (the torch twin's loss)")
    differ = sorted(k for k in p if k not in ("input_shape", "loss") and p[k] != config.get(k))
    if differ:
        raise SystemExit(f"profile_step: preset {preset} sets {', '.join(differ)}, which the torch twin "
                         f"(bench_train.model_config) does not follow")
    levels = config.get("n_conv_layers", config.get("levels"))
    if config["input_shape"][1] % 2 ** levels:
        raise SystemExit(f"profile_step: {name}: size {config['input_shape'][1]} must be divisible by "
                         f"2^{levels} (each of the {levels} levels halves it)")
    return config, notes


def describe(in_shape, out_shape, weighted=False) -> str:
    """'4->16 @64^3' (conv), '16 @64^3->32^3' (pool), '256@4^3->128' (flatten + dense), '128->64'
    (dense); ``weighted``: a conv or dense layer, whose channels read 'in->out' even when equal."""
    def spatial(shape):
        dims = shape[2:]
        return f"{dims[0]}^3" if len(set(dims)) == 1 else "x".join(map(str, dims))

    c_in, c_out = in_shape[1], out_shape[1]
    channels = f"{c_in}" if c_in == c_out and not weighted else f"{c_in}->{c_out}"
    if len(in_shape) == 5 and len(out_shape) == 5:
        where = spatial(in_shape) if in_shape[2:] == out_shape[2:] else \
            f"{spatial(in_shape)}->{spatial(out_shape)}"
        return f"{channels} @{where}"
    if len(in_shape) == 5:
        return f"{c_in}@{spatial(in_shape)}->{c_out}"
    return channels


def same_kind(ours: str, theirs: str) -> bool:
    """refimpl's class name vs torch's: SpatialDropout ~ Dropout, FlattenLinear ~ (Flatten +) Linear
    (the twins of refimpl/oracle/model_twins.py have a FlattenLinear of their own)."""
    def plain(name):
        return name.removeprefix("Spatial").removeprefix("Flatten")
    return plain(ours) == plain(theirs)


# ---------------------------------------------------------------------------- one instrumented step

class StepLog:
    """One instrumented step: the leaf layers' forward calls in order, their backward times, the rest."""

    def __init__(self):
        self.calls = []                      # [name, kind, in shape, out shape, fwd s], forward order
        self.bwd = defaultdict(list)         # name -> backward seconds, in the order they ran
        self.fwd_s = self.bwd_s = None       # the forward (zero_grad + forward) and backward phases
        self.loss_fwd_s, self.loss_bwd_s = None, None

    def layers(self):
        """[{name, kind, in, out, fwd_s, bwd_s}] in forward order: a layer called n times has its
        k-th backward matched with its (n-1-k)-th forward (backward runs in reverse)."""
        calls, seen, rows = Counter(c[0] for c in self.calls), Counter(), []
        for name, kind, in_shape, out_shape, fwd in self.calls:
            k = calls[name] - 1 - seen[name]
            seen[name] += 1
            bwd = self.bwd[name][k] if k < len(self.bwd[name]) else None
            rows.append(dict(name=name, kind=kind, in_shape=in_shape, out_shape=out_shape, fwd_s=fwd,
                             bwd_s=bwd))
        return rows

    def other(self):
        """(fwd, bwd) seconds of each phase outside its layers (and the loss)."""
        rows = self.layers()
        fwd = self.fwd_s - sum(r["fwd_s"] for r in rows)
        bwd = self.bwd_s - sum(r["bwd_s"] or 0.0 for r in rows) - (self.loss_bwd_s or 0.0)
        return fwd, bwd


def refimpl_leaves(module, prefix=""):
    """(dotted name, module) of every Module without sub-modules, in registration order."""
    for name, child in module._modules.items():
        if child._modules:
            yield from refimpl_leaves(child, f"{prefix}{name}.")
        else:
            yield prefix + name, child


def pooled_first(module, prefix="") -> set:
    """The dotted names of the leaves that a ``Sequential`` of ``module`` runs after the layer
    written behind them (``Sequential.run_order``: an activation after its max pool)."""
    out = set()
    run_order = getattr(module, "run_order", None)
    if run_order is not None:
        ran = {id(m): i for i, m in enumerate(run_order())}
        written = list(module._modules.items())
        out |= {prefix + name for (name, m), (_, nxt) in zip(written, written[1:]) if ran[id(m)] > ran[id(nxt)]}
    for name, child in module._modules.items():
        out |= pooled_first(child, f"{prefix}{name}.")
    return out


class RefimplStep:
    """refimpl's model and batch: plain steps, and steps with every leaf layer's forward / backward timed."""

    def __init__(self, name, config, x, y, seed):
        from refimpl.models import build_model
        self.model = build_model(name, config, seed=seed, dtype="float32")
        self.model.train()
        from refimpl import backend
        self.x, self.y = backend.asarray(x), backend.asarray(y)        # the device's arrays on a GPU
        self.log, self.wrapped = None, []
        self.leaf_index = {name: i for i, (name, _) in enumerate(refimpl_leaves(self.model))}
        self.pooled_first = pooled_first(self.model)

    def params(self) -> int:
        return sum(int(p.data.size) for p in self.model.parameters())

    def step(self) -> float:
        t0 = now()
        self.model.zero_grad()
        _, dout, _ = self.model.loss(self.model.forward(self.x), self.y)
        self.model.backward(dout)
        return now() - t0

    def instrument(self):
        for name, layer in refimpl_leaves(self.model):
            self._wrap(name, layer)
            self.wrapped.append(layer)

    def _wrap(self, name, layer):
        forward, backward, kind = layer.forward, layer.backward, type(layer).__name__   # bound originals

        def timed_forward(x, *args, **kwargs):
            t0 = now()
            y = forward(x, *args, **kwargs)
            self.log.calls.append([name, kind, tuple(x.shape), tuple(y.shape), now() - t0])
            return y

        def timed_backward(dy, *args, **kwargs):
            t0 = now()
            dx = backward(dy, *args, **kwargs)
            self.log.bwd[name].append(now() - t0)
            return dx

        layer.forward, layer.backward = timed_forward, timed_backward    # instance attributes

    def uninstrument(self):
        for layer in self.wrapped:
            del layer.forward, layer.backward                           # the class methods again
        self.wrapped = []

    def profiled_step(self) -> StepLog:
        log = self.log = StepLog()
        t0 = now()
        self.model.zero_grad()
        out = self.model.forward(self.x)
        t1 = now()
        _, dout, _ = self.model.loss(out, self.y)
        t2 = now()
        self.model.backward(dout)
        t3 = now()
        log.fwd_s, log.loss_fwd_s, log.bwd_s = t1 - t0, t2 - t1, t3 - t2
        log.calls.sort(key=lambda call: self.leaf_index[call[0]])      # the written order (stable)
        return log


class TorchStep:
    """bench_train's torch twin and the same batch: plain steps, and steps timed by hooks on every leaf."""

    def __init__(self, bench_train, name, config, x, y, seed, layout="ncdhw", device="cpu"):
        import torch
        torch.manual_seed(seed)
        self.net, self.loss_fn = bench_train.torch_model(name, config)
        self.net.train()
        device = torch.device("cuda" if device == "cuda" else "cpu")
        self.x, self.y = torch.from_numpy(x.copy()).to(device), torch.from_numpy(y.copy()).to(device)
        self.net, self.x = bench_train.torch_layout(self.net.to(device), self.x, layout)
        self.log, self.handles = None, []
        self.fwd_t0, self.bwd_t0 = defaultdict(list), defaultdict(list)   # per module: open calls
        self.first_bwd_t0, self.no_input_grad = None, []

    def params(self) -> int:
        return sum(p.numel() for p in self.net.parameters())

    def step(self) -> float:
        t0 = now()
        self.net.zero_grad()
        self.loss_fn(self.net(self.x), self.y).backward()
        return now() - t0

    def instrument(self):
        for name, module in self.net.named_modules():       # a shared module is listed once
            if next(module.children(), None) is not None:
                continue
            kind = type(module).__name__
            self.handles += [
                module.register_forward_pre_hook(lambda m, args: self.fwd_t0[m].append(now())),
                module.register_forward_hook(
                    lambda m, args, out, name=name, kind=kind: self.log.calls.append(
                        [name, kind, tuple(args[0].shape), tuple(out.shape),
                         now() - self.fwd_t0[m].pop()])),
                module.register_full_backward_pre_hook(self._bwd_pre),
                module.register_full_backward_hook(lambda m, gin, gout, name=name: self._bwd_post(m, name, gin))]

    def _bwd_pre(self, module, grad_output):
        t = now()
        self.bwd_t0[module].append(t)
        self.first_bwd_t0 = t if self.first_bwd_t0 is None else self.first_bwd_t0

    def _bwd_post(self, module, name, grad_input):
        t = now()
        t0 = self.bwd_t0[module].pop()
        if all(g is None for g in grad_input):      # no input gradient: called before the layer's backward
            self.no_input_grad.append((name, t0))   # ends with loss.backward() (profiled_step)
        else:
            self.log.bwd[name].append(t - t0)

    def uninstrument(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def profiled_step(self) -> StepLog:
        log = self.log = StepLog()
        self.first_bwd_t0, self.no_input_grad = None, []
        t0 = now()
        self.net.zero_grad()
        out = self.net(self.x)
        t1 = now()
        loss = self.loss_fn(out, self.y)
        t2 = now()
        loss.backward()
        t3 = now()
        for name, t in self.no_input_grad:
            log.bwd[name].append(t3 - t)
        log.fwd_s, log.loss_fwd_s, log.bwd_s = t1 - t0, t2 - t1, t3 - t2
        log.loss_bwd_s = (self.first_bwd_t0 or t3) - t2
        return log


# ---------------------------------------------------------------------------- rows

def fold(layers):
    """torch rows with the FOLDED leaves (Flatten) added into the row after them."""
    out, carry = [], None
    for row in layers:
        if row["kind"] in FOLDED:
            carry = row
            continue
        if carry is not None:
            row = dict(row, name=f"{carry['name']}+{row['name']}", in_shape=carry["in_shape"],
                       fwd_s=carry["fwd_s"] + row["fwd_s"], bwd_s=(carry["bwd_s"] or 0.0) + (row["bwd_s"] or 0.0))
            carry = None
        out.append(row)
    return out


def check_aligned(ours, theirs, model, pooled=frozenset()):
    """Same number of layers, and pairwise the same kind and output shape (not for the ``pooled``
    rows of ours: activations run on the pooled block), or SystemExit."""
    def listing(rows):
        return "\n".join(f"  {r['name']} {r['kind']} -> {r['out_shape']}" for r in rows)

    bad = len(ours) != len(theirs) or any(
        not same_kind(a["kind"], b["kind"]) or (a["out_shape"] != b["out_shape"] and a["name"] not in pooled)
        for a, b in zip(ours, theirs))
    if bad:
        raise SystemExit(f"profile_step: {model}: the refimpl and torch layers do not match call by call\n"
                         f"refimpl:\n{listing(ours)}\ntorch:\n{listing(theirs)}")


def best(values):
    values = [v for v in values if v is not None]
    return min(values) if values else None


def best_rows(logs, folded=False):
    """Per row, the best fwd and bwd over the instrumented steps; the loss and 'other' likewise."""
    runs = [fold(log.layers()) if folded else log.layers() for log in logs]
    rows = [dict(run_rows[0], fwd_s=best(r["fwd_s"] for r in run_rows), bwd_s=best(r["bwd_s"] for r in run_rows))
            for run_rows in zip(*runs)]
    others = [log.other() for log in logs]
    loss = dict(fwd_s=best(log.loss_fwd_s for log in logs), bwd_s=best(log.loss_bwd_s for log in logs))
    other = dict(fwd_s=best(o[0] for o in others), bwd_s=best(o[1] for o in others))
    return rows, loss, other


def f_plus_b(fwd, bwd):
    return None if fwd is None else fwd + (bwd or 0.0)


def ratio(theirs, ours):
    return theirs / ours if theirs is not None and ours else None


def measure(sides, repeats):
    """(plain step times, instrumented StepLogs) per side: one warm-up step each, then ``repeats``
    plain steps and ``repeats`` instrumented steps, the sides alternately (the same machine conditions)."""
    for side in sides:                                    # first-call allocations, caches
        side.step()
    plain, logs = [[] for _ in sides], [[] for _ in sides]
    for _ in range(repeats):
        for i, side in enumerate(sides):
            plain[i].append(side.step())
    for side in sides:
        side.instrument()
    try:
        for _ in range(repeats):
            for i, side in enumerate(sides):
                logs[i].append(side.profiled_step())
    finally:
        for side in sides:
            side.uninstrument()
    return plain, logs


def make_rows(name, ours_logs, torch_logs, torch_loss, pooled=frozenset()):
    """The table's rows (layers in written order, loss, other) with their best times, f+b sums,
    ratios and shares; and the sums of the rows.  ``pooled``: the names of refimpl's layers
    run after the pool written behind them (labelled so)."""
    o_rows, o_loss, o_other = best_rows(ours_logs)
    if torch_logs:
        t_rows, t_loss, t_other = best_rows(torch_logs, folded=True)
        check_aligned(o_rows, t_rows, name, pooled)
    else:
        t_rows, t_loss, t_other = [None] * len(o_rows), None, None
    rows = [dict(layer=o["name"], kind=o["kind"], out_shape=list(o["out_shape"]),
                 label=f"{o['name']} {o['kind']} "
                       f"{describe(o['in_shape'], o['out_shape'], weighted=o['kind'].endswith(WEIGHTED))}"
                       + (" after the pool" if o["name"] in pooled else ""),
                 torch_layer=t and t["name"], ours=o, torch=t) for o, t in zip(o_rows, t_rows)]
    rows.append(dict(layer="loss", kind="loss", out_shape=None, label=LOSS_LABEL[name], torch_layer=torch_loss,
                     ours=dict(o_loss, bwd_s=None), torch=t_loss))   # refimpl: value and dL/dout in one call
    rows.append(dict(layer="other", kind="other", out_shape=None, label="other (step minus rows)", torch_layer=None,
                     ours=o_other, torch=t_other))
    for r in rows:
        for side in ("ours", "torch"):
            times = r.pop(side) or dict(fwd_s=None, bwd_s=None)
            r[f"{side}_fwd_s"], r[f"{side}_bwd_s"] = times["fwd_s"], times["bwd_s"]
            r[f"{side}_s"] = f_plus_b(times["fwd_s"], times["bwd_s"])
        r["torch_over_ours"] = ratio(r["torch_s"], r["ours_s"])
    sums = {}
    for side in ("ours", "torch"):
        measured = rows[0][f"{side}_s"] is not None
        for part, key in (("fwd", f"{side}_fwd_s"), ("bwd", f"{side}_bwd_s"), ("rows", f"{side}_s")):
            sums[f"{side}_{part}_s"] = sum(r[key] or 0.0 for r in rows) if measured else None
    for r in rows:
        r["ours_share"] = r["ours_s"] / sums["ours_rows_s"]
        r["torch_share"] = r["torch_s"] / sums["torch_rows_s"] if sums["torch_rows_s"] else None
    return rows, sums


def profile_model(name, config, notes, args, bench_train, use_torch) -> dict:
    batch = args.batch or DEFAULT_BATCH[name]
    x, y = bench_train.synthetic_batch(name, config, batch, args.seed + 1)
    try:
        ours = RefimplStep(name, config, x, y, args.seed)
    except ValueError as err:
        raise SystemExit(f"profile_step: {name}: {err}")
    theirs = (TorchStep(bench_train, name, config, x, y, args.seed, args.torch_layout, args.device) if use_torch
              else None)
    if theirs is not None and theirs.params() != ours.params():
        raise SystemExit(f"profile_step: {name}: refimpl has {ours.params():,} parameters, the torch twin "
                         f"{theirs.params():,}: not the same network")
    sides = [ours] + ([theirs] if theirs is not None else [])
    plain, logs = measure(sides, args.repeats)
    if theirs is None:                                    # the torch columns read n/a
        plain, logs = plain + [None], logs + [None]
    rows, sums = make_rows(name, logs[0], logs[1], theirs and type(theirs.loss_fn).__name__, ours.pooled_first)
    step = [min(p) if p else None for p in plain]
    instrumented = [best(log.fwd_s + log.loss_fwd_s + log.bwd_s for log in side) if side else None
                    for side in logs]
    totals = dict(sums, ours_step_s=step[0], torch_step_s=step[1], torch_over_ours=ratio(step[1], step[0]),
                  ours_step_all_s=plain[0], torch_step_all_s=plain[1],
                  ours_step_instrumented_s=instrumented[0], torch_step_instrumented_s=instrumented[1],
                  instrumented_torch_over_ours=ratio(instrumented[1], instrumented[0]))
    floors = gemm_floor(ours.model, rows) if args.gemm_floor else None
    return dict(model=name, preset=args.preset, config=config, batch=batch, params=ours.params(),
                notes=notes, rows=rows, totals=totals, gemm_floor=floors)


# ---------------------------------------------------------------------------- GEMM floor

#: Column positions per timed GEMM of the floor: cache-sized tiles as im2col's (8 MiB of columns)
FLOOR_TILE_BYTES = 8 * 2**20


def gemm_floor(model, rows, repeats=5) -> list:
    """For each convolution row: the time numpy's GEMMs alone take for the products an im2col
    route must compute (forward ``W (F, K) @ col (K, M)``, weight gradient ``col @ dy^T``, input
    gradient ``W^T @ dy`` unless the layer needs none; K = C*kd*kh*kw, M = the output positions
    of the batch), on cache-resident tiles of ``FLOOR_TILE_BYTES`` of columns, BLAS on the
    script's threads, best of ``repeats``: no copy, no im2col, no col2im.  A route built on
    numpy's GEMM cannot run the layer faster than this; torch's f+b over it is the best ratio
    such a route can reach (Winograd computes fewer products, and pays memory-bound transforms
    instead)."""
    import numpy
    modules = dict(refimpl_leaves(model))
    out = []
    for r in rows:
        module = modules.get(r["layer"])
        if r["kind"] != "Conv3d" or module is None or getattr(module, "groups", 1) != 1:
            continue
        f = module.weight.shape[0]
        k_rows = int(numpy.prod(module.weight.shape[1:]))
        positions = r["out_shape"][0] * int(numpy.prod(r["out_shape"][2:]))
        tile = max(1, min(positions, FLOOR_TILE_BYTES // (4 * k_rows)))
        rng = numpy.random.default_rng(0)
        w = rng.standard_normal((f, k_rows)).astype(numpy.float32)
        col = rng.standard_normal((k_rows, tile)).astype(numpy.float32)
        dy = rng.standard_normal((f, tile)).astype(numpy.float32)
        wt = numpy.ascontiguousarray(w.T)
        passes = {"fwd": lambda: numpy.matmul(w, col), "dw": lambda: numpy.matmul(col, dy.T),
                  "dx": lambda: numpy.matmul(wt, dy)}
        need_dx = getattr(module, "needs_input_grad", True)
        times = {}
        for name, fn in passes.items():
            fn()
            times[name] = min(_timed(fn) for _ in range(repeats)) * positions / tile
        bwd = times["dw"] + (times["dx"] if need_dx else 0.0)
        floor = times["fwd"] + bwd
        flops = 2 * f * k_rows * positions * (3 if need_dx else 2)
        out.append(dict(layer=r["layer"], label=r["label"], k_rows=k_rows, positions=positions, tile=tile,
                        input_grad=bool(need_dx), floor_fwd_s=times["fwd"], floor_bwd_s=bwd, floor_s=floor,
                        gemm_gflops=flops / floor / 1e9, ours_s=r["ours_s"], torch_s=r["torch_s"],
                        ours_over_floor=floor / r["ours_s"], torch_over_floor=ratio(r["torch_s"], floor)))
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def print_floor(floors):
    print("\nGEMM floor of the conv rows (numpy's GEMMs alone, cache-resident tiles; torch/floor: the best "
          "torch/ours an im2col route can reach)")
    width = max(31, max((len(f["label"]) for f in floors), default=0))
    head = (f"{'layer':<{width}} {'K':>5} {'floor fwd':>9} {'floor bwd':>9} {'floor f+b':>9} {'GFLOP/s':>7} "
            f"{'ours f+b':>9} {'torch f+b':>9} {'floor/ours':>10} {'torch/floor':>11}")
    print(head)
    print("-" * len(head))
    for f in floors:
        print(f"{f['label']:<{width}} {f['k_rows']:>5} {fmt_ms(f['floor_fwd_s'], 9)} {fmt_ms(f['floor_bwd_s'], 9)} "
              f"{fmt_ms(f['floor_s'], 9)} {f['gemm_gflops']:7.0f} {fmt_ms(f['ours_s'], 9)} {fmt_ms(f['torch_s'], 9)} "
              f"{fmt_ratio(f['ours_over_floor'], 10)} {fmt_ratio(f['torch_over_floor'], 11)}")


# ---------------------------------------------------------------------------- output

def fmt_ms(seconds, width):
    if seconds is None:
        return f"{'n/a':>{width}}"
    v = seconds * 1e3
    digits = 0 if abs(v) >= 100 else 1 if abs(v) >= 10 else 2 if abs(v) >= 0.1 else 3
    return f"{v:{width}.{digits}f}"


def fmt_ratio(r, width):
    return f"{'n/a':>{width}}" if r is None else f"{r:{width}.2f}"


def fmt_share(s, width):
    return f"{'n/a':>{width}}" if s is None else f"{100 * s:{width}.1f}"


def print_report(report, repeats):
    cfg, tot = report["config"], report["totals"]
    shape = "x".join(map(str, cfg["input_shape"]))
    print(f"\n## {report['model']}, preset {report['preset']}: batch {report['batch']} x {shape}, "
          f"{report['params']:,} parameters" + "".join(f"; {n}" for n in report["notes"]))
    width = max(31, max(len(r["label"]) for r in report["rows"]))
    head = (f"{'layer':<{width}} {'ours fwd':>9} {'ours bwd':>9} {'ours f+b':>9} {'torch fwd':>9} "
            f"{'torch bwd':>9} {'torch f+b':>9} {'torch/ours':>10} {'ours %':>6} {'torch %':>7}")
    print(head)
    print("-" * len(head))

    def line(label, times, r, shares=None):
        """times: ours fwd, bwd, f+b, torch fwd, bwd, f+b (None: n/a; a string: printed as is)."""
        cells = [f"{v:>9}" if isinstance(v, str) else fmt_ms(v, 9) for v in times]
        tail = "" if shares is None else f" {fmt_share(shares[0], 6)} {fmt_share(shares[1], 7)}"
        print(f"{label:<{width}} {' '.join(cells)} {fmt_ratio(r, 10)}{tail}")

    for r in report["rows"]:
        ours_bwd = "-" if r["kind"] == "loss" else r["ours_bwd_s"]    # refimpl's loss: one call
        line(r["label"], (r["ours_fwd_s"], ours_bwd, r["ours_s"], r["torch_fwd_s"], r["torch_bwd_s"],
                          r["torch_s"]), r["torch_over_ours"], (r["ours_share"], r["torch_share"]))
    print("-" * len(head))
    line("sum of rows", (tot["ours_fwd_s"], tot["ours_bwd_s"], tot["ours_rows_s"], tot["torch_fwd_s"],
                         tot["torch_bwd_s"], tot["torch_rows_s"]), ratio(tot["torch_rows_s"], tot["ours_rows_s"]),
         (1.0, 1.0 if tot["torch_rows_s"] else None))
    line(f"step instrumented (best of {repeats})", ("", "", tot["ours_step_instrumented_s"], "", "",
                                                    tot["torch_step_instrumented_s"]),
         tot["instrumented_torch_over_ours"])
    line(f"step plain (best of {repeats})", ("", "", tot["ours_step_s"], "", "", tot["torch_step_s"]),
         tot["torch_over_ours"])


def load_average() -> list | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


# ---------------------------------------------------------------------------- arguments

def model_list(text: str) -> list:
    names = text.split(",")
    for name in names:
        if name not in MODELS:
            raise argparse.ArgumentTypeError(f"unknown model {name!r} (choose from {', '.join(MODELS)})")
    return names


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "--models", dest="models", type=model_list, default=list(MODELS),
                    metavar="NAME[,NAME]", help=f"models to profile (default {','.join(MODELS)})")
    ap.add_argument("--preset", default="small",
                    help="refimpl.models.PRESETS entry of each model (default small; tiny for a smoke run)")
    ap.add_argument("--batch", type=int, default=None,
                    help="batch size (default " + ", ".join(f"{m} {b}" for m, b in DEFAULT_BATCH.items()) + ")")
    ap.add_argument("--size", type=int, default=None, help="override the preset's extent D=H=W")
    ap.add_argument("--threads", type=int, default=2, help="BLAS / refimpl / torch threads (default 2)")
    ap.add_argument("--repeats", type=int, default=3, help="plain and instrumented steps per side (best kept)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-torch", action="store_true", help="refimpl only")
    ap.add_argument("--torch-layout", choices=import_bench_train().TORCH_LAYOUTS, default="ncdhw",
                    help="memory layout of the torch twin (bench_train.torch_layout): NCDHW, or channels_last_3d")
    ap.add_argument("--gemm-floor", action="store_true",
                    help="also time numpy's GEMMs alone for each conv row's products (gemm_floor): the "
                         "fastest an im2col route could run, and torch's f+b over it")
    ap.add_argument("--device", choices=("cpu", "cuda", "strict"), default="cpu",
                    help="cpu (default); cuda: refimpl on CuPy vs the twin on the same GPU, every clock read "
                         "synchronised; strict: refimpl on the host stand-in of a device array vs torch on the CPU")
    ap.add_argument("--tf32", choices=("off", "on"), default="off",
                    help="with --device cuda: off (default) compares full float32 on both sides; on lets refimpl's "
                         "CuPy GEMMs and cuDNN/cuBLAS round to TF32 alike")
    ap.add_argument("--json", metavar="FILE", help="write the numbers to FILE (times in seconds)")
    args = ap.parse_args(argv)
    if args.tf32 == "on" and args.device != "cuda":
        ap.error("--tf32 on: TF32 exists only on a GPU (use it with --device cuda)")
    if args.gemm_floor and args.device != "cpu":
        ap.error("--gemm-floor times numpy's GEMMs on the host: use it with --device cpu")
    if len(set(args.models)) != len(args.models):
        ap.error("--model: a model is listed more than once")
    for key in ("batch", "size", "threads", "repeats"):
        if getattr(args, key) is not None and getattr(args, key) < 1:
            ap.error(f"--{key} must be a positive integer")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    refimpl = import_refimpl()
    import numpy
    bench_train = import_bench_train()
    bench_train.set_tf32_env(os.environ, args)             # before CuPy is imported (refimpl/precision.py)
    allocator = tune_allocator_if_any()
    use_torch = not args.no_torch and bench_train.torch_available()
    missing = bench_train.device_missing(args.device, use_torch)
    if missing:
        print(f"profile_step: {missing}", file=sys.stderr)
        return 2
    device = args.device
    if device != "cpu":
        from refimpl import backend
        backend.set_backend("cupy" if device == "cuda" else "strict")
        _SYNCS.append(backend.synchronize)
        if device == "cuda":
            device = f"cuda ({bench_train.gpu_name()}), TF32 {args.tf32} on both sides"
    torch_version = None
    if use_torch:
        import torch
        torch.set_num_threads(args.threads)
        if args.device == "cuda":
            torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = args.tf32 == "on"
            _SYNCS.append(torch.cuda.synchronize)
        # the first layer's post hook fires early: TorchStep handles it (ends its backward at the step's end)
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed "
                                "with respect to module outputs")
        torch_version = torch.__version__
    workers = refimpl_threads()
    load_start = load_average()
    print(f"# profile_step: one step (forward, loss, backward; no optimiser), float32, one process; "
          f"threads {args.threads} (BLAS, torch{'' if workers is None else f'; refimpl workers {workers}'}); "
          f"repeats {args.repeats}; device {device}; torch layout {args.torch_layout}; numpy {numpy.__version__}; torch "
          f"{torch_version or ('n/a: --no-torch' if args.no_torch else 'n/a: not installed')}", flush=True)
    print(f"# refimpl {os.path.dirname(os.path.abspath(refimpl.__file__))}; allocator {allocator}; "
          f"load average {' '.join(f'{v:.2f}' for v in load_start or [])}", flush=True)
    setups = {name: model_setup(bench_train, name, args.preset, args.size)   # every model checked first
              for name in args.models}
    reports = []
    for name, (config, notes) in setups.items():
        reports.append(profile_model(name, config, notes, args, bench_train, use_torch))
        print_report(reports[-1], args.repeats)
        if reports[-1]["gemm_floor"] is not None:
            print_floor(reports[-1]["gemm_floor"])
    load_end = load_average()
    print(f"\n# ms, best of {args.repeats}; torch/ours: torch f+b / ours f+b (> 1: refimpl faster); "
          f"ours % / torch %: share of the side's sum of rows; the loss row's ours fwd holds refimpl's whole "
          f"loss (value and dL/dout; the U-Net's also its hard Dice metric, which the twin does not compute); other: the phase minus its rows; step plain: no instrumentation; "
          f"load average at the end {' '.join(f'{v:.2f}' for v in load_end or [])}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"settings": {k: getattr(args, k) for k in ("models", "preset", "batch", "size", "threads",
                                                                   "repeats", "seed", "torch_layout", "gemm_floor", "device",
                                                                   "tf32")},
                       "refimpl": os.path.dirname(os.path.abspath(refimpl.__file__)), "allocator": allocator,
                       "refimpl_threads": workers, "numpy": numpy.__version__, "torch": torch_version,
                       "load_average": {"start": load_start, "end": load_end}, "models": reports}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
