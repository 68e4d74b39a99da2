"""Exit codes, and the errors that end a command with them.

The codes, documented in docs/training.md ("Faults"): 0 done, 1 a check failed
(``check-layer``), 2 bad input, 3 divergence, 4 I/O failure, 5 stall, 70 internal error
(a bug), 130 / 143 interrupted by SIGINT / SIGTERM, 138 checkpointed and ended on a
pre-emption warning (SIGUSR1, ``refimpl train`` only).  A ``RunError`` carries its code;
``agreed`` marks one raised on every rank alike (refimpl/failstop.py: ``agree``,
``on_root``, ``decide``), which rank 0 reports with one line.
"""
from __future__ import annotations

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_IO = 4
EXIT_STALL = 5
EXIT_INTERNAL = 70          # EX_SOFTWARE (sysexits.h): a bug, not the user's input
EXIT_INTERRUPTED = 130
EXIT_PREEMPTED = 138        # 128 + SIGUSR1 (10 on Linux): checkpointed at a pre-emption warning


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


#: the kinds an agreed outcome names (by class name: it crosses ranks as a string)
ERRORS = {cls.__name__: cls for cls in (RunError, InputError, Diverged, WriteError, InternalError)}


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


def refuse(message: str):
    """Raise InputError for bad input that every rank finds identically (no message needed to agree)."""
    raise InputError(message, agreed=True)
