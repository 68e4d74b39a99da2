"""The pure pieces of the fail-stop machinery (refimpl/failstop.py and the modules it builds on:
atomic, errors, paths, progress, signals, watchdog), on one process (tests/test_faults.py runs
them under mpiexec).

- ``check_writable``: what a path given on the command line must satisfy;
- ``atomic_write``: the target is untouched or complete, no temporary is left, errors name it;
- ``agree`` / ``on_root``: exceptions become the documented RunError kinds, flagged as agreed;
- the watchdog's stall verdicts and messages, from heartbeat records (no thread, no MPI message).
"""
import errno
import os
import time

import pytest

pytest.importorskip("mpi4py", reason="mpi4py is not installed: pip install 'refimpl[mpi]'")

from refimpl import atomic, progress, signals, watchdog  # noqa: E402
from refimpl.atomic import atomic_write  # noqa: E402
from refimpl.errors import (EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_IO, EXIT_STALL, InputError,  # noqa: E402
                            InternalError, WriteError)
from refimpl.failstop import agree, on_root  # noqa: E402
from refimpl.paths import check_writable  # noqa: E402


def test_check_writable(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    check_writable(tmp_path / "new" / "deeper", "--out", directory=True)      # creatable
    check_writable(tmp_path, "--out", directory=True)
    check_writable(a_file, "--save")                                          # overwritable file
    check_writable(tmp_path / "new.npz", "--save")
    with pytest.raises(ValueError, match="--out .* exists and is not a directory"):
        check_writable(a_file, "--out", directory=True)
    with pytest.raises(ValueError, match="cannot be created: .*file is not a directory"):
        check_writable(a_file / "sub" / "x", "--out", directory=True)
    with pytest.raises(ValueError, match="--save .* is a directory, not a file"):
        check_writable(tmp_path, "--save")
    if os.geteuid() != 0:                         # root may write anywhere: permissions mean nothing
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="not writable"):
            check_writable(locked / "x", "--save")


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path):
    path = tmp_path / "out.json"
    atomic_write(path, lambda f: f.write("old"))
    assert path.read_text() == "old"

    def fail(f):
        f.write("half of the new")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with pytest.raises(OSError) as info:
        atomic_write(path, fail)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(path)   # names the target
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]             # no temporary left
    assert not atomic._cleanups
    atomic_write(path, lambda f: f.write(b"new"), binary=True, fsync=True)
    assert path.read_text() == "new"


def test_agree_and_on_root_raise_the_documented_kinds():
    from mpi4py import MPI
    comm = MPI.COMM_SELF
    assert agree(comm, lambda: 7) == 7
    cases = [(ValueError("bad flag"), InputError, EXIT_BAD_INPUT, "bad flag"),
             (OSError(errno.ENOENT, "No such file or directory", "/x/y"), InputError, EXIT_BAD_INPUT,
              "No such file or directory at /x/y"),
             (KeyError("missing"), InputError, EXIT_BAD_INPUT, "missing"),
             (ZeroDivisionError("division by zero"), InternalError, EXIT_INTERNAL, "division by zero")]
    for err, kind, code, message in cases:
        def fail(err=err):
            raise err
        with pytest.raises(kind) as info:
            agree(comm, fail)
        assert info.value.agreed and info.value.exit_code == code and str(info.value) == message
    with pytest.raises(WriteError) as info:
        on_root(comm, lambda: (_ for _ in ()).throw(OSError(errno.EFBIG, "File too large", "/o/m")))
    assert info.value.agreed and info.value.exit_code == EXIT_IO and "File too large at /o/m" in str(info.value)
    assert on_root(comm, lambda: "done") == "done"


def test_progress_names_layers():
    from refimpl.models import build_model
    model = build_model("cosmoflow", {"input_shape": (4, 16, 16, 16), "conv_size": 2, "n_conv_layers": 2,
                                      "fc1_size": 8, "fc2_size": 4}, seed=0)
    progress.label_layers(model)
    conv = model.features[0]
    progress.phase("halo exchange of {layer} (forward)", conv)
    progress.set_step(12)
    assert progress.PROGRESS.where() == "halo exchange of features.0 (forward) at step 12"
    progress.phase("gradient allreduce")
    progress.set_step(None)
    assert progress.PROGRESS.where() == "gradient allreduce"


class FakeWatchdog(watchdog.Watchdog):
    """A watchdog's bookkeeping without its thread or communicator: verdicts only."""

    def __init__(self, size, timeout, rank=0):
        self.rank, self.size, self.command = rank, size, "train"
        self.configure(timeout)
        self.state = [(0, "start-up")] * size
        self.ending, self.verdicts = False, []

    def end_job(self, code, line):          # what the real one does after printing: end the job
        self.verdicts.append((code, line))


def test_stall_verdicts():
    now = time.monotonic()
    # rank 2 of 4 went silent; the others wait in one halo exchange, still beating
    dog = FakeWatchdog(4, timeout=10)
    wait = "halo exchange of features.3 (forward) at step 5"
    for r in range(4):
        dog._note(r, (7, wait), now - 1)
    dog.last_beat[2] = now - 11
    progress.PROGRESS.count, progress.PROGRESS.phase, progress.PROGRESS.layer, progress.PROGRESS.step = \
        7, "halo exchange of features.3 (forward)", None, 5
    dog._check(now)
    code, line = dog.verdicts[-1]
    assert code == EXIT_STALL
    assert "rank 2 stopped answering (no heartbeat for 11.0 s" in line
    assert f"ranks 0-1, 3 wait in {wait}" in line and "--stall-timeout 10" in line

    # nobody silent, nobody moving: the rank in the minority phase is named
    dog = FakeWatchdog(3, timeout=10)
    for r in range(3):
        dog._note(r, (3, "gradient allreduce at step 9" if r else "backward of features.0 at step 9"), now - 12)
        dog.last_beat[r] = now - 0.5
    progress.PROGRESS.count, progress.PROGRESS.phase, progress.PROGRESS.step = 3, "backward of features.0", 9
    dog._check(now)
    line = dog.verdicts[-1][1]
    assert "rank 0 made no progress for" in line and "in backward of features.0 at step 9" in line
    assert "ranks 1-2 wait in gradient allreduce at step 9" in line

    # moving along: no verdict; rank 1 watching a silent rank 0 speaks for it
    dog = FakeWatchdog(2, timeout=10)
    dog._note(1, (5, "x"), now)
    dog._check(now)
    assert dog.verdicts == []
    deputy = FakeWatchdog(3, timeout=10, rank=1)
    deputy.last_beat[0] = now - 10.5
    deputy._check(now)
    assert "rank 0 stopped answering" in deputy.verdicts[-1][1]
    other = FakeWatchdog(3, timeout=10, rank=2)      # waits 3 intervals more before speaking itself
    other.last_beat[0] = now - 10.5
    other._check(now)
    assert other.verdicts == []


def test_a_watchdog_that_was_itself_frozen_accuses_no_one():
    """A rank stopped (SIGSTOP) and continued (Open MPI continues its processes before killing
    them) sees every peer silent for as long as it was stopped: that silence is its own, so its
    watchdog restarts its clocks instead of naming the others (its peers have named it)."""
    from refimpl.watchdog import self_frozen
    assert self_frozen(10.0, 13.5, 3.0) and self_frozen(0.0, 3.0, 3.0)
    assert not self_frozen(10.0, 10.2, 3.0)
    assert not self_frozen(0.0, 100.0, 0.0)          # --stall-timeout 0: off
    # rank 0 stopped right after a heartbeat: its peers name it after the timeout, 8 s of stop with
    # --stall-timeout 10 (interval 2); continued then, it must not blame them
    assert self_frozen(0.0, 8.0, 10.0) and self_frozen(0.0, 4.0, 10.0)
    assert not self_frozen(0.0, 0.5, 10.0)           # a slow iteration of its own loop is no freeze


def test_a_lock_held_by_a_zombie_is_stale(tmp_path):
    """An exited rank not yet reaped (a container's init may not reap at once) holds no lock: its
    lock is stale and, its holder being of this host, taken over at once with a note (not
    reported as a job still running)."""
    import json
    import socket
    import subprocess
    import sys
    from refimpl.run_lock import LockHeld, RunLock, holder_of
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:                  # exited, not reaped: a zombie
        with open(f"/proc/{child.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.01)
    (tmp_path / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": child.pid,
                                                "started": time.time(), "command": "train"}))
    lock = RunLock(tmp_path).acquire()
    assert holder_of(lock.path)["pid"] == os.getpid() and "took over" in lock.note and "no longer runs" in lock.note
    with pytest.raises(LockHeld, match="in use by another job"):      # this process is live: never broken
        RunLock(tmp_path).acquire(break_lock=True)
    lock.release()
    assert not (tmp_path / ".lock").exists()
    child.wait()


def test_the_signal_thread_ends_before_its_pipe_is_closed(tmp_path):
    """After close() the thread is gone, so no later file that reuses the pipe's descriptor
    number is read as signals (HDF5 bytes 2 / 15 ended a later in-process command with 130)."""
    for _ in range(3):
        thread = signals.handle_signals("test")
        read_fd = thread.read_fd
        thread.close()
        assert not thread.thread.is_alive()
        with open(tmp_path / "bytes", "wb") as f:           # likely the same descriptor number now
            f.write(bytes([2, 15] * 64))
        with open(tmp_path / "bytes", "rb") as f:
            assert f.fileno() != read_fd or not thread.thread.is_alive()
