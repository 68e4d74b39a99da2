"""The strict device stand-in (refimpl/strict.py, REFIMPL_BACKEND=strict).

- it refuses what a CuPy array refuses or makes a hidden synchronisation, and counts the
  explicit transfers;
- the models train under it bit-identically to NumPy, with a fixed number of device -> host
  synchronisations per step that does not grow with the number of layers;
- a planted ``float(device array)`` and a planted NumPy call in a layer's forward make the step
  fail under it (and pass unnoticed under NumPy: that is what the stand-in is for);
- under mpiexec, every partitioned layer (check-layer) and training on spatial, data and model
  grids run under it, with device buffers handed to MPI directly and staged, and end
  bit-identical to the NumPy run.
"""
import os
import shutil
import sys

import h5py
import numpy as np
import pytest

from launcher import run_launched
from refimpl import backend, strict
from refimpl.strict import StrictArray, StrictDeviceError, xp

ENV = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMI_", "REFIMPL_"))}
MPI_ENV = dict(ENV, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1")


@pytest.fixture
def strict_backend():
    backend.set_backend("strict")
    strict.reset_counts()
    try:
        yield
    finally:
        backend.set_backend("numpy")


def test_refuses_what_a_device_refuses():
    a = xp.asarray(np.arange(6.0).reshape(2, 3))
    host = np.ones((2, 3))
    refused = [lambda: np.exp(a), lambda: np.asarray(a), lambda: np.sum(a), lambda: float(a[0, 0]),
               lambda: int(a[0, 0]), lambda: bool(a.any()), lambda: [v for v in a], lambda: a.tolist(),
               lambda: a + host, lambda: xp.matmul(a, host.T), lambda: a.__setitem__(0, host[0])]
    for fn in refused:
        with pytest.raises(TypeError):              # StrictDeviceError, or NumPy's for ufuncs
            fn()
    with pytest.raises(StrictDeviceError, match="hidden device -> host synchronisation"):
        float(a.sum())
    with pytest.raises(StrictDeviceError, match="numpy.sum was called on a device array"):
        np.sum(a)


def test_allows_and_counts():
    strict.reset_counts()
    host = np.arange(24.0).reshape(2, 3, 4)
    a = xp.asarray(host)
    assert isinstance(a, StrictArray) and backend.is_device_array(a) and backend.array_module(a) is xp
    b = xp.exp(a) * 2 - a.sum(axis=2, keepdims=True) @ xp.ones((1, 4))
    np.testing.assert_array_equal(backend.to_host(b), np.exp(host) * 2 - host.sum(axis=2, keepdims=True) @ np.ones((1, 4)))
    view = a[:, 1:]
    view += 1                                        # views share memory, as on a device
    assert backend.to_host(a)[0, 1, 0] == host[0, 1, 0] + 1
    s = a.sum()
    assert isinstance(s, StrictArray) and s.shape == ()      # a 0-d array, as CuPy returns
    assert s.item() == (host.sum() + 16)
    assert strict.SYNCS == {"to_host": 2, "item": 1} and strict.sync_count() == 3
    iface = a.__cuda_array_interface__
    assert iface["shape"] == (2, 3, 4) and iface["data"][0] == a._a.ctypes.data


def _step_runner(name, config, batch, seed=0):
    """One training step of ``name`` on one process (forward, loss, backward, gradient
    synchronisation, Adam): returns (step function, model)."""
    from mpi4py import MPI

    from refimpl.models import build_model
    from refimpl.optim import make_optimizer
    from refimpl.parallel.grad_sync import GradientSynchronizer
    model = build_model(name, config, None, seed=seed, dtype=np.float64)
    optimizer = make_optimizer("adam", model.parameters(), lr=1e-3)
    sync = GradientSynchronizer(model.parameters(), MPI.COMM_SELF)
    rng = np.random.default_rng(seed)
    shape = (batch,) + tuple(config["input_shape"])
    x = backend.asarray(rng.standard_normal(shape), dtype=np.float64)
    if name == "cosmoflow":
        y = backend.asarray(rng.uniform(-1, 1, (batch, model.num_outputs)), dtype=np.float64)
    else:
        y = backend.asarray(rng.integers(0, model.num_classes, (batch,) + shape[2:]))

    def step():
        model.train()
        model.zero_grad()
        out = model.forward(x)
        loss, dout, metrics = model.loss(out, y)
        model.backward(dout)
        sync.finish()
        optimizer.step()
        return loss, metrics
    return step, model


SYNCS_PER_STEP = {"cosmoflow": 2, "unet3d": 3}
MODELS = [("cosmoflow", {"input_shape": (4, 16, 16, 16), "conv_size": 4, "n_conv_layers": 2, "fc1_size": 16,
                         "fc2_size": 8, "dropout": 0.5}, 3),
          ("unet3d", {"input_shape": (1, 8, 8, 8), "levels": 2, "base_width": 4, "num_classes": 3}, 2)]


@pytest.mark.parametrize("name, config, batch", MODELS)
def test_models_train_bit_identically_with_few_syncs(name, config, batch, strict_backend, monkeypatch):
    """Three steps under the stand-in equal three NumPy steps bit for bit; the device -> host
    synchronisations per step are a fixed few, the same for a model twice as deep.  (One worker
    thread for NumPy too: a device runs the chunked passes as one kernel, in one order.)"""
    monkeypatch.setenv("REFIMPL_THREADS", "1")
    monkeypatch.setenv("REFIMPL_CONV_SCHEDULE", "device")        # NumPy's convs scheduled as a device's
    results, per_step = {}, {}
    for kind in ("numpy", "strict"):
        backend.set_backend(kind)
        for depth in (1, 2):
            cfg = dict(config, **({"n_conv_layers": config["n_conv_layers"] * depth} if name == "cosmoflow"
                                  else {"levels": config["levels"] + depth - 1}))
            step, model = _step_runner(name, cfg, batch)
            step()
            strict.reset_counts()
            losses = [step()[0] for _ in range(2)]
            per_step[kind, depth] = strict.sync_count() / 2
            results[kind, depth] = (losses, [backend.to_host(p.data) for p in model.parameters()])
    for depth in (1, 2):
        (l_np, p_np), (l_st, p_st) = results["numpy", depth], results["strict", depth]
        assert l_np == l_st and all(np.array_equal(a, b) for a, b in zip(p_np, p_st))
    # CosmoFlow: its loss and MAE to the host; the U-Net: its loss, one label range check (SoftmaxParts
    # validates the labels for every piece) and the hard Dice counts: a fixed few per step, the same
    # for twice the layers
    assert per_step["strict", 1] == per_step["strict", 2] == SYNCS_PER_STEP[name], per_step


def _plant(monkeypatch, hazard):
    """Replace the LeakyReLU / ReLU forward of the layers by one with ``hazard`` planted."""
    from refimpl.nn import activation
    real = activation.leaky_relu

    def planted(x, negative_slope=0.01, **out):
        if hazard == "float":
            if float(x.max()) > 1e9:                  # a host scalar from a device array
                raise RuntimeError("unreachable")
        else:
            np.exp(x[:1])                             # a NumPy call on a device array
        return real(x, negative_slope, **out)
    monkeypatch.setattr(activation, "leaky_relu", planted)


@pytest.mark.parametrize("hazard", ["float", "numpy"])
def test_planted_hazards_fail_under_strict(hazard, monkeypatch, strict_backend):
    _plant(monkeypatch, hazard)
    name, config, batch = MODELS[0]
    backend.set_backend("numpy")
    _step_runner(name, config, batch)[0]()          # unnoticed on the host
    backend.set_backend("strict")
    step, _ = _step_runner(name, config, batch)
    with pytest.raises(TypeError) as err:           # StrictDeviceError (NumPy's TypeError for ufuncs)
        step()
    assert "device" in str(err.value) or "StrictArray" in str(err.value)


# ---------------------------------------------------------------- under mpiexec

def _mpiexec(n, args, env=None, timeout=240):
    """refimpl under mpiexec; started once more if Open MPI's launcher failed before any rank ran."""
    cmd = [shutil.which("mpiexec"), "--oversubscribe", "-n", str(n), sys.executable, "-m", "refimpl"] + args
    return run_launched(cmd, env=dict(MPI_ENV, **(env or {})), timeout=timeout)


LAYERS = [["conv3d", "--out-channels", "5", "--kernel", "3,2,5", "--stride", "2,1,1", "--padding", "1,0,2",
           "--dilation", "1,2,1"],
          ["conv3d", "--out-channels", "4", "--kernel", "3", "--padding", "1"],          # Winograd
          ["conv_transpose3d", "--out-channels", "4", "--kernel", "3", "--stride", "2", "--padding", "1",
           "--output-padding", "1"],
          ["max_pool3d", "--kernel", "3", "--stride", "2", "--padding", "1"],
          ["avg_pool3d", "--kernel", "2"],
          ["batch_norm3d"]]


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
@pytest.mark.parametrize("cuda_aware", ["0", "1"])
def test_every_layer_partitioned_under_strict(cuda_aware):
    for layer in LAYERS:
        for grid in ("1,2,2,1", "2,1,1,2") + (("1,1,1,2,2",) if layer[0] == "conv3d" else ()):
            extra = ["--model-parallel", "filter"] if grid.count(",") == 4 else []
            proc = _mpiexec(4, ["check-layer"] + layer + ["--input", "2,3,11,9,7", "--grid", grid,
                                                           "--dtype", "float64"] + extra,
                            {"REFIMPL_BACKEND": "strict", "REFIMPL_CUDA_AWARE": cuda_aware})
            assert proc.returncode == 0, (layer, grid, proc.stdout[-1500:], proc.stderr[-1500:])
            assert '"ok": true' in proc.stdout


#: The NumPy run of a bit-for-bit comparison schedules its convs as a device does.
NUMPY_AS_DEVICE = {"REFIMPL_CONV_SCHEDULE": "device"}


def _checkpoint_arrays(path):
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return out


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
@pytest.mark.parametrize("model, ranks, grid, extra", [
    ("cosmoflow", 2, "1,2,1,1", []),
    ("cosmoflow", 4, "2,1,2,1", []),
    ("unet3d", 2, "1,1,2,1", []),
    ("cosmoflow", 2, "1,1,1,1,2", ["--model-parallel", "filter"]),
])
def test_training_under_strict_equals_numpy(model, ranks, grid, extra, tmp_path):
    """refimpl train under the stand-in, device buffers staged (CUDA-aware off) and direct (on),
    ends with the NumPy run's checkpoint, every array bit for bit."""
    runs = {}
    for name, env in (("numpy", NUMPY_AS_DEVICE), ("staged", {"REFIMPL_BACKEND": "strict"}),
                      ("direct", {"REFIMPL_BACKEND": "strict", "REFIMPL_CUDA_AWARE": "1"})):
        out = tmp_path / name
        proc = _mpiexec(ranks, ["train", "--model", model, "--preset", "tiny", "--grid", grid, "--steps", "3",
                                "--out", str(out), "--quiet"] + extra, env)
        assert proc.returncode == 0, (name, proc.stdout[-1500:], proc.stderr[-1500:])
        runs[name] = _checkpoint_arrays(out / "checkpoint.h5")
    for name in ("staged", "direct"):
        assert runs[name].keys() == runs["numpy"].keys()
        for key, value in runs["numpy"].items():
            assert np.array_equal(runs[name][key], value), (name, key)


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
def test_resume_on_another_grid_under_strict(tmp_path):
    """A run written on (1,2,1,1) under the stand-in resumes on (2,1,1,1) (checkpoint restore and
    redistribution on device arrays) and ends where the same NumPy runs end, bit for bit."""
    runs = {}
    for name, env in (("numpy", NUMPY_AS_DEVICE), ("strict", {"REFIMPL_BACKEND": "strict"})):
        out = str(tmp_path / name)
        for ranks, grid, steps, more in ((2, "1,2,1,1", "2", []), (2, "2,1,1,1", "3", ["--resume"])):
            proc = _mpiexec(ranks, ["train", "--model", "cosmoflow", "--preset", "tiny", "--grid", grid,
                                    "--steps", steps, "--out", out, "--quiet"] + more, env)
            assert proc.returncode == 0, (name, grid, proc.stdout[-1500:], proc.stderr[-1500:])
        runs[name] = _checkpoint_arrays(os.path.join(out, "checkpoint.h5"))
    assert runs["strict"].keys() == runs["numpy"].keys()
    for key, value in runs["numpy"].items():
        assert np.array_equal(runs["strict"][key], value), key
