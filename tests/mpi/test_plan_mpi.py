"""The planner's predicted halo traffic equals a real run's, rank by rank and layer by layer.

Every rank builds the real model on every grid of the world size, runs one forward and
backward, and compares the bytes and messages each ``HaloExchange`` handed to MPI with
``plan.rank_costs`` for its own coordinates: exactly equal.
"""
import numpy as np
import pytest

from refimpl.models import build_model
from refimpl.parallel.grid import ProcessGrid, all_grids
from refimpl.parallel.partition import block_range
from refimpl.parallel.collectives import LAYER_ALLREDUCES
from refimpl.parallel.grad_sync import GradientSynchronizer
from refimpl.plan import Machine, gradient_buckets, model_layers, rank_costs

CASES = [("cosmoflow", "tiny", 2), ("unet3d", "tiny", 2),
         ("cosmoflow", {"input_shape": (2, 12, 20, 8), "conv_size": 3, "n_conv_layers": 2, "fc1_size": 8,
                        "fc2_size": 4}, 6)]


def measured(model):
    return {name: (mod.halo.bytes_sent, mod.halo.messages_sent) for name, mod in model.named_modules()
            if getattr(mod, "halo", None) is not None}


@pytest.mark.parametrize("name, config, batch", CASES, ids=["cosmoflow-tiny", "unet-tiny", "cosmoflow-uneven"])
def test_halo_bytes_and_messages_equal_the_plan(comm, all_ranks_agree, name, config, batch):
    size = comm.Get_size()
    layers = model_layers(name, config)
    shape = layers[0].in_dhw
    for dims in all_grids(size):
        if batch % dims[0] or any(p > n for p, n in zip(dims[1:], shape)):
            continue
        grid = ProcessGrid(comm, dims)
        model = build_model(name, config, grid, seed=0, global_batch=batch)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((batch, layers[0].c_in) + tuple(shape)).astype(np.float32)
        samples = slice(*block_range(batch, dims[0], grid.sample_coord))
        x_local = x[(samples, slice(None)) + grid.local_block(shape)]
        before = LAYER_ALLREDUCES.bytes
        out = model.forward(np.ascontiguousarray(x_local))
        model.backward(np.ones_like(out))
        reduced = LAYER_ALLREDUCES.bytes - before
        got = measured(model)
        costs = rank_costs(layers, dims, grid.coords, batch, 4, Machine())
        want = {c.name: (c.halo_bytes, c.halo_messages) for c in costs if c.kind in ("conv", "conv_transpose", "pool")}
        bad = {k: (got.get(k), want.get(k)) for k in set(got) | set(want) if got.get(k) != want.get(k)}
        # the gradient buckets the synchroniser allreduces, byte for byte
        buckets = [b.nbytes for b in GradientSynchronizer(model.parameters(), grid.data_comm, grid.spatial_comm,
                                                          bucket_bytes=4096, first_bucket_bytes=1024).buckets]
        if buckets != gradient_buckets(costs, 4096, 1024):
            bad["gradient buckets"] = (buckets, gradient_buckets(costs, 4096, 1024))
        if reduced != sum(c.allreduce_bytes for c in costs):      # batch norm, flatten layer
            bad["layer allreduces"] = (reduced, sum(c.allreduce_bytes for c in costs))
        all_ranks_agree(not bad, f"{name} on {dims}, rank {comm.Get_rank()}: (measured, planned) {bad}")
        grid.free()


MODEL_CASES = [("cosmoflow", {"input_shape": (3, 8, 8, 8), "conv_size": 4, "n_conv_layers": 2, "fc1_size": 6,
                              "fc2_size": 5, "model_parallel": mode, "model_parallel_blocks": 2}, 2)
               for mode in ("filter", "channel")] + \
              [("unet3d", {"input_shape": (1, 8, 8, 8), "levels": 1, "base_width": 4, "num_classes": 2,
                           "model_parallel": "channel"}, 2)]


@pytest.mark.parametrize("name, config, batch", MODEL_CASES, ids=["cosmoflow-filter", "cosmoflow-channel",
                                                                   "unet-channel"])
def test_model_axis_traffic_equals_the_plan(comm, all_ranks_agree, name, config, batch):
    """On grids with a model axis: halo traffic per layer, and the channel collectives' bytes
    (``channels.TRAFFIC``) summed over the step."""
    from refimpl.parallel.channels import TRAFFIC
    from refimpl.plan import feasibility
    layers = model_layers(name, config)
    shape = layers[0].in_dhw
    tried = 0
    for dims in all_grids(comm.Get_size(), model=True):
        if dims[4] == 1 or batch % dims[0] or feasibility(layers, dims, batch):
            continue
        tried += 1
        grid = ProcessGrid(comm, dims)
        model = build_model(name, config, grid, seed=0, global_batch=batch)
        x = np.random.default_rng(0).standard_normal((batch, layers[0].c_in) + tuple(shape)).astype(np.float32)
        samples = slice(*block_range(batch, dims[0], grid.sample_coord))
        before, before_ar = TRAFFIC.bytes, LAYER_ALLREDUCES.bytes
        out = model.forward(np.ascontiguousarray(x[(samples, slice(None)) + grid.local_block(shape)]))
        model.backward(np.ones_like(out))
        reduced = LAYER_ALLREDUCES.bytes - before_ar
        costs = rank_costs(layers, dims, grid.coords, batch, 4, Machine())
        got = measured(model)
        want = {c.name: (c.halo_bytes, c.halo_messages) for c in costs if c.kind in ("conv", "conv_transpose", "pool")}
        bad = {k: (got.get(k), want.get(k)) for k in set(got) | set(want) if got.get(k) != want.get(k)}
        traffic = (TRAFFIC.bytes - before, sum(c.model_bytes for c in costs))
        buckets = [b.nbytes for b in GradientSynchronizer(model.parameters(), grid.data_comm, grid.spatial_comm,
                                                          bucket_bytes=4096, first_bucket_bytes=1024).buckets]
        if buckets != gradient_buckets(costs, 4096, 1024):
            bad["gradient buckets"] = (buckets, gradient_buckets(costs, 4096, 1024))
        if reduced != sum(c.allreduce_bytes for c in costs):      # + the model group's dx allreduces
            bad["layer allreduces"] = (reduced, sum(c.allreduce_bytes for c in costs))
        all_ranks_agree(not bad and traffic[0] == traffic[1],
                        f"{name} on {dims}, rank {comm.Get_rank()}: halo {bad}, channel bytes (measured, planned) "
                        f"{traffic}")
        grid.free()
    assert tried or comm.Get_size() == 1
