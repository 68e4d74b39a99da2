"""Atomic writes, and the temporaries an abort must remove.

Every file refimpl writes (checkpoints, metrics, configs, case files, datasets) goes through
``atomic_write``: a temporary beside the target, renamed over it, so the target is either
untouched or complete.  While a temporary exists it is registered (``remove_on_abort``);
whatever ends the job abruptly (the fail-stop watchdog, a signal, refimpl/failstop.py)
calls ``clean_up`` first, so no half-written file is left behind.
"""
from __future__ import annotations

import os

from .paths import refuse_special

_cleanups: set = set()


def remove_on_abort(path) -> None:
    """Delete ``path`` if the job is ended while it exists (a temporary file being written)."""
    _cleanups.add(os.fspath(path))


def forget_on_abort(path) -> None:
    _cleanups.discard(os.fspath(path))


def clean_up() -> None:
    """Remove every registered temporary (the job is being ended)."""
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
