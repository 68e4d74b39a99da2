"""What ``refimpl datagen`` and ``refimpl convert`` share: writing a dataset into ``--out``.

Both write the splits of docs/data.md's layout into one directory, so they share its flags
(``add_output_arguments``; ``--workers``, the threads that make or read the samples while one
writes, resolved by ``worker_count``), the rule that one process writes them (``run_alone``),
and the checks around the writing (``writing_into``): ``OUT`` not inside a running job's
directory, ``OUT/.lock`` held, no existing split replaced without ``--overwrite``, and no split
of an earlier dataset left beside the new one.
"""
from __future__ import annotations

import contextlib
import os
import sys


#: ``--workers``' default: the cores this process may use, at most this many (the writer is one).
MAX_DEFAULT_WORKERS = 8


def add_output_arguments(parser, command: str, work: str) -> None:
    """The flags of a command that writes a dataset: its workers (``work``: what they do), layout,
    chunks, replacing, lock and progress."""
    parser.add_argument("--workers", type=int, default=None,
                        help=f"threads that {work} while one writes, in order: the output is the same for any "
                             f"count (default: the cores this process may use, at most {MAX_DEFAULT_WORKERS}; "
                             "each holds up to two samples)")
    parser.add_argument("--layout", choices=("single", "per-sample"), default="single",
                        help="one file per split (default) or one file per sample")
    parser.add_argument("--chunk", type=int, default=32,
                        help="spatial chunk edge in voxels (default 32; pick a divisor of your blocks)")
    parser.add_argument("--overwrite", action="store_true",
                        help=f"replace existing output (and take over the lock of a {command} that is gone)")
    parser.add_argument("--break-lock", action="store_true",
                        help=f"take over OUT/.lock left by a {command} that is gone (a live one is never broken)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def worker_count(args) -> int:
    """``args.workers``, its default resolved (``MAX_DEFAULT_WORKERS``); an InputError below 1."""
    from ..data.ordered_pool import usable_cores
    from ..errors import refuse
    workers = min(MAX_DEFAULT_WORKERS, usable_cores()) if args.workers is None else args.workers
    if workers < 1:
        refuse(f"--workers must be >= 1, got {workers}")
    return workers


def run_alone(command: str, write) -> int:
    """``write()`` under the fail-stop rules of a one-process command; started under mpiexec,
    every rank refuses before writing (P copies would race for OUT's lock and its files, and
    mpiexec ends the writer when a loser exits)."""
    from ..errors import InputError
    from ..failstop import run_command
    from ..watchdog import launcher_size

    def body():
        if launcher_size() > 1:
            raise InputError(f"refimpl {command} runs in one process (one writer per split): start it without "
                             "mpiexec", agreed=True)
        return write()
    return run_command(command, None, body)


@contextlib.contextmanager
def writing_into(args, command: str, targets):
    """The block that writes ``targets`` (the split paths) into ``args.out``: refuses (exit 2) an
    ``OUT`` inside a running job's directory, holds ``OUT/.lock``, refuses an existing target and
    a split of an earlier dataset that this one does not replace (another layout's, or a split
    not written now: ``layout.stale_splits``) without ``--overwrite``, and removes those once the
    block has written everything."""
    from ..data.layout import remove_splits, stale_splits
    from ..errors import refuse
    from ..run_lock import RunLock, describe_holder, live_lock_above
    above = live_lock_above(args.out)
    if above is not None:      # e.g. OUT/data of a running train: it reads (or generates) this data
        refuse(f"--out {args.out} lies in the directory of a running job ({describe_holder(above[1])}; lock: "
               f"{above[0]}), which may be reading this data: wait for it to end, or choose another --out")
    with RunLock(args.out).acquire(break_lock=args.break_lock or args.overwrite,
                                   how_to_break="--break-lock (or --overwrite)") as lock:
        if lock.note:
            print(f"refimpl {command}: note: {lock.note}", file=sys.stderr, flush=True)
        existing = [t for t in targets if os.path.exists(t)]      # looked at under the lock
        stale = stale_splits(args.out, targets)      # another layout's, or a split not written now
        if existing and not args.overwrite:
            refuse(f"{', '.join(existing)} exists; pass --overwrite to replace")
        if stale and not args.overwrite:
            refuse(f"{', '.join(stale)} from an earlier dataset would stay beside this one; pass --overwrite "
                   "to remove it")
        yield
        remove_splits(stale)                             # only once this dataset is complete


__all__ = ["MAX_DEFAULT_WORKERS", "add_output_arguments", "worker_count", "run_alone", "writing_into"]
