"""The compressed gradient exchange under mpiexec -n 1, 2, 3, 4, 6, 8: every rank ends with the
same bits, equal to the sum of every rank's decompressed message in rank order; the bytes each
rank sends are the message's; int8's sum is within the quantisation steps of the exact sum."""
import numpy as np
import pytest
from mpi4py import MPI

from refimpl.parallel import compress


@pytest.mark.parametrize("spec", ["int8", "topk:0.05", "topk:1"])
@pytest.mark.parametrize("n", [1, 300, 1031])
def test_exchange(comm, all_ranks_agree, spec, n):
    rank = comm.Get_rank()
    g = np.random.default_rng([n, rank]).standard_normal(n).astype(np.float32)
    exact = g.astype(np.float64).copy()
    comm.Allreduce(MPI.IN_PLACE, exact)
    c = compress.Compressor(spec, comm)
    out = g.copy()
    c.exchange(out, 0)
    kind, ratio = compress.parse(spec)
    # the sum of the decompressed messages, by hand, in rank order
    parts = c._encode(g.copy())
    gathered = [comm.allgather(np.asarray(p)) for p in parts]
    by_hand = np.zeros(n, np.float32)
    for r in range(comm.Get_size()):
        by_hand += c._decode([part[r] for part in gathered], n, np.float32)
    problems = []
    if not np.array_equal(out, by_hand):
        problems.append("not the rank-order sum of the messages")
    if len(set(comm.allgather(out.tobytes()))) != 1:
        problems.append("ranks differ")
    if c.bytes_sent != compress.message_bytes(kind, n, ratio):
        problems.append(f"bytes {c.bytes_sent}")
    if kind == "int8":
        steps = comm.allreduce(np.repeat(compress.int8_encode(g)[1], compress.INT8_BLOCK)[:n] / 2)
        if not np.all(np.abs(out - exact) <= steps * 1.001 + 1e-5):
            problems.append("int8 beyond half a step per rank")
    if spec == "topk:1" and not np.allclose(out, exact, rtol=1e-5, atol=1e-5):
        problems.append("topk:1 is not the sum")
    all_ranks_agree(not problems, f"{spec} n={n}: {problems}")
