"""The reference conv (refimpl/functional/conv3d.py: pad, one slice per tap, one GEMM) and the
kernels checked against it.

- the reference equals PyTorch in float64 (1e-12), forward and backward, conv and transposed
  conv, any stride / padding / dilation, and gradients that cover only the first outputs;
- every fast route of refimpl/kernels/ equals the reference (float64, 1e-10): im2col on the host
  schedule and on the device schedule, the phase grids of strided convs, Winograd (its adjoint
  and its flipped-kernel input gradient), and the fused transposed-conv backward;
- the reference is small: ``REFIMPL_CONV_ALGORITHM=reference`` runs a conv's forward and
  backward through at most 4 files of refimpl/, none of them in refimpl/kernels/;
- the oracle's expectations never run a kernel.
"""
import os
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import refimpl
from refimpl.functional.conv3d import conv3d, conv3d_backward, conv3d_input_grad, conv3d_weight_grad
from refimpl.functional.conv_transpose3d import conv_transpose3d, conv_transpose3d_backward

torch = pytest.importorskip("torch")
ROOT = os.path.dirname(refimpl.__file__)
EXAMPLES = int(os.environ.get("REFIMPL_EXAMPLES", "25"))


def rel(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


@st.composite
def conv_cases(draw):
    """A conv with anisotropic kernel, stride, padding and dilation whose windows fit."""
    k = tuple(draw(st.integers(1, 3)) for _ in range(3))
    s = tuple(draw(st.integers(1, 3)) for _ in range(3))
    d = tuple(draw(st.integers(1, 2)) for _ in range(3))
    p = tuple(draw(st.integers(0, 2)) for _ in range(3))
    size = tuple(max(draw(st.integers(1, 7)), d_ * (k_ - 1) + 1 - 2 * p_) for k_, d_, p_ in zip(k, d, p))
    n, c, f = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    return n, c, f, size, k, s, p, d, draw(st.integers(0, 2 ** 16))


@settings(max_examples=EXAMPLES, deadline=None)
@given(conv_cases())
def test_reference_conv_equals_torch(case):
    n, c, f, size, k, s, p, d, seed = case
    rng = np.random.default_rng(seed)
    x, w, b = rng.standard_normal((n, c) + size), rng.standard_normal((f, c) + k), rng.standard_normal(f)
    y = conv3d(x, w, b, s, p, d, algorithm="reference")
    xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    yt = torch.nn.functional.conv3d(xt, wt, torch.tensor(b), s, p, d)
    assert y.shape == tuple(yt.shape) and rel(y, yt.detach().numpy()) <= 1e-12
    dy = rng.standard_normal(y.shape)
    yt.backward(torch.tensor(dy))
    dx, dw, db = conv3d_backward(dy, x, w, s, p, d, algorithm="reference")
    assert rel(dx, xt.grad.numpy()) <= 1e-12 and rel(dw, wt.grad.numpy()) <= 1e-12
    assert rel(db, dy.sum(axis=(0, 2, 3, 4))) <= 1e-12


@settings(max_examples=EXAMPLES, deadline=None)
@given(conv_cases(), st.data())
def test_reference_transposed_conv_equals_torch(case, data):
    n, c, f, size, k, s, p, d, seed = case
    op = tuple(data.draw(st.integers(0, max(s_, d_) - 1)) for s_, d_ in zip(s, d))
    out = [(e - 1) * s_ - 2 * p_ + d_ * (k_ - 1) + o_ + 1 for e, s_, p_, d_, k_, o_ in zip(size, s, p, d, k, op)]
    if min(out) < 1:
        return
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal((n, c) + size), rng.standard_normal((c, f) + k)
    y = conv_transpose3d(x, w, None, s, p, op, d, algorithm="reference")
    xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    yt = torch.nn.functional.conv_transpose3d(xt, wt, None, s, p, op, 1, d)
    assert y.shape == tuple(yt.shape) and rel(y, yt.detach().numpy()) <= 1e-12
    dy = rng.standard_normal(y.shape)
    yt.backward(torch.tensor(dy))
    dx, dw, _ = conv_transpose3d_backward(dy, x, w, s, p, op, d, algorithm="reference")
    assert rel(dx, xt.grad.numpy()) <= 1e-12 and rel(dw, wt.grad.numpy()) <= 1e-12


# ---------------------------------------------------------------- every kernel route vs the reference

ROUTES = [   # (name, algorithm, REFIMPL_CONV_SCHEDULE, kernel, stride, padding, (C, F), spatial, budget, the
             #  kernels function that must run: (module, name), to prove the route was taken)
    ("im2col, depth taps", "im2col", "host", (3, 2, 3), 1, 1, (3, 5), (9, 10, 11), None,
     ("_im2col", "_forward_depth_taps")),
    ("im2col, depth taps, one GEMM per plane", "im2col", "host", (3, 2, 3), 1, 1, (1, 5), (5, 64, 64),
     None, ("_im2col", "_forward_plane_gemms")),
    ("im2col, width taps as column offsets", "im2col", "host", (3, 3, 3), 1, 1, (3, 5), (5, 6, 24),
     None, ("_width_taps", "forward")),
    ("im2col, bounded tiles", "im2col", "host", (3, 2, 3), 1, 1, (3, 5), (9, 10, 11), 4096, ("_im2col", "col2im")),
    ("im2col, device schedule", "im2col", "device", (3, 2, 3), (1, 2, 1), 1, (3, 5), (9, 10, 11), None,
     ("_im2col_device", "forward")),
    ("im2col, k2 s2 without col2im", "im2col", "host", (2, 2, 2), 2, 0, (4, 6), (8, 8, 8), None,
     ("_im2col", "input_grad_without_overlap")),
    ("im2col, flipped-kernel dx (F <= C)", "im2col", "host", (3, 3, 3), 1, 1, (12, 4), (9, 10, 11), None,
     ("_im2col", "input_grad_by_flipped_kernel")),
    ("1x1x1 kernel: GEMMs on views", "im2col", "host", (1, 1, 1), 1, 0, (3, 5), (9, 10, 11), None,
     ("_pointwise_conv", "backward")),
    ("phase grids (stride 2)", "im2col", "host", (3, 3, 3), 2, 1, (4, 4), (9, 10, 11), None, ("_phase_grid", "forward")),
    ("Winograd, tile chunks", "winograd", "host", (3, 3, 3), 1, 1, (4, 12), (9, 10, 11), None, ("winograd", "chunks")),
    ("Winograd, channel blocks (few tiles)", "winograd", "host", (3, 3, 3), 1, 1, (32, 32), (4, 4, 4), None,
     ("winograd", "_backward_by_channel_blocks")),
    ("Winograd, flipped-kernel dx (F <= C)", "winograd", "host", (3, 3, 3), 1, 1, (12, 4), (9, 10, 11), None,
     ("winograd", "dx_by_flipped_kernel")),
]


@pytest.mark.parametrize("name, algorithm, schedule, k, s, p, cf, spatial, budget, probe", ROUTES,
                         ids=[r[0] for r in ROUTES])
def test_every_conv_route_equals_the_reference(monkeypatch, name, algorithm, schedule, k, s, p, cf, spatial,
                                               budget, probe):
    import importlib
    monkeypatch.setenv("REFIMPL_CONV_SCHEDULE", schedule)
    module = importlib.import_module(f"refimpl.kernels.{probe[0]}")
    ran, original = [], getattr(module, probe[1])
    monkeypatch.setattr(module, probe[1], lambda *a, **kw: ran.append(1) or original(*a, **kw))
    rng = np.random.default_rng(7)
    c, f = cf
    x, w, b = rng.standard_normal((2, c) + spatial), rng.standard_normal((f, c) + k), rng.standard_normal(f)
    want = conv3d(x, w, b, s, p, algorithm="reference")
    assert rel(conv3d(x, w, b, s, p, algorithm=algorithm, max_temp_bytes=budget), want) <= 1e-10
    dy = rng.standard_normal(want.shape)
    ref = conv3d_backward(dy, x, w, s, p, algorithm="reference")
    got = conv3d_backward(dy, x, w, s, p, algorithm=algorithm, max_temp_bytes=budget)
    for a, r in zip(got, ref):
        assert rel(a, r) <= 1e-10
    assert rel(conv3d_input_grad(dy, w, x.shape, s, p, algorithm=algorithm, max_temp_bytes=budget), ref[0]) <= 1e-10
    assert rel(conv3d_weight_grad(dy, x, w.shape, s, p, algorithm=algorithm, max_temp_bytes=budget), ref[1]) <= 1e-10
    assert ran, f"the route {name} did not run ({probe[0]}.{probe[1]} was not called)"


@pytest.mark.parametrize("algorithm", ["im2col", "winograd"])
def test_transposed_conv_routes_equal_the_reference(algorithm):
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((2, 6, 5, 6, 4)), rng.standard_normal((6, 5, 3, 3, 3))
    s, op = (1, 1, 1) if algorithm == "winograd" else (2, 1, 2), (0, 0, 0) if algorithm == "winograd" else (1, 0, 1)
    want = conv_transpose3d(x, w, None, s, 1, op, algorithm="reference")
    assert rel(conv_transpose3d(x, w, None, s, 1, op, algorithm=algorithm), want) <= 1e-10
    dy = rng.standard_normal(want.shape)
    ref = conv_transpose3d_backward(dy, x, w, s, 1, op, algorithm="reference")
    for a, r in zip(conv_transpose3d_backward(dy, x, w, s, 1, op, algorithm=algorithm), ref):
        assert rel(a, r) <= 1e-10


def test_reference_gradients_of_the_first_outputs_only():
    """``dy`` covering the first outputs per axis (transposed conv's output_padding): the rest is zero."""
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((1, 2, 8, 7, 6)), rng.standard_normal((3, 2, 3, 2, 3))
    full = conv3d(x, w, None, 2, 1, algorithm="reference").shape
    part = rng.standard_normal(full[:2] + tuple(e - 1 for e in full[2:]))
    padded = np.zeros(full)
    padded[:, :, :-1, :-1, :-1] = part
    for algorithm in ("reference", "im2col"):
        dx = conv3d_input_grad(part, w, x.shape, 2, 1, algorithm=algorithm)
        dw = conv3d_weight_grad(part, x, w.shape, 2, 1, algorithm=algorithm)
        want_dx, want_dw, _ = conv3d_backward(padded, x, w, 2, 1, algorithm="reference")
        assert rel(dx, want_dx) <= 1e-12 and rel(dw, want_dw) <= 1e-12


# ---------------------------------------------------------------- small enough to read; the oracle rests on it

def traced(fn):
    """(files, functions) of refimpl/ that ``fn()`` calls (comprehensions not counted)."""
    seen = set()

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(ROOT) and not code.co_name.startswith("<"):
            seen.add((os.path.relpath(code.co_filename, ROOT), code.co_name))
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return sorted({f for f, _ in seen}), sorted(seen)


def test_the_reference_conv_reads_in_four_files(monkeypatch):
    """Forward and backward of a conv under REFIMPL_CONV_ALGORITHM=reference: the math
    (functional/conv3d.py) and its argument checks (args.py, backend.py, settings.py), nothing
    of refimpl/kernels/: at most 15 functions, 8 of them the math (60 in 8 files before the split)."""
    monkeypatch.setenv("REFIMPL_CONV_ALGORITHM", "reference")
    rng = np.random.default_rng(0)
    x, w, b = rng.standard_normal((2, 3, 8, 8, 8)), rng.standard_normal((4, 3, 3, 3, 3)), rng.standard_normal(4)

    def run():
        y = conv3d(x, w, b, 1, 1)
        conv3d_backward(np.ones_like(y), x, w, 1, 1)
    files, functions = traced(run)
    assert len(files) <= 4 and not [f for f in files if f.startswith("kernels")], files
    math = {"conv3d", "conv3d_backward", "forward", "im2col", "tap_windows", "col2im", "input_grad", "weight_grad"}
    assert math <= {name for f, name in functions if f == os.path.join("functional", "conv3d.py")}
    assert len(functions) <= 15, functions


def test_oracle_expectations_run_no_kernel():
    """Every case of ``refimpl oracle generate hard`` computes its expectations with the reference:
    no frame of refimpl/kernels/ while they are computed."""
    from refimpl.oracle import expect
    from refimpl.oracle.suite import load_suite
    specs = load_suite("hard")
    assert len({spec.layer for spec in specs}) >= 5
    for spec in specs:
        files, _ = traced(lambda: expect.expectations(spec, "float64"))
        assert "oracle/expect.py" in files
        assert not [f for f in files if f.startswith("kernels")], (spec.layer, files)


def test_the_reference_runs_on_the_device_stand_in():
    """xp-generic: on the strict stand-in of a CuPy array (refimpl/strict.py) the reference conv and
    transposed conv compute the same bits as on NumPy, with no hidden device -> host sync."""
    from refimpl import backend, strict
    previous = backend._backend
    backend.set_backend("strict")
    try:
        xp = backend.get_xp()
        rng = np.random.default_rng(2)
        host = [rng.standard_normal(s) for s in ((2, 3, 6, 5, 4), (4, 3, 3, 2, 3), (4,), (3, 4, 3, 3, 2))]
        x, w, b, wt = (xp.asarray(a) for a in host)
        before = dict(strict.SYNCS)
        y = conv3d(x, w, b, (2, 1, 1), 1, algorithm="reference")
        grads = conv3d_backward(xp.ones_like(y), x, w, (2, 1, 1), 1, algorithm="reference")
        yt = conv_transpose3d(x, wt, None, 2, 1, 1, algorithm="reference")
        grads_t = conv_transpose3d_backward(xp.ones_like(yt), x, wt, 2, 1, 1, algorithm="reference")
        assert strict.SYNCS == before
        y_host = conv3d(*host[:3], (2, 1, 1), 1, algorithm="reference")
        assert np.array_equal(backend.to_host(y), y_host)
        for got, want in zip(grads + grads_t, conv3d_backward(np.ones_like(y_host), *host[:2], (2, 1, 1), 1,
                                                              algorithm="reference")
                             + conv_transpose3d_backward(np.ones(yt.shape), host[0], host[3], 2, 1, 1,
                                                         algorithm="reference")):
            assert np.array_equal(backend.to_host(got), want)
    finally:
        backend._backend = previous
