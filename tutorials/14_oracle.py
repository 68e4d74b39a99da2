# %% [markdown]
# # Tutorial 14 — Checking your implementation shard by shard
#
#     python tutorials/14_oracle.py        (needs PyTorch: pip install -e ".[oracle]")
#
# One process is enough. Under mpiexec, every rank runs the whole tutorial on its own.
#
# Tutorials 4 and 11 check refimpl's partitioned layers against the unpartitioned oracle by
# gathering y, dx, dW and db and comparing the *global* tensors. That is enough to say
# "right" or "wrong". It is not enough to debug someone else's implementation (LBANN,
# DistDL, DTensor, your own). A message like "max relative error of y: 0.3" does not say
# which rank is wrong, which element, or which convention was misread.
#
# A partitioned layer is a pipeline. On every rank it runs the forward halo exchange
# (x -> x_needed), the local layer (y, then dx_needed and dw_partial), the adjoint halo
# exchange (dx_needed -> dx) and the gradient allreduce (dw_partial -> dw). A mistake in
# any step makes some global tensor wrong. The oracle toolkit (`refimpl.oracle`,
# `refimpl oracle ...`) writes *case files*. Each holds one layer on one process grid: the
# global inputs and expected outputs, plus **every rank's expected tensor at every step of
# that pipeline**. You run your implementation on the case and write a *results file* with
# what it computed, globally and per rank if you can. `compare` then reports, per tensor
# and rank:
#
# - the error and the tolerance, with the reason for that tolerance;
# - the first global index that mismatches, and the rank that owns it;
# - a diagnosis, when the error matches a known mistake: a missing halo, ghosts not
#   cleared, a padding off by one, batch-norm statistics or gradients not reduced.
#
# This tutorial does it all from Python, with PyTorch standing in for "your
# implementation". Then it plants bugs in PyTorch's per-rank run and reads the diagnosis.
# It needs PyTorch and h5py (the `oracle` extra): the first cell checks for them, so that a
# missing one stops it here with the command that installs them, not a third of the way in.

# %%
import importlib.util

missing = [name for name in ("torch", "h5py") if importlib.util.find_spec(name) is None]
if missing:
    raise SystemExit(f"tutorial 14 needs {' and '.join(missing)}: pip install -e '.[oracle]'")

# %%
import os
import shutil
import tempfile
import tomllib

import numpy as np

from refimpl.oracle import compare, load_case, load_results, load_suite, parse_suite, write_case, write_results
from refimpl.oracle import torch_adapter
from refimpl.oracle.compare import causal_index, root_cause
from refimpl.oracle.expect import embed

workdir = tempfile.mkdtemp(prefix="refimpl-tutorial14-")     # every process gets its own; removed at the end

# %% [markdown]
# ## 1. A suite of cases
# A *suite* is a small TOML file. It lists `[[case]]` tables. Each one names a layer and
# its arguments, spelled as `refimpl check-layer` takes them, plus `grids`, the process
# grids `(Pn, Pd, Ph, Pw[, Pm])` to split the layer over. One case file is written per
# (case, grid) pair, named `NAME.Pn-Pd-Ph-Pw.h5`.
#
# Ours has two cases, both from the shipped `hard` suite:
#
# - a conv with an **even** kernel on a 2 x 2 (D x H) grid. With an even kernel the halos
#   are asymmetric: a rank needs ghost cells on one side of an axis and not the other.
# - a **batch norm** on a grid with 2 sample groups and 2 spatial blocks. Its statistics
#   must be summed over both groups and both blocks.
#
# `load_suite` reads a file, or takes the name of a shipped suite (`"hard"`). `parse_suite`
# takes an already-parsed TOML table. Both check every case with check-layer's own rules.
# A typo fails early, and the error names the case and the key.

# %%
SUITE = """
description = "tutorial 14: an even-kernel conv and a batch norm"
seed = 0
dtypes = ["float64", "float32"]

[[case]]
name = "conv_even_kernel"
layer = "conv3d"
input = [2, 3, 9, 8, 7]          # N, C, D, H, W (global)
out_channels = 4
kernel = [2, 4, 2]
padding = [0, 1, 1]
grids = [[1, 2, 2, 1]]           # D and H split in two: 4 ranks

[[case]]
name = "batchnorm_global"
layer = "batch_norm3d"
input = [4, 3, 6, 5, 4]
grids = [[2, 2, 1, 1]]           # 2 sample groups x 2 D blocks: 4 ranks
"""
suite_path = os.path.join(workdir, "tutorial.toml")
with open(suite_path, "w") as f:
    f.write(SUITE)
specs = load_suite(suite_path)
assert specs == parse_suite(tomllib.loads(SUITE), "inline")

try:
    parse_suite(tomllib.loads(SUITE.replace("kernel =", "kernal =")), "typo")
except ValueError as err:
    print("a typo is refused:", err)

cases_dir = os.path.join(workdir, "cases")
os.makedirs(cases_dir)
paths = [write_case(spec, cases_dir) for spec in specs]
for spec, path in zip(specs, paths):
    print(f"wrote {os.path.basename(path):<30} {spec.layer}, input {list(spec.input)}, grid {list(spec.grid)}, "
          f"{spec.ranks} ranks, {os.path.getsize(path) / 1024:.0f} KiB")

# %% [markdown]
# ## 2. What a rank holds
# `load_case` reads a case file back and checks it. `case.layouts[r]` gives rank r's place
# on the grid and its global ranges. Every range is half-open `(start, stop)`, and the
# spatial ones are listed for D, H and W:
#
# - `samples`: the samples this rank holds (its slice of the batch, set by Pn);
# - `owned`: the rank's own **input** block. This is its x, and later its dx;
# - `outputs`: the block of y it computes. Window layers split their *output* evenly and
#   work back to the input each rank needs;
# - `needed`: the input range its outputs read, clipped to the domain. The clipped part is
#   the layer's padding. Where `needed` goes past `owned`, the rank needs **ghost cells**.
#
# Look at rank 1 (D block 0, H block 1). It owns H rows 4..7 but needs rows 3..7. The
# kernel is 4 high and the padding 1, so the window of output row 4 starts at input row 3,
# which rank 0 owns. Rank 0 needs H rows 0..5, two rows past its own block. Same axis,
# different halo sizes: that is the even kernel.

# %%
case = load_case(paths[0])
print(f"{case.name}: digest {case.digest}, grid {list(case.spec.grid)}")
print("rank  coords (n,d,h,w,m)  samples  owned (D, H, W)           outputs                   needed")
for lo in case.layouts:
    print(f"{lo.rank:>4}  {str(lo.coords):<19} {str(lo.samples):<8} {str(lo.owned):<25} "
          f"{str(lo.outputs):<25} {lo.needed}")
lo1 = case.layouts[1]
assert lo1.owned[1] == (4, 8) and lo1.needed[1] == (3, 8) and case.layouts[0].needed[1] == (0, 6)

# %% [markdown]
# `case.ranks[dtype][r]` maps each of rank r's tensors to `(array, offset)`. The offset is
# the global index of the block's first element.
#
# - `x`, `dy`: what the rank is given, its owned input block and its output-gradient block.
# - `x_needed`: its input after the forward halo exchange, on the whole needed range. It is
#   the owned block **with the ghost cells filled in** around it.
# - `y`: its output block.
# - `dx_needed`: its input gradient on the needed range, **before the adjoint halo
#   exchange**. It holds only what flows back from this rank's own outputs, ghost rows
#   included. Those ghost rows are what the rank sends back to the ranks that own them.
# - `dx`: its input gradient on its owned block, **after** the adjoint exchange. Each rank
#   adds the ghost gradients it receives from its neighbours into its own part.
# - `dw_partial`, `db_partial`: its own share of the weight gradients, before the
#   allreduce. `dw` and `db` are the values after the allreduce.
#
# Batch norm has `sum_partial` and `sumsq_partial` instead of the halo tensors. A
# channel-parallel conv also has `y_partial`.

# %%
ranks64 = case.ranks["float64"]
print("rank 1's tensors (float64):")
for name, (array, offset) in ranks64[1].items():
    span = ", ".join(f"{o}:{o + n}" for o, n in zip(offset, array.shape))
    print(f"  {name:<11} shape {str(array.shape):<20} offset {str(offset):<16} global [{span}]")

# %% [markdown]
# None of these tensors is special. Each one is a slice, a sum of slices, or a sum over
# ranks of the global arrays. `lo.index(which)` turns a layout into global slices: `"x"`
# for the owned block, `"needed"` and `"y"`. That is how your adapter cuts its inputs.
# Below we check the relations: x_needed is a slice of the global x, and it contains x. If
# we add up every rank's dx_needed at its offset (which is what the adjoint exchange does),
# we get the global dx. If we add up every rank's dw_partial (which is what the allreduce
# does), we get dw.

# %%
x = case.inputs["float64"]["x"]
glob64 = case.expected["float64"]
x_needed, off = ranks64[1]["x_needed"]
assert np.array_equal(x_needed, x[lo1.index("needed")])
inner = tuple(slice(s.start - o, s.stop - o) for s, o in zip(lo1.index("x"), off))
assert np.array_equal(x_needed[inner], ranks64[1]["x"][0])             # the owned block, ghosts around it
dx_sum = embed(x.shape, [r["dx_needed"] for r in ranks64])          # what the adjoint halo exchange does
dw_sum = sum(r["dw_partial"][0] for r in ranks64)                   # what the allreduce does
dx_ok = np.allclose(dx_sum, glob64["dx"], rtol=0, atol=1e-12)
dw_ok = np.allclose(dw_sum, glob64["dw"], rtol=0, atol=1e-12)
print("sum of dx_needed == dx:", dx_ok, "| sum of dw_partial == dw:", dw_ok)
print("rank 1's dx_needed on its ghost row H=3 (sent to rank 0), first values:",
      np.round(ranks64[1]["dx_needed"][0][0, 0, 0, 0, :3], 4))
assert dx_ok and dw_ok

# %% [markdown]
# ## 3. Your implementation (here: PyTorch)
# An adapter reads the case, runs the implementation under test, and writes what it
# computed. `refimpl.oracle.torch_adapter.run_case(case)` is that adapter for PyTorch, and
# you can copy it as a model (`refimpl/oracle/torch_adapter.py`). It does two runs:
#
# - a **global** run: the whole layer with `torch.nn.functional` and autograd;
# - a **per-rank** run. Each rank r takes `x[layout.index("needed")]`, which is what its
#   halo exchange would have delivered. It pads the part of its windows that the clipping
#   removed, runs the layer on its block, and back-propagates its own `dy` block. The
#   "messages" (adding ghost gradients into their owners, allreducing dW and db) are sums
#   over the ranks' tensors, done in this one process.
#
# Your adapter does the same thing with your code. If your code runs under MPI, gather
# every rank's blocks into one process and write one results file. `write_results` takes
# `global_={dtype: {name: array}}` and `ranks={dtype: {rank: {name: array}}}`. Per rank,
# `y` and `dx` are required, plus `dw` and `db` for a layer with parameters. Every other
# tensor is optional, and each one you report is checked. `load_results` refuses a file it
# cannot check (wrong shape or dtype, NaN, a missing dataset, a file made for another
# case). `compare` checks everything else.

# %%
torch_dir = os.path.join(workdir, "torch")
reports = {}
for path in paths:
    c = load_case(path)
    glob, ranks = torch_adapter.run_case(c)
    out = os.path.join(torch_dir, c.name)
    write_results(out, c, global_=glob, ranks=ranks)
    reports[c.name] = compare(c, load_results(out, c))

report = reports[case.name]
print(f"{case.name}: {len(report.findings)} findings, ok = {report.ok}; the worst rank of each tensor:")
print("dtype    tensor       rank    max_rel     tolerance   why")
worst = {}
for f in report.findings:
    key = (f.dtype, f.tensor)
    if key not in worst or f.max_rel > worst[key].max_rel:
        worst[key] = f
for f in worst.values():
    where = "global" if f.rank is None else str(f.rank)
    print(f"{f.dtype:<8} {f.tensor:<12} {where:<7} {f.max_rel:<11.2e} {f.tolerance:<11.2e} {f.why}")
for name, r in reports.items():
    ratio = max(f.max_rel / f.tolerance for f in r.findings)
    print(f"{name}: ok = {r.ok}, worst error = {ratio:.2f} of its tolerance")
assert all(r.ok for r in reports.values())

# %% [markdown]
# Why these tolerances? Each element of y is a sum of K products. For this conv,
# K = C·kd·kh·kw = 48. If two correct codes add the terms in different orders, the
# rounding errors grow roughly like a random walk, about eps·sqrt(K). The oracle allows
# **16·eps·sqrt(K)**, relative to the largest value of the tensor. K is different for each
# tensor: for dW it is N times the output volume. An exact copy such as x_needed gets
# K = 1. PyTorch CPU stays below 0.05 of these tolerances on the whole `hard` suite, in
# float32 and in float64. If your code uses an inexact algorithm such as Winograd, pass
# `--tolerance-factor`.
#
# ## 4. A planted bug: rank 1 never receives its ghost cells
# `plant="halo:1"` makes rank 1's halo exchange deliver zeros instead of its ghost cells.
# `global_mode="gathered"` builds the global results from the ranks' blocks, as a
# partitioned run would report them. With the default, `"whole"`, the global tensors come
# from the unpartitioned layer, which the bug cannot touch.
#
# Each failing finding reports where the first mismatch is (`first_index`, a global index)
# and which rank owns it (`owner`). Where the pattern is a known one, it also gives a
# `diagnosis`. `root_cause` picks the earliest diagnosed failure in the layer's order of
# computation (x_needed, y, dx_needed, dw_partial, dx, dw). Failures further down the
# pipeline are labelled as following from it.

# %%
def planted(path, bug):
    """PyTorch with a known mistake, gathered, written and compared: (case, report)."""
    c = load_case(path)
    glob, ranks = torch_adapter.run_case(c, plant=torch_adapter.parse_plant(bug, c), global_mode="gathered")
    out = os.path.join(workdir, bug.replace(":", "_"), c.name)
    write_results(out, c, global_=glob, ranks=ranks)
    return c, compare(c, load_results(out, c))


case, report = planted(paths[0], "halo:1")
failed = [f for f in report.findings if not f.ok]
print(f"{case.name} with halo:1: ok = {report.ok}, {len(failed)} failing findings; float64, in causal order:")
consequences = {}
for f in sorted(failed, key=lambda f: (causal_index(f.tensor), f.rank is not None, f.rank or 0)):
    if f.dtype != "float64":
        continue
    where = "global" if f.rank is None else f"rank {f.rank}"
    if (f.diagnosis or "").startswith("follows"):  # downstream of a diagnosed error: one line per tensor
        consequences.setdefault((f.tensor, f.diagnosis), []).append(where)
        continue
    print(f"  {f.tensor:<10} {where:<7} {f.mismatches:>4} off, first at {list(f.first_index)}, owner {f.owner}\n"
          f"      {f.diagnosis or 'no known pattern'}")
for (tensor, diagnosis), where in consequences.items():
    print(f"  {tensor:<10} {', '.join(where)}: {diagnosis}")
cause = root_cause(report)
print(f"root cause ({cause.dtype} {cause.tensor}, rank {cause.rank}): {cause.diagnosis}")

assert not report.ok
assert {f.rank for f in failed if f.tensor == "y"} == {None, 1}          # only rank 1's outputs are wrong
assert all("halo" in f.diagnosis and f.owner == 1 for f in failed if f.tensor == "y")
assert not [f for f in failed if f.tensor in ("dx", "dx_needed")]        # a conv's dx does not read x
assert cause.rank == 1 and "rank 1" in cause.diagnosis

# %% [markdown]
# How to read this:
#
# - Only rank 1's **y** is wrong. The first bad element is in H row 4, the first row of
#   rank 1's output block, and its window reads H row 3, a ghost row.
# - Rank 1's **x_needed** shows the cause: the ghost cells (owned by rank 0) are wrong,
#   while its own block is right.
# - **dW** is wrong on every rank, because the allreduce spread rank 1's bad partial to
#   all of them. The diagnosis says it follows from the x_needed error.
# - **dx** is right. A conv's input gradient depends on w and dy, not on x.
#
# With global tensors alone, `check` can still name rank 1 and the H face, from where the
# errors in y lie. The per-rank tensors add which *step* went wrong: x_needed is wrong, so
# the halo exchange is at fault, not the local conv.
#
# ## 5. More planted bugs
# The adapter has other `--plant` mistakes:
#
# - `ghost-clear`: the adjoint exchange adds the ghost gradients into their owners but
#   never clears them, so they are counted twice.
# - `dw-unsummed`: dW is not allreduced over the spatial shards.
# - `local-stats`: every rank normalises with the statistics of its own block (a plant of
#   every layer with statistics: here batch norm).
#
# For each one we check the diagnosis of the root cause.

# %%
for path, bug, expected in ((paths[0], "ghost-clear", "doubled gradient on ghost cells"),
                            (paths[0], "dw-unsummed", "not summed over the spatial shards"),
                            (paths[1], "local-stats", "not reduced over the spatial group")):
    c, r = planted(path, bug)
    cause = root_cause(r)
    where = "global" if cause.rank is None else f"rank {cause.rank}"
    print(f"{bug:<15} {c.name:<30} ok = {r.ok}; root cause {cause.tensor} ({where}): {cause.diagnosis}\n")
    assert not r.ok and expected in cause.diagnosis, (bug, cause.diagnosis)

# %% [markdown]
# ## 6. The same from the command line
# The Python calls above have command-line equivalents. They run in one process, with no
# mpiexec:
#
#     refimpl oracle generate hard --out cases/           # or a suite TOML file of your own
#     refimpl oracle run-torch cases/ --out torch/        # PyTorch as the implementation under test
#     refimpl oracle check cases/ torch/ --json report.json
#     refimpl oracle run-torch cases/conv_even_kernel.1-2-2-1.h5 --out bad/ --plant halo:1 --global gathered
#     refimpl oracle check cases/conv_even_kernel.1-2-2-1.h5 bad/conv_even_kernel.1-2-2-1.h5   # exit 1
#
# `check` exits 0 when everything passes and 1 on a mismatch. It exits 2 on input it
# cannot check, and prints one line naming the file and the dataset. docs/oracle.md has
# the file layouts, a minimal results writer using h5py only, the tolerance rule, and the
# table of diagnoses.

# %% [markdown]
# ## 7. A real partitioned implementation: PyTorch DTensor
# So far PyTorch only *played* a partitioned implementation, inside one process.
# `refimpl oracle run-dtensor` checks a real one: PyTorch's DTensor
# (`torch.distributed.tensor`), one process per rank, talking gloo on the CPU. Per case,
# the adapter (`refimpl.oracle.dtensor_adapter`) starts the ranks. Each rank builds a
# `DeviceMesh` shaped like the case's grid and shards x with `Shard(dim)` along the split
# axes. The parameters stay `Replicate`. Then it runs the layer's `torch.nn.functional`
# call on the DTensors, and a backward with the case's dy.
#
# Each rank writes its local shards in **DTensor's own layout**. DTensor splits like
# `torch.chunk` does (W = 6 over 4 ranks is 2, 2, 2, 0), not like refimpl's balanced
# blocks (2, 2, 1, 1). So every dataset carries an `offset` attribute, the global index of
# its first element, and `compare` checks each block at that place. dw and db are written
# once. What DTensor refuses (`NotImplementedError`, or its own `RuntimeError` for a
# sharding it does not support) or crashes on is left out of the results file. It is
# recorded in a summary instead, with the exception's first line.
#
# Three 2-process cases from the suite in docs/peers.md:
#
# - a conv split over the **batch**: the one conv sharding DTensor supports;
# - the same conv split over **W**;
# - a max pooling split over **D**.

# %%
from refimpl.oracle import dtensor_adapter

dtensor_suite = """
seed = 1
dtypes = ["float64"]

[[case]]
name = "conv_batch_split"
layer = "conv3d"
input = [2, 2, 4, 4, 5]
out_channels = 3
padding = 1
grids = [[2, 1, 1, 1]]

[[case]]
name = "conv_w_split"
layer = "conv3d"
input = [1, 2, 4, 4, 6]
out_channels = 3
padding = 1
grids = [[1, 1, 1, 2]]

[[case]]
name = "maxpool_d_split"
layer = "max_pool3d"
input = [1, 2, 6, 4, 4]
kernel = 2
grids = [[1, 2, 1, 1]]
"""
dt_cases = os.path.join(workdir, "dtensor-cases")
dt_out = os.path.join(workdir, "dtensor")
os.makedirs(dt_cases)
dt_paths = [write_case(spec, dt_cases) for spec in parse_suite(tomllib.loads(dtensor_suite), "dtensor-2")]
dt_loaded = [load_case(path) for path in dt_paths]
dt_entries = dtensor_adapter.run_cases(dt_loaded, dt_out)   # 2 rank processes; a results file per case
dt_verdicts = {}
for c, entry in zip(dt_loaded, dt_entries):
    r = compare(c, load_results(os.path.join(dt_out, c.name), c))
    dt_verdicts[c.name] = dtensor_adapter.verdicts(entry, r.as_dict())
    print(f"{c.name:<28} {dt_verdicts[c.name]}")
    for rec in entry["tensors"]:
        if rec["status"] != "ok":
            print(f"    {rec['tensor']:<3} {rec['status']}: {rec['error']}")
    for f in r.findings:
        if not f.ok and f.rank is not None:
            print(f"    {f.tensor:<3} rank {f.rank}: {f.mismatches} off, first at {list(f.first_index)}")
            break

assert dt_verdicts["conv_batch_split.2-1-1-1.h5"] == {"y": "pass", "dx": "pass", "dw": "pass", "db": "pass"}
assert dt_verdicts["conv_w_split.1-1-1-2.h5"]["y"] == "fail"
assert dt_verdicts["maxpool_d_split.1-2-1-1.h5"] == {"y": "pass", "dx": "refused"}

# %% [markdown]
# How to read this:
#
# - Split over the batch, the conv passes: every sample is computed whole on one rank,
#   and dw and db come back as `Partial` sums that `full_tensor()` reduces.
# - Split over W, y is wrong. DTensor's conv strategy accepts only a batch split, so it
#   asks for x to be gathered and calls y `Replicate`. But its conv handler runs the
#   local conv on the un-gathered shard: each rank's "whole" y is the conv of its own
#   block, with no halo, and its shape contradicts the label. The adapter places each
#   block where its shape says (torch.chunk's block of the rank, not the label's offset
#   0), and `compare` shows where it first goes wrong: rank 0's last output column, the
#   first one whose window reaches rank 1's cells.
# - Its backward does exchange halos along W. But the function that adds the ghost
#   gradients back never returns its result, so x gets no gradient at all (dx crashed),
#   and dw and db are computed from the wrong blocks.
# - The max pooling's forward is right: DTensor gathers x and pools the whole tensor on
#   every rank. It has no sharding strategy for the pooling backward, so dx is refused.
#
# The same from the command line (the world size defaults to each case's rank count):
#
#     refimpl oracle run-dtensor cases/ --out dtensor/ --nproc 2
#     refimpl oracle check cases/ dtensor/
#
# docs/peers.md has the whole `hard` suite under DTensor, case by case, with what a fix
# must satisfy. It also shows how to write an adapter for another library.

# %% [markdown]
# ## 8. A whole model: one training step, layer by layer
#
# Your CosmoFlow trains differently on 8 ranks than on 1. Cutting it into single-layer
# cases by hand is slow; a **model trace** does it for you. `refimpl oracle trace
# generate` runs one training step of a whole model with refimpl's unpartitioned
# reference and stores, for every layer (under the model's module names, `features.0`,
# `head.3`, ...), its output `y`, the gradient at its input `dx`, its parameter gradients
# `dw`, `db`, the loss and the parameters after the update. Each `y` and `dx` is also cut
# into every rank's block of a process grid, with its offset.
#
# Your implementation writes what it computed in the same layout, and `trace check`
# walks the forward layers in order, the backward in reverse, then the update. The key
# idea: **each layer is judged on your own input** — the previous layer's output as *you*
# reported it — recomputed through the reference for that layer alone. So one wrong layer
# does not make every later layer look wrong: the report names the *first layer whose
# output is wrong while its input was right*, and lists what merely follows from it.
#
# The model here is CosmoFlow's `tiny` preset on a grid that splits H over two ranks.

# %%
from refimpl.oracle import trace as model_trace, trace_check, trace_results, trace_torch

trace_path = os.path.join(workdir, "trace.h5")
spec = model_trace.TraceSpec("cosmoflow", "tiny", model_trace.default_input("cosmoflow", "tiny"), (1, 1, 2, 1),
                             steps=1, dtypes=("float64",))
model_trace.write_trace(spec, trace_path)
trace = model_trace.load_trace(trace_path)
for entry in trace.layers:
    print(f"{entry['name']:<11} {entry['kind']:<15} y {entry['y_shape']}")

# %% [markdown]
# Your implementation goes here. We use the model's PyTorch twin
# (`refimpl/oracle/model_twins.py`: the same module names), which `trace run-torch` runs:
# it computes the step globally and cuts every tensor into the ranks' blocks, as a correct
# partitioned run would report them. Everything passes, within tolerances derived from
# the reduction length of each tensor.

# %%
def judged(plant=None):
    """Run the twin (with a planted bug), write its results, check them: the findings."""
    results = trace_torch.run_trace(trace, trace_torch.parse_plant(plant, trace))
    path = os.path.join(workdir, "peer.h5")
    trace_torch.write_results(path, trace, results)
    return trace_check.check_trace(trace, trace_results.load_peer(path, trace))


findings = judged()
print(f"{len(findings)} tensors judged, {sum(f.status == 'pass' for f in findings)} passed")
assert all(f.status == "pass" for f in findings)

# %% [markdown]
# Now a bug: on rank 1, the second conv (`features.3`) reads zeros instead of its
# neighbour's cells beyond its first internal face — its forward halo exchange delivered
# nothing. Everything after it is computed from a wrong tensor, so every later layer's
# output differs from the reference trace. The check still names the one layer at fault.

# %%
findings = judged("halo:features.3:1")
fails = [f for f in findings if f.status == "fail"]
first = fails[0]
print("first finding:", first.where)
print("   first wrong cell:", first.first_index, "  diagnosis:", first.diagnosis)
print("following from it:", ", ".join(f"{f.layer} {f.tensor}" for f in findings if f.status == "follows"))
assert (first.layer, first.tensor, first.ranks) == ("features.3", "y", [1])

# %% [markdown]
# How to read this:
#
# - The first finding is `features.3`'s `y` on rank 1, at the first output whose window
#   reads past rank 1's block, with the layer-level diagnosis of that pattern.
# - The layers after it are listed as *following*: judged on the wrong input the peer
#   gave them, they compute what they should. A second, independent bug further on would
#   still be named as a finding of its own.
# - The backward is judged the same way, on the peer's own `dy`: the conv's `dx` and `dw`
#   follow from its wrong forward.
#
# From the command line (your own results file in the layout of docs/oracle.md, "Model
# traces"; `--names` maps your module names onto refimpl's):
#
#     refimpl oracle trace generate --model cosmoflow --preset tiny --grid 1,1,2,1 --out trace.h5
#     refimpl oracle trace run-torch trace.h5 --out bad.h5 --plant halo:features.3:1
#     refimpl oracle trace check trace.h5 bad.h5
#
# and a DTensor-sharded CosmoFlow step, checked the same way, is on docs/peers.md
# ("A whole CosmoFlow step"): `refimpl oracle run-dtensor --trace trace.h5 --out dt.h5`.

# %%
shutil.rmtree(workdir)
