"""The distributed weight update (parallel/sharded_update.py: reduce-scatter, update one block,
allgather) equals the plain update, under mpiexec -n 1, 2, 3, 4, 6, 8.

On every grid of the world size (data, spatial and both axes; uneven blocks where the rank count
does not divide), a CosmoFlow in float64 trains 5 steps with the plain update and with the
distributed one, SGD with momentum and Adam with weight decay, over several allreduce
algorithms: every parameter agrees to 1e-12.  The optimizer state per rank is the group's
1/|G| share, and the state dict is the plain one (so checkpoints move between the two).
"""
import numpy as np
import pytest

from refimpl.models import build_model
from refimpl.optim import make_optimizer
from refimpl.parallel.grad_sync import GradientSynchronizer
from refimpl.parallel.sharded_update import ShardedOptimizer

CONFIG = {"input_shape": (2, 8, 8, 8), "conv_size": 3, "n_conv_layers": 2, "fc1_size": 8, "fc2_size": 4,
          "dropout": 0.0}
BATCH = 12


def run(grid, optimizer, sharded, algorithm, steps=5, state=None):
    model = build_model("cosmoflow", CONFIG, grid, seed=3, dtype=np.float64, global_batch=BATCH)
    sync = GradientSynchronizer(model.parameters(), grid.data_comm, grid.spatial_comm, algorithm=algorithm,
                                bucket_bytes=2048, first_bucket_bytes=512, shard=sharded)

    def make(params):
        return make_optimizer(optimizer, params, lr=0.05 if optimizer == "sgd" else 0.01, momentum=0.9,
                              weight_decay=1e-3)
    opt = ShardedOptimizer(make, model.parameters(), sync) if sharded else make(model.parameters())
    if state is not None:
        opt.load_state_dict(state)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((BATCH,) + CONFIG["input_shape"])
    t = rng.uniform(-1, 1, (BATCH, model.num_outputs))
    x_local = np.ascontiguousarray(model.local_input(x))        # (B/Pn, C, local block)
    t_local = model.local_target(t)
    for _ in range(steps):
        model.zero_grad()
        out = model.forward(x_local)
        _, dout, _ = model.loss(out, t_local)
        model.backward(dout)
        sync.finish()
        opt.step()
    params = [p.data.copy() for p in model.parameters()]
    sync.detach()
    return params, opt


def chosen(grids):
    """Per family the first grid the batch divides over: pure data, pure spatial, data x spatial."""
    usable = [g for g in grids if BATCH % g.dims[0] == 0]
    families = {}
    for g in usable:
        spatial = g.dims[1] * g.dims[2] * g.dims[3]
        families.setdefault((g.dims[0] > 1, spatial > 1), g)
    return list(families.values())


def rel(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("algorithm", ["native", "ring", "halving_doubling", "recursive_doubling"])
def test_distributed_update_equals_plain(comm, all_ranks_agree, grids, optimizer, algorithm):
    problems = []
    for grid in chosen(grids):
        plain, plain_opt = run(grid, optimizer, False, algorithm)
        shard, shard_opt = run(grid, optimizer, True, algorithm)
        err = max(rel(a, b) for a, b in zip(shard, plain))
        moved = min(float(np.abs(a - b).max()) for a, b in zip(plain, run(grid, optimizer, False, algorithm, 0)[0]))
        if not (err <= 1e-12 and moved > 0):
            problems.append(f"{grid.dims}: err {err:.2e}, smallest update {moved:.2e}")
        # the state dict is the plain optimizer's, whole (checkpoints move between the two)
        a, b = plain_opt.state_dict(), shard_opt.state_dict()
        if a["arrays"].keys() != b["arrays"].keys() or a["step_count"] != b["step_count"] or \
                max(rel(b["arrays"][k], a["arrays"][k]) for k in a["arrays"]) > 1e-12:
            problems.append(f"{grid.dims}: state dicts differ")
        # state per rank: this rank's blocks only, 1/|G| of the whole up to the block rounding
        group = shard_opt.comm.Get_size()
        whole = sum(v.nbytes for v in a["arrays"].values())
        mine = shard_opt.state_bytes()
        total = comm.allreduce(mine) / (comm.Get_size() // group)         # over one group's ranks
        if total != whole or mine > whole / group + len(shard_opt.inner.state) * len(shard_opt.slots) * 8:
            problems.append(f"{grid.dims}: state {mine} B of {whole} B over {group} ranks")
    all_ranks_agree(not problems, "; ".join(problems[:3]))


def test_checkpoint_state_moves_between_plain_and_distributed(comm, all_ranks_agree, grids):
    """3 plain steps, then 2 more with the distributed update from the plain state, equal 5 plain
    steps (and the other way round): the state format is shared."""
    problems = []
    for grid in chosen(grids)[-1:]:
        five, _ = run(grid, "adam", False, "native")
        _, plain3 = run(grid, "adam", False, "native", steps=3)
        state = plain3.state_dict()
        cont, _ = _continue(grid, state, sharded=True)
        err = max(rel(a, b) for a, b in zip(cont, five))
        if err > 1e-12:
            problems.append(f"{grid.dims} plain -> distributed: {err:.2e}")
        _, shard3 = run(grid, "adam", True, "native", steps=3)
        cont, _ = _continue(grid, shard3.state_dict(), sharded=False)
        err = max(rel(a, b) for a, b in zip(cont, five))
        if err > 1e-12:
            problems.append(f"{grid.dims} distributed -> plain: {err:.2e}")
    all_ranks_agree(not problems, "; ".join(problems[:3]))


def _continue(grid, state, sharded):
    """Parameters after 3 plain steps (recomputed), then 2 steps from ``state``."""
    three, _ = run(grid, "adam", False, "native", steps=3)
    model_params = three

    import refimpl.models as models
    real = models.build_model

    def seeded(*args, **kwargs):                      # the model at the 3-step parameters
        model = real(*args, **kwargs)
        for p, value in zip(model.parameters(), model_params):
            p.data[...] = value
        return model
    models.build_model, globals()["build_model"] = seeded, seeded
    try:
        return run(grid, "adam", sharded, "native", steps=2, state=state)
    finally:
        models.build_model, globals()["build_model"] = real, real
