"""A job owns its output directory: ``OUT/.lock``, taken atomically before anything is written.

Why: a resubmitted or requeued job, or a second terminal, may start ``refimpl
train`` into the ``--out`` of a job that still runs.  Without a lock both write
there: metrics.jsonl interleaves two runs, the checkpoint comes from one and
config.json from the other, and both exit 0.  The trusted tools all give a job
exclusive ownership of its run directory (Slurm's requeue, Lightning's and
Hydra's run directories, PyTorch DCP's checkpoint id, ``flock``-style locks).

The lock is a file created with ``O_CREAT | O_EXCL`` (atomic on every local file
system and on NFS v3+), holding the job's host, process id, start time and
command line, so that a refused job can name the holder.  ``flock`` is not used:
on several parallel file systems it is local to a node, or off.

A lock whose holder is gone is *stale*: its host is this host and its process no
longer runs, or it has not been refreshed for ``STALE_AFTER_S`` seconds (a daemon
thread of the holder touches it every ``REFRESH_S``; a job on another host that
was killed stops refreshing).  A holder on this host whose process is gone is
certainly gone (SIGKILL, or the launcher ending it after a Ctrl-C): its lock is
taken over at once and the command says so, with the temporaries it left
(``remove_temporaries``).  A lock that is merely old, of another host, is reported,
never taken silently: ``--break-lock`` (or ``--overwrite``, which discards the old
run anyway) takes it over.  A live lock is never broken by any flag: wait for the holder, or choose
another ``--out``.  The holder removes the lock on every way out: normal end,
an agreed error, ``fail_stop``'s abort (``atomic.remove_on_abort``) and a
signal; only SIGKILL (or a lost node) leaves it behind, stale.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid

from . import atomic

NAME = ".lock"
REFRESH_S = 60.0           # the holder touches the lock this often
STALE_AFTER_S = 600.0      # a lock not touched for this long belongs to a job that is gone


class LockHeld(ValueError):
    """The directory belongs to another job (live), or to a gone one and no --break-lock was given."""


def _process_exists(pid: int) -> bool:
    """Whether ``pid`` runs on this host; a zombie (exited, not yet reaped: in a container whose
    init does not reap, for a while) runs no more."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:              # another user's live process
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True                      # no /proc: trust the signal test
    return state not in ("Z", "X")


def holder_of(path: str) -> dict:
    """What the lock file says about its holder ({} if it cannot be read: still a lock)."""
    try:
        with open(path) as f:
            holder = json.load(f)
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}


def gone_here(holder: dict) -> bool:
    """Whether the holder ran on this host and its process no longer runs: certainly gone (killed,
    or ended by the launcher after a Ctrl-C), so its lock is taken over without --break-lock."""
    pid = holder.get("pid")
    return holder.get("host") == socket.gethostname() and isinstance(pid, int) and not _process_exists(pid)


def stale_reason(holder: dict, age_s: float) -> str | None:
    """Why the holder is gone, or None while it may still run."""
    pid = holder.get("pid")
    if gone_here(holder):
        return f"process {pid} on this host no longer runs"
    if age_s > STALE_AFTER_S:
        return f"it was last refreshed {age_s:.0f} s ago (stale after {STALE_AFTER_S:.0f} s)"
    return None


def describe_holder(holder: dict) -> str:
    if not holder:
        return "a job whose lock file cannot be read"
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return (f"PID {holder.get('pid', '?')} on {holder.get('host', '?')}, started {when}: "
            f"{holder.get('command', '?')}")


def lock_state(path) -> tuple[dict, str | None] | None:
    """(holder, why it is gone or None while it may still run) of the lock file ``path``; None
    when there is no lock there (or it was released meanwhile)."""
    holder = holder_of(path)
    try:
        age = time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return None
    return holder, stale_reason(holder, age)


def live_lock_above(directory) -> tuple[str, dict] | None:
    """(lock path, holder) of a live job's lock in a directory *above* ``directory`` (its
    ``OUT`` holds ``directory``: e.g. ``OUT/data`` of a running ``refimpl train``), or None.
    A writer refuses such a directory: the live job reads or writes what is there."""
    path = os.path.abspath(os.fspath(directory))
    parent = os.path.dirname(path)
    while parent != path:
        lock = os.path.join(parent, NAME)
        state = lock_state(lock) if os.path.isfile(lock) else None
        if state is not None and "pid" in state[0] and state[1] is None:   # a live refimpl job's lock
            return lock, state[0]                                          # (another tool's .lock says nothing)
        path, parent = parent, os.path.dirname(parent)
    return None


def remove_temporaries(directory, holder: dict) -> list[str]:
    """Remove what a gone job on this host left half-written in ``directory``: the files and
    directories named ``*.tmp-<its pid>`` (atomic.atomic_write's and the data writer's
    temporaries); their names."""
    import shutil
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int):
        return []                            # another host's pid names nothing here
    removed = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(f".tmp-{pid}"):
            path = os.path.join(directory, name)
            try:
                shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
                removed.append(name)
            except OSError:
                pass                         # gone meanwhile, or not ours to remove: leave it
    return removed


class RunLock:
    """``OUT/.lock`` held by this process: ``acquire`` (raises LockHeld), ``release``."""

    def __init__(self, directory, flag: str = "--out"):
        self.directory = os.fspath(directory)
        self.path = os.path.join(self.directory, NAME)
        self.flag = flag
        self.token = uuid.uuid4().hex
        self.held = False
        self.note = None                     # what was taken over, said by the command
        self._stop = threading.Event()
        self._thread = None

    def acquire(self, break_lock: bool = False, how_to_break: str = "--break-lock") -> "RunLock":
        os.makedirs(self.directory, exist_ok=True)
        for _ in range(3):                   # a racing breaker may win in between: look again
            if self._create():
                return self._held()
            state = lock_state(self.path)
            if state is None:
                continue                     # released meanwhile: try again
            holder, reason = state
            if reason is None:
                raise LockHeld(f"{self.flag} {self.directory} is in use by another job ({describe_holder(holder)}); "
                               f"wait for it to end or choose another {self.flag} (lock: {self.path})")
            if not break_lock and not gone_here(holder):
                raise LockHeld(f"{self.flag} {self.directory} is locked by a job that is gone ({reason}; "
                               f"{describe_holder(holder)}); pass {how_to_break} to take the lock over "
                               f"(lock: {self.path})")
            aside = f"{self.path}.broken-{self.token}"
            try:
                os.replace(self.path, aside)     # one breaker wins the rename, then the O_EXCL create
                os.remove(aside)
            except FileNotFoundError:
                pass
            self.note = f"took over the lock of a job that is gone ({reason}; {describe_holder(holder)})"
            removed = remove_temporaries(self.directory, holder)
            if removed:
                self.note += f"; removed the temporar{'ies' if len(removed) > 1 else 'y'} it left: {', '.join(removed)}"
        raise LockHeld(f"{self.flag} {self.directory}: could not take {self.path} (other jobs keep taking it)")

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        atomic.remove_on_abort(self.path)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                  "command": " ".join(sys.argv), "token": self.token}
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            self._remove()
            raise
        return True

    def _held(self) -> "RunLock":
        self.held = True
        self._thread = threading.Thread(target=self._refresh, name="refimpl-lock", daemon=True)
        self._thread.start()
        return self

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                os.utime(self.path)
            except OSError:
                pass                         # a full or vanished directory ends the run elsewhere

    def release(self) -> None:
        """Remove the lock if it is still ours (a stale-lock breaker may have taken it over)."""
        if not self.held:
            return
        self.held = False
        self._stop.set()
        if holder_of(self.path).get("token") == self.token:
            self._remove()
        atomic.forget_on_abort(self.path)

    def _remove(self) -> None:
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


__all__ = ["NAME", "REFRESH_S", "STALE_AFTER_S", "LockHeld", "RunLock", "holder_of", "stale_reason"]
