"""The weight update of a training run: lr schedule, gradient exchange, optimiser, from the settings.

After backward every rank sums its gradients over its spatial peers and
averages them over the sample groups (``GradientSynchronizer``,
refimpl/parallel/grad_sync.py), bucketed and overlapped with backward; then
every rank applies the same update.  The flags that shape this (--allreduce,
--bucket-mb, --no-overlap, --optimizer-sharding, --compress, --priority,
--chunk-mb) are read here and checked against each other: a combination that
cannot run is refused identically on every rank.

The exchange also holds state of its own: with --compress each rank keeps the
residuals its compression dropped (error feedback), saved per rank in the
checkpoint (``compressor_state``) and restored on the same grid.
"""
from __future__ import annotations

import statistics

from .errors import refuse
from .failstop import agree
from .optim import Schedule, make_optimizer


def make_schedule(config, run, steps_per_epoch) -> Schedule:
    """The learning rate as a function of the step: MLPerf's (in epochs), or warmup then milestones."""
    if config["schedule"] == "mlperf":
        return Schedule("mlperf", run["peak_lr"], base_lr=run["base_lr"], steps_per_epoch=steps_per_epoch,
                        warmup_epochs=config["warmup_epochs"], decay_epochs=run["decay"])
    return Schedule(config["schedule"], run["peak_lr"], warmup_steps=config["warmup_steps"],
                    milestones=run["decay"])


def make_gradient_sync(config: dict, model, grid):
    """The GradientSynchronizer of the run, from the allreduce flags (checked against each other)."""
    from .parallel.grad_sync import MIB, GradientSynchronizer
    compressor = None
    if config["compress"] != "none":
        from .parallel.compress import Compressor
        from .parallel.grad_sync import product_comm
        if config["optimizer_sharding"]:
            refuse("--compress and --optimizer-sharding do not combine (the distributed update needs "
                   "the reduce-scatter of the exact gradients)")
        compressor = Compressor(config["compress"], product_comm(grid.data_comm, grid.spatial_comm),
                                config["error_feedback"])
    if config["priority"] != "none":
        other = [flag for flag, on in (("--optimizer-sharding", config["optimizer_sharding"]),
                                       ("--compress", compressor is not None),
                                       ("--no-overlap", not config["overlap"])) if on]
        if other:
            refuse(f"--priority {config['priority']} does not combine with {' and '.join(other)}: it "
                   "reorders the overlapped allreduce of exact gradients and defers their update")
    chunk_mb = config["chunk_mb"] if config["chunk_mb"] is not None else \
        (1.0 if config["priority"] != "none" else 0.0)
    return GradientSynchronizer(model.parameters(), grid.data_comm, grid.spatial_comm,
                                bucket_bytes=int(config["bucket_mb"] * MIB), algorithm=config["allreduce"],
                                overlap=config["overlap"], shard=config["optimizer_sharding"],
                                compressor=compressor, reduce_comm=compressor.comm if compressor else None,
                                priority=config["priority"], chunk_bytes=int(chunk_mb * MIB),
                                **config["allreduce_options"])


def build_optimizer(config: dict, comm, model, sync, lr: float):
    """The run's optimiser at ``lr``; with --optimizer-sharding, of this rank's block of the parameters."""
    def optimizer_over(params):
        return make_optimizer(config["optimizer"], params, lr=lr, momentum=config["momentum"],
                              nesterov=config["nesterov"], weight_decay=config["weight_decay"],
                              betas=tuple(config["betas"]), eps=config["eps"])
    if config["optimizer_sharding"]:
        from .parallel.sharded_update import ShardedOptimizer
        return agree(comm, ShardedOptimizer, optimizer_over, model.parameters(), sync)
    return agree(comm, optimizer_over, model.parameters())


def compressor_state(sync) -> dict:
    """This rank's own arrays for the checkpoint: the compressor's residuals (error feedback)."""
    if sync.compressor is None:
        return {}
    return {f"compress/{key}": value for key, value in sync.compressor.state().items()}


def restore_compressor_state(sync, arrays, meta, grid, comm) -> list[str]:
    """This rank's compressor residuals, when the checkpoint was written on this grid; the notes to say."""
    compressor = sync.compressor
    if compressor is None:
        return []
    prefix = f"rank/{comm.Get_rank()}/compress/"
    saved = {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}
    if list(meta.get("grid", [])) == list(grid.dims) and meta.get("world_size") == comm.Get_size():
        compressor.load_state(saved)
    elif any(k.startswith("rank/") for k in arrays):
        return ["the compressor's residuals (error feedback) were saved on another grid: they start at zero"]
    return []


def exchange_summary(config, update, sync, steps_run: int) -> dict:
    """The summary's entries on the gradient exchange: the backward-to-forward gap, compressed bytes."""
    summary = {}
    if update.gaps:         # end of backward -> the next forward's first layer
        summary["backward_to_next_forward_s"] = statistics.median(update.gaps)
    if sync.compressor is not None and steps_run:
        summary["gradient_exchange"] = {
            "compress": config["compress"], "error_feedback": config["error_feedback"],
            "bytes_sent_per_step": sync.history[-1]["bytes_sent"],
            "bytes_uncompressed": sum(int(b.flat.nbytes) for b in sync.buckets)}
    return summary


__all__ = ["make_schedule", "make_gradient_sync", "build_optimizer", "compressor_state",
           "restore_compressor_state", "exchange_summary"]
