"""refimpl's own partitioned models pass their traces (``refimpl oracle trace``).

Every rank runs CosmoFlow and the U-Net on its grid (the real halo exchanges, allreduces
and distributed batch norm, the gradient synchroniser), records each layer's y and dx
block, each rank's dw and db, the loss and each rank's parameters after the update, and rank 0
writes them in the documented results layout with each block's offset
(``grid.local_block``: the blocks the spatial layers hold) and checks them against the
trace computed unpartitioned: the trace's block math and refimpl's partitioned layers
agree, and a real partitioned run (float64 and float32) is judged as the docs say (run under ``mpiexec -n N``
by tests/test_mpiexec.py; a 1-rank world in plain pytest).  With a model axis (5-entry
grids, ``model_parallel`` filter / channel) a split layer's blocks hold the model rank's
channels (``channel_range``) and its parameters' gradients and updates their shares
(``Parameter.shard``), each written with its offset.
"""
import numpy as np
import pytest

pytest.importorskip("h5py")

from refimpl.models import build_model  # noqa: E402
from refimpl.oracle import trace as T  # noqa: E402
from refimpl.oracle.trace_check import check_trace, load_peer  # noqa: E402
from refimpl.nn.model_parallel import slice_of  # noqa: E402
from refimpl.parallel.grad_sync import GradientSynchronizer  # noqa: E402
from refimpl.parallel.grid import ProcessGrid, all_grids  # noqa: E402
from refimpl.parallel.partition import channel_range  # noqa: E402

INPUTS = {"cosmoflow": (2, 4, 8, 8, 8), "unet3d": (2, 1, 8, 8, 8)}




def recorded_step(model, grid, trace, x, target):
    """This rank's (layer, tensor, block, offset) of one step of ``model`` (y, dx, and dw, db
    after the gradient synchroniser), the loss, and its parameters after the update."""
    records = []
    for _, m in model.named_modules():         # each layer on its written input: no max pool run
        if hasattr(m, "pool_first"):           # ahead of the activation in front of it (Sequential)
            m.pool_first = False
    leaves = {name: m for name, m in model.named_modules() if name and not m.children()}
    for name, module in leaves.items():
        def forward(inp, name=name, original=module.forward):
            out = original(inp)
            records.append((name, "y", np.array(out)))
            return out

        def backward(dy, name=name, original=module.backward):
            dx = original(dy)
            if dx is not None:
                records.append((name, "dx", np.array(dx)))
            return dx
        module.forward, module.backward = forward, backward
    # dw, db summed over the spatial ranks and averaged over the sample groups, as refimpl trains
    sync = GradientSynchronizer(model.parameters(), grid.data_comm, grid.spatial_comm, reduce_comm=grid.batch_comm)
    out = model.forward(model.local_input(x))
    loss, dout, _ = model.loss(out, model.local_target(target))
    model.backward(dout)
    sync.finish()
    shards = {}
    for name, module in leaves.items():
        for attr, p in module._parameters.items():
            records.append((name, T.PARAM_TENSORS[attr], np.array(p.grad)))
            shards[(name, T.PARAM_TENSORS[attr])] = shards[p.name] = share_offset(p)
    optimizer = T.make_optimizer(trace.spec.optimizer, model.parameters())
    optimizer.step()
    updates = {n: (np.array(p.data), shards[n]) for n, p in model.named_parameters()}
    sample0 = model.local_samples(x.shape[0]).start
    placed = []
    for name, tensor, block in records:
        if tensor in ("dw", "db"):
            placed.append((name, tensor, block, shards[(name, tensor)]))   # the gradient of its share
            continue
        global_shape = trace.layer(name)["y_shape" if tensor == "y" else "x_shape"]
        channel0 = 0 if block.shape[1] == global_shape[1] else \
            channel_range(global_shape[1], grid.model_dims, grid.model_coord)[0]     # a channel-split block
        starts = [s.start for s in model.local_block(global_shape[2:])] if block.ndim == 5 else []
        placed.append((name, tensor, block, [sample0, channel0] + starts))
    return placed, loss, updates


def share_offset(p) -> list:
    """Where this rank's part of parameter ``p`` starts in the whole: 0, or its model-axis shard's."""
    offset = [0] * p.data.ndim
    if p.shard is not None:
        axis, start, _, _ = p.shard
        offset[axis] = start
    return offset


def model_parallel_grid(comm):
    """A 5-entry grid with a model axis 1 < Pm <= 4 and, where the world allows, a spatial
    split too (the 1-rank world: (1, 1, 1, 1, 1), its gathers identities)."""
    dims = [g for g in all_grids(comm.Get_size(), model=True) if 1 < g[4] <= 4 and g[0] == 1]
    dims = sorted(dims, key=lambda g: (g[1] * g[2] * g[3] == 1, -g[4]))
    return ProcessGrid(comm, dims[0] if dims else (1, 1, 1, 1, 1))


@pytest.mark.parametrize("name", ["cosmoflow", "unet3d"])
def test_refimpl_partitioned_passes_its_trace(comm, grids, all_ranks_agree, tmp_path, name):
    plain = [g for g in grids if len(g.dims) == 4 or g.dims[4] == 1]      # no model axis
    data_parallel = [g for g in plain if g.dims[0] > 1 and INPUTS[name][0] % g.dims[0] == 0]
    for grid in plain[:2] + data_parallel[:1]:                           # spatial, and data-parallel
        check_partitioned_run(comm, all_ranks_agree, tmp_path, name, grid)


def test_refimpl_partitioned_passes_a_trace_of_another_configuration(comm, grids, all_ranks_agree, tmp_path):
    """--model-config's overrides (here CosmoFlow with 2x2x2 kernels, 3 channels, a global
    average pool, another slope) reach the trace and the partitioned model alike."""
    plain = [g for g in grids if len(g.dims) == 4 or g.dims[4] == 1]
    overrides = {"kernel_size": 2, "conv_size": 3, "global_pool": "avg", "leaky_slope": 0.1}
    check_partitioned_run(comm, all_ranks_agree, tmp_path, "cosmoflow", plain[min(1, len(plain) - 1)],
                          overrides=overrides)


@pytest.mark.parametrize("split", ["filter", "channel"])
@pytest.mark.parametrize("name, levels", [("cosmoflow", None), ("unet3d", None), ("unet3d", 2)])
def test_refimpl_model_parallel_passes_its_trace(comm, all_ranks_agree, tmp_path, name, levels, split):
    """The model axis: refimpl's filter- / channel-parallel layers, 1.5-D head and gathers; the
    U-Net's bottleneck alone, and with both its levels split too (``model_parallel_levels``)."""
    grid = model_parallel_grid(comm)
    try:
        check_partitioned_run(comm, all_ranks_agree, tmp_path, name, grid, split,
                              overrides=None if levels is None else {"model_parallel_levels": levels})
    finally:
        grid.free()


def check_partitioned_run(comm, all_ranks_agree, tmp_path, name, grid, split="none", overrides=None):
    """Every rank runs ``name`` on ``grid`` (its config the preset's with ``overrides``); rank 0
    writes the results and checks them."""
    import h5py
    path = comm.bcast(str(tmp_path / f"{name}.h5") if comm.rank == 0 else None)
    dims = tuple(grid.dims) if split != "none" else tuple(grid.dims[:4])
    if comm.rank == 0:
        T.write_trace(T.TraceSpec(name, "tiny", INPUTS[name], dims, 1, model_parallel=split,
                                  overrides=dict(overrides or {})), path)
    comm.Barrier()
    trace = T.load_trace(path)
    mine = {}
    for dtype in trace.spec.dtypes:          # refimpl in float64 and in float32
        data = trace.data[dtype]
        model = build_model(name, trace.spec.config(), grid=grid, seed=0, dtype=dtype,
                            global_batch=INPUTS[name][0])
        model.load_state_dict({n: slice_of(data["initial"][n], p.shard)             # each rank its share
                               for n, p in model.named_parameters()}, strict=False)
        mine[dtype] = comm.gather(recorded_step(model, grid, trace, data["x"], data["target"]))
    verdict = None
    if comm.rank == 0:
        results = path.replace(".h5", ".mine.h5")
        with h5py.File(results, "w") as h5:
            h5.attrs["trace_digest"] = trace.digest
            for dtype, gathered in mine.items():
                h5[f"{dtype}/step/0/loss"] = np.asarray(gathered[0][1], dtype=dtype)
                for rank, (rank_blocks, _, updates) in enumerate(gathered):
                    for layer, tensor, block, offset in rank_blocks:
                        h5.create_dataset(f"{dtype}/step/0/{layer}/rank/{rank}/{tensor}",
                                          data=block).attrs["offset"] = offset
                    for pname, (array, offset) in updates.items():
                        h5.create_dataset(f"{dtype}/step/0/update/rank/{rank}/{pname}",
                                          data=array).attrs["offset"] = offset
        findings = check_trace(trace, load_peer(results, trace))
        verdict = ([f.where for f in findings if f.status != "pass"],
                   sum(f.phase == "forward" for f in findings), sum(f.phase == "backward" for f in findings),
                   sum(f.phase == "update" for f in findings))
    verdict = comm.bcast(verdict)
    params = len(trace.param_names)
    all_ranks_agree(verdict[0] == [] and verdict[1] == 2 * len(trace.layers) and verdict[2] > 0
                    and verdict[3] == 2 * params, f"grid {grid.dims} {split}: {verdict}")
