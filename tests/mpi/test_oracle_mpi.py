"""refimpl's own partitioned layers against the oracle's per-rank expectations.

The oracle derives every rank's blocks on one process (``refimpl/oracle/expect.py``);
here each rank runs refimpl's partitioned layer on its block of the same case and
compares y, dx, its partial dW/db (before the allreduce) and the reduced ones with the
expectation *for its own rank* (float64, 1e-10): the case files describe the blocks
refimpl actually computes, on every grid of the world size.
"""
import numpy as np
import pytest

from refimpl import layers
from refimpl.oracle import load_suite, parse_suite
from refimpl.oracle.expect import expectations
from refimpl.parallel.collectives import allreduce
from refimpl.parallel.grid import ProcessGrid, all_grids

TOL = 1e-10


def cases_for(size):
    """The hard suite's cases on grids of ``size`` ranks: their own grids of that size, and
    each case re-gridded onto the first valid grids of the world size."""
    specs = [s for s in load_suite("hard") if s.ranks == size]
    seen = {s.name for s in specs}
    for base in load_suite("hard"):
        if base.name in seen:
            continue
        seen.add(base.name)
        table = {"name": base.name, "layer": base.layer, "input": list(base.input), "kernel": list(base.kernel),
                 "stride": list(base.stride), "padding": list(base.padding), "dilation": list(base.dilation),
                 "values": base.values, "model_parallel": base.model_parallel, "dtypes": ["float64"],
                 **base.options}
        taken = layers.lookup(base.layer).hyper_parameters
        if "out_channels" in taken:
            table["out_channels"] = base.out_channels
        if "output_padding" in taken:
            table["output_padding"] = list(base.output_padding)
        for grid in all_grids(size, model=base.model_parallel != "none"):
            try:
                spec, = parse_suite({"case": [dict(table, grids=[list(grid)])]}, "regrid")
            except ValueError:
                continue          # e.g. more sample groups than samples, or Pm > channels
            specs.append(spec)
            break
    return specs


def relative(a, b):
    scale = float(np.abs(b).max()) if b.size else 0.0
    err = float(np.abs(np.asarray(a, np.float64) - b).max()) if b.size else 0.0
    return err / scale if scale else err


def test_refimpl_layers_match_the_per_rank_expectations(comm, all_ranks_agree):
    size, rank = comm.Get_size(), comm.Get_rank()
    specs = cases_for(size)
    assert specs
    for spec in specs:
        inputs, _, ranks = expectations(spec, "float64")
        mine = ranks[rank]
        grid = ProcessGrid(comm, spec.grid)
        layer = layers.lookup(spec.layer).partitioned(spec, grid=grid, rng=np.random.default_rng(0), dtype=np.float64)
        layer.setup(spec.input[2:])
        params = [p for p in (getattr(layer, "weight", None), getattr(layer, "bias", None)) if p is not None]
        for p, name in zip(params, ("w", "b")):          # the case's parameters, this rank's slice
            whole = inputs[name]
            p.data[...] = whole if p.shard is None else np.take(whole, range(p.shard[1], p.shard[2]), p.shard[0])
        y = layer.forward(mine["x"][0].copy())
        dx = layer.backward(mine["dy"][0].copy())
        errors = {"y": relative(y, mine["y"][0]), "dx": relative(dx, mine["dx"][0])}
        for p, name in zip(params, ("dw", "db")):
            g = p.grad if p.grad is not None else np.zeros(p.shape)
            errors[f"{name}_partial"] = relative(g, mine[f"{name}_partial"][0])
            reduced = allreduce(np.ascontiguousarray(g), grid.batch_comm)     # the ranks holding this slice
            errors[name] = relative(reduced, mine[name][0])
        bad = {k: v for k, v in errors.items() if not v <= TOL}
        all_ranks_agree(not bad, f"{spec.name} on grid {spec.grid}, rank {rank}: {bad}")
        grid.free()


@pytest.mark.parametrize("dummy", [0])
def test_every_world_size_has_cases(comm, dummy):
    assert len(cases_for(comm.Get_size())) >= 10
