"""Prioritised gradient exchange with the layer-by-layer update (parallel/priority.py) equals the
plain ``finish(); step()``, under mpiexec -n 1, 2, 3, 4, 6, 8.

On the grids of the world size (pure data, pure spatial, data x spatial; uneven blocks where the
rank count does not divide), a CosmoFlow in float64 trains 5 steps plainly and with
``priority="input-first"`` (buckets cut into 512-byte chunks, so chunks of a bucket really are
overtaken), SGD with momentum and Adam with weight decay: every parameter agrees to 1e-12.  The
trace shows the start order the module promises: the input-side bucket's chunks start before the
output-side chunks still waiting at the end of backward, the same order on every rank.
"""
import numpy as np
import pytest

from refimpl.models import build_model
from refimpl.optim import make_optimizer
from refimpl.parallel.grad_sync import GradientSynchronizer
from refimpl.parallel.priority import LayerwiseUpdate

CONFIG = {"input_shape": (2, 8, 8, 8), "conv_size": 3, "n_conv_layers": 2, "fc1_size": 8, "fc2_size": 4,
          "dropout": 0.0}
BATCH = 12


def run(grid, optimizer, priority, algorithm="native", steps=5):
    model = build_model("cosmoflow", CONFIG, grid, seed=3, dtype=np.float64, global_batch=BATCH)
    sync = GradientSynchronizer(model.parameters(), grid.data_comm, grid.spatial_comm, algorithm=algorithm,
                                bucket_bytes=2048, first_bucket_bytes=512, priority=priority,
                                chunk_bytes=512 if priority != "none" else 0, trace=True)
    opt = make_optimizer(optimizer, model.parameters(), lr=0.05 if optimizer == "sgd" else 0.01, momentum=0.9,
                         weight_decay=1e-3)
    update = LayerwiseUpdate(model, sync, opt)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((BATCH,) + CONFIG["input_shape"])
    t = rng.uniform(-1, 1, (BATCH, model.num_outputs))
    x_local = np.ascontiguousarray(model.local_input(x))        # (B/Pn, C, local block)
    t_local = model.local_target(t)
    for step in range(steps):
        model.zero_grad()
        out = model.forward(x_local)
        _, dout, _ = model.loss(out, t_local)
        model.backward(dout)
        update.step(0.05 / (1 + step))            # a changing lr: each update must use its own
    owed_before_flush = len(update.owed)
    update.flush()
    params = [p.data.copy() for p in model.parameters()]
    sync.detach()
    return params, sync, update, owed_before_flush


def chosen(grids):
    usable = [g for g in grids if BATCH % g.dims[0] == 0]
    families = {}
    for g in usable:
        families.setdefault((g.dims[0] > 1, g.dims[1] * g.dims[2] * g.dims[3] > 1), g)
    return list(families.values())


def rel(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("algorithm", ["native", "ring"])
def test_prioritised_update_equals_plain(comm, all_ranks_agree, grids, optimizer, algorithm):
    problems = []
    for grid in chosen(grids):
        plain, *_ = run(grid, optimizer, "none", algorithm)
        first, sync, update, owed = run(grid, optimizer, "input-first", algorithm)
        err = max(rel(a, b) for a, b in zip(first, plain))
        moved = min(float(np.abs(a - b).max()) for a, b in zip(plain, run(grid, optimizer, "none", steps=0)[0]))
        if not (err <= 1e-12 and moved > 0):
            problems.append(f"{grid.dims}: err {err:.2e}, smallest update {moved:.2e}")
        if owed != len(sync.buckets):      # after the last step nothing was applied yet: all deferred
            problems.append(f"{grid.dims}: {owed} of {len(sync.buckets)} buckets owed at the end")
        if len(update.gaps) != 4:          # steps 2..5 each have a 'next forward' after a step
            problems.append(f"{grid.dims}: {len(update.gaps)} gaps recorded")
    all_ranks_agree(not problems, "; ".join(problems[:3]))


def test_input_side_chunks_overtake(comm, all_ranks_agree, grids):
    """In the trace of one step, the chunks started at the end of backward go best first: the
    highest-priority bucket's before any lower one's; and every rank starts them in the same order."""
    grid = chosen(grids)[0]
    _, sync, _, _ = run(grid, "sgd", "input-first", steps=1)
    chunks = sorted(sync.trace, key=lambda r: r["start"])
    order = [(r["bucket"], r["chunk"]) for r in chunks]
    problems = []
    if len(sync.buckets) < 3 or max(len(b.chunks) for b in sync.buckets) < 2:
        problems.append(f"the model gives {len(sync.buckets)} buckets: too few to test priorities")
    started_in_backward = sync.history[-1]["started_in_backward"]
    late = order[started_in_backward:]            # started by finish(wait=False), in priority order
    priorities = [sync.buckets[b].priority for b, _ in late]
    if priorities != sorted(priorities, reverse=True):
        problems.append(f"end-of-backward starts not best first: {late}")
    last = len(sync.buckets) - 1                  # the input-side bucket, ready last in backward
    overtaken = [item for item in order[order.index((last, 0)):] if item[0] < last]
    if not overtaken:                             # chunks ready before it, started after it
        problems.append(f"the input-side bucket overtook nothing: order {order}")
    if comm.allgather(order) != [order] * comm.Get_size():
        problems.append("ranks started the chunks in different orders")
    all_ranks_agree(not problems, "; ".join(problems[:3]))
