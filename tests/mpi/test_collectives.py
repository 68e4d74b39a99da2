"""Every allreduce algorithm against ``comm.Allreduce`` (run under mpiexec -n 1, 2, 3, 4, 8).

Integers: bit-identical (sums wrap around identically; data spans the whole
int range so overflow happens).  Floats: to float64 rounding, and every rank
must end with the *same* bits.  8/16-bit integers are left out on purpose:
Open MPI's AVX reduction kernels saturate instead of wrapping on overflow
(open-mpi/ompi#8045, wontfix), so MPI itself is not a valid oracle there.
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from mpi4py import MPI

from refimpl.parallel.allreduce import configurations
from refimpl.parallel.collectives import ALGORITHMS, allreduce, start_allreduce

# (algorithm, options) from the registry: every algorithm with its defaults, then each example value of
# each option (multicolor with several k); hierarchical with every divisor below
CONFIGS = configurations()
SIZES = [0, 1, 2, 3, 5, 7, 13, 31, 97, 1000]


def divisors(p):
    return [g for g in range(1, p + 1) if p % g == 0]


def local_data(n, dtype, seed, rank):
    """Rank-specific random data: full-range integers (overflow wraps), normal floats."""
    rng = np.random.default_rng([seed, rank])
    dtype = np.dtype(dtype)
    if dtype.kind == "i":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=n, dtype=dtype, endpoint=True)
    if dtype.kind == "c":
        return (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


def mismatch(got, ref, comm):
    """'' if got equals ref (bitwise for ints, to rounding for floats) on every rank identically."""
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return f"shape/dtype {got.shape} {got.dtype} != {ref.shape} {ref.dtype}"
    if ref.dtype.kind in "iu":
        if not np.array_equal(got, ref):
            return f"integers differ at {int(np.flatnonzero(got != ref)[0])}"
    elif ref.size:
        tol = {np.dtype(np.float64): 1e-13, np.dtype(np.complex128): 1e-13}.get(ref.dtype, 1e-5)
        rel = float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-300))
        if rel > tol:
            return f"rel error {rel:.3e} > {tol}"
    digests = comm.allgather(got.tobytes())  # every rank must hold the same bits
    if any(d != digests[0] for d in digests):
        return "ranks hold different results"
    return ""


def check_one(comm, algorithm, options, n, dtype, seed):
    """Problems ('' each) of in-place and out-of-place runs of one configuration."""
    x = local_data(n, dtype, seed, comm.Get_rank())
    ref = x.copy()
    comm.Allreduce(MPI.IN_PLACE, ref)
    inplace = x.copy()
    returned = allreduce(inplace, comm, algorithm, **options)
    out = np.full_like(x, 7)
    kept = x.copy()
    allreduce(x, comm, algorithm, out=out, **options)
    problems = [mismatch(inplace, ref, comm), mismatch(out, ref, comm)]
    if returned is not inplace:
        problems.append("in-place call did not return its buffer")
    if not np.array_equal(x, kept):
        problems.append("out-of-place call changed its input")
    return [f"{algorithm}{options} n={n} {np.dtype(dtype)}: {m}" for m in problems if m]


@pytest.mark.parametrize("algorithm,options", CONFIGS, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.float64])
def test_equals_mpi_allreduce(comm, all_ranks_agree, algorithm, options, dtype):
    p = comm.Get_size()
    problems = []
    for n in sorted(set(SIZES + [p - 1, p + 1, 3 * p + 2])):
        problems += check_one(comm, algorithm, options, n, dtype, seed=n)
    all_ranks_agree(not problems, "; ".join(problems[:4]))


def test_hierarchical_every_divisor(comm, all_ranks_agree):
    problems = []
    for g in divisors(comm.Get_size()):
        for n in (0, 1, 11, 300):
            problems += check_one(comm, "hierarchical", {"group_size": g}, n, np.int64, seed=g)
            problems += check_one(comm, "hierarchical", {"group_size": g}, n, np.float64, seed=g)
    all_ranks_agree(not problems, "; ".join(problems[:4]))


def test_hierarchical_non_divisor_raises_before_any_message(comm, all_ranks_agree):
    """A group size that does not divide p raises ValueError on every rank, sending nothing."""
    p = comm.Get_size()
    bad_sizes = [0, p + 1] + [g for g in range(2, p) if p % g]
    outcomes = []
    for g in bad_sizes:
        buf = np.arange(5, dtype=np.int64)
        try:
            allreduce(buf, comm, "hierarchical", group_size=g)
            outcomes.append(f"group_size={g} did not raise")
        except ValueError as err:
            if "group_size" not in str(err):
                outcomes.append(f"message does not name group_size: {err}")
            if not np.array_equal(buf, np.arange(5)):
                outcomes.append("buffer was modified")
    comm.Barrier()
    if comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
        outcomes.append("a message was sent")
    all_ranks_agree(not outcomes, "; ".join(outcomes))


@settings(max_examples=10)
@given(n=st.integers(0, 400), dtype=st.sampled_from(["int32", "int64", "float32", "float64", "complex128"]),
       config=st.sampled_from(CONFIGS), seed=st.integers(0, 2**16))
def test_hypothesis_sizes_and_dtypes(comm, all_ranks_agree, n, dtype, config, seed):
    algorithm, options = config
    problems = check_one(comm, algorithm, options, n, dtype, seed)
    all_ranks_agree(not problems, "; ".join(problems))


def test_nonblocking_handles_interleaved(comm, all_ranks_agree):
    """Many allreduces in flight on one communicator at once, advanced by test() in turns."""
    rank = comm.Get_rank()
    started = []
    for i, (algorithm, options) in enumerate(CONFIGS * 2):
        x = local_data(50 + 37 * i, np.float64 if i % 2 else np.int64, i, rank)
        ref = x.copy()
        comm.Allreduce(MPI.IN_PLACE, ref)
        started.append((start_allreduce(x, comm, algorithm, **options), x, ref, algorithm))
    for _ in range(3):
        for handle, *_ in reversed(started):
            handle.test()
    problems = []
    for handle, x, ref, algorithm in started:
        if handle.wait() is not x or not handle.test():
            problems.append(f"{algorithm}: wait() did not finish with the buffer")
        m = mismatch(x, ref, comm)
        if m:
            problems.append(f"{algorithm}: {m}")
    all_ranks_agree(not problems, "; ".join(problems[:4]))


def test_nonblocking_out_of_place(comm, all_ranks_agree):
    x = local_data(101, np.int64, 3, comm.Get_rank())
    ref = x.copy()
    comm.Allreduce(MPI.IN_PLACE, ref)
    problems = []
    for algorithm in ALGORITHMS:
        out = np.zeros_like(x)
        handle = start_allreduce(x, comm, algorithm, out=out)
        while not handle.test():
            pass
        m = mismatch(out, ref, comm)
        if m or handle.result is not out:
            problems.append(f"{algorithm}: {m or 'result is not out'}")
    all_ranks_agree(not problems, "; ".join(problems))


def test_multidimensional_and_fortran_order(comm, all_ranks_agree):
    rank = comm.Get_rank()
    problems = []
    for order in ("C", "F"):
        x = np.asarray(local_data(60, np.float64, 5, rank).reshape(3, 4, 5), order=order)
        ref = x.copy(order=order)
        comm.Allreduce(MPI.IN_PLACE, ref)
        for algorithm in ALGORITHMS:
            y = x.copy(order=order)
            allreduce(y, comm, algorithm)
            m = mismatch(y, ref, comm)
            if m:
                problems.append(f"{algorithm} {order}: {m}")
    all_ranks_agree(not problems, "; ".join(problems))


def test_bad_arguments_raise(comm, all_ranks_agree):
    x = np.arange(12.0)
    cases = [
        (lambda: allreduce(x.copy(), comm, "butterfly"), "algorithm"),
        (lambda: allreduce(np.arange(12.0)[::2], comm, "ring"), "contiguous"),
        (lambda: allreduce(np.ones(3, bool), comm, "ring"), "numbers"),
        (lambda: allreduce(x.copy(), comm, "ring", out=np.zeros(11)), "out"),
        (lambda: allreduce(x.copy(), comm, "ring", out=np.zeros(12, np.float32)), "out"),
        (lambda: allreduce(x.copy(), comm, "multicolor", colors=0), "colors"),
        (lambda: allreduce(x.copy(), comm, "ring", colors=2), "colors"),
    ] + [(lambda name=name: allreduce(x.copy(), comm, name, no_such_option=1), "no_such_option")
         for name in ALGORITHMS]
    failures = []
    for call, word in cases:
        try:
            call()
            failures.append(f"no error (expected one naming {word})")
        except ValueError as err:
            if word not in str(err):
                failures.append(f"message {err!r} does not name {word}")
    all_ranks_agree(not failures, "; ".join(failures))


class FakeDevice(np.ndarray):
    """Host memory that claims to be device memory (exposes ``__cuda_array_interface__``)."""

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ctypes.data, False),
                "strides": None if self.flags.c_contiguous else self.strides, "version": 3}


class FakeCupy:
    """The array module buffers.py uses for device arrays: host copies stand in for transfers."""
    asnumpy = staticmethod(lambda a: np.array(a))
    asarray = staticmethod(lambda a: np.array(a).view(FakeDevice))
    empty = staticmethod(lambda shape, dtype: np.empty(shape, dtype).view(FakeDevice))
    ascontiguousarray = staticmethod(lambda a: np.ascontiguousarray(a).view(FakeDevice))


@pytest.mark.parametrize("cuda_aware", [False, True])
def test_device_buffers_staged_or_direct(comm, all_ranks_agree, monkeypatch, cuda_aware):
    """Device arrays go through refimpl.parallel.buffers: staged via host, or handed over directly."""
    from refimpl.parallel import buffers
    monkeypatch.setattr(buffers, "array_module",
                        lambda *a: FakeCupy if any(isinstance(x, FakeDevice) for x in a) else np)
    monkeypatch.setattr(buffers, "_cuda_aware", cuda_aware)
    problems = []
    for algorithm, options in CONFIGS:
        for n in (0, 1, 37):
            x = local_data(n, np.float64, n, comm.Get_rank())
            ref = x.copy()
            comm.Allreduce(MPI.IN_PLACE, ref)
            dev = x.copy().view(FakeDevice)
            allreduce(dev, comm, algorithm, **options)
            m = mismatch(dev.view(np.ndarray), ref, comm)
            if m:
                problems.append(f"{algorithm}{options} n={n}: {m}")
    all_ranks_agree(not problems, "; ".join(problems[:4]))


# ---------------------------------------------------------------- reduce-scatter / allgather halves

@pytest.mark.parametrize("algorithm,options", CONFIGS, ids=lambda v: str(v))
def test_reduce_scatter_and_allgather_halves(comm, all_ranks_agree, algorithm, options):
    """Every algorithm's halves: reduce_scatter leaves each rank the sum of its block
    (owned_block), allgather restores every block everywhere; together they are the allreduce;
    and the dot-product test <RS(x), y> = <x, AG(y)> (summed over ranks) shows allgather is
    the adjoint of reduce_scatter."""
    from refimpl.parallel.collectives import allgather, halves, owned_block, reduce_scatter
    problems = []
    for n in SIZES:
        x = local_data(n, np.float64, n + 1, comm.Get_rank())
        ref = x.copy()
        comm.Allreduce(MPI.IN_PLACE, ref)
        rs = x.copy()
        lo, hi = reduce_scatter(rs, comm, algorithm, **options)
        if (lo, hi) != owned_block(n, comm):
            problems.append(f"n={n}: block {(lo, hi)}")
        m = mismatch(rs[lo:hi], ref[lo:hi], MPI.COMM_SELF)
        if m:
            problems.append(f"n={n} reduce_scatter: {m}")
        ag = np.zeros(n)
        ag[lo:hi] = rs[lo:hi]
        allgather(ag, comm, algorithm, **options)
        m = mismatch(ag, ref, comm)
        if m:
            problems.append(f"n={n} allgather: {m}")
        # adjoint: <RS(x)_mine, y_mine> summed over ranks == <x, AG(y)> summed over ranks
        y = local_data(n, np.float64, n + 7, comm.Get_rank())
        y_block = np.zeros(n)
        y_block[lo:hi] = y[lo:hi]
        lhs = comm.allreduce(float(np.dot(rs[lo:hi], y[lo:hi])))
        allgather(y_block, comm, algorithm, **options)
        rhs = comm.allreduce(float(np.dot(x, y_block)))
        if abs(lhs - rhs) > 1e-12 * max(1.0, abs(lhs)):
            problems.append(f"n={n} adjoint: {lhs} vs {rhs}")
    all_ranks_agree(not problems, f"{algorithm} ({halves(algorithm, comm.Get_size())}): " + "; ".join(problems[:4]))
