"""What kind of file a path names, so that nothing refimpl reads or writes is a FIFO, a
device node or a socket.

Reading a FIFO blocks until some other process writes to it (a results file that is a FIFO
hangs ``oracle check`` forever); writing a file atomically (a new file renamed over the
path, ``atomic.atomic_write``) *replaces* whatever the path names — run as root,
``--json /dev/null`` would replace ``/dev/null`` for everyone.  So every path given for a
file is checked here first: an existing path must be a regular file (or, where one is due,
a directory), else the command stops with exit 2 and one line, before any work.  A path
given for output is checked whole before the first message (``check_writable``): that it
can be created or overwritten, and that the file system can hold its name.
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
