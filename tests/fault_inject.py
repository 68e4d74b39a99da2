"""Run the ``refimpl`` command with one fault injected on one rank (tests/test_faults.py).

    mpiexec -n 3 python tests/fault_inject.py train --out ... (any refimpl arguments)

The fault comes from the environment, so that every rank parses the same command line:

- ``FAULT_RANK``: the rank that misbehaves (default 0);
- ``FAULT``: what it does, ``WHAT:STEP`` with WHAT one of
  ``forward`` (RuntimeError in a conv layer's forward), ``backward`` (the same in
  its backward), ``stop`` (SIGSTOP itself inside a conv's forward: a process that
  stops answering), ``kill`` (SIGKILL itself there), ``plot`` (the loss plot's
  write fails with ENOSPC), ``sigterm`` (SIGTERM to itself: a scheduler's cancel of
  one rank), ``ctrl-c`` (SIGINT to the launcher's process group, as a terminal's
  Ctrl-C sends it), ``sigterm-launcher`` (SIGTERM to mpiexec), ``sigusr1`` (SIGUSR1 to
  itself: a scheduler's pre-emption warning), ``slow`` (every conv
  forward sleeps 0.2 s from that step on: a run that lasts), and STEP the training
  step (1-based) it happens at;
- ``FAULT=stop-calibrating:N``: SIGSTOP itself before timing the N-th conv shape of
  ``refimpl plan --calibrate`` (tests/test_plan_faults.py);
- ``FAULT_BLIND``: a path; on the faulty rank ``os.path.exists``, ``glob.glob`` and
  ``os.listdir`` see nothing under it (a file system whose metadata this node sees
  late): a rank that decided alone what OUT holds would take another branch;
- ``FAULT_FSIZE``: a file-size limit in bytes for that rank (``RLIMIT_FSIZE``;
  Python ignores SIGXFSZ, so a write past it fails with EFBIG, like a full disk);
- ``FAULT_LOG``: a directory; every rank writes ``pid-RANK`` (its process id) there
  at start, and the faulty rank ``fault`` (the ``time.time()`` of the fault).

Nothing here is part of refimpl: the faults are patched in from outside.
"""
import errno
import os
import resource
import signal
import sys
import time

from mpi4py import MPI

rank = MPI.COMM_WORLD.Get_rank()
fault_rank = int(os.environ.get("FAULT_RANK", "0"))
what, _, at = os.environ.get("FAULT", "").partition(":")
log = os.environ.get("FAULT_LOG")
if log:
    with open(os.path.join(log, f"pid-{rank}"), "w") as f:
        f.write(str(os.getpid()))


def mark_fault():
    if log:
        with open(os.path.join(log, "fault"), "w") as f:
            f.write(repr(time.time()))


if rank == fault_rank and os.environ.get("FAULT_BLIND"):
    import glob

    blind = os.path.abspath(os.environ["FAULT_BLIND"])

    def hidden(path):
        path = os.path.abspath(os.fspath(path))
        return path == blind or path.startswith(blind + os.sep)

    def seeing(original, nothing):
        def look(path, *args, **kwargs):
            return nothing if hidden(path) else original(path, *args, **kwargs)
        return look
    os.path.exists = seeing(os.path.exists, False)
    glob.glob = seeing(glob.glob, [])
    os.listdir = seeing(os.listdir, [])

if rank == fault_rank:
    if os.environ.get("FAULT_FSIZE"):
        limit = int(os.environ["FAULT_FSIZE"])
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    if what:
        from refimpl import progress, train_report
        from refimpl.nn import spatial

        def due():
            return progress.PROGRESS.step == int(at)

        def wrap(method_name, action):
            original = getattr(spatial.SpatialConv3d, method_name)

            def method(self, x):
                if due():
                    action()
                return original(self, x)
            setattr(spatial.SpatialConv3d, method_name, method)

        def fail():
            mark_fault()
            raise RuntimeError(f"injected fault on rank {rank}")

        def stop():
            mark_fault()
            os.kill(os.getpid(), signal.SIGSTOP)

        def kill():
            mark_fault()
            os.kill(os.getpid(), signal.SIGKILL)

        sent = []

        def signal_self(signum=signal.SIGTERM):
            if not sent:                     # once: the step's later convs must not send it again
                sent.append(mark_fault())
                os.kill(os.getpid(), signum)

        def ctrl_c():
            if not sent:
                sent.append(mark_fault())
                os.killpg(os.getpgid(os.getppid()), signal.SIGINT)     # the launcher's group
                time.sleep(2.0)              # a step still running when the launcher passes it on

        def cancel_launcher():
            if not sent:
                sent.append(mark_fault())
                os.kill(os.getppid(), signal.SIGTERM)                  # a scheduler's cancel of mpiexec
                time.sleep(2.0)

        if what == "slow":
            original_forward = spatial.SpatialConv3d.forward

            def slow_forward(self, x):
                if (progress.PROGRESS.step or 0) >= int(at):
                    time.sleep(0.2)
                return original_forward(self, x)
            spatial.SpatialConv3d.forward = slow_forward
        elif what == "sigterm":
            wrap("forward", signal_self)
        elif what == "sigusr1":
            wrap("forward", lambda: signal_self(signal.SIGUSR1))
        elif what == "ctrl-c":
            wrap("forward", ctrl_c)
        elif what == "sigterm-launcher":
            wrap("forward", cancel_launcher)
        elif what in ("forward", "backward"):
            wrap(what, fail)
        elif what == "stop":
            wrap("forward", stop)
        elif what == "kill":
            wrap("forward", kill)
        elif what == "plot":
            original_plot = train_report.plot_metrics

            def plot(metrics_path, png_path, metric_name):
                if due():
                    mark_fault()
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), png_path)
                return original_plot(metrics_path, png_path, metric_name)
            train_report.plot_metrics = plot
        elif what == "stop-calibrating":
            from refimpl import plan
            original_time_conv, timed = plan._time_conv, []

            def time_conv(layer, repeats, rng):
                timed.append(layer)
                if len(timed) == int(at):
                    stop()
                return original_time_conv(layer, repeats, rng)
            plan._time_conv = time_conv
        else:
            raise SystemExit(f"fault_inject: unknown FAULT {what!r}")

from refimpl.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
