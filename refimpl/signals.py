"""Signals: SIGINT and SIGTERM end the job at once with one line; SIGUSR1 asks for a checkpoint
(``refimpl train``) or, in a command that cannot checkpoint, ends it as SIGTERM does (138).

SIGINT and SIGTERM are read from Python's wake-up pipe by a thread of their own
(``SignalThread``), at once, whatever the main thread is doing; temporaries and the lock
are removed first (Open MPI's mpiexec sends SIGKILL 0.5 s after it was interrupted), then
the job ends as for a failure on one rank, with one line naming the signal, the step and
the last checkpoint.  SIGUSR1, a scheduler's warning before pre-emption or the time limit
(``sbatch --signal=USR1@60``), only sets a flag (``preemption_requested``) for commands
that ask for it (``failstop.run_command(..., preemptible=True)``: ``refimpl train``): the
loop agrees on it at the next step boundary, every rank writes the checkpoint at that same
step, and the job ends with ``EXIT_PREEMPTED``.
"""
from __future__ import annotations

import os
import sys
import threading
import time

from .atomic import clean_up
from .progress import PROGRESS
from .watchdog import abort, leave, running, world

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
    clean_up()
    name = signal.Signals(signum).name
    rank, size = world()
    step = f" at step {PROGRESS.step}" if PROGRESS.step is not None else f" during {PROGRESS.where()}"
    kept = f"; {PROGRESS.saved}" if PROGRESS.saved else ""
    line = f"refimpl {command}: interrupted by {name} on rank {rank}{step}{kept}"
    code = 128 + signum
    watchdog = running()
    if watchdog is not None and watchdog.was_frozen(time.monotonic()):
        leave()                 # a stopped rank, named by its peers, now ended by the launcher: no second line
        os._exit(code)
    if size > 1 and watchdog is not None:
        watchdog.report(code, line)
    print(line, file=sys.stderr, flush=True)
    abort(code)


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
        # a command that cannot checkpoint (datagen, oracle generate, ...) ends on SIGUSR1 as on
        # SIGTERM (its temporaries and lock removed, one line, 138) rather than by the default action
        self.interrupts = INTERRUPTS if preemptible else INTERRUPTS + (PREEMPTION,)
        self.preemptible = preemptible
        self.previous = {name: signal.signal(getattr(signal, name), _park) for name in self.interrupts}
        if preemptible:            # SIGUSR1 no longer kills the process: the thread sets the flag
            self.previous[PREEMPTION] = signal.signal(getattr(signal, PREEMPTION), _note)
        _preemption.clear()
        self.previous_fd = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        self.thread = threading.Thread(target=self._wait, name="refimpl-signals", daemon=True)
        self.thread.start()

    def _wait(self) -> None:
        import signal
        wanted = {int(getattr(signal, name)) for name in self.interrupts}
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
                elif signum == int(getattr(signal, PREEMPTION)) and self.preemptible:
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
        if self.preemptible:
            # the run is over (checkpointed, or ended): a pre-emption warning that arrives between now
            # and the process's exit has nothing left to save, and must not turn a finished run's 0
            # into the default action's 138 (a requeue-on-138 script would requeue a finished job)
            signal.signal(getattr(signal, PREEMPTION), signal.SIG_IGN)
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
