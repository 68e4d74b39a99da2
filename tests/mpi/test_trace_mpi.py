"""refimpl's own spatially partitioned models pass their traces (``refimpl oracle trace``).

Every rank runs CosmoFlow and the U-Net on its grid (the real halo exchanges, allreduces
and distributed batch norm, the gradient synchroniser), records each layer's y and dx
block, each rank's dw and db, the loss and each rank's parameters after the update, and rank 0
writes them in the documented results layout with each block's offset
(``grid.local_block``: the blocks the spatial layers hold) and checks them against the
trace computed unpartitioned: the trace's block math and refimpl's partitioned layers
agree, and a real partitioned run (float64 and float32) is judged as the docs say (run under ``mpiexec -n N``
by tests/test_mpiexec.py; a 1-rank world in plain pytest).
"""
import numpy as np
import pytest

pytest.importorskip("h5py")

from refimpl.models import build_model  # noqa: E402
from refimpl.oracle import trace as T  # noqa: E402
from refimpl.oracle.trace_check import check_trace, load_peer  # noqa: E402
from refimpl.parallel.grad_sync import GradientSynchronizer  # noqa: E402

INPUTS = {"cosmoflow": (2, 4, 8, 8, 8), "unet3d": (2, 1, 8, 8, 8)}




def recorded_step(model, grid, trace, x, target):
    """This rank's (layer, tensor, block, offset) of one step of ``model`` (y, dx, and dw, db
    after the gradient synchroniser), the loss, and its parameters after the update."""
    records = []
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
    for name, module in leaves.items():
        for attr, p in module._parameters.items():
            records.append((name, T.PARAM_TENSORS[attr], np.array(p.grad)))
    optimizer = T.make_optimizer(trace.spec.optimizer, model.parameters())
    optimizer.step()
    updates = {n: np.array(p.data) for n, p in model.named_parameters()}
    sample0 = model.local_samples(x.shape[0]).start
    placed = []
    for name, tensor, block in records:
        if tensor in ("dw", "db"):
            placed.append((name, tensor, block, [0] * block.ndim))      # the whole parameter's gradient
        elif block.ndim == 5:
            global_shape = trace.layer(name)["y_shape" if tensor == "y" else "x_shape"]
            starts = [s.start for s in model.local_block(global_shape[2:])]
            placed.append((name, tensor, block, [sample0, 0] + starts))
        else:
            placed.append((name, tensor, block, [sample0, 0]))
    return placed, loss, updates


@pytest.mark.parametrize("name", ["cosmoflow", "unet3d"])
def test_refimpl_partitioned_passes_its_trace(comm, grids, all_ranks_agree, tmp_path, name):
    import h5py
    plain = [g for g in grids if len(g.dims) == 4 or g.dims[4] == 1]      # no model axis
    data_parallel = [g for g in plain if g.dims[0] > 1 and INPUTS[name][0] % g.dims[0] == 0]
    for grid in plain[:2] + data_parallel[:1]:                           # spatial, and data-parallel
        path = comm.bcast(str(tmp_path / f"{name}.h5") if comm.rank == 0 else None)
        if comm.rank == 0:
            T.write_trace(T.TraceSpec(name, "tiny", INPUTS[name], tuple(grid.dims[:4]), 1), path)
        comm.Barrier()
        trace = T.load_trace(path)
        mine = {}
        for dtype in trace.spec.dtypes:          # refimpl in float64 and in float32
            data = trace.data[dtype]
            model = build_model(name, T.model_config(name, "tiny", INPUTS[name]), grid=grid, seed=0, dtype=dtype,
                                global_batch=INPUTS[name][0])
            model.load_state_dict(data["initial"], strict=False)
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
                        for pname, array in updates.items():
                            h5[f"{dtype}/step/0/update/rank/{rank}/{pname}"] = array
            findings = check_trace(trace, load_peer(results, trace))
            verdict = ([f.where for f in findings if f.status != "pass"],
                       sum(f.phase == "forward" for f in findings), sum(f.phase == "backward" for f in findings),
                       sum(f.phase == "update" for f in findings))
        verdict = comm.bcast(verdict)
        params = len(trace.param_names)
        all_ranks_agree(verdict[0] == [] and verdict[1] == 2 * len(trace.layers) and verdict[2] > 0
                        and verdict[3] == 2 * params, f"grid {grid.dims}: {verdict}")
