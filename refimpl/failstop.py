"""Fail-stop: a failure on any rank ends every rank within seconds, with one message.

An SPMD program has one rule that every failure path must keep: **no rank may
wait forever for a rank that will not come**.  A rank that raises and simply
exits leaves the others blocked in their next collective (and Python's
``MPI_Finalize`` at exit then blocks the failing rank too); a rank that is
stopped, or whose node vanished without MPI noticing, leaves them blocked with
no error at all.  refimpl closes both holes with the pieces below, each small
enough to read here.

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

3. **A watchdog with heartbeats** (``Watchdog``), for ranks that stop
   answering.  Every rank runs one daemon thread on a private duplicate of the
   communicator (its messages never match the program's).  The main thread
   records what it is doing in ``PROGRESS`` (two stores and an increment per
   phase: *halo exchange of features.3 (forward)*, *gradient allreduce*,
   *checkpoint write*); every ``interval`` the thread sends that record to rank 0
   (rank 0 sends its own to everyone).  Rank 0 declares a stall when a rank has
   sent nothing for ``timeout`` seconds (a stopped process, a lost node: its
   watchdog thread is stopped too) or when no rank has moved to a new phase for
   ``timeout`` seconds (a deadlock or a hang inside one phase); it names the
   ranks that stopped answering and the phase the others wait in, and ends the
   job with ``EXIT_STALL``.  Rank 1 does the same for rank 0.  The thread only
   ever uses non-blocking calls (``isend``, ``improbe``) and sleeps between
   polls: Open MPI's blocking receive would spin a core.

4. **Exit codes** documented in docs/training.md ("Faults"): 0 done, 1 a check
   failed (``check-layer``), 2 bad input, 3 divergence, 4 I/O failure, 5 stall,
   70 internal error (a bug), 130 / 143 interrupted by SIGINT / SIGTERM, 138 checkpointed
   and ended on a pre-emption warning (SIGUSR1, ``refimpl train`` only).
   Tracebacks are shown only with ``--debug`` or ``REFIMPL_DEBUG=1``.

5. **Signals** (``SignalThread``).  SIGINT and SIGTERM are read from Python's
   wake-up pipe by a thread of their own, at once, whatever the main thread is
   doing; temporaries and the lock are removed first (Open MPI's mpiexec sends
   SIGKILL 0.5 s after it was interrupted), then the job ends as for a failure
   on one rank, with one line naming the signal, the step and the last checkpoint.
   SIGUSR1, a scheduler's warning before pre-emption or the time limit (``sbatch
   --signal=USR1@60``), only sets a flag (``preemption_requested``) for commands
   that ask for it (``run_command(..., preemptible=True)``: ``refimpl train``):
   the loop agrees on it at the next step boundary, every rank writes the
   checkpoint at that same step, and the job ends with ``EXIT_PREEMPTED``.

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

import os
import sys
import threading
import time
import traceback

from .paths import refuse_special

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_IO = 4
EXIT_STALL = 5
EXIT_INTERNAL = 70          # EX_SOFTWARE (sysexits.h): a bug, not the user's input
EXIT_INTERRUPTED = 130
EXIT_PREEMPTED = 138        # 128 + SIGUSR1 (10 on Linux): checkpointed at a pre-emption warning

DEFAULT_STALL_TIMEOUT = 600.0
GRACE_S = 2.0               # how long a failing rank waits for rank 0 to end the job for it


class RunError(Exception):
    """A failure that ends the command with ``exit_code``; ``agreed``: raised on every rank."""

    exit_code, label = EXIT_INTERNAL, "internal error"

    def __init__(self, message, *, agreed=False):
        super().__init__(message)
        self.agreed = agreed


class InputError(RunError):
    """Bad input: a flag, a setting, a data file, a path that cannot be written."""

    exit_code, label = EXIT_BAD_INPUT, "error"


class Diverged(RunError):
    """The loss became NaN or Inf (decided collectively, before the update)."""

    exit_code, label = EXIT_DIVERGED, "stopped"


class WriteError(RunError):
    """An output could not be written (disk full, file-size limit, a path that went away)."""

    exit_code, label = EXIT_IO, "I/O error"


class Preempted(RunError):
    """A pre-emption warning (SIGUSR1) arrived: the checkpoint is written, resume with --resume."""

    exit_code, label = EXIT_PREEMPTED, "pre-empted"


class InternalError(RunError):
    """An exception nobody expected: a bug (``--debug`` shows the traceback)."""


# ---------------------------------------------------------------- 1. agreed outcomes

def describe(err: BaseException) -> str:
    """One line for an exception: its message, or its type when the message is empty."""
    if isinstance(err, RunError):
        return str(err)
    if isinstance(err, OSError) and err.strerror:
        where = f" at {err.filename}" if err.filename else ""
        return f"{err.strerror}{where}"
    text = str(err) if not isinstance(err, KeyError) else str(err.args[0] if err.args else "")
    return text or type(err).__name__


def classify(err: BaseException, error=InputError) -> type:
    """The RunError class an exception becomes: its own, ``error`` for the expected kinds, else internal."""
    if isinstance(err, RunError):
        return type(err)
    if isinstance(err, (ValueError, OSError, KeyError, RuntimeError)):
        return error
    return InternalError


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
        raise _ERRORS[cls_name](message + ("" if alike else f" (rank {rank})"), agreed=True)
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
        raise _ERRORS[outcome[0]](outcome[1], agreed=True)
    return shared if share else result


_ERRORS = {cls.__name__: cls for cls in (RunError, InputError, Diverged, WriteError, InternalError)}


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


def refuse(message: str):
    """Raise InputError for bad input that every rank finds identically (no message needed to agree)."""
    raise InputError(message, agreed=True)


def check_writable(path, what: str, directory: bool = False) -> None:
    """Raise ValueError unless ``path`` can be written (created) by this process.

    A path named on the command line that cannot be written is bad input, found
    before the first message: the nearest existing ancestor must be a directory
    we may write in, and ``path`` itself, if it exists, must be a directory
    (``directory=True``) or a regular file we may overwrite.  Names the file
    system cannot hold (a component over NAME_MAX, a path over PATH_MAX) and
    dangling symbolic links are refused here rather than failing mid-run.  A
    file that is a symbolic link is refused too: refimpl writes files atomically
    (a new file renamed over the old one), which would replace the link by a
    regular file and leave its target stale.
    """
    path = os.path.abspath(os.fspath(path))
    _check_name_lengths(path, what)
    refuse_special(path, what)                # a FIFO or a device would be replaced (or block)
    if os.path.islink(path) and not os.path.exists(path):
        raise ValueError(f"{what} {path} is a dangling symbolic link (to {os.readlink(path)})")
    if os.path.exists(path):
        if directory and not os.path.isdir(path):
            raise ValueError(f"{what} {path} exists and is not a directory")
        if not directory and os.path.isdir(path):
            raise ValueError(f"{what} {path} is a directory, not a file")
        if not directory and os.path.islink(path):
            raise ValueError(f"{what} {path} is a symbolic link (to {os.readlink(path)}): refimpl replaces "
                             "its files atomically, which would replace the link; give the target's path")
        target = path if directory else os.path.dirname(path)
        if not os.access(target, os.W_OK | os.X_OK) or (not directory and not os.access(path, os.W_OK)):
            raise ValueError(f"{what} {path} is not writable")
        return
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        if os.path.islink(parent):
            raise ValueError(f"{what} {path} cannot be created: {parent} is a dangling symbolic link "
                             f"(to {os.readlink(parent)})")
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"{what} {path} cannot be created: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {path} cannot be created: {parent} is not writable")


def _check_name_lengths(path: str, what: str) -> None:
    """ValueError for a path the file system cannot hold (ENAMETOOLONG mid-run otherwise)."""
    encoded = os.fsencode(path)
    limit = _path_limit("PC_PATH_MAX", 4096)
    if len(encoded) >= limit:
        raise ValueError(f"{what} is {len(encoded)} bytes long, over the file system's limit of {limit - 1} "
                         f"(PATH_MAX): {path[:60]}...")
    name_max = _path_limit("PC_NAME_MAX", 255)
    for part in path.split(os.sep):
        if len(os.fsencode(part)) > name_max:
            raise ValueError(f"{what} {path[:60]}...: the name {part[:40]}... is {len(os.fsencode(part))} "
                             f"bytes long, over the file system's limit of {name_max} (NAME_MAX)")


def _path_limit(name: str, default: int) -> int:
    try:
        return os.pathconf("/", name)
    except (OSError, ValueError):
        return default


# ---------------------------------------------------------------- 3. what the main thread is doing

class Progress:
    """The main thread's current phase, read by the watchdog thread (GIL-atomic stores)."""

    __slots__ = ("count", "step", "phase", "layer", "names", "saved")

    def __init__(self):
        self.count, self.step, self.phase, self.layer, self.names = 0, None, "start-up", None, {}
        self.saved = None        # what an interrupted run keeps: 'the last checkpoint is step 40'

    def where(self) -> str:
        """'halo exchange of features.3 (forward) at step 12'."""
        text = self.phase
        if self.layer is not None:
            name = self.names.get(id(self.layer)) or type(self.layer).__name__
            text = text.replace("{layer}", name)
        return text + (f" at step {self.step}" if self.step is not None else "")


PROGRESS = Progress()


def phase(what: str, layer=None) -> None:
    """Record that the main thread now does ``what`` ('{layer}' is replaced by ``layer``'s name)."""
    p = PROGRESS
    p.phase, p.layer = what, layer
    p.count += 1


def set_step(step) -> None:
    PROGRESS.step = step
    PROGRESS.count += 1


def label_layers(model) -> None:
    """Name the layers of ``model`` for stall messages (PyTorch-style dotted names)."""
    PROGRESS.names = {id(m): name or type(m).__name__ for name, m in model.named_modules()}


_cleanups: set = set()


def remove_on_abort(path) -> None:
    """Delete ``path`` if the job is ended while it exists (a temporary file being written)."""
    _cleanups.add(os.fspath(path))


def forget_on_abort(path) -> None:
    _cleanups.discard(os.fspath(path))


def _clean_up() -> None:
    import shutil
    for path in list(_cleanups):
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)         # a per-sample dataset being built
            else:
                os.remove(path)
        except OSError:
            pass


def atomic_write(path, write, *, binary: bool = False, fsync: bool = False) -> None:
    """``write(file)`` into a temporary beside ``path``, then rename it over ``path``.

    ``path`` is either untouched or complete: a failure (disk full, EFBIG) removes
    the temporary and re-raises; an abort of the job meanwhile removes it too
    (``remove_on_abort``).  ``fsync``: flush to the disk before the rename (and the
    directory after it), for files a crash must not lose.
    """
    path = os.fspath(path)
    refuse_special(path, "output")            # never replace a device node, FIFO or socket
    tmp = f"{path}.tmp-{os.getpid()}"
    remove_on_abort(tmp)
    try:
        with open(tmp, "wb" if binary else "w") as f:
            write(f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(err, OSError) and err.filename in (None, tmp):   # name the file meant
            raise OSError(err.errno, err.strerror, path) from None
        raise
    finally:
        forget_on_abort(tmp)
    if fsync:
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ---------------------------------------------------------------- the watchdog thread

_BEAT, _FAIL, _ABORT = 11, 12, 13         # tags on the watchdog's private communicator


class Watchdog:
    """Heartbeats, stall detection and the fail-stop channel; one daemon thread per rank.

    ``timeout`` seconds without a heartbeat from a rank, or without any rank
    entering a new phase, is a stall (0: stall detection off; the fail-stop
    channel still runs).  Heartbeats go every ``interval`` = timeout / 5
    (0.05 to 5 s); the inbox is polled at least every 0.2 s, so an abort
    reaches every live rank within a fraction of a second.
    """

    def __init__(self, comm, command: str, timeout: float = DEFAULT_STALL_TIMEOUT):
        self.comm = comm.Dup()
        self.command = command
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.configure(timeout)
        self.state = [(0, "start-up")] * self.size    # (progress count, where) per rank
        self.sends = {}                               # dest -> pending request (at most one each)
        self.ending = False
        self.last_loop = time.monotonic()             # when the thread last ran its loop
        self.thawed = None                            # when it last found its process had been frozen
        self._pending = []                            # requests of the abort / fail messages (kept alive)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="refimpl-watchdog", daemon=True)

    def configure(self, timeout: float) -> None:
        """Set the timeout; every rank's clock restarts (they all call this at the same point)."""
        self.timeout = float(timeout)
        self.interval = heartbeat_interval(self.timeout)
        self.poll = min(0.2, self.interval)
        now = time.monotonic()
        self.last_beat = [now] * self.size            # when each rank's last heartbeat arrived
        self.last_change = [now] * self.size          # when each rank last entered a new phase
        self.next_beat = now                          # beat at once with the new interval

    # ------------------------------------------------------------ life cycle
    def start(self) -> "Watchdog":
        global _watchdog
        _watchdog = self
        self._thread.start()
        return self

    def stop(self) -> None:
        """Collective, on the normal path: stop the thread, then drain so MPI_Finalize finds nothing pending."""
        global _watchdog
        self._stop.set()
        self._thread.join()
        deadline = time.monotonic() + 5.0
        for req in self.sends.values():
            while not req.Test() and time.monotonic() < deadline:
                time.sleep(0.001)
        self.comm.Barrier()
        while (message := self.comm.improbe()) is not None:    # heartbeats sent before the barrier
            message.recv()
        self.comm.Free()
        _watchdog = None

    # ------------------------------------------------------------ the thread
    def _loop(self) -> None:
        self.last_loop = time.monotonic()
        while not self._stop.wait(self.poll):
            try:
                self._receive()
                now = time.monotonic()
                if now >= self.next_beat:
                    self._beat()
                    self.next_beat = now + self.interval
                if self_frozen(self.last_loop, now, self.timeout):
                    # this process itself did not run for a while (SIGSTOP then SIGCONT, a frozen
                    # VM): the silence it sees is its own; its peers judge it, it restarts its
                    # clocks instead of accusing them
                    self.last_beat = [now] * self.size
                    self.last_change = [now] * self.size
                    self.thawed = now
                elif self.timeout > 0 and not self.ending:
                    self._check(now)
                self.last_loop = now
            except Exception as err:  # noqa: BLE001 - the watchdog must never die silently
                print(f"refimpl {self.command}: watchdog on rank {self.rank} failed: {describe(err)}",
                      file=sys.stderr, flush=True)
                return

    def _send(self, dest: int, tag: int, payload) -> None:
        pending = self.sends.get(dest)
        if pending is not None and not pending.Test():
            return                                   # the last one is not delivered: do not pile up
        self.sends[dest] = self.comm.isend(payload, dest=dest, tag=tag)

    def _beat(self) -> None:
        """Rank 0 tells everyone (rank 1 watches it); the others tell rank 0 (rank 0 notes itself
        in ``_check``)."""
        record = (PROGRESS.count, PROGRESS.where())
        for dest in (range(1, self.size) if self.rank == 0 else (0,)):
            self._send(dest, _BEAT, record)

    def _note(self, rank: int, record, now: float) -> None:
        self.last_beat[rank] = now
        if record[0] != self.state[rank][0]:
            self.last_change[rank] = now
        self.state[rank] = record

    def _receive(self) -> None:
        from mpi4py import MPI
        status = MPI.Status()
        while True:
            message = self.comm.improbe(status=status)
            if message is None:
                return
            payload, source, tag = message.recv(), status.Get_source(), status.Get_tag()
            if tag == _BEAT:
                self._note(source, payload, time.monotonic())
            elif tag == _ABORT:
                self._exit_quietly(payload)
            elif tag == _FAIL and self.rank == 0 and not self.ending:
                code, line = payload
                self.end_job(code, line)

    # ------------------------------------------------------------ stalls
    def _check(self, now: float) -> None:
        if self.rank == 0:
            self._note(0, (PROGRESS.count, PROGRESS.where()), now)
        found = self.verdict(now)
        if found is not None:
            self.end_job(EXIT_STALL, found)

    def verdict(self, now: float) -> str | None:
        """The stall message at time ``now`` from the heartbeats seen so far, or None (no stall).

        Rank 0 judges every rank: a stall when a rank has sent nothing for
        ``timeout`` or no rank has entered a new phase for ``timeout``; it then
        names every rank whose heartbeats stopped (3 intervals late) and groups the
        others by the phase they wait in.  Rank 1 judges rank 0 alone (the others
        give rank 1 three more intervals before they speak themselves).
        """
        if self.rank != 0:
            silent = now - self.last_beat[0]
            if silent >= self.timeout and self.rank == 1 or silent >= self.timeout + 3 * self.interval:
                return (self._label("stalled") +
                        f"rank 0 stopped answering (no heartbeat for {silent:.1f} s: a stopped process or "
                        f"a lost node); rank {self.rank} waits in {PROGRESS.where()}. Ending the job "
                        f"(--stall-timeout {self.timeout:g})")
            return None
        idle = min(now - t for t in self.last_change)
        if idle < self.timeout and all(now - t < self.timeout for t in self.last_beat[1:]):
            return None
        silent = [r for r in range(1, self.size) if now - self.last_beat[r] >= min(self.timeout, 3 * self.interval)]
        live = [r for r in range(self.size) if r not in silent]
        if silent:
            waited = max(now - self.last_beat[r] for r in silent)
            cause = (f"{_ranks(silent)} stopped answering (no heartbeat for {waited:.1f} s: a stopped "
                     f"process or a lost node)")
            others = _group_by_phase(live, self.state)
            tail = f"; {others}" if others else ""
        else:
            groups = {}
            for r in live:
                groups.setdefault(self.state[r][1], []).append(r)
            ordered = sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[1]))
            if len(ordered) == 1:
                cause = f"every rank has waited {idle:.1f} s in {ordered[0][0]} (a deadlock or a hang there)"
                tail = ""
            else:
                (where, ranks), rest = ordered[0], ordered[1:]
                cause = f"{_ranks(ranks)} made no progress for {idle:.1f} s in {where}"
                tail = "; " + "; ".join(f"{_ranks(rs)} wait in {w}" for w, rs in rest)
        return (self._label("stalled") + cause + tail +
                f". Ending the job (--stall-timeout {self.timeout:g})")

    def _label(self, label: str) -> str:
        return f"refimpl {self.command}: {label}: "

    # ------------------------------------------------------------ ending the job
    def end_job(self, code: int, line: str) -> None:
        """Print ``line`` (once), tell every rank to exit with ``code``, then MPI_Abort as the safety net."""
        if self.ending:
            return
        self.ending = True
        _clean_up()        # first: the launcher may kill this process the moment another rank has left
        print(line, file=sys.stderr, flush=True)
        for dest in range(self.size):
            if dest != self.rank:
                self._pending.append(self.comm.isend(code, dest=dest, tag=_ABORT))
        deadline = time.monotonic() + 0.5             # let the live ranks leave on their own
        while time.monotonic() < deadline:
            time.sleep(0.05)
        _abort(code)

    def report(self, code: int, line: str) -> None:
        """From the main thread of a failing rank: have rank 0 end the job (or do it ourselves)."""
        if self.rank == 0:
            self.end_job(code, line)
        self.ending = True
        self._pending.append(self.comm.isend((code, line), dest=0, tag=_FAIL))
        deadline = time.monotonic() + GRACE_S         # rank 0's abort ends this process meanwhile
        while time.monotonic() < deadline:
            self._receive()
            time.sleep(0.02)
        self.ending = False
        self.end_job(code, line)                      # rank 0 did not answer: it is gone or stuck

    def was_frozen(self, now: float) -> bool:
        """Whether this process was stopped just now (or is resuming from it at this moment): the
        launcher continues (SIGCONT) and terminates (SIGTERM) a stopped rank its peers have named."""
        return self_frozen(self.last_loop, now, self.timeout) or \
            (self.thawed is not None and now - self.thawed < 2 * self.interval + 1.0)

    def _exit_quietly(self, code: int) -> None:
        _leave()
        os._exit(code)


def heartbeat_interval(timeout: float) -> float:
    """Seconds between heartbeats: a fifth of the stall timeout, 0.05 to 5 s (1 s with stall
    detection off: the fail-stop channel still polls)."""
    return min(5.0, max(0.05, timeout / 5)) if timeout > 0 else 1.0


def self_frozen(previous: float, now: float, timeout: float) -> bool:
    """Whether the watchdog thread itself did not run for two heartbeat intervals (at least 1 s;
    its process was stopped or frozen): then its own view of who is silent is void.

    Why not a whole timeout: the peers name a stopped rank 0 after ``timeout`` seconds without
    its heartbeat, which left up to one interval before it stopped; Open MPI then continues it
    (SIGCONT) before killing it, so it may have been stopped for only ``timeout - interval`` and
    would blame the healthy ranks a moment before it dies: a second, contradicting verdict.
    Its own loop runs every 0.2 s, so a gap of two intervals is a freeze, never a busy rank.
    """
    if timeout <= 0:
        return False
    return now - previous >= min(timeout, max(1.0, 2 * heartbeat_interval(timeout)))


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + _span(ranks)


def _span(ranks) -> str:
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(parts)


def _group_by_phase(ranks, state) -> str:
    groups = {}
    for r in ranks:
        groups.setdefault(state[r][1], []).append(r)
    return "; ".join(f"{_ranks(rs)} {'waits' if len(rs) == 1 else 'wait'} in {w}" for w, rs in groups.items())


_watchdog: Watchdog | None = None
DEBUG = False


def _leave() -> None:
    """What every way out of the job does first: remove temporaries being written, flush output."""
    _clean_up()
    sys.stdout.flush()
    sys.stderr.flush()


def launcher_size() -> int:
    """How many processes the launcher started (1 when not under one), without starting MPI."""
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 1


def _mpi_running() -> bool:
    """Whether this process started MPI (one-process commands never import mpi4py.MPI)."""
    MPI = sys.modules.get("mpi4py.MPI")
    return MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized()


def _world() -> tuple[int, int]:
    """(rank, size) of COMM_WORLD, or (0, 1) without MPI."""
    if not _mpi_running():
        return 0, 1
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def _abort(code: int) -> None:
    _leave()
    if not _mpi_running() or _world()[1] == 1 and launcher_size() == 1:    # no launcher to tell
        os._exit(code)
    from mpi4py import MPI
    MPI.COMM_WORLD.Abort(code)


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
    if _watchdog is not None:
        _watchdog.report(code, text)
    print(text, file=sys.stderr, flush=True)
    _abort(code)
    return code                                       # not reached


# ---------------------------------------------------------------- 5. signals

INTERRUPTS = ("SIGINT", "SIGTERM")
PREEMPTION = "SIGUSR1"
_preemption = threading.Event()


def preemption_requested() -> bool:
    """Whether SIGUSR1 reached this rank (a command that asked for it decides with its peers)."""
    return _preemption.is_set()


def _interrupted(signum: int, command: str) -> None:
    """A SIGINT / SIGTERM arrived: one line, every rank ends with 128 + the signal number.

    Runs on the signal thread, not in a Python signal handler: the main thread may
    be inside a GEMM or an MPI wait for a long time, and Open MPI's mpiexec, when
    it is interrupted or cancelled, sends the ranks SIGCONT, SIGTERM 0.25 s later
    and SIGKILL 0.25 s after that.  So the temporaries (a checkpoint being
    written, the run's lock) are removed first, then the line, then the job ends
    as for any failure on one rank (``Watchdog.report``: rank 0 prints and aborts).
    """
    import signal
    _clean_up()
    name = signal.Signals(signum).name
    rank, size = _world()
    step = f" at step {PROGRESS.step}" if PROGRESS.step is not None else f" during {PROGRESS.where()}"
    kept = f"; {PROGRESS.saved}" if PROGRESS.saved else ""
    line = f"refimpl {command}: interrupted by {name} on rank {rank}{step}{kept}"
    code = 128 + signum
    if _watchdog is not None and _watchdog.was_frozen(time.monotonic()):
        _leave()                 # a stopped rank, named by its peers, now ended by the launcher: no second line
        os._exit(code)
    if size > 1 and _watchdog is not None:
        _watchdog.report(code, line)
    print(line, file=sys.stderr, flush=True)
    _abort(code)


class SignalThread:
    """SIGINT and SIGTERM handled on a thread of their own, at once, whatever the main thread does.

    The C-level handler that Python installs writes the signal's number into the
    wake-up file descriptor (``signal.set_wakeup_fd``) the moment the signal
    arrives; this thread blocks on that pipe and ends the job.  The Python-level
    handler, which the main thread runs at its next bytecode, parks the main
    thread: from then on it starts no step, no collective and no write (a
    checkpoint begun after the signal would race the clean-up), and it cannot
    finish the run and exit 0 while the job is being ended.
    """

    def __init__(self, command: str, preemptible: bool = False):
        import signal
        self.command = command
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        self.previous = {name: signal.signal(getattr(signal, name), _park) for name in INTERRUPTS}
        if preemptible:            # SIGUSR1 no longer kills the process: the thread sets the flag
            self.previous[PREEMPTION] = signal.signal(getattr(signal, PREEMPTION), _note)
        _preemption.clear()
        self.previous_fd = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        self.thread = threading.Thread(target=self._wait, name="refimpl-signals", daemon=True)
        self.thread.start()

    def _wait(self) -> None:
        import signal
        wanted = {int(getattr(signal, name)) for name in INTERRUPTS}
        while True:
            try:
                data = os.read(self.read_fd, 64)
            except OSError:
                return                       # closed: the command ended normally
            if not data:
                return
            for signum in data:
                if signum in wanted:
                    _interrupted(signum, self.command)
                elif signum == int(getattr(signal, PREEMPTION)) and PREEMPTION in self.previous:
                    _preemption.set()

    def close(self) -> None:
        """Give the signals back (the command ended); a signal from now on acts as before.

        The write end is closed first, so the thread's read returns end-of-file and the
        thread ends; only then is the read end closed.  Closed the other way round, a thread
        between two reads would read whatever file next got the read end's number (an
        HDF5 file's bytes 2 or 15 then read as SIGINT / SIGTERM: a command run after this
        one in the same process ended with 130)."""
        import signal
        signal.set_wakeup_fd(self.previous_fd)
        for name, handler in self.previous.items():
            signal.signal(getattr(signal, name), handler)
        os.close(self.write_fd)
        self.thread.join(timeout=5.0)
        if not self.thread.is_alive():       # still ending the job (a signal came): leave it its pipe
            os.close(self.read_fd)


def _note(signum, frame) -> None:
    """The main thread's SIGUSR1 handler: set the flag too.  The signal thread sets it as soon as
    it gets the GIL; this runs at the main thread's next bytecode, so the step during which the
    warning arrived sees it at its end whatever the other threads do."""
    _preemption.set()


def _park(signum, frame) -> None:
    """The main thread's handler: wait here while the signal thread ends the job."""
    while True:
        time.sleep(3600)


def handle_signals(command: str, preemptible: bool = False) -> SignalThread | None:
    """SIGINT / SIGTERM end the command with one line (130 / 143); with ``preemptible``, SIGUSR1
    sets ``preemption_requested``.  None off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return SignalThread(command, preemptible)


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
    if _watchdog is not None:
        _watchdog.configure(seconds)


def install_excepthook(command: str = "") -> None:
    """Safety net: an uncaught exception in any thread ends the whole job (as ``python -m mpi4py``)."""
    def hook(kind, value, tb):
        if DEBUG:
            traceback.print_exception(kind, value, tb)
        rank, size = _world()
        code = fail_stop(command or "refimpl", value, rank, size)
        _abort(code)              # alone too: end here, never return into the loop that failed

    def thread_hook(args):
        hook(args.exc_type, args.exc_value, args.exc_traceback)

    sys.excepthook = hook
    threading.excepthook = thread_hook


__all__ = ["EXIT_OK", "EXIT_CHECK_FAILED", "EXIT_BAD_INPUT", "EXIT_DIVERGED", "EXIT_IO", "EXIT_STALL",
           "EXIT_INTERNAL", "EXIT_INTERRUPTED", "EXIT_PREEMPTED", "DEFAULT_STALL_TIMEOUT", "RunError", "InputError",
           "Diverged", "Preempted", "preemption_requested",
           "WriteError", "InternalError", "agree", "on_root", "decide", "refuse", "check_writable", "PROGRESS",
           "phase", "set_step", "label_layers", "remove_on_abort", "forget_on_abort", "atomic_write", "Watchdog",
           "fail_stop", "run_command", "set_stall_timeout", "install_excepthook", "note_settings", "agree_settings",
           "launcher_size", "handle_signals", "heartbeat_interval"]
