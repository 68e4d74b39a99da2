"""``refimpl train``: hybrid data x spatial parallel training of CosmoFlow or 3D U-Net under mpiexec.

Without --data a small synthetic dataset matching the model preset is generated
into OUT/data first (rank 0), so the command works on a fresh machine.  OUT
receives checkpoint.h5 (resumable bit for bit with --resume), metrics.jsonl,
loss.png, config.json and summary.json.  Settings come from the defaults, then
--config FILE.toml, then the flags given (see docs/training.md).

Exit status: 0 done; 2 bad input (one line from rank 0, every rank exits); 3 the
loss became NaN/Inf (the last good checkpoint is kept); 4 an output could not be
written (disk full, ...); 5 a rank stopped answering for --stall-timeout seconds;
70 an internal error (a bug: --debug shows the traceback); 130 / 143 interrupted
by SIGINT / SIGTERM; 138 pre-empted: SIGUSR1 (sbatch --signal=USR1@120) wrote a
checkpoint at the end of the step, continue with --resume.  A failure on any one
rank ends every rank within seconds with one message (docs/training.md, "Faults").

Examples:
    mpiexec -n 4 --oversubscribe refimpl train --model cosmoflow --preset tiny --grid 2,2,1,1 --steps 300 --lr 0.003 --out runs/quickstart
    mpiexec -n 4 --oversubscribe refimpl train --out runs/quickstart --resume --steps 400
    mpiexec -n 2 --oversubscribe refimpl train --model unet3d --grid 1,2,1,1 --optimizer adam --lr 0.01 --steps 20 --out runs/unet
    refimpl datagen cosmoflow --out data/c32 --size 32 --samples 128 && \\
        mpiexec -n 8 --oversubscribe refimpl train --config run.toml --data data/c32 --grid 2,1,2,2
"""
from __future__ import annotations

import argparse


def add_arguments(parser):
    from ..config import CHOICES
    from ..optim import SCHEDULES
    from ..parallel.allreduce import option_help
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    a = parser.add_argument
    a("--config", metavar="FILE.toml", help="TOML file of settings (flags given override it)")
    a("--model", choices=CHOICES["model"], help="network (default cosmoflow)")
    a("--preset", help="model preset (default tiny): cosmoflow tiny, small, tiny-same, mlperf, mlperf-k3; "
      "unet3d tiny, small, default")
    a("--data", metavar="DIR", help="directory with train.h5 (+ val.h5) from 'refimpl datagen', or train/ "
      "(+ val/) directories of one HDF5 file per sample (datagen --layout per-sample, LBANN's layout) "
      "(default: generate a small dataset into OUT/data)")
    a("--generate", dest="generate", action="store_const", const=True,
      help="generate OUT/data when --data is not given (the default)")
    a("--no-generate", dest="generate", action="store_const", const=False,
      help="fail instead of generating data when --data is not given")
    a("--gen-samples", type=int, help="generated training samples (default: 16 to 256, about 128 MiB)")
    a("--gen-val-samples", type=int, help="generated validation samples (default: 1/8 of the training samples, at least 4)")
    a("--grid", metavar="Pn,Pd,Ph,Pw[,Pm]", help="process grid; must multiply to the number of ranks "
      "(default: all ranks data parallel); Pm: the model axis (see --model-parallel)")
    a("--model-parallel", choices=("none", "filter", "channel"),
      help="split layers by filters or channels over the grid's Pm: cosmoflow its last [model_config] "
           "model_parallel_blocks conv blocks (default 1) and its dense head (Gholami's 1.5-D layers), "
           "unet3d its bottleneck and its deepest [model_config] model_parallel_levels levels (default 0) "
           "(docs/model_parallel.md; default none: every model rank runs every layer)")
    a("--norm", choices=("batch", "group", "instance"),
      help="unet3d: the conv blocks' normalisation, [model_config] norm (default batch: statistics of the "
           "global batch; group: per sample and group of [model_config] num_groups channels, default 8; "
           "instance: per sample and channel; docs/training.md)")
    a("--global-batch", type=int, metavar="B", help="samples per step over all sample groups; "
      "divisible by Pn (default 4 rounded up to a multiple of Pn)")
    a("--steps", type=int, help="train this many steps in total (default: --epochs)")
    a("--epochs", type=int, help="train this many epochs in total (default 1)")
    a("--optimizer", choices=CHOICES["optimizer"][1:], help="default adam (sgd with --schedule mlperf)")
    a("--lr", type=float, help="base learning rate (default sgd 0.01, adam 0.001, mlperf 0.001)")
    a("--base-batch", type=int, help="linear scaling: lr = LR * global_batch / BASE_BATCH (default: no "
      "scaling; mlperf: 64)")
    a("--momentum", type=float, help="SGD momentum (default 0.9)")
    a("--nesterov", action="store_const", const=True, help="Nesterov momentum")
    a("--weight-decay", type=float, help="L2 weight decay (default 0)")
    a("--warmup-steps", type=int, help="linear warmup steps (constant / step schedules)")
    a("--schedule", choices=SCHEDULES, help="constant (default); step (see --decay); mlperf (MLPerf "
      "CosmoFlow: SGD 0.001 at batch 64 scaled linearly, 4 warmup epochs, x0.25 after epoch 32, "
      "x0.125 after 64)")
    a("--decay", metavar="STEP:FACTOR,...", help="step schedule: lr = peak * FACTOR from STEP on "
      "(mlperf: EPOCH:FACTOR)")
    a("--dtype", choices=CHOICES["dtype"], help="default float32")
    a("--seed", type=int, help="seed of the weights, data order and dropout (default 0)")
    a("--out", metavar="DIR", help="output directory (default runs/train)")
    a("--resume", action="store_const", const=True, help="continue the run in OUT from OUT/checkpoint.h5")
    a("--overwrite", action="store_const", const=True, help="start over in an OUT that holds a run")
    a("--break-lock", action="store_const", const=True,
      help="take over OUT/.lock of a job on another host that was not refreshed for 10 minutes (--overwrite "
           "does too; a lock whose process no longer runs on this host is taken over without it, and said so); "
           "a live job's lock is never broken")
    a("--data-changed-ok", action="store_const", const=True,
      help="with --resume: train on the data even if it is not what the checkpoint recorded (another sample "
           "count, shape, generator, seed or content); without it such a resume is refused")
    a("--checkpoint-every", type=int, metavar="N", help="checkpoint every N steps and at the end (default 50)")
    a("--validate-every", type=int, metavar="N", help="validate every N steps and at the end (default 25)")
    a("--log-every", type=int, metavar="N", help="a log line every N steps and at the last (default 10; each validation prints its own line)")
    a("--allreduce", choices=sorted(CHOICES["allreduce"]), help="gradient allreduce algorithm (default native; "
      "docs/communication.md)")
    a("--allreduce-option", dest="allreduce_options", action="append", metavar="NAME=VALUE",
      help="an option of the --allreduce algorithm, repeatable (TOML: an [allreduce_options] table); VALUE "
           f"reads as a TOML value (4, 0.5, true; else a string). {option_help()}")
    a("--bucket-mb", type=float, help="gradient bucket size in MiB (default 25)")
    a("--no-overlap", dest="overlap", action="store_const", const=False,
      help="reduce gradients after backward instead of during it")
    a("--optimizer-sharding", action="store_const", const=True,
      help="distributed weight update (ZeRO stage 1): reduce-scatter the gradients, each rank updates "
           "its block of the parameters with 1/P of the optimizer state, allgather (docs/communication.md)")
    a("--compress", metavar="SPEC", help="compress the gradient exchange: none (default), int8 (block-wise "
      "8-bit) or topk:RATIO (the largest RATIO of each bucket, e.g. topk:0.01), with error feedback; "
      "lossy (docs/communication.md)")
    a("--no-error-feedback", dest="error_feedback", action="store_const", const=False,
      help="drop what --compress loses instead of carrying it to the next step")
    a("--priority", choices=CHOICES["priority"], help="input-first: start the buckets of the layers nearest "
      "the input first, cut large buckets into chunks they can overtake, and apply each layer's update "
      "just before its next forward, so that forward starts before every bucket is summed "
      "(docs/communication.md; default none)")
    a("--chunk-mb", type=float, metavar="MIB", help="cut each gradient bucket into allreduces of at most "
      "MIB MiB (default: 1 with --priority input-first, else 0 = whole buckets)")
    a("--backend", choices=CHOICES["backend"], help="array module (default numpy)")
    a("--tf32", action="store_true", default=None,
      help="let float32 matrix products on a GPU round to TF32 (faster on tensor cores, 10 mantissa bits): "
           "the same as REFIMPL_TF32=1 (docs/gpu.md, Precision); refused for --dtype float64")
    a("--cuda-aware", action="store_const", const=True, help="hand device buffers to MPI directly")
    a("--check-data", choices=CHOICES["check_data"], help="full (default): read and check every "
      "sample before training; lazy: check each batch as it is read")
    a("--no-normalize", dest="normalize", action="store_const", const=False,
      help="feed inputs as read (default: standardise each channel with the mean and std of the "
      "first 32 training samples)")
    a("--no-cache", dest="cache", action="store_const", const=False, help="re-read samples every epoch")
    a("--no-plot", dest="plot", action="store_const", const=False, help="do not write loss.png")
    a("--quiet", action="store_const", const=True, help="no progress bar or log lines (kept by --resume)")
    a("--no-quiet", dest="quiet", action="store_const", const=False,
      help="progress and log lines again (a run started --quiet keeps it across --resume otherwise)")
    a("--stall-timeout", type=float, metavar="SECONDS",
      help="end the job (exit 5) when a rank has sent no heartbeat, or no rank has moved on, for this "
           "long; the message names the silent ranks and where the others wait (default 600; 0 = off)")


FLAG_KEYS = ("model", "preset", "data", "generate", "gen_samples", "gen_val_samples", "grid", "global_batch",
             "steps", "epochs", "optimizer", "lr", "base_batch", "momentum", "nesterov", "weight_decay",
             "warmup_steps", "schedule", "decay", "dtype", "seed", "out", "resume", "overwrite", "break_lock",
             "data_changed_ok", "checkpoint_every", "validate_every", "log_every", "allreduce", "allreduce_options", "bucket_mb", "overlap",
             "optimizer_sharding", "compress", "error_feedback", "priority", "chunk_mb", "backend", "cuda_aware", "check_data", "cache", "normalize", "plot", "quiet", "stall_timeout")


def allreduce_options(texts) -> dict:
    """{name: value} of the ``--allreduce-option NAME=VALUE`` flags (the last of a name wins):
    NAME with '_' for '-', VALUE read as a TOML value (``4`` an int, ``0.5`` a float, ``true`` a
    bool, anything else the string itself), as the ``[allreduce_options]`` table would give it.
    Which names and values the algorithm takes is checked with the config (``config.validate``)."""
    import tomllib
    options = {}
    for text in texts:
        name, sep, value = text.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not name.isidentifier():
            raise ValueError(f"--allreduce-option must be NAME=VALUE (e.g. colors=4), got {text!r}")
        try:
            table = tomllib.loads(f"value = {value.strip()}")
            options[name] = table["value"] if list(table) == ["value"] else value.strip()
        except tomllib.TOMLDecodeError:
            options[name] = value.strip()
    return options


def given_settings(args) -> dict:
    """The settings named by --config and the flags (flags win); pure, raises ValueError."""
    from ..config import check_keys, load_toml
    given = {}
    if args.config:
        given = load_toml(args.config)
        check_keys(given, f"--config {args.config}")
        length = [k for k in ("steps", "epochs") if getattr(args, k) is not None]
        if len(length) == 1:     # a length flag replaces the file's length
            given.pop("epochs" if length[0] == "steps" else "steps", None)
    flags = {k: getattr(args, k) for k in FLAG_KEYS if getattr(args, k) is not None}
    if args.allreduce is not None and args.allreduce != given.get("allreduce"):
        given.pop("allreduce_options", None)      # the file's options were for another algorithm
    if "allreduce_options" in flags:              # over the file's, option by option
        table = given.get("allreduce_options", {})
        if not isinstance(table, dict):
            raise ValueError(f"--config {args.config}: allreduce_options must be a table of options, got {table!r}")
        flags["allreduce_options"] = {**table, **allreduce_options(flags["allreduce_options"])}
    given = {**given, **flags}
    for key in ("model_parallel", "norm"):     # model settings: they go into [model_config]
        if getattr(args, key) is not None:
            given["model_config"] = {**given.get("model_config", {}), key: getattr(args, key)}
    return given


def run(args) -> int:
    from mpi4py import MPI

    from ..failstop import run_command
    comm = MPI.COMM_WORLD
    return run_command("train", comm, lambda: train(args, comm), preemptible=True)


def train(args, comm) -> int:
    from ..config import merge
    from ..failstop import agree, set_stall_timeout
    from ..train import main
    given = agree(comm, given_settings, args)
    config = agree(comm, merge, given)
    set_stall_timeout(config["stall_timeout"])
    main(config, given, comm)
    return 0
