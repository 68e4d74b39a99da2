"""parallel/compress.py: the codecs' bounds and byte counts, error feedback's bookkeeping, and
the settings (the exchange under mpiexec is tests/mpi/test_compress_mpi.py)."""
import numpy as np
import pytest
from mpi4py import MPI

from refimpl.parallel import compress


@pytest.mark.parametrize("spec, parsed", [("none", ("none", None)), ("int8", ("int8", None)),
                                          ("topk:0.01", ("topk", 0.01)), ("topk:1", ("topk", 1.0))])
def test_parse(spec, parsed):
    assert compress.parse(spec) == parsed


@pytest.mark.parametrize("spec", ["int4", "topk", "topk:0", "topk:1.5", "topk:x", "topk:-0.1", "", 3, None])
def test_parse_refuses(spec):
    with pytest.raises(ValueError, match="compress must be 'none', 'int8' or 'topk:RATIO'"):
        compress.parse(spec)


@pytest.mark.parametrize("n", [1, 255, 256, 1000, 4097])
def test_int8_round_trip_within_half_a_step(n):
    g = np.random.default_rng(n).standard_normal(n).astype(np.float32) * np.linspace(0.01, 10, n, dtype=np.float32)
    codes, scales = compress.int8_encode(g)
    back = compress.int8_decode(codes, scales, n, np.float32)
    step = np.repeat(scales, compress.INT8_BLOCK)[:n]
    assert np.all(np.abs(back - g) <= step / 2 * (1 + 1e-6) + 1e-12)
    assert codes.nbytes + scales.nbytes == compress.message_bytes("int8", n)
    assert np.all(compress.int8_decode(*compress.int8_encode(np.zeros(n, np.float32)), n, np.float32) == 0)


@pytest.mark.parametrize("n, ratio", [(1, 0.01), (100, 0.01), (1000, 0.05), (777, 1.0)])
def test_topk_keeps_the_largest(n, ratio):
    g = np.random.default_rng(n).standard_normal(n)
    index, values = compress.topk_encode(g, ratio)
    k = max(1, int(np.ceil(ratio * n)))
    assert index.size == k and np.all(np.diff(index) > 0)
    assert np.abs(g[index]).min() >= np.sort(np.abs(g))[n - k]
    back = compress.topk_decode(index, values, n, np.float64)
    assert np.array_equal(back[index], g[index].astype(np.float32)) and np.count_nonzero(back) <= k
    assert index.nbytes + values.nbytes == compress.message_bytes("topk", n, ratio)


@pytest.mark.parametrize("spec", ["int8", "topk:0.1"])
def test_error_feedback_keeps_what_was_dropped(spec):
    """On one rank the exchange returns D(C(g + r)) and leaves r' = g + r - D(C(g + r)): over
    steps, sum of what was applied + the last residual = sum of the gradients (nothing is lost);
    without error feedback the residual stays empty and the loss of top-k accumulates."""
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal(500).astype(np.float32) for _ in range(6)]
    with_ef = compress.Compressor(spec, MPI.COMM_SELF)
    without = compress.Compressor(spec, MPI.COMM_SELF, error_feedback=False)
    applied, applied_no = np.zeros(500), np.zeros(500)
    for g in grads:
        a, b = g.copy(), g.copy()
        with_ef.exchange(a, 0)
        without.exchange(b, 0)
        applied += a
        applied_no += b
    total = np.sum(grads, axis=0, dtype=np.float64)
    np.testing.assert_allclose(applied + with_ef.residuals[0], total, atol=1e-4)
    assert without.residuals == {}
    assert np.abs(applied - total).max() < np.abs(applied_no - total).max()
    per_step = compress.message_bytes(*compress.parse(spec)[:1], 500, compress.parse(spec)[1])
    assert with_ef.bytes_sent == 6 * per_step
