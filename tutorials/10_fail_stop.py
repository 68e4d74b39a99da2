# %% [markdown]
# # Tutorial 10 — Fail-stop: no rank waits forever
#
#     mpiexec -n 4 --oversubscribe python tutorials/10_fail_stop.py        (any number of ranks; 1 works too)
#
# In an SPMD program every rank runs the same code and meets the others in collectives
# (allreduce, halo exchange, broadcast). That makes failures dangerous: if one rank raises
# and leaves, the others block in their next collective **forever**: on a cluster, until the
# job's wall time is burnt. `refimpl/failstop.py` keeps one rule on every failure path:
# *no rank may wait forever for a rank that will not come*. It has three pieces, and this
# tutorial runs each of them:
#
# 1. **agreed outcomes**: whatever can fail on one rank's input runs on every rank and the
#    outcomes are gathered, so all ranks leave by the same path (`agree`, `on_root`);
# 2. **fail-stop** for what escapes: an exception on one rank ends the whole job with one
#    message (`fail_stop`, with `MPI_Abort` as the safety net);
# 3. **a watchdog** (`refimpl/watchdog.py`) that notices a rank that stopped answering, and
#    says which one and where the others wait;
#
# and two rules that keep ranks from parting ways before anything fails: **decisions taken
# once** (what the file system holds, the `REFIMPL_*` settings) and **a lock on the run
# directory**, so that two jobs never write into one.

# %%
import os
import shutil
import tempfile
import time

from mpi4py import MPI

from refimpl import failstop
from refimpl.errors import EXIT_BAD_INPUT, EXIT_IO, InputError, WriteError
from refimpl.failstop import agree, on_root
from refimpl.progress import phase
from refimpl.watchdog import Watchdog

comm = MPI.COMM_WORLD
say = print if comm.rank == 0 else (lambda *a, **k: None)

# %% [markdown]
# ## 1. Agree before anyone moves on
# Each rank checks its own piece: here, the last rank finds a problem in "its data". With a
# bare `raise`, that rank would leave and the others would wait in the next collective.
# `agree(comm, fn)` runs `fn` on every rank, allgathers the outcomes (one small message) and,
# if any rank failed, raises the same `InputError` on *every* rank, with the failing rank named.
# The error is flagged `agreed`: the command can exit normally, every rank with status 2.

# %%
def check_my_block():
    if comm.rank == comm.size - 1:
        raise ValueError("sample 7 holds NaN in this rank's block")
    return "ok"


try:
    agree(comm, check_my_block)
except InputError as err:
    outcome = (type(err).__name__, str(err), err.agreed, err.exit_code)
every = comm.allgather(outcome)
say("every rank got:", every[0])
assert all(o == every[0] for o in every) and every[0][2] and every[0][3] == EXIT_BAD_INPUT

# %% [markdown]
# ## 2. One rank writes, everyone learns the outcome
# Rank 0 writes the metrics, the plot, the checkpoint. If its disk is full, rank 0 raises,
# but the others have already gone on to the next step's halo exchange. `on_root` runs the
# write on rank 0 only and broadcasts its outcome (with `parallel.objects.bcast_object`,
# which waits without holding Python's GIL, so the watchdog thread keeps running; mpi4py's
# pickle `bcast` would freeze it). Here rank 0 tries to write under a path that is a file.

# %%
scratch = tempfile.mkdtemp() if comm.rank == 0 else None
a_file = os.path.join(scratch, "not-a-directory") if comm.rank == 0 else None
if comm.rank == 0:
    open(a_file, "w").close()


def write_metrics():
    with open(os.path.join(a_file, "metrics.jsonl"), "a") as f:
        f.write("{}\n")


try:
    on_root(comm, write_metrics)
except WriteError as err:
    outcome = (str(err), err.exit_code)
every = comm.allgather(outcome)
say("every rank got:", every[0])
assert all(o == every[0] for o in every) and every[0][1] == EXIT_IO
if comm.rank == 0:
    shutil.rmtree(scratch)                                   # the scratch directory, cleaned up

# %% [markdown]
# ## 3. The watchdog: heartbeats and phases
# A rank that is *stopped* (SIGSTOP, a node that vanished without MPI noticing) raises
# nothing. Only silence gives it away. Each rank runs a watchdog thread on a private copy of
# the communicator. The main thread records what it is doing with `progress.phase(...)`
# (the layers call it: "halo exchange of features.3 (forward)", "gradient allreduce"), and
# every `timeout / 5` seconds the thread sends that record to rank 0. Rank 0 declares a stall
# when a rank has sent nothing for `timeout` seconds, or when no rank has entered a new phase
# for that long. Let each rank enter a phase of its own and watch what rank 0 learns.

# %%
watchdog = Watchdog(comm, "tutorial", timeout=2.0).start()    # heartbeats every 0.4 s
last = comm.size - 1
phase("a long computation" if comm.rank == last else "halo exchange of features.3 (forward)")
time.sleep(1.0)                                              # a few heartbeats, less than the timeout
watchdog.stop()                                              # collective: drains, frees its communicator
if comm.rank == 0:
    for rank, (count, where) in enumerate(watchdog.state):
        print(f"rank 0 saw rank {rank} in {where!r} (phase count {count}), "
              f"{time.monotonic() - watchdog.last_beat[rank]:.2f} s ago")
    assert all(time.monotonic() - t < 2.0 for t in watchdog.last_beat)

# %% [markdown]
# Nobody has been silent, or stuck in one phase, for a whole timeout: no verdict yet.
# `verdict(now)` is the judgement the thread makes at each poll (it is pure: it reads only the
# heartbeats recorded so far). Play the clock forward 3 seconds. First, as if the heartbeats had
# kept coming but no rank had moved on: the rank in the odd phase is named, and where the others
# wait. Then, as if the last rank had also fallen silent. Each is the line `refimpl train` prints
# before it ends every rank with exit status 5. (For real:
# `mpiexec -n 2 --oversubscribe python -m refimpl train --stall-timeout 5 ...`, then `kill -STOP` one rank.)

# %%
if comm.rank == 0:
    now = time.monotonic()
    assert watchdog.verdict(now) is None
    later = now + 3.0
    watchdog.last_beat = [later] * comm.size                 # beats kept coming; nobody moved on
    print(watchdog.verdict(later))
    if comm.size > 1:
        watchdog.last_beat[last] = now                       # ... and the last rank fell silent
        print(watchdog.verdict(later))
        assert f"rank {last} stopped answering" in watchdog.verdict(later)

# %% [markdown]
# ## 4. Decisions taken once
# `agree` gathers *outcomes*; some branches need one *answer*. "Does OUT already hold a run?"
# asked by every rank of a shared file system can get two answers: rank 0 may be deleting the
# old run (`--overwrite`) while rank 1 looks, or this node's metadata cache may lag. Rank 1
# would then skip the clear-out that rank 0 joins, and both wait in different collectives: a
# deadlock (4 runs in 5, before this rule). `decide(comm, fn)` asks rank 0 alone and
# broadcasts the answer. Here a file exists in a directory only rank 0 can see; every rank
# follows rank 0's answer.

# %%
private = tempfile.mkdtemp()                                 # one per rank: rank 0's is not the others'
if comm.rank == 0:
    open(os.path.join(private, "checkpoint.h5"), "w").close()
here = os.path.exists(os.path.join(private, "checkpoint.h5"))
decided = failstop.decide(comm, os.path.exists, os.path.join(private, "checkpoint.h5"))
print(f"rank {comm.rank}: sees a checkpoint: {here}; decided: {decided}")
assert decided is True
shutil.rmtree(private)

# %% [markdown]
# The `REFIMPL_*` environment variables are the same kind of decision. mpiexec usually gives
# every rank the same environment, but a per-node profile may not. Each rank only *notes* what
# it found (`note_settings`, done by the `refimpl` command before MPI starts); the command's
# first collective (`agree_settings`) gathers every rank's values and ends every rank with one
# line if one is bad or different. Let the last rank run with `REFIMPL_THREADS=2`:

# %%
failstop.note_settings(None, {"REFIMPL_THREADS": 2 if comm.rank == last and comm.size > 1 else None})
try:
    failstop.agree_settings(comm)
    outcome = "agreed"
except InputError as err:
    outcome = str(err)
say("every rank:", outcome)
assert comm.size == 1 or "REFIMPL_THREADS differs between ranks" in outcome
failstop.note_settings(None, {})

# %% [markdown]
# ## 5. One job per run directory
# A job resubmitted while the first still runs would write into the same `--out`: metrics of
# two runs interleaved, a checkpoint from one and a config from the other. `refimpl train`
# takes `OUT/.lock` first (created with `O_EXCL`: exactly one process succeeds), holding its
# host, PID, start time and command, so that the job refused can name the holder. A lock whose
# holder is gone (its PID no longer runs on this host, or it was not refreshed for 10 minutes)
# is taken over only with `--break-lock`; a live one never.

# %%
from refimpl.run_lock import LockHeld, RunLock  # noqa: E402

if comm.rank == 0:
    out = tempfile.mkdtemp()
    first = RunLock(out).acquire()
    try:
        RunLock(out).acquire(break_lock=True)                # a second job: refused, even with the flag
    except LockHeld as err:
        print("the second job is told:", err)
    first.release()
    second = RunLock(out).acquire()                          # free again once the first has ended
    second.release()
    shutil.rmtree(out)

# %% [markdown]
# ## 6. Fail-stop
# The last piece is the one you cannot run in a tutorial without ending it: an exception on
# one rank that nothing agreed on (a bug inside one rank's layer). `refimpl` runs every command
# under `failstop.run_command`, which sends it to `fail_stop`: the failing rank reports to rank
# 0's watchdog, rank 0 prints one line (rank, phase, step, cause), tells every rank to exit with
# the same status, and finally calls `MPI_Abort`, which kills whatever did not listen (a stopped
# process included). `tests/test_faults.py` injects each fault under `mpiexec` and checks the
# exit status, the one message, that every process is gone within seconds, and that a
# `--resume` then ends bit-identical to an uninterrupted run. docs/training.md ("Faults") has
# the table of faults and exit statuses.
