"""refimpl.nn layers vs equivalent PyTorch models with the same weights (float64)."""
import numpy as np
import pytest

from refimpl.nn.activation import LeakyReLU, ReLU, ScaledTanh, Tanh
from refimpl.nn.batch_norm import BatchNorm3d
from refimpl.nn.conv import Conv3d, ConvTranspose3d
from refimpl.nn.dropout import Dropout
from refimpl.nn.linear import Flatten, Linear
from refimpl.nn.module import Module, Sequential
from refimpl.nn.pooling import AvgPool3d, MaxPool3d

torch = pytest.importorskip("torch", reason="PyTorch absent: pip install 'refimpl[oracle]'")
tnn = torch.nn


def rel_err(a, b, floor=1e-300):
    """max|a - b| / max(max|b|, floor)."""
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(np.max(np.abs(b)), floor))


def classifier(rng, dtype=np.float64):
    """conv -> bn -> relu -> pool -> flatten -> linear, input (N, 2, 7, 6, 5)."""
    return Sequential(
        Conv3d(2, 3, (3, 2, 3), stride=(1, 2, 1), padding=(1, 0, 2), rng=rng, dtype=dtype),
        BatchNorm3d(3, dtype=dtype),
        ReLU(),
        MaxPool3d(2, stride=(2, 1, 2), padding=(1, 0, 0)),
        Flatten(),
        Linear(3 * 4 * 2 * 3, 4, rng=rng, dtype=dtype))


def torch_classifier():
    return tnn.Sequential(
        tnn.Conv3d(2, 3, (3, 2, 3), stride=(1, 2, 1), padding=(1, 0, 2)),
        tnn.BatchNorm3d(3), tnn.ReLU(), tnn.MaxPool3d(2, stride=(2, 1, 2), padding=(1, 0, 0)),
        tnn.Flatten(), tnn.Linear(3 * 4 * 2 * 3, 4)).double()


def upsampler(rng, dtype=np.float64):
    """deconv -> leaky -> avgpool -> conv(dilated) -> bn -> tanh -> flatten -> linear -> 1.2 tanh."""
    return Sequential(
        ConvTranspose3d(2, 3, (3, 2, 2), stride=(2, 1, 2), padding=(1, 0, 0), output_padding=(1, 0, 1),
                        dilation=(1, 2, 1), rng=rng, dtype=dtype),
        LeakyReLU(0.3),
        AvgPool3d((2, 1, 3), stride=(1, 2, 2), padding=(1, 0, 1)),
        Conv3d(3, 2, 2, dilation=(2, 1, 1), bias=False, rng=rng, dtype=dtype),
        BatchNorm3d(2, dtype=dtype), Tanh(), Flatten(),
        Linear(80, 3, rng=rng, dtype=dtype), ScaledTanh(1.2))


class TorchScaledTanh(tnn.Module):
    def forward(self, x):
        return 1.2 * torch.tanh(x)


def torch_upsampler():
    return tnn.Sequential(
        tnn.ConvTranspose3d(2, 3, (3, 2, 2), stride=(2, 1, 2), padding=(1, 0, 0),
                            output_padding=(1, 0, 1), dilation=(1, 2, 1)),
        tnn.LeakyReLU(0.3), tnn.AvgPool3d((2, 1, 3), stride=(1, 2, 2), padding=(1, 0, 1)),
        tnn.Conv3d(3, 2, 2, dilation=(2, 1, 1), bias=False), tnn.BatchNorm3d(2), tnn.Tanh(),
        tnn.Flatten(), tnn.Linear(80, 3), TorchScaledTanh()).double()


def copy_to_torch(model, tmodel):
    state = {k: torch.tensor(v) for k, v in model.state_dict().items()}
    missing, unexpected = tmodel.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("num_batches_tracked") for k in missing)


def compare_with_torch(model, tmodel, x_shape, seed, steps=2):
    """Train-mode forward/backward for ``steps`` steps, then an eval forward; all vs torch."""
    rng = np.random.default_rng(seed)
    copy_to_torch(model, tmodel)
    for _ in range(steps):
        x = rng.standard_normal(x_shape)
        xt = torch.tensor(x, requires_grad=True)
        yt = tmodel(xt)
        y = model.forward(x)
        assert rel_err(y, yt.detach().numpy()) <= 1e-10
        dy = rng.standard_normal(y.shape)
        yt.backward(torch.tensor(dy))
        assert rel_err(model.backward(dy), xt.grad.numpy()) <= 1e-10
    tparams = dict(tmodel.named_parameters())
    # accumulated over the steps, as in torch; a conv bias feeding batch norm has a true
    # gradient of exactly 0 (rounding noise ~1e-15): hence the floor of 1 on the scale
    for name, p in model.named_parameters():
        assert rel_err(p.grad, tparams[name].grad.numpy(), floor=1.0) <= 1e-10, name
    tbuffers = dict(tmodel.named_buffers())
    for name, b in model.named_buffers():
        assert rel_err(b, tbuffers[name].numpy()) <= 1e-10, name
    model.eval(), tmodel.eval()
    x = rng.standard_normal(x_shape)
    assert rel_err(model.forward(x), tmodel(torch.tensor(x)).detach().numpy()) <= 1e-10


@pytest.mark.parametrize("seed", [0, 1])
def test_classifier_matches_torch(seed):
    compare_with_torch(classifier(np.random.default_rng(seed)), torch_classifier(), (3, 2, 7, 6, 5), seed)


def test_upsampler_matches_torch():
    model = upsampler(np.random.default_rng(5))
    compare_with_torch(model, torch_upsampler(), (2, 2, 3, 4, 4), 5)


def test_names_order_and_state_dict_keys_match_torch():
    model = classifier(np.random.default_rng(0))
    tkeys = [k for k in torch_classifier().state_dict() if not k.endswith("num_batches_tracked")]
    assert sorted(model.state_dict()) == sorted(tkeys)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in torch_classifier().named_parameters()]
    assert [p.name for p in model.parameters()] == [n for n, _ in model.named_parameters()]


# ------------------------------------------------ Sequential: max pooling before a monotone activation

def test_sequential_pools_before_a_non_decreasing_activation_unless_told():
    """run_order swaps (activation, max pool) where the activation is non-decreasing (ReLU,
    LeakyReLU with a slope >= 0); never an average pool, a negative slope, or with
    pool_first=False; pool_first takes only a bool."""
    def order(*layers, **kw):
        seq = Sequential(*layers, **kw)
        return [type(m).__name__ for m in seq.run_order()], [type(m).__name__ for m in seq]
    pool = lambda: MaxPool3d(2)                                          # noqa: E731
    assert order(LeakyReLU(0.1), pool(), Tanh())[0] == ["MaxPool3d", "LeakyReLU", "Tanh"]
    assert order(ReLU(), pool(), ReLU(), pool(), Tanh())[0] == ["MaxPool3d", "ReLU", "MaxPool3d", "ReLU", "Tanh"]
    assert order(LeakyReLU(0.0), pool(), Tanh())[0][:2] == ["MaxPool3d", "LeakyReLU"]
    assert order(Tanh(), ReLU(), pool())[0] == ["Tanh", "MaxPool3d", "ReLU"]          # the pool last
    for layers, kw in (((LeakyReLU(-0.5), pool(), Tanh()), {}), ((ReLU(), AvgPool3d(2), Tanh()), {}),
                       ((Tanh(), pool(), ReLU()), {}), ((ReLU(), pool(), Tanh()), {"pool_first": False})):
        ran, written = order(*layers, **kw)
        assert ran == written
    with pytest.raises(ValueError, match="pool_first must be True or False"):
        Sequential(ReLU(), pool_first=1)


def test_a_swapped_activation_at_the_end_leaves_the_callers_gradient_alone():
    """With the pool last, the activation's backward runs first: a dy-reusing one gets a copy of
    the caller's dy (which the written order, the pool's backward first, never writes either)."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 6, 6, 6))
    dy = rng.standard_normal((2, 3, 3, 3, 3))
    kept = dy.copy()
    seqs = [Sequential(Tanh(), LeakyReLU(0.2, reuse_grad=True), MaxPool3d(2), pool_first=flag)
            for flag in (True, False)]
    assert [type(m).__name__ for m in seqs[0].run_order()] == ["Tanh", "MaxPool3d", "LeakyReLU"]
    dxs = []
    for seq in seqs:
        seq.forward(x.copy())
        dxs.append(seq.backward(dy))
        assert np.array_equal(dy, kept)
    assert np.array_equal(dxs[0], dxs[1])


def _both_orders(make, x, dy):
    """(y, dx) of Sequential(*make()) in its run order and in the written order."""
    out = []
    for pool_first in (True, False):
        seq = Sequential(*make(), pool_first=pool_first)
        y = seq.forward(x.copy())
        out.append((y.copy(), seq.backward(dy.copy())))
    return out


POOLS = [dict(kernel_size=2), dict(kernel_size=(3, 2, 2), stride=(1, 2, 2), padding=(1, 0, 1)),
         dict(kernel_size=2, stride=(2, 1, 2), dilation=(1, 2, 1), ceil_mode=True)]


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("act", ["relu", "leaky", "leaky_steep"])
def test_pool_first_gives_the_written_orders_output_bits_and_its_gradient(pool, dtype, act):
    """The same y bit for bit (ties, NaN, -0 and +0, -inf, negatives a ReLU maps to one 0; no input
    LeakyReLU rounds to zero, see the next test), in place and dy-reusing activations included;
    the same dx: bit for bit for ReLU (ties too), for LeakyReLU where windows do not overlap,
    else to rounding (a slope times a sum against a sum of slope times each).  Large enough that
    the pooling kernel's blocks run."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 70, 33, 34)).astype(dtype)
    flat = x.reshape(-1)
    x[..., ::3] = np.round(x[..., ::3])                                  # ties, and zeros
    flat[::1013], flat[5::1019], flat[7::1021], flat[9::1031] = np.nan, -0.0, 0.0, -np.inf
    if act == "relu":
        make = lambda: [ReLU(in_place=True, reuse_grad=True), MaxPool3d(**pool), Tanh()]     # noqa: E731
    else:
        slope = 0.01 if act == "leaky" else 2.5
        make = lambda: [LeakyReLU(slope, in_place=True, reuse_grad=True), MaxPool3d(**pool), Tanh()]  # noqa: E731
    y_shape = Sequential(*make()).forward(x.copy()).shape
    dy = rng.standard_normal(y_shape).astype(dtype)
    (y, dx), (y_written, dx_written) = _both_orders(make, x, dy)
    assert y.dtype == dtype and np.array_equal(y, y_written, equal_nan=True)
    assert np.array_equal(np.signbit(y), np.signbit(y_written))
    overlapping = pool is not POOLS[0]                    # (POOLS[2]: stride 1 < 2 taps along H)
    if act == "relu" or not overlapping:           # (LeakyReLU's ties by rounding: none in these inputs)
        assert np.array_equal(dx, dx_written, equal_nan=True)
    else:
        finite = np.isfinite(dx_written)
        assert np.array_equal(finite, np.isfinite(dx))
        tol = 1e-6 if dtype == np.float32 else 1e-15
        assert np.max(np.abs(dx - dx_written)[finite]) <= tol * np.max(np.abs(dx_written[finite]))


def test_pool_first_sends_a_rounding_tie_to_the_larger_input():
    """The documented differences: two negative inputs of one window that LeakyReLU rounds to
    one float32 are a tie in the written order (the first gets the gradient) but not in the pool's
    (the larger does); the window's gradient is the same, only its place differs.  And a negative
    input it rounds to -0 next to a +0: the same zero output, its sign may differ."""
    s = np.float32(0.01)
    a = np.float32(-1.0)
    for _ in range(100):             # an input whose next float32 LeakyReLU rounds to the same value
        b = np.nextafter(a, np.float32(0))
        if np.float32(s * b) == np.float32(s * a):
            break
        a = b
    assert a < b and np.float32(s * a) == np.float32(s * b)
    x = np.full((1, 1, 2, 2, 2), -5.0, dtype=np.float32)
    x[0, 0, 0, 0, 0], x[0, 0, 0, 0, 1] = a, b                          # the smaller first in scan order
    dy = np.full((1, 1, 1, 1, 1), 3.0, dtype=np.float32)
    make = lambda: [LeakyReLU(0.01), MaxPool3d(2), Tanh()]                # noqa: E731
    (y, dx), (y_written, dx_written) = _both_orders(make, x, dy)
    assert np.array_equal(y, y_written)
    assert dx_written[0, 0, 0, 0, 0] != 0 and dx_written[0, 0, 0, 0, 1] == 0
    assert dx[0, 0, 0, 0, 0] == 0 and dx[0, 0, 0, 0, 1] == dx_written[0, 0, 0, 0, 0]
    assert np.count_nonzero(dx) == np.count_nonzero(dx_written) == 1
    # a negative input LeakyReLU rounds to -0 next to a +0: the same value, the zero's sign may differ
    x[0, 0, 0, 0, 0], x[0, 0, 0, 0, 1] = 0.0, -1e-45
    (y, _), (y_written, _) = _both_orders(make, x, dy)
    assert y == y_written == 0 and np.signbit(y) != np.signbit(y_written)


def test_default_init_bounds_dtype_and_reproducibility():
    conv = Conv3d(4, 8, (3, 3, 2), rng=np.random.default_rng(0))
    deconv = ConvTranspose3d(4, 8, 3, rng=np.random.default_rng(0))
    lin = Linear(50, 10, rng=np.random.default_rng(0))
    for layer, fan_in in ((conv, 4 * 18), (deconv, 8 * 27), (lin, 50)):
        bound = 1 / np.sqrt(fan_in)
        for p in layer.parameters():
            assert p.data.dtype == np.float32
            assert np.abs(p.data).max() <= bound
        assert np.abs(layer.weight.data).max() > 0.9 * bound     # fills the interval
    again = Conv3d(4, 8, (3, 3, 2), rng=np.random.default_rng(0))
    assert np.array_equal(conv.weight.data, again.weight.data) and np.array_equal(conv.bias.data, again.bias.data)
    other = Conv3d(4, 8, (3, 3, 2), rng=np.random.default_rng(1))
    assert not np.array_equal(conv.weight.data, other.weight.data)
    with pytest.raises(ValueError, match="rng must be a numpy.random.Generator"):
        Conv3d(1, 1, 1, rng=0)


def test_zero_grad_and_accumulation():
    model = classifier(np.random.default_rng(2))
    ready = []
    for p in model.parameters():
        p.on_grad_ready = lambda param: ready.append(param.name)
    x = np.random.default_rng(3).standard_normal((2, 2, 7, 6, 5))
    dy = np.random.default_rng(4).standard_normal(model.forward(x).shape)
    model.backward(dy)
    first = {n: p.grad.copy() for n, p in model.named_parameters()}
    # backward order: last layer first; each parameter reported once
    assert ready == ["5.weight", "5.bias", "1.weight", "1.bias", "0.weight", "0.bias"]
    model.forward(x)  # same batch: same batch-norm statistics, same gradients, added
    model.backward(dy)
    for n, p in model.named_parameters():
        assert rel_err(p.grad, 2 * first[n], floor=1.0) <= 1e-12, n
    model.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(RuntimeError, match="backward called without a forward"):
        model.backward(dy)


def test_state_dict_round_trip():
    src = classifier(np.random.default_rng(6))
    x = np.random.default_rng(7).standard_normal((2, 2, 7, 6, 5))
    src.forward(x)                       # moves the running statistics
    state = src.state_dict()
    dst = classifier(np.random.default_rng(8))
    dst.load_state_dict(state)
    for (name, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert np.array_equal(a, b), name
    src.eval(), dst.eval()
    assert np.array_equal(src.forward(x), dst.forward(x))
    state["0.weight"][...] = 0           # a copy: the model is untouched
    assert np.abs(src[0].weight.data).max() > 0
    with pytest.raises(ValueError, match=r"missing \['5.bias'\]"):
        dst.load_state_dict({k: v for k, v in state.items() if k != "5.bias"})
    with pytest.raises(ValueError, match="has shape"):
        dst.load_state_dict({**state, "1.running_mean": np.zeros(4)})


def test_dropout_layer():
    x = np.random.default_rng(9).standard_normal((2, 3, 4, 4, 4))
    layer = Dropout(0.25, seed=3)
    y1 = layer.forward(x)
    dx = layer.backward(np.ones_like(x))
    kept = y1 != 0
    assert np.allclose(y1[kept], x[kept] / 0.75) and np.allclose(dx[kept], 1 / 0.75)
    assert np.all(dx[~kept] == 0)
    y2 = layer.forward(x)
    assert not np.array_equal(y1 != 0, y2 != 0)                  # a fresh mask per step
    replay = Dropout(0.25, seed=3)
    assert np.array_equal(replay.forward(x), y1)                 # reproducible from the seed
    layer.eval()
    assert layer.forward(x) is x and layer.backward(x) is x


def test_train_eval_propagate_and_bad_arguments():
    model = classifier(np.random.default_rng(0))
    model.eval()
    assert not any(m.training for m in model)
    model.train()
    assert all(m.training for m in model)
    with pytest.raises(ValueError, match="x has 4 channels but BatchNorm3d expects 3"):
        BatchNorm3d(3).forward(np.ones((2, 4, 2, 2, 2), np.float32))
    with pytest.raises(ValueError, match="in_channels must be a positive integer"):
        Conv3d(0, 2, 3, rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="kernel_size must be >= 1"):
        MaxPool3d(0)
    with pytest.raises(ValueError, match="module '0' must be a refimpl.nn Module"):
        Sequential(torch.nn.ReLU())
    assert isinstance(model, Module) and "Conv3d(2, 3" in repr(model)


def test_allocator_setting(monkeypatch):
    """REFIMPL_ALLOCATOR: retain (default) tunes glibc's malloc, system leaves it, others refused."""
    from refimpl.backend import tune_allocator
    monkeypatch.setenv("REFIMPL_ALLOCATOR", "system")
    assert tune_allocator() is False
    monkeypatch.setenv("REFIMPL_ALLOCATOR", "keep")
    with pytest.raises(ValueError, match="REFIMPL_ALLOCATOR must be one of retain, system"):
        tune_allocator()
    monkeypatch.setenv("REFIMPL_ALLOCATOR", "retain")
    assert tune_allocator() in (True, False)          # False only where libc is not glibc
    x = np.arange(3 * 2**20, dtype=np.float32)         # big allocations still work
    assert float(x[-1]) == 3 * 2**20 - 1


def test_first_conv_skips_the_input_gradient():
    """needs_input_grad=False: backward returns None with the same dw, db."""
    from refimpl.nn import Conv3d
    rng = np.random.default_rng(0)
    a = Conv3d(2, 3, 3, padding=1, rng=np.random.default_rng(1), dtype=np.float64)
    b = Conv3d(2, 3, 3, padding=1, rng=np.random.default_rng(1), dtype=np.float64)
    b.needs_input_grad = False
    x = rng.standard_normal((2, 2, 5, 6, 7))
    dy = rng.standard_normal((2, 3, 5, 6, 7))
    a.forward(x), b.forward(x)
    assert a.backward(dy).shape == x.shape and b.backward(dy) is None
    np.testing.assert_allclose(b.weight.grad, a.weight.grad, rtol=1e-12)
    np.testing.assert_allclose(b.bias.grad, a.bias.grad, rtol=1e-12)


@pytest.mark.parametrize("var, value", [("REFIMPL_THREADS", "two"), ("REFIMPL_CONV_ALGORITHM", "fft"),
                                        ("REFIMPL_CONV_SCHEDULE", "gpu"), ("REFIMPL_ALLOCATOR", "pool")])
def test_refimpl_command_refuses_malformed_speed_settings(monkeypatch, capsys, var, value):
    from refimpl.cli import main
    monkeypatch.setenv(var, value)
    assert main(["datagen", "cosmoflow", "--out", "unused", "--samples", "2", "--size", "8"]) == 2
    assert var in capsys.readouterr().err


def test_accumulate_grad_copies_unless_fresh():
    """A gradient is copied as the first one (the caller may reuse its buffer) unless the
    caller says it is a fresh array (``fresh=True``: Linear's dy^T x); later ones add in place."""
    from refimpl.nn.parameter import Parameter
    p = Parameter(np.zeros((2, 3)))
    g = np.arange(6.0).reshape(2, 3)
    p.accumulate_grad(g)
    assert p.grad is not g and np.array_equal(p.grad, g)
    p.zero_grad()
    p.accumulate_grad(g, fresh=True)
    assert p.grad is g
    p.accumulate_grad(np.ones((2, 3)))
    assert np.array_equal(p.grad, np.arange(6.0).reshape(2, 3) + 1)
