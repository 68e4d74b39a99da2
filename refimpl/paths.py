"""What kind of file a path names, so that nothing refimpl reads or writes is a FIFO, a
device node or a socket.

Reading a FIFO blocks until some other process writes to it (a results file that is a FIFO
hangs ``oracle check`` forever); writing a file atomically (a new file renamed over the
path, ``failstop.atomic_write``) *replaces* whatever the path names — run as root,
``--json /dev/null`` would replace ``/dev/null`` for everyone.  So every path given for a
file is checked here first: an existing path must be a regular file (or, where one is due,
a directory), else the command stops with exit 2 and one line, before any work.
"""
from __future__ import annotations

import os
import stat

#: the kinds of special files, by the stat test that finds them
SPECIAL_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                 (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def special_kind(path) -> str | None:
    """'a FIFO (named pipe)', 'a character device', 'a block device', 'a socket' for such a
    path (a symbolic link followed), None for a regular file, a directory or no file at all."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return next((kind for test, kind in SPECIAL_KINDS if test(mode)), None)


def refuse_special(path, what: str) -> None:
    """ValueError (exit 2 in every command) if ``path`` is a FIFO, a device or a socket."""
    kind = special_kind(path)
    if kind is not None:
        raise ValueError(f"{what} {path} is {kind}, not a regular file: refimpl reads and writes regular files "
                         f"only (give a file's path)")
