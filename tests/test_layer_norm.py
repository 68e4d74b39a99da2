"""Layer norm over (C, D, H, W) vs PyTorch float64: the functional op, its kind, its flags.

The reference is ``torch.nn.functional.layer_norm(x, (C, D, H, W), weight, bias)`` with the
(C,) weight and bias expanded over (D, H, W), backward by autograd; refimpl's op is group norm
with one group (refimpl/functional/layer_norm.py).
"""
import numpy as np
import pytest

from refimpl import functional as F
from refimpl import layers
from refimpl.check import LayerCheck

torch = pytest.importorskip("torch", reason="PyTorch absent: pip install 'refimpl[oracle]'")


def rel_err(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(np.max(np.abs(b)), 1e-300))


def torch_layer_norm(x, gamma, beta, dy, eps):
    """(y, dx, dgamma, dbeta) of PyTorch's layer norm, float64, autograd."""
    shape = x.shape[1:]
    xt = torch.tensor(x, requires_grad=True)
    g = torch.tensor(gamma, requires_grad=True)
    b = torch.tensor(beta, requires_grad=True)
    y = torch.nn.functional.layer_norm(xt, shape, g.reshape(-1, 1, 1, 1).expand(shape),
                                       b.reshape(-1, 1, 1, 1).expand(shape), eps)
    y.backward(torch.tensor(dy))
    return y.detach().numpy(), xt.grad.numpy(), g.grad.numpy(), b.grad.numpy()


@pytest.mark.parametrize("shape", [(2, 3, 5, 4, 3), (1, 1, 2, 1, 1), (3, 4, 1, 7, 2)])
@pytest.mark.parametrize("eps", [1e-5, 0.1])
def test_layer_norm_equals_torch_float64(shape, eps):
    rng = np.random.default_rng(sum(shape))
    c = shape[1]
    x = rng.standard_normal(shape) * rng.uniform(0.5, 3, (1, c, 1, 1, 1)) + rng.uniform(-2, 2, (1, c, 1, 1, 1))
    gamma, beta, dy = rng.uniform(0.5, 1.5, c), rng.standard_normal(c), rng.standard_normal(shape)
    y, cache = F.layer_norm3d(x, gamma, beta, eps)
    dx, dgamma, dbeta = F.layer_norm3d_backward(dy, cache)
    want = torch_layer_norm(x, gamma, beta, dy, eps)
    # dx's terms can nearly cancel (2 values per sample): its error is measured against their size
    flat = x.reshape(shape[0], -1)
    dx_scale = np.max(np.abs(dy)) * np.max(gamma) / np.sqrt(np.min(flat.var(axis=1)) + eps)
    scales = (np.max(np.abs(want[0])), dx_scale, np.max(np.abs(want[2])), np.max(np.abs(want[3])))
    for name, got, ref, scale in zip(("y", "dx", "dgamma", "dbeta"), (y, dx, dgamma, dbeta), want, scales):
        assert np.max(np.abs(got - ref)) / scale < 1e-12, (name, np.max(np.abs(got - ref)) / scale)
    # the statistics are per sample over every channel and voxel: shape (N, 1)
    assert cache.mean.shape == (shape[0], 1)
    np.testing.assert_allclose(cache.mean[:, 0], x.reshape(shape[0], -1).mean(axis=1), rtol=1e-13)


def test_layer_norm_without_affine_is_plain_normalisation():
    rng = np.random.default_rng(1)
    x, dy = rng.standard_normal((2, 3, 4, 3, 2)), rng.standard_normal((2, 3, 4, 3, 2))
    y, cache = F.layer_norm3d(x)
    flat = x.reshape(2, -1)
    want = (flat - flat.mean(1, keepdims=True)) / np.sqrt(flat.var(1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y.reshape(2, -1), want, rtol=1e-12, atol=1e-14)
    dx, dgamma, dbeta = F.layer_norm3d_backward(dy, cache)
    assert dgamma is None and dbeta is None
    ones = np.ones(3)
    np.testing.assert_allclose(dx, torch_layer_norm(x, ones, 0 * ones, dy, 1e-5)[1], rtol=1e-12, atol=1e-14)


def test_the_kind_declares_per_sample_statistics_and_refuses_a_channel_split():
    kind = layers.lookup("layer_norm3d")
    check = LayerCheck(layer="layer_norm3d", input=(2, 6, 4, 3, 2), grid=(1, 2, 1, 1))
    assert kind.statistic_names() == ("sum_partial", "sumsq_partial", "gsum_partial", "gxhat_partial")
    assert all(s.shape(check, None) == (2, 1) for s in kind.statistics)
    assert kind.option_names() == () and kind.model_modes == ("none",)
    with pytest.raises(ValueError, match="--num-groups applies to group_norm3d only"):
        LayerCheck(layer="layer_norm3d", input=(2, 6, 4, 3, 2), grid=(1, 1, 1, 1), options={"num_groups": 2})
    with pytest.raises(ValueError, match="does not apply to layer_norm3d"):
        LayerCheck(layer="layer_norm3d", input=(2, 6, 4, 3, 2), grid=(1, 1, 1, 1, 1), model_parallel="channel")
    with pytest.raises(ValueError, match="cut a group"):      # group norm's rule speaks first on Pm > 1
        LayerCheck(layer="layer_norm3d", input=(2, 6, 4, 3, 2), grid=(1, 1, 1, 1, 2), model_parallel="channel")


def test_the_kind_reference_and_torch_twin_agree():
    kind = layers.lookup("layer_norm3d")
    check = LayerCheck(layer="layer_norm3d", input=(2, 3, 4, 3, 2), grid=(1, 1, 1, 1))
    rng = np.random.default_rng(2)
    x = rng.standard_normal(check.input)
    p = kind.draw_parameters(rng, check)
    y, _ = kind.forward(check, x, p["w"], p["b"])
    yt = kind.torch_forward(check, torch.nn.functional, torch.tensor(x), torch.tensor(p["w"]), torch.tensor(p["b"]))
    assert rel_err(y, yt.numpy()) < 1e-12
