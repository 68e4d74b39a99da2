"""The watchdog: heartbeats, stall detection and the fail-stop channel, one daemon thread per rank.

Every rank runs one daemon thread on a private duplicate of the communicator (its
messages never match the program's).  The main thread records what it is doing in
``progress.PROGRESS``; every ``interval`` the thread sends that record to rank 0 (rank 0
sends its own to everyone).  Rank 0 declares a stall when a rank has sent nothing for
``timeout`` seconds (a stopped process, a lost node: its watchdog thread is stopped too)
or when no rank has moved to a new phase for ``timeout`` seconds (a deadlock or a hang
inside one phase); it names the ranks that stopped answering and the phase the others
wait in, and ends the job with ``EXIT_STALL``.  Rank 1 does the same for rank 0.  The
thread only ever uses non-blocking calls (``isend``, ``improbe``) and sleeps between
polls: Open MPI's blocking receive would spin a core.  A rank that fails alone reports
here (``Watchdog.report``) and rank 0 ends the job for it (refimpl/failstop.py, ``fail_stop``).

The ways out of a job live here too: ``leave`` (temporaries removed, output flushed) and
``abort`` (``MPI_Abort``, or ``os._exit`` without a launcher).
"""
from __future__ import annotations

import os
import sys
import threading
import time

from .atomic import clean_up
from .errors import EXIT_STALL, describe
from .progress import PROGRESS

DEFAULT_STALL_TIMEOUT = 600.0
GRACE_S = 2.0               # how long a failing rank waits for rank 0 to end the job for it

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
        clean_up()        # first: the launcher may kill this process the moment another rank has left
        print(line, file=sys.stderr, flush=True)
        for dest in range(self.size):
            if dest != self.rank:
                self._pending.append(self.comm.isend(code, dest=dest, tag=_ABORT))
        deadline = time.monotonic() + 0.5             # let the live ranks leave on their own
        while time.monotonic() < deadline:
            time.sleep(0.05)
        abort(code)

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
        leave()
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


def running() -> Watchdog | None:
    """The watchdog of the command running now (None: one process, or none started)."""
    return _watchdog


# ---------------------------------------------------------------- ways out of the job

def leave() -> None:
    """What every way out of the job does first: remove temporaries being written, flush output."""
    clean_up()
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


def world() -> tuple[int, int]:
    """(rank, size) of COMM_WORLD, or (0, 1) without MPI."""
    if not _mpi_running():
        return 0, 1
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def abort(code: int) -> None:
    """End the whole job with ``code`` (temporaries removed first); never returns."""
    leave()
    if not _mpi_running() or world()[1] == 1 and launcher_size() == 1:    # no launcher to tell
        os._exit(code)
    from mpi4py import MPI
    MPI.COMM_WORLD.Abort(code)
