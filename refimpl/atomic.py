"""Atomic writes, and the temporaries an abort must remove.

Every file refimpl writes (checkpoints, metrics, configs, case files, datasets) goes through
``atomic_write``: a temporary beside the target, renamed over it, so the target is either
untouched or complete.  While a temporary exists it is registered (``remove_on_abort``);
whatever ends the job abruptly (the fail-stop watchdog, a signal, refimpl/failstop.py)
calls ``clean_up`` first, so no half-written file is left behind.
"""
from __future__ import annotations

import contextlib
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


class _KeepFirstError:
    """The file HDF5 writes through: every write "succeeds" for HDF5; the first failure is kept.

    HDF5 reports a failed write (ENOSPC, EFBIG) wherever its caches happen to be
    flushed, often while h5py frees an object: from a destructor, where the
    error reaches only ``sys.excepthook`` / ``sys.unraisablehook`` and the
    writing code carries on.  Here HDF5 never sees a failure: the first
    ``OSError`` is kept (nothing after it reaches the disk) and ``check`` raises
    it in the writer's own code.  It wraps the unbuffered file, because a
    buffered one would also fail in ``seek`` (which flushes its buffer).
    """

    def __init__(self, raw):
        self.raw = raw
        self.error = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        if self.error is None:
            try:
                while view:                        # an unbuffered write may write a part only
                    view = view[self.raw.write(view):]
            except OSError as err:
                self.error = err
        return size

    def truncate(self, size: int) -> int:
        if self.error is None:
            try:
                self.raw.truncate(size)
            except OSError as err:
                self.error = err
        return size

    def check(self) -> None:
        """Raise the first failed write's error, if any."""
        if self.error is not None:
            raise self.error

    def __getattr__(self, name):                   # seek, tell, read, flush: the file's own
        return getattr(self.raw, name)


@contextlib.contextmanager
def hdf5_file(binary_file):
    """``(h5py.File, check)`` writing through ``binary_file`` (the file ``atomic_write`` hands
    its writer); the HDF5 file is closed here, and a write that failed (in the body, or in the
    close's flush) is raised after the close, as an ``OSError``, never from an h5py destructor
    (a full disk is exit 4 at any file size, not an internal error).  Every HDF5 file refimpl
    writes goes through it: datasets, case and results files, traces."""
    import h5py

    sink = _KeepFirstError(binary_file.raw)
    f = h5py.File(sink, "w")
    try:
        yield f, sink.check
    finally:
        f.close()
    sink.check()
