"""GradientSynchronizer under mpiexec: bucketed, overlapped gradient averaging.

Fake parameters get random float64 gradients on every rank through
``Parameter.accumulate_grad`` (what a layer's backward calls), in backward
order; after ``finish()`` each gradient must equal the oracle computed with a
plain ``comm.allreduce``: the sum over the product (data x spatial) group
divided by the data-group size.
"""
import numpy as np
import pytest
from mpi4py import MPI

from refimpl.nn.parameter import Parameter
from refimpl.parallel.allreduce import ALGORITHMS, configurations
from refimpl.parallel.grad_sync import GradientSynchronizer, make_buckets

SHAPES = [(4, 3, 3, 3, 3), (4,), (8, 4, 3, 3, 3), (8,), (8,), (16, 8), (16,), (1,), (5, 7)]
BUCKET_SIZES = {"one per param": (0, 0), "small": (700, 300), "default": (25 << 20, 1 << 20),
                "one giant": (1 << 40, 1 << 40)}


def make_params(dtype=np.float64):
    return [Parameter(np.zeros(s, dtype), name=f"p{i}") for i, s in enumerate(SHAPES)]


def random_grads(rank, step, dtype=np.float64):
    rng = np.random.default_rng([rank, step, 99])
    return [rng.standard_normal(s).astype(dtype) for s in SHAPES]


def backward(params, grads, skip=()):
    """What backward does: layers in reverse order, each accumulating its gradients."""
    for i in reversed(range(len(params))):
        if i not in skip:
            params[i].accumulate_grad(grads[i])


def expected(comm, grads, divide_by):
    return [comm.allreduce(g, op=MPI.SUM) / divide_by for g in grads]


def errors(params, want):
    """Largest relative error over all parameters (grad None counts as a failure)."""
    worst = 0.0
    for param, w in zip(params, want):
        if param.grad is None or param.grad.shape != w.shape or param.grad.dtype != w.dtype:
            return float("inf")
        worst = max(worst, float(np.abs(param.grad - w).max() / max(np.abs(w).max(), 1e-300)))
    return worst


def same_on_all_ranks(comm, params):
    digests = comm.allgather(b"".join(p.grad.tobytes() for p in params))
    return all(d == digests[0] for d in digests)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("sizes", list(BUCKET_SIZES), ids=str)
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_average_over_data_comm(comm, all_ranks_agree, algorithm, sizes, overlap):
    bucket_bytes, first = BUCKET_SIZES[sizes]
    params = make_params()
    sync = GradientSynchronizer(params, comm, bucket_bytes=bucket_bytes, first_bucket_bytes=first,
                                algorithm=algorithm, overlap=overlap)
    worst = 0.0
    for step in range(2):  # the second step reuses the buckets
        for p in params:
            p.zero_grad()
        grads = random_grads(comm.Get_rank(), step)
        backward(params, grads)
        sync.finish()
        worst = max(worst, errors(params, expected(comm, grads, comm.Get_size())))
    record = sync.history[-1]
    started = record["started_in_backward"]
    ok_overlap = started == (len(sync.buckets) if overlap else 0)
    all_ranks_agree(worst < 1e-13 and same_on_all_ranks(comm, params) and ok_overlap
                    and len(sync.history) == 2 and record["wait_s"] >= 0,
                    f"err={worst:.3e} started={started}/{len(sync.buckets)} record={record}")


def test_bucket_layout():
    """Reverse order, first bucket small, caps respected, one dtype per bucket."""
    params = make_params()
    rev = params[::-1]
    per_param = make_buckets(rev, 0, 0)
    giant = make_buckets(rev, 1 << 40, 1 << 40)
    small = make_buckets(rev, 700, 300)
    assert [b.params for b in per_param] == [[p] for p in rev]
    assert len(giant) == 1 and giant[0].params == rev
    assert [p for b in small for p in b.params] == rev
    assert small[0].nbytes <= 300 or len(small[0].params) == 1
    assert all(b.nbytes <= 700 or len(b.params) == 1 for b in small[1:])
    mixed = make_buckets([Parameter(np.zeros(3)), Parameter(np.zeros(3, np.float32)), Parameter(np.zeros(3))],
                         1 << 20, 1 << 20)
    assert [len(b.params) for b in mixed] == [1, 1, 1]


def test_float32_gradients(comm, all_ranks_agree):
    params = make_params(np.float32)
    sync = GradientSynchronizer(params, comm, bucket_bytes=500, first_bucket_bytes=100, algorithm="ring")
    grads = random_grads(comm.Get_rank(), 7, np.float32)
    backward(params, grads)
    sync.finish()
    exact = expected(comm, [g.astype(np.float64) for g in grads], comm.Get_size())
    err = errors(params, [w.astype(np.float32) for w in exact])  # dtype kept, float32 rounding
    all_ranks_agree(err < 1e-5, f"err={err:.3e}")


def test_unused_parameters_count_as_zeros(comm, all_ranks_agree):
    """A parameter unused everywhere ends as zeros; one unused on rank 0 only averages the others."""
    rank, p = comm.Get_rank(), comm.Get_size()
    params = make_params()
    sync = GradientSynchronizer(params, comm, bucket_bytes=200, first_bucket_bytes=100, algorithm="ring")
    grads = random_grads(rank, 3)
    skip = {2} | ({5} if rank == 0 else set())
    backward(params, grads, skip=skip)
    sync.finish()
    used = [np.zeros_like(g) if i in skip else g for i, g in enumerate(grads)]
    err = errors(params, expected(comm, used, p))
    zero = np.abs(params[2].grad).max()
    all_ranks_agree(err < 1e-13 and zero == 0.0, f"err={err:.3e} unused={zero}")


def test_no_sync_accumulates_locally(comm, all_ranks_agree):
    rank = comm.Get_rank()
    params = make_params()
    sync = GradientSynchronizer(params, comm, bucket_bytes=400, first_bucket_bytes=100, algorithm="native")
    micro = [random_grads(rank, s) for s in range(3)]
    with sync.no_sync():
        backward(params, micro[0])
        sync.finish()  # a no-op inside no_sync
        backward(params, micro[1])
    local = [a + b for a, b in zip(micro[0], micro[1])]
    err_local = errors(params, local)
    backward(params, micro[2])  # the synchronised step reduces the accumulated sum
    sync.finish()
    total = [a + b + c for a, b, c in zip(*micro)]
    err = errors(params, expected(comm, total, comm.Get_size()))
    all_ranks_agree(err_local < 1e-15 and err < 1e-13 and len(sync.history) == 1,
                    f"local err={err_local:.3e} synced err={err:.3e} steps={len(sync.history)}")


def grid_shape(p):
    """(model, data, spatial) with model*data*spatial == p; a prime p gives data=p, spatial=1."""
    spatial = 2 if p % 2 == 0 else 1
    rest = p // spatial
    data = 2 if rest % 2 == 0 and rest > 2 else rest
    return rest // data, data, spatial


@pytest.mark.parametrize("overlap", [True, False])
def test_spatial_sum_data_average(comm, all_ranks_agree, overlap):
    """Sum over the spatial group, average over the data group: one reduction, no double count.

    Parameters marked ``spatial_replicated`` are averaged over both groups.  The world is split (model, data, spatial) row-major; with 8 ranks the product
    group data x spatial is a proper subgroup (one per model index).
    """
    rank = comm.Get_rank()
    model_n, data_n, spatial_n = grid_shape(comm.Get_size())
    m, rem = divmod(rank, data_n * spatial_n)
    d, s = divmod(rem, spatial_n)
    data_comm = comm.Split(color=m * spatial_n + s, key=d)
    spatial_comm = comm.Split(color=m * data_n + d, key=s)
    product = comm.Split(color=m, key=rem)  # the oracle's group
    params = make_params()
    replicated = [3, 6]  # e.g. biases of a replicated head: equal on every spatial rank
    for i in replicated:
        params[i].spatial_replicated = True
    sync = GradientSynchronizer(params, data_comm, spatial_comm, bucket_bytes=600, first_bucket_bytes=200,
                                algorithm="ring", overlap=overlap)
    grads = random_grads(rank, 11)
    for i in replicated:  # the same gradient on every spatial rank of a data replica
        grads[i] = random_grads(m * data_n + d, 12)[i]
    backward(params, grads)
    sync.finish()
    want = expected(product, grads, data_n)
    for i in replicated:  # averaged over data and spatial: the spatial ranks' common value, data-averaged
        want[i] = data_comm.allreduce(grads[i], op=MPI.SUM) / data_n
    err = errors(params, want)
    sizes = (sync.reduce_comm.Get_size(), data_comm.Get_size(), spatial_comm.Get_size())
    for c in (data_comm, spatial_comm, product):
        c.Free()
    all_ranks_agree(err < 1e-13 and sizes == (data_n * spatial_n, data_n, spatial_n),
                    f"err={err:.3e} sizes={sizes} grid={(model_n, data_n, spatial_n)}")


def test_gradient_after_its_bucket_left_raises(comm, all_ranks_agree):
    params = make_params()
    sync = GradientSynchronizer(params, comm, bucket_bytes=0, first_bucket_bytes=0)
    grads = random_grads(comm.Get_rank(), 0)
    backward(params, grads)
    try:
        params[-1].accumulate_grad(grads[-1])
        raised = False
    except RuntimeError:
        raised = True
    sync.finish()
    all_ranks_agree(raised, "a late gradient was silently ignored")


def test_bad_arguments(comm, all_ranks_agree):
    failures = []
    for kwargs, word in [({"algorithm": "butterfly"}, "algorithm"), ({"bucket_bytes": -1}, "bucket_bytes"),
                         ({"first_bucket_bytes": 1.5}, "first_bucket_bytes"),
                         ({"algorithm": "ring", "colors": 2}, "colors"),
                         ({"algorithm": "multicolor", "colors": 0}, "colors"),
                         ({"algorithm": "hierarchical", "group_size": comm.Get_size() + 1}, "group_size")]:
        try:
            GradientSynchronizer(make_params(), comm, **kwargs)
            failures.append(f"{kwargs}: no error")
        except ValueError as err:
            if word not in str(err):
                failures.append(f"{kwargs}: {err}")
    all_ranks_agree(not failures, "; ".join(failures))


@pytest.mark.parametrize("algorithm,options", [c for c in configurations() if c[1]], ids=str)
def test_algorithm_options_reach_the_allreduce(comm, all_ranks_agree, monkeypatch, algorithm, options):
    """Every option value the registry tests (``--allreduce-option``) is handed to each allreduce of the
    synchroniser, and the average is still right."""
    from refimpl.parallel import grad_sync
    seen = []

    def recording(buf, reduce_comm, name, **kw):
        seen.append((name, kw))
        return start(buf, reduce_comm, name, **kw)
    start = grad_sync.start_allreduce
    monkeypatch.setattr(grad_sync, "start_allreduce", recording)
    params = make_params()
    sync = GradientSynchronizer(params, comm, bucket_bytes=700, first_bucket_bytes=300, algorithm=algorithm,
                                **options)
    grads = random_grads(comm.Get_rank(), 3)
    backward(params, grads)
    sync.finish()
    worst = errors(params, expected(comm, grads, comm.Get_size()))
    all_ranks_agree(worst < 1e-13 and seen and all(s == (algorithm, options) for s in seen),
                    f"err={worst:.3e} calls={seen[:3]}")


def test_bad_option_raises_before_any_message(comm, all_ranks_agree):
    """hierarchical's group_size must divide the ranks of the reduce group: ValueError on every rank,
    naming it, before any message."""
    p = comm.Get_size()
    problems = []
    for g in [0, p + 1] + [g for g in range(2, p) if p % g]:
        try:
            GradientSynchronizer(make_params(), comm, algorithm="hierarchical", group_size=g)
            problems.append(f"group_size={g}: no error")
        except ValueError as err:
            if "group_size" not in str(err):
                problems.append(f"group_size={g}: {err}")
    comm.Barrier()
    if comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
        problems.append("a message was sent")
    all_ranks_agree(not problems, "; ".join(problems))
