"""Fail-stop: a failure on any rank ends every rank within seconds, with one message.

An SPMD program has one rule that every failure path must keep: **no rank may
wait forever for a rank that will not come**.  A rank that raises and simply
exits leaves the others blocked in their next collective (and Python's
``MPI_Finalize`` at exit then blocks the failing rank too); a rank that is
stopped, or whose node vanished without MPI noticing, leaves them blocked with
no error at all.  refimpl closes both holes with the pieces below: this module
(agreement, fail-stop, the command wrapper) and the small ones it builds on.

0. **Decisions taken once** (``decide``, ``agree_settings``).  The rule: a branch
   whose outcome could differ between ranks is decided on rank 0 and broadcast
   before any rank acts on it, never re-derived by each rank from a shared file
   system (``os.path.exists``, ``glob``, ``os.listdir`` on OUT, the data
   directory, the checkpoint), where rank 0 or another job may be changing it at
   that moment: ``--overwrite`` used to deadlock 4 runs in 5 because rank 1 looked
   for the files rank 0 was deleting.  Checks that only *validate* (a path is
   writable, a file parses) may run on every rank, inside ``agree``.  The
   ``REFIMPL_*`` settings are read per rank (a per-node profile may differ) and
   agreed in the first collective of every command, before the watchdog's
   ``Dup``: a bad or differing value anywhere ends every rank with one line.
   ``tests/test_faults.py`` keeps the rule: a rank that sees nothing under OUT
   must end like the others.  A job also owns its output directory
   (``run_lock.RunLock``, ``OUT/.lock``).

1. **Agreed outcomes** (``agree``, ``on_root``).  Whatever can fail on bad input
   or I/O runs on every rank, and the outcomes are allgathered before anyone
   moves on: if one rank failed, *every* rank raises the same error (its
   ``agreed`` flag set), rank 0 prints one line, and all exit with the same
   code.  Where one rank writes for all (config, metrics, plots, checkpoints,
   ``--save``), rank 0 tries and broadcasts the outcome (``on_root``), so the
   others leave with the same message instead of waiting in the next collective.

2. **Fail-stop for what escapes** (``fail_stop``).  An exception raised on one
   rank only (a bug in a layer's forward, an I/O error nobody expected) cannot
   be agreed on: the others are already inside a halo exchange or an allreduce.
   The failing rank reports it to rank 0's watchdog, which prints the one
   message (rank and cause), tells every rank to exit with the same code, and
   finally calls ``MPI_Abort`` as the safety net — what ``python -m mpi4py``
   does for any uncaught exception.  ``install_excepthook`` routes uncaught
   exceptions (main thread and worker threads) here too.

3. **A watchdog with heartbeats** (refimpl/watchdog.py), for ranks that stop
   answering: one daemon thread per rank, on a private duplicate of the
   communicator, sends what the main thread is doing (refimpl/progress.py:
   *halo exchange of features.3 (forward)*, *gradient allreduce*) to rank 0,
   which names the ranks that stopped answering, or the phase every rank hangs
   in, and ends the job with ``EXIT_STALL``; rank 1 does the same for rank 0.

4. **Exit codes** (refimpl/errors.py), documented in docs/training.md ("Faults").
   Tracebacks are shown only with ``--debug`` or ``REFIMPL_DEBUG=1``.

5. **Signals** (refimpl/signals.py).  SIGINT and SIGTERM end the job at once,
   whatever the main thread is doing, with one line naming the signal, the step
   and the last checkpoint (temporaries and the lock removed first, refimpl/atomic.py);
   SIGUSR1, a scheduler's warning before pre-emption, makes ``refimpl train``
   checkpoint at the next step boundary on every rank and end with ``EXIT_PREEMPTED``.

How the anchors do it: ULFM (Open MPI 5, ``features/ulfm``) makes a failed
peer an error *returned* by MPI calls and lets the survivors revoke and shrink
the communicator — more than a trainer that restarts from its checkpoint
needs.  PyTorch's NCCL watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``,
``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``) is a thread that tears the process group
down when a collective exceeds its timeout, and its Flight Recorder names the
rank that diverged; Horovod's stall inspector (``HOROVOD_STALL_CHECK_TIME_SECONDS``,
60 s) warns with the ranks that did not submit a tensor.  The watchdog here is
the same idea at the granularity of phases, with the names of the layers.
"""
from __future__ import annotations

import sys
import threading
import traceback

from .errors import (EXIT_BAD_INPUT, EXIT_INTERRUPTED, ERRORS, InputError, InternalError, RunError, WriteError,
                     classify, describe)
from .progress import PROGRESS
from .signals import handle_signals
from .watchdog import DEFAULT_STALL_TIMEOUT, Watchdog, abort, running, world

DEBUG = False               # tracebacks shown (--debug, REFIMPL_DEBUG=1)


# ---------------------------------------------------------------- 1. agreed outcomes

def agree(comm, fn, *args, error=InputError, **kwargs):
    """Run ``fn`` on every rank; if it raised anywhere, raise on every rank (``agreed``).

    The outcomes are allgathered, so every rank leaves by the same path.  The
    error is the first failing rank's, suffixed with ``(rank r)`` unless every
    rank failed alike.  ValueError / OSError / KeyError / RuntimeError become
    ``error`` (InputError by default); other exceptions are bugs (InternalError).
    ``fn`` must not itself make collective calls that a failing rank would skip.
    """
    try:
        result, outcome = fn(*args, **kwargs), None
    except Exception as err:  # noqa: BLE001 - every failure must reach the other ranks
        if DEBUG:
            traceback.print_exc()
        result, outcome = None, (classify(err, error).__name__, describe(err))
    outcomes = comm.allgather(outcome)
    failed = [(rank, o) for rank, o in enumerate(outcomes) if o is not None]
    if failed:
        rank, (cls_name, message) = failed[0]
        alike = len({o for _, o in failed}) == 1 and len(failed) == len(outcomes)
        raise ERRORS[cls_name](message + ("" if alike else f" (rank {rank})"), agreed=True)
    return result


def on_root(comm, fn, *args, error=WriteError, root=0, **kwargs):
    """Run ``fn`` on ``root`` only (it writes for everyone) and broadcast the outcome.

    Every rank returns together, or every rank raises ``error`` with root's
    message: no rank is left waiting in the next collective.  Returns ``fn``'s
    result on root, None elsewhere.
    """
    return _root_runs(comm, fn, args, kwargs, error, root, share=False)


def decide(comm, fn, *args, error=InputError, root=0, **kwargs):
    """A decision every rank acts on, taken once: ``fn`` runs on ``root``, its result is broadcast.

    The rule of this module for the file system: a branch whose outcome could
    differ between ranks (does OUT hold a run? is there generated data? is there
    a validation split?) is never re-derived by each rank from a shared file
    system, where another rank (or another job) may be changing it at that very
    moment: rank 0 looks, every rank follows (ULFM's agreement, Horovod's
    coordinator).  Returns ``fn``'s result on every rank, or raises ``error``
    with root's message on every rank.
    """
    return _root_runs(comm, fn, args, kwargs, error, root, share=True)


def _root_runs(comm, fn, args, kwargs, error, root, share):
    result, outcome = None, None
    if comm.Get_rank() == root:
        try:
            result = fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001
            if DEBUG:
                traceback.print_exc()
            outcome = (classify(err, error).__name__, describe(err))
    from .parallel.objects import bcast_object
    outcome, shared = bcast_object(comm, (outcome, result if share else None), root=root)
    if outcome is not None:
        raise ERRORS[outcome[0]](outcome[1], agreed=True)
    return shared if share else result


# ---------------------------------------------------------------- 0. settings agreed before the first message

_settings = (None, {})          # (this rank's REFIMPL_* error or None, {name: parsed value})


def note_settings(error: str | None, values: dict | None) -> None:
    """What this rank found checking its ``REFIMPL_*`` variables (``cli.main``, before MPI starts)."""
    global _settings
    from .settings import SETTINGS
    shared = {k: v for k, v in (values or {}).items() if not SETTINGS[k].test_only}
    _settings = (error, shared)


def agree_settings(comm) -> None:
    """The first collective of every command: every rank's settings outcome, allgathered once.

    mpiexec normally gives every rank the same environment, but a per-node
    profile, a wrapper or a module load may not: a rank that refused its
    ``REFIMPL_*`` value alone would leave the others blocked in their first
    collective.  So each rank only *notes* its outcome, and here every rank
    learns every outcome and every value: a bad value anywhere, or a value that
    differs between ranks (the ranks would run different code: threads, conv
    algorithms, device paths), raises the same ``InputError`` on every rank.
    """
    outcomes = comm.allgather(_settings)
    failed = [(rank, error) for rank, (error, _) in enumerate(outcomes) if error is not None]
    if failed:
        rank, error = failed[0]
        alike = len(failed) == len(outcomes) and len({e for _, e in failed}) == 1
        raise InputError(error + ("" if alike else f" (rank {rank})"), agreed=True)
    names = sorted({name for _, values in outcomes for name in values})
    for name in names:
        seen = [values.get(name) for _, values in outcomes]
        if len({repr(v) for v in seen}) > 1:
            rank = next(r for r, v in enumerate(seen) if repr(v) != repr(seen[0]))
            raise InputError(f"{name} differs between ranks: rank {rank} has {_shown(seen[rank])}, rank 0 has "
                             f"{_shown(seen[0])}; every rank must run with the same REFIMPL_* settings", agreed=True)


def _shown(value) -> str:
    return "the default (unset)" if value is None else repr(value)


# ---------------------------------------------------------------- 2. fail-stop and the command wrapper

def fail_stop(command: str, err: BaseException, rank: int, size: int) -> int:
    """An exception on this rank only: end every rank with one message.  Returns only when alone."""
    if isinstance(err, KeyboardInterrupt):
        code, text = EXIT_INTERRUPTED, f"refimpl {command}: interrupted on rank {rank}"
    else:
        cls = classify(err, WriteError if isinstance(err, OSError) else
                       InputError if isinstance(err, (ValueError, KeyError)) else InternalError)
        code = cls.exit_code
        hint = " (a bug; --debug or REFIMPL_DEBUG=1 shows the traceback)" if cls is InternalError and not DEBUG else ""
        where = f" during {PROGRESS.where()}" if PROGRESS.phase != "start-up" else ""
        cause = describe(err) if cls is not InternalError else f"{type(err).__name__}: {describe(err)}"
        text = f"refimpl {command}: {cls.label} on rank {rank}{where}{hint}: {cause}"
    if DEBUG:
        traceback.print_exception(err)
    if size == 1:
        print(text, file=sys.stderr, flush=True)
        return code
    watchdog = running()
    if watchdog is not None:
        watchdog.report(code, text)
    print(text, file=sys.stderr, flush=True)
    abort(code)
    return code                                       # not reached


def run_command(command: str, comm, body, *, stall_timeout: float = DEFAULT_STALL_TIMEOUT,
                preemptible: bool = False) -> int:
    """Run ``body()`` (returns an exit code) on every rank of ``comm`` under the fail-stop rules
    (``comm`` None: a command of one process).

    Agreed errors: rank 0 prints one line, every rank returns the code.  Anything
    else raised on a rank ends the job from that rank (``fail_stop``).  A
    watchdog thread runs alongside when there is more than one rank.
    """
    rank, size = (0, 1) if comm is None else (comm.Get_rank(), comm.Get_size())
    if comm is None and _settings[0] is not None:          # a one-process command: no one to agree with
        print(f"refimpl {command}: error: {_settings[0]}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    try:
        if comm is not None:
            agree_settings(comm)          # before any other message: the watchdog's Dup included
    except InputError as err:
        if rank == 0:
            print(f"refimpl {command}: {err.label}: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    watchdog = Watchdog(comm, command, stall_timeout).start() if size > 1 else None
    signals = handle_signals(command, preemptible)
    try:
        code = body() or 0
    except RunError as err:
        if not err.agreed:
            return fail_stop(command, err, rank, size)
        if rank == 0:
            print(f"refimpl {command}: {err.label}: {err}", file=sys.stderr, flush=True)
        code = err.exit_code
    except BaseException as err:  # noqa: BLE001 - KeyboardInterrupt and SystemExit included
        if isinstance(err, SystemExit) and size == 1:
            raise
        return fail_stop(command, err, rank, size)
    finally:
        if signals is not None:
            signals.close()
    if watchdog is not None:
        watchdog.stop()
    return code


def set_stall_timeout(seconds: float) -> None:
    """Change the running watchdog's stall timeout (the command read it from its settings)."""
    watchdog = running()
    if watchdog is not None:
        watchdog.configure(seconds)


def install_excepthook(command: str = "") -> None:
    """Safety net: an uncaught exception in any thread ends the whole job (as ``python -m mpi4py``)."""
    def hook(kind, value, tb):
        if DEBUG:
            traceback.print_exception(kind, value, tb)
        rank, size = world()
        code = fail_stop(command or "refimpl", value, rank, size)
        abort(code)              # alone too: end here, never return into the loop that failed

    def thread_hook(args):
        hook(args.exc_type, args.exc_value, args.exc_traceback)

    sys.excepthook = hook
    threading.excepthook = thread_hook


__all__ = ["DEBUG", "agree", "on_root", "decide", "note_settings", "agree_settings", "fail_stop", "run_command",
           "set_stall_timeout", "install_excepthook"]
