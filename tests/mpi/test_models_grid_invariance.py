"""The central promise: the same seed and global batch train the same model on any process grid.

For the world size P, every (Pn, Pd, Ph, Pw) arrangement below (including
(1, 8, 1, 1): the deepest 4^3 level then leaves half the ranks with empty blocks) runs
a few plain SGD steps (``p.data -= lr * p.grad`` after
``GradientSynchronizer.finish()``) of CosmoFlow and 3D U-Net in float64 and float32, with
dropout on (p = 0.5) and batch norm over the global batch.  Every rank also
trains the unpartitioned model (grid None) on the whole global batch, locally,
without any message; losses, metrics, every parameter and every batch-norm
statistic must agree to 1e-10 relative in float64, and in float32 to 5e-3 of the larger of
the tensor's own scale and 1 % of the model's largest parameter (``FLOAT32_FLOOR``).

Why float32 gets more than its rounding: a ReLU's input that rounds to exactly 0 on one
grid and to 5e-8 on another (seen: 1 voxel of 65536 in the U-Net's last block) passes
that voxel's whole gradient on one side and none on the other, and every weight gradient
upstream carries the difference: 3e-3 relative after one step, in the unpartitioned run
alone when only its worker-thread count changes.  Some tensors are rounding noise
themselves: a batch-norm bias whose gradient nearly cancels (the next conv + batch norm
remove a per-channel shift) stays ~1e-5 and moves by 10 % between runs; against the
model's scale it moves by 1e-6.  A partitioning bug moves tensors by O(1); float64's
1e-10 is the exactness proof.

The convolutions run with the default algorithm ("auto": Winograd where it pays) in
float64, where Winograd is exact, and with im2col in float32: Winograd's float32
rounding (documented in refimpl/kernels/winograd.py, ~1e-4 of a typical output)
depends on where the 4x4x4 tiles fall, which differs between a partitioned block and
the whole volume, so float32 agreement to 1e-4 is a property of the plain algorithm.
"""
import functools
import itertools
import os

import numpy as np
import pytest
from mpi4py import MPI

from refimpl.models import PRESETS, build_model
from refimpl.parallel.grad_sync import GradientSynchronizer
from refimpl.parallel.grid import ProcessGrid

SIZE = MPI.COMM_WORLD.Get_size()
SEED, STEPS, LR = 11, 3, 0.1
TOLERANCE = {"float64": 1e-10, "float32": 5e-3}
#: float32 tensors are measured against max(their largest |value|, this x the model's largest
#: |parameter|) (module docstring).
FLOAT32_FLOOR = 1e-2
CONFIGS = {"cosmoflow": {**PRESETS["cosmoflow"]["tiny"], "dropout": 0.5},
           "unet3d": {**PRESETS["unet3d"]["tiny"], "loss": "ce+dice"}}

# the arrangements tried for each world size; sizes not listed use every arrangement
CHOSEN = {
    2: [(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2)],
    3: [(3, 1, 1, 1), (1, 3, 1, 1), (1, 1, 1, 3)],
    4: [(4, 1, 1, 1), (2, 1, 2, 1), (1, 2, 2, 1), (1, 1, 2, 2), (1, 4, 1, 1)],
    8: [(8, 1, 1, 1), (2, 2, 2, 1), (1, 2, 2, 2), (2, 1, 1, 4), (1, 8, 1, 1)],
}


def arrangements(p):
    """The chosen (Pn, Pd, Ph, Pw) with product p (every arrangement for unlisted p)."""
    every = [dims for dims in itertools.product(range(1, p + 1), repeat=4) if int(np.prod(dims)) == p]
    return [dims for dims in CHOSEN.get(p, every) if dims in every]


def global_batch(pn):
    """The smallest multiple of Pn that is at least 4."""
    return pn * -(-4 // pn)


def data(model, batch, step, dtype):
    """Step ``step``'s global (x, target): the same on every rank."""
    rng = np.random.default_rng([SEED, batch, step])
    x = rng.standard_normal((batch,) + model.input_shape).astype(dtype)
    if model.task == "regression":
        return x, rng.uniform(-1, 1, (batch, model.num_outputs)).astype(dtype)
    return x, rng.integers(0, model.num_classes, (batch,) + model.input_shape[1:])


def train(name, grid, batch, dtype, conv=None):
    """STEPS SGD steps; returns (model, [(loss, metrics) per step]).  ``conv``: the conv algorithm
    (default: im2col in float32, auto in float64)."""
    algorithm = os.environ.get("REFIMPL_CONV_ALGORITHM")
    os.environ["REFIMPL_CONV_ALGORITHM"] = conv or ("im2col" if np.dtype(dtype) == np.float32 else "auto")
    try:
        return _train(name, grid, batch, dtype)
    finally:
        if algorithm is None:
            del os.environ["REFIMPL_CONV_ALGORITHM"]
        else:
            os.environ["REFIMPL_CONV_ALGORITHM"] = algorithm


def _train(name, grid, batch, dtype, config=None):
    model = build_model(name, config or CONFIGS[name], grid, SEED, np.dtype(dtype).type, global_batch=batch)
    # gradients are reduced over the ranks holding the same slice (the whole grid without a model axis)
    sync = None if grid is None else GradientSynchronizer(
        model.parameters(), grid.data_comm, grid.spatial_comm, reduce_comm=grid.batch_comm)
    history = []
    for step in range(STEPS):
        x, target = data(model, batch, step, dtype)
        model.zero_grad()
        out = model.forward(model.local_input(x))
        loss, dout, metrics = model.loss(out, model.local_target(target))
        model.backward(dout)
        if sync is not None:
            sync.finish()
        for p in model.parameters():
            p.data -= LR * p.grad
        history.append((loss, metrics))
    return model, history


@functools.lru_cache(maxsize=None)
def reference(name, batch, dtype, conv=None):
    """The unpartitioned run, on this rank alone (no message)."""
    return train(name, None, batch, dtype, conv)


def rel_err(a, b, floor=0.0):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), floor))


@pytest.mark.parametrize("dtype", sorted(TOLERANCE))
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("dims", arrangements(SIZE), ids=lambda d: "x".join(map(str, d)))
def test_training_is_grid_invariant(comm, all_ranks_agree, name, dims, dtype):
    check_grid_invariance(comm, all_ranks_agree, name, dims, dtype)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_training_under_the_reference_conv_is_grid_invariant(comm, all_ranks_agree, name):
    """REFIMPL_CONV_ALGORITHM=reference (refimpl/functional/conv3d.py's plain math, no kernel) trains
    every layer of both models, partitioned (the most spatial arrangement of this world size) as
    unpartitioned, in float64."""
    dims = max(arrangements(SIZE), key=lambda d: (d[1] * d[2] * d[3], d))
    check_grid_invariance(comm, all_ranks_agree, name, dims, "float64", conv="reference")


def check_grid_invariance(comm, all_ranks_agree, name, dims, dtype, conv=None):
    grid = ProcessGrid(comm, dims)
    batch = global_batch(dims[0])
    model, history = train(name, grid, batch, dtype, conv)
    ref_model, ref_history = reference(name, batch, dtype, conv)

    worst, where = 0.0, ""
    state, ref_state = model.state_dict(), ref_model.state_dict()
    floor = 0.0 if dtype == "float64" else FLOAT32_FLOOR * max(
        float(np.max(np.abs(p.data))) for p in ref_model.parameters())
    for key, want in ref_state.items():      # every parameter and batch-norm statistic
        err = rel_err(state[key], want, floor)
        if err > worst:
            worst, where = err, key
    for step, ((loss, metrics), (ref_loss, ref_metrics)) in enumerate(zip(history, ref_history)):
        for what, got, want in [("loss", loss, ref_loss)] + [
                (k, metrics[k], ref_metrics[k]) for k in ref_metrics]:
            err = abs(got - want) / abs(want)
            if err > worst:
                worst, where = err, f"step {step} {what}"
    # the loss and the metrics are the same float on every rank
    same = comm.allgather([(loss, sorted(m.items())) for loss, m in history])
    all_ranks_agree(all(s == same[0] for s in same), f"losses/metrics differ between ranks: {same}")
    all_ranks_agree(worst <= TOLERANCE[dtype], f"{name} {dtype} on grid {dims}: max rel err {worst:.3g} at {where}")
    grid.free()


def test_global_batch_not_divisible_by_pn_raises_on_every_rank(comm, all_ranks_agree):
    if SIZE == 1:
        pytest.skip("every batch divides over one sample group")
    grid = ProcessGrid(comm, (SIZE, 1, 1, 1))
    try:
        build_model("cosmoflow", CONFIGS["cosmoflow"], grid, SEED, np.float64, global_batch=SIZE + 1)
        raised = False
    except ValueError as err:
        raised = "divisible" in str(err)
    all_ranks_agree(raised, "build_model accepted a global batch that Pn does not divide")
    grid.free()


# ---------------------------------------------------------------- with the model axis

MODEL_GRIDS = {1: [(1, 1, 1, 1, 1)], 2: [(1, 1, 1, 1, 2)], 3: [(1, 1, 1, 1, 3)],
               4: [(1, 1, 1, 1, 4), (2, 1, 1, 1, 2), (1, 2, 1, 1, 2)], 6: [(2, 1, 1, 1, 3), (1, 2, 1, 1, 3)],
               8: [(2, 2, 1, 1, 2), (1, 1, 1, 1, 8), (1, 2, 1, 2, 2)]}


@pytest.mark.parametrize("mode", ["filter", "channel"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("dims", MODEL_GRIDS.get(SIZE, []), ids=lambda d: "x".join(map(str, d)))
def test_model_parallel_training_is_grid_invariant(comm, all_ranks_agree, dims, name, mode):
    """CosmoFlow with its last conv blocks filter- or channel-parallel and a 1.5-D head, the U-Net
    with a model-parallel bottleneck and deepest levels (batch norm on channel slices): the same parameters and
    batch-norm statistics after 3 SGD steps as the unpartitioned model (float64), the split ones
    gathered whole."""
    from refimpl.nn.model_parallel import buffer_shards, whole_of
    pm = dims[4]
    config = {**CONFIGS[name], "model_parallel": mode}
    if name == "cosmoflow":
        config["model_parallel_blocks"] = 2 if pm <= 4 else 1    # a split block needs >= Pm channels
        if mode == "channel" and pm > 4:
            pytest.skip("the channel-parallel block splits 4 input channels: Pm <= 4")
    else:                                                        # level 0 has 4 channels, level 1 8
        config["model_parallel_levels"] = 2 if pm <= 4 else 1
    grid = ProcessGrid(comm, dims)
    batch = global_batch(dims[0])
    model, history = train_config(name, config, grid, batch)
    ref_model, ref_history = train_config(name, config, None, batch)
    split = buffer_shards(model)
    mine = [(key, whole_of(p.data, p.shard, grid.model_comm)) for key, p in model.named_parameters()]
    mine += [(key, whole_of(b, split.get(key), grid.model_comm)) for key, b in model.named_buffers()]
    worst, where = worst_error(mine, history, ref_model.state_dict(), ref_history)
    n_split = sum(p.shard is not None for p in model.parameters())
    split_blocks = {key.split(".")[0] for key, p in model.named_parameters() if p.shard is not None}
    expected = set() if pm == 1 or name != "unet3d" else \
        {"bottleneck"} | {f"{part}{level}" for part in ("enc", "dec")
                          for level in range(config["levels"] - config["model_parallel_levels"], config["levels"])}
    all_ranks_agree(worst <= 1e-10 and (pm == 1 or n_split > 0) and expected <= split_blocks,
                    f"{name} {mode} on grid {dims}: max rel err {worst:.3g} at {where}; {n_split} split parameters "
                    f"in {sorted(split_blocks)}")
    grid.free()


def worst_error(mine, history, ref_state, ref_history):
    """The largest relative error, and where: over the gathered ``(key, array)`` pairs against the
    unpartitioned model's state, and over the per-step losses against its history."""
    worst, where = 0.0, ""
    for key, got in mine:
        err = rel_err(got, ref_state[key])
        if err > worst:
            worst, where = err, key
    for step, ((loss, _), (ref_loss, _)) in enumerate(zip(history, ref_history)):
        err = abs(loss - ref_loss) / abs(ref_loss)
        if err > worst:
            worst, where = err, f"step {step} loss"
    return worst, where


def train_config(name, config, grid, batch):
    """STEPS float64 SGD steps of model ``name`` with ``config`` (``_train``)."""
    return _train(name, grid, batch, np.float64, config)


# ---------------------------------------------------------------- the MLPerf network's even kernel
#: CosmoFlow with the MLPerf reference's Conv3D(kernel 2, padding 'same') -- TensorFlow's rule:
#: 0 before, 1 after -- (``--preset tiny-same``; ``mlperf`` is the same network at 128^3)
SAME_CONFIG = {**PRESETS["cosmoflow"]["tiny-same"], "dropout": 0.5}
SAME_GRIDS = {1: [(1, 1, 1, 1)], 2: [(2, 1, 1, 1), (1, 2, 1, 1)], 3: [(1, 3, 1, 1)], 4: [(1, 1, 2, 2)],
              6: [(1, 3, 2, 1)], 8: [(1, 2, 2, 2)]}


@functools.lru_cache(maxsize=None)
def same_reference(batch):
    return _train("cosmoflow", None, batch, np.float64, SAME_CONFIG)


@pytest.mark.parametrize("dims", SAME_GRIDS.get(SIZE, []), ids=lambda d: "x".join(map(str, d)))
def test_kernel_2_same_cosmoflow_is_grid_invariant(comm, all_ranks_agree, dims):
    """The asymmetric 'same' padding of an even kernel: each rank's halo comes from its hi side
    only; float64 training equals the unpartitioned run to 1e-10."""
    grid = ProcessGrid(comm, dims)
    batch = global_batch(dims[0])
    model, history = _train("cosmoflow", grid, batch, np.float64, SAME_CONFIG)
    ref_model, ref_history = same_reference(batch)
    errors = {key: rel_err(model.state_dict()[key], want) for key, want in ref_model.state_dict().items()}
    errors.update({f"step {i} loss": abs(a[0] - b[0]) / abs(b[0])
                   for i, (a, b) in enumerate(zip(history, ref_history))})
    where = max(errors, key=errors.get)
    all_ranks_agree(errors[where] <= TOLERANCE["float64"],
                    f"tiny-same on grid {dims}: max rel err {errors[where]:.3g} at {where}")
    grid.free()


# ---------------------------------------------------------------- group and instance norm
#: the U-Net with --norm group / instance: statistics per sample, reduced over the spatial ranks
#: only; (1, 8, 1, 1) leaves half the ranks an empty block at the 4^3 bottleneck
NORM_GRIDS = {1: [(1, 1, 1, 1)], 2: [(2, 1, 1, 1), (1, 2, 1, 1)], 3: [(1, 3, 1, 1)], 4: [(1, 1, 2, 2)],
              6: [(2, 1, 3, 1)], 8: [(1, 8, 1, 1)]}
NORM_MODEL_GRIDS = {1: [(1, 1, 1, 1, 1)], 2: [(1, 1, 1, 1, 2)], 3: [(1, 1, 1, 1, 3)], 4: [(1, 2, 1, 1, 2)],
                    6: [(1, 1, 2, 1, 3)], 8: [(1, 2, 1, 1, 4)]}


@functools.lru_cache(maxsize=None)
def norm_reference(norm, batch, mode="none"):
    return train_config("unet3d", {**CONFIGS["unet3d"], "norm": norm, "model_parallel": mode}, None, batch)


@pytest.mark.parametrize("norm", ["group", "instance"])
@pytest.mark.parametrize("dims", NORM_GRIDS.get(SIZE, []), ids=lambda d: "x".join(map(str, d)))
def test_unet_norm_is_grid_invariant(comm, all_ranks_agree, dims, norm):
    """--norm group / instance (float64, 3 SGD steps): the losses equal the unpartitioned run's to
    1e-12, every parameter to 1e-10 (tests/mpi/test_group_norm_mpi.py: without the allreduce they differ)."""
    grid = ProcessGrid(comm, dims)
    batch = global_batch(dims[0])
    model, history = train_config("unet3d", {**CONFIGS["unet3d"], "norm": norm}, grid, batch)
    ref_model, ref_history = norm_reference(norm, batch)
    kind = {"group": "GroupNorm3d", "instance": "InstanceNorm3d"}[norm]
    built = {type(m).__name__ for _, m in model.named_modules()}
    losses = max(abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(history, ref_history))
    params = max(rel_err(model.state_dict()[k], v) for k, v in ref_model.state_dict().items())
    all_ranks_agree(f"Spatial{kind}" in built and "SpatialBatchNorm3d" not in built, f"built {sorted(built)}")
    all_ranks_agree(losses <= 1e-12 and params <= 1e-10,
                    f"{norm} norm on grid {dims}: losses {losses:.3g}, parameters {params:.3g}")
    grid.free()


@pytest.mark.parametrize("norm", ["group", "instance"])
@pytest.mark.parametrize("dims", NORM_MODEL_GRIDS.get(SIZE, []), ids=lambda d: "x".join(map(str, d)))
def test_unet_norm_with_a_model_parallel_bottleneck(comm, all_ranks_agree, dims, norm):
    """The bottleneck split over Pm (filter mode): instance norm and a group norm whose groups
    (8 groups of 2 of the 16 channels) stay whole on every model rank train as unpartitioned;
    Pm = 3 would cut a group: a ValueError on every rank when the model is built."""
    from refimpl.nn.model_parallel import whole_of
    grid = ProcessGrid(comm, dims)
    batch = global_batch(dims[0])
    config = {**CONFIGS["unet3d"], "norm": norm, "model_parallel": "filter"}
    if norm == "group" and dims[4] == 3:
        with pytest.raises(ValueError, match="cuts a group"):
            train_config("unet3d", config, grid, batch)
        grid.free()
        return
    model, history = train_config("unet3d", config, grid, batch)
    ref_model, ref_history = norm_reference(norm, batch, "filter")
    ref_state = ref_model.state_dict()
    params = max(rel_err(whole_of(p.data, p.shard, grid.model_comm), ref_state[k])
                 for k, p in model.named_parameters())
    losses = max(abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(history, ref_history))
    all_ranks_agree(losses <= 1e-12 and params <= 1e-10,
                    f"{norm} norm, bottleneck over Pm, grid {dims}: losses {losses:.3g}, parameters {params:.3g}")
    grid.free()


# ---------------------------------------------------------------- CosmoFlow's global average pool
#: global_pool "avg" (the fixed-capacity family of scripts/experiment_volume.py): the pool's window
#: is the last block's whole extent, (3, 4, 2) here, so on a grid its halo gathers the window from
#: every rank that owns a piece, and the ranks that own no output voxel still join the exchange
POOL_CONFIG = {**CONFIGS["cosmoflow"], "global_pool": "avg", "input_shape": (4, 12, 16, 8)}


@pytest.mark.parametrize("dims", arrangements(SIZE) + MODEL_GRIDS.get(SIZE, []),
                         ids=lambda d: "x".join(map(str, d)))
def test_global_average_pool_training_is_grid_invariant(comm, all_ranks_agree, dims):
    """The same parameters and losses after 3 SGD steps as the unpartitioned model (float64), on
    every spatial arrangement and, with a model axis, with the last blocks filter-parallel."""
    from refimpl.nn.model_parallel import whole_of
    config = dict(POOL_CONFIG)
    if len(dims) == 5:
        config.update(model_parallel="filter", model_parallel_blocks=2 if dims[4] <= 4 else 1)
    grid = ProcessGrid(comm, dims)
    batch = global_batch(dims[0])
    model, history = _train("cosmoflow", grid, batch, np.float64, config)
    ref_model, ref_history = _train("cosmoflow", None, batch, np.float64, config)
    mine = [(key, whole_of(p.data, p.shard, grid.model_comm)) for key, p in model.named_parameters()]
    worst, where = worst_error(mine, history, ref_model.state_dict(), ref_history)
    all_ranks_agree(worst <= 1e-10, f"global_pool avg on grid {dims}: max rel err {worst:.3g} at {where}")
    grid.free()
