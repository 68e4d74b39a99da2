"""CosmoFlow and 3D U-Net on one process: shapes, argument checks, PyTorch oracle, training.

The grid-invariance of the same models (any ProcessGrid gives the same training
trajectory) is tested under mpiexec in tests/mpi/test_models_grid_invariance.py.
"""
import types

import numpy as np
import pytest

from refimpl.models import PRESETS, build_model

TINY = {name: PRESETS[name]["tiny"] for name in PRESETS}


def rel_err(a, b):
    """max|a - b| / max|b|."""
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def batch(model, n, seed):
    """A fixed random (x, target) global batch for ``model``."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n,) + model.input_shape)
    if model.task == "regression":
        return x, rng.uniform(-1, 1, (n, model.num_outputs))
    return x, rng.integers(0, model.num_classes, (n,) + model.input_shape[1:])


# ---------------------------------------------------------------- shapes and checks
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_forward_backward_shapes(name):
    model = build_model(name, "tiny", None, seed=0, dtype=np.float32)
    assert model.needs_input_grad is False            # training skips dL/dx of the data
    model.needs_input_grad = True
    x, target = batch(model, 2, seed=1)
    out = model.forward(x.astype(np.float32))
    expected = (2, 4) if name == "cosmoflow" else (2, 3) + model.input_shape[1:]
    assert out.shape == expected and out.dtype == np.float32
    loss, dout, metrics = model.loss(out, target.astype(out.dtype) if name == "cosmoflow" else target)
    assert np.isfinite(loss) and dout.shape == out.shape and dout.dtype == np.float32
    assert set(metrics) == ({"mae"} if name == "cosmoflow" else {"dice"})
    dx = model.backward(dout)
    assert dx.shape == x.shape
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


def test_presets_build_with_their_input_shapes():
    for name, presets in PRESETS.items():
        for preset, config in presets.items():
            model = build_model(name, preset, None, seed=0)
            assert model.input_shape == tuple(config["input_shape"]), (name, preset)


def test_cosmoflow_head_after_the_flatten_is_spatially_replicated():
    model = build_model("cosmoflow", "tiny", None, seed=0)
    replicated = {name for name, p in model.named_parameters() if p.spatial_replicated}
    # the flatten + dense weight is split by columns over the spatial ranks (summed, not averaged)
    assert replicated == {name for name, _ in model.named_parameters()
                          if name.startswith("head.") and name != "head.0.weight"}


def test_same_seed_same_weights_other_seed_other_weights():
    a, b, c = (build_model("unet3d", "tiny", None, seed=s) for s in (3, 3, 4))
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert np.array_equal(pa.data, pb.data), name
        if name.endswith(".weight") and pa.data.ndim == 5:      # batch norm starts at (1, 0) always
            assert not np.array_equal(pa.data, pc.data), name


@pytest.mark.parametrize("name, config, match", [
    ("cosmoflow", {"input_shape": (4, 18, 16, 16)}, "18"),           # 2 blocks: divisible by 4
    ("cosmoflow", {"input_shape": (4, 16, 16, 12), "n_conv_layers": 3}, "12"),
    ("unet3d", {"input_shape": (1, 12, 16, 16), "levels": 3}, "12"),  # 3 levels: divisible by 8
    ("cosmoflow", {"kernel_size": 0}, "kernel_size"),
    ("cosmoflow", {"dropout": 1.0}, "dropout"),
    ("cosmoflow", {"conv_sise": 4}, "conv_sise"),
    ("unet3d", {"loss": "focal"}, "loss"),
    ("unet3d", {"class_weights": [1.0, 2.0]}, "class_weights"),
    ("unet3d", {"levels": 0}, "levels"),
    ("unet3d", {"norm": "layer"}, "'norm'"),
    ("unet3d", {"norm": "group", "num_groups": 3}, "'num_groups'"),
    ("unet3d", {"num_groups": 0}, "'num_groups'"),
    ("unet3d", {"model_parallel_levels": 3}, r"\['model_parallel_levels'\] = 3 exceeds levels = 2"),
    ("unet3d", {"model_parallel_levels": -1}, "'model_parallel_levels'.* must be an integer >= 0"),
    ("unet3d", {"model_parallel_levels": True}, "'model_parallel_levels'"),
    ("cosmoflow", {"global_pool": "max"}, r"\['global_pool'\] must be one of none, avg"),
    ("cosmoflow", {"global_pool": True}, "'global_pool'"),
])
def test_bad_config_raises_naming_it(name, config, match):
    with pytest.raises(ValueError, match=match):
        build_model(name, {**TINY[name], **config}, None, seed=0)


def test_bad_name_preset_seed_raise():
    with pytest.raises(ValueError, match="model name"):
        build_model("resnet", {}, None, seed=0)
    with pytest.raises(ValueError, match="preset"):
        build_model("unet3d", "huge", None, seed=0)
    with pytest.raises(ValueError, match="seed"):
        build_model("unet3d", "tiny", None, seed=-1)


def test_global_batch_must_divide_over_sample_groups():
    three_groups = types.SimpleNamespace(dims=(3, 1, 1, 1))   # checked before any layer is built
    with pytest.raises(ValueError, match="global_batch 4 .* Pn=3"):
        build_model("cosmoflow", "tiny", three_groups, seed=0, global_batch=4)
    model = build_model("cosmoflow", "tiny", None, seed=0, dtype=np.float64, global_batch=4)
    x, _ = batch(model, 2, seed=0)
    with pytest.raises(ValueError, match="global_batch 4"):
        model.forward(x)


def test_wrong_input_shape_or_dtype_raises():
    model = build_model("unet3d", "tiny", None, seed=0, dtype=np.float64)
    with pytest.raises(ValueError, match="x_local must have shape"):
        model.forward(np.ones((2, 1, 16, 16, 8)))
    with pytest.raises(ValueError, match="float32"):
        model.forward(np.ones((2, 1, 16, 16, 16), np.float32))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_eval_mode_is_deterministic_and_train_mode_dropout_is_not(name):
    model = build_model(name, "tiny", None, seed=0, dtype=np.float64)   # cosmoflow tiny: dropout 0.5
    x, _ = batch(model, 2, seed=4)
    train_a, train_b = model.forward(x), model.forward(x)               # fresh masks / same BN batch
    model.eval()
    eval_a, eval_b = model.forward(x), model.forward(x)                 # running stats, no dropout
    assert np.array_equal(eval_a, eval_b)
    assert not np.allclose(eval_a, train_a)
    if name == "cosmoflow":
        assert not np.array_equal(train_a, train_b)


# ---------------------------------------------------------------- PyTorch oracle
def torch_cosmoflow(torch, config):
    tnn = torch.nn
    k, slope = config["kernel_size"], config["leaky_slope"]
    layers, c_in = [], config["input_shape"][0]
    for i in range(config["n_conv_layers"]):
        c_out = config["conv_size"] * 2 ** i
        layers += [tnn.Conv3d(c_in, c_out, k, padding="same"), tnn.LeakyReLU(slope), tnn.MaxPool3d(2)]
        c_in = c_out
    final = [n // 2 ** config["n_conv_layers"] for n in config["input_shape"][1:]]
    if config["global_pool"] == "avg":
        layers.append(tnn.AvgPool3d(final))              # the whole extent: a global average pool
        final = [1, 1, 1]
    n_flat = c_in * int(np.prod(final))

    class FlattenLinear(tnn.Linear):
        def forward(self, x):
            return super().forward(torch.flatten(x, 1))

    class ScaledTanh(tnn.Module):
        def forward(self, x):
            return config["output_scale"] * torch.tanh(x)

    model = tnn.Module()
    model.features = tnn.Sequential(*layers)
    model.head = tnn.Sequential(
        FlattenLinear(n_flat, config["fc1_size"]), tnn.LeakyReLU(slope), tnn.Dropout(0.0),
        tnn.Linear(config["fc1_size"], config["fc2_size"]), tnn.LeakyReLU(slope), tnn.Dropout(0.0),
        tnn.Linear(config["fc2_size"], config["num_outputs"]), ScaledTanh())
    model.forward = lambda x: model.head(model.features(x))
    return model.double()


def torch_unet3d(torch, config):
    tnn = torch.nn
    levels, base = config["levels"], config["base_width"]
    widths = [base * 2 ** i for i in range(levels + 1)]

    def norm(c):
        kind = config.get("norm", "batch")
        if kind == "group":
            return tnn.GroupNorm(min(config["num_groups"], c), c)
        return tnn.InstanceNorm3d(c, affine=True) if kind == "instance" else tnn.BatchNorm3d(c)

    def block(c_in, c_out):
        return tnn.Sequential(tnn.Conv3d(c_in, c_out, 3, padding=1, bias=False), norm(c_out),
                              tnn.ReLU(), tnn.Conv3d(c_out, c_out, 3, padding=1, bias=False),
                              norm(c_out), tnn.ReLU())

    class UNet(tnn.Module):
        def __init__(self):
            super().__init__()
            c_in = config["input_shape"][0]
            for i in range(levels):
                setattr(self, f"enc{i}", block(c_in, widths[i]))
                setattr(self, f"pool{i}", tnn.MaxPool3d(2))
                c_in = widths[i]
            self.bottleneck = block(c_in, widths[-1])
            for i in reversed(range(levels)):
                setattr(self, f"up{i}", tnn.ConvTranspose3d(widths[i + 1], widths[i], 2, stride=2))
                setattr(self, f"dec{i}", block(2 * widths[i], widths[i]))
            self.out = tnn.Conv3d(widths[0], config["num_classes"], 1)

        def forward(self, x):
            skips = []
            for i in range(levels):
                x = getattr(self, f"enc{i}")(x)
                skips.append(x)
                x = getattr(self, f"pool{i}")(x)
            x = self.bottleneck(x)
            for i in reversed(range(levels)):
                x = getattr(self, f"dec{i}")(torch.cat([getattr(self, f"up{i}")(x), skips[i]], 1))
            return self.out(x)

    return UNet().double()


def torch_soft_dice(torch, logits, labels, eps):
    """1 - mean_k (2 I_k + eps) / (P_k + T_k + eps), sums over batch and voxels (refimpl's definition)."""
    p = torch.softmax(logits, 1)
    t = torch.nn.functional.one_hot(labels, logits.shape[1]).movedim(-1, 1).to(p.dtype)
    axes = (0,) + tuple(range(2, logits.ndim))
    inter, psum, tsum = (p * t).sum(axes), p.sum(axes), t.sum(axes)
    return 1 - ((2 * inter + eps) / (psum + tsum + eps)).mean()


ORACLE_CASES = [
    ("cosmoflow", {**TINY["cosmoflow"], "dropout": 0.0}),
    ("cosmoflow", {**TINY["cosmoflow"], "dropout": 0.0, "n_conv_layers": 3, "input_shape": (2, 8, 16, 8)}),
    ("cosmoflow", {**PRESETS["cosmoflow"]["tiny-same"], "dropout": 0.0}),     # kernel 2 'same': 0 before, 1 after
    ("cosmoflow", {**TINY["cosmoflow"], "dropout": 0.0, "global_pool": "avg", "input_shape": (2, 8, 16, 12)}),
    ("unet3d", {**TINY["unet3d"], "loss": "ce"}),
    ("unet3d", {**TINY["unet3d"], "loss": "ce+dice", "input_shape": (2, 8, 12, 16), "num_classes": 4, "class_weights": [0.5, 1.0, 2.0, 1.5]}),
    ("unet3d", {**TINY["unet3d"], "loss": "dice", "levels": 1}),
    ("unet3d", {**TINY["unet3d"], "loss": "ce+dice", "norm": "group"}),               # 4 groups, then 8
    ("unet3d", {**TINY["unet3d"], "loss": "ce", "norm": "group", "num_groups": 2}),
    ("unet3d", {**TINY["unet3d"], "loss": "ce", "norm": "instance", "input_shape": (2, 8, 12, 16)}),
]


@pytest.mark.parametrize("name, config", ORACLE_CASES)
def test_single_process_model_matches_torch(name, config):
    torch = pytest.importorskip("torch", reason="PyTorch absent: pip install 'refimpl[oracle]'")
    from refimpl.models import DEFAULTS
    model = build_model(name, config, None, seed=5, dtype=np.float64)
    model.needs_input_grad = True
    full = {**DEFAULTS[name], **config}
    tmodel = torch_cosmoflow(torch, full) if name == "cosmoflow" else torch_unet3d(torch, full)
    missing, unexpected = tmodel.load_state_dict(
        {k: torch.tensor(v) for k, v in model.state_dict().items()}, strict=False)
    assert not unexpected and all(k.endswith("num_batches_tracked") for k in missing)

    x, target = batch(model, 3, seed=6)
    out = model.forward(x)
    loss, dout, metrics = model.loss(out, target)
    dx = model.backward(dout)

    xt = torch.tensor(x, requires_grad=True)
    out_t = tmodel(xt)
    if name == "cosmoflow":
        loss_t = torch.nn.functional.mse_loss(out_t, torch.tensor(target))
        mae_t = torch.nn.functional.l1_loss(out_t, torch.tensor(target)).item()
        assert abs(metrics["mae"] - mae_t) <= 1e-12 * mae_t
    else:
        labels = torch.tensor(target)
        loss_t = out_t.new_zeros(())
        terms = full["loss"].split("+")
        if "ce" in terms:
            weight = None if full["class_weights"] is None else \
                torch.tensor(full["class_weights"], dtype=torch.float64)
            loss_t = loss_t + torch.nn.functional.cross_entropy(out_t, labels, weight=weight)
        if "dice" in terms:
            loss_t = loss_t + torch_soft_dice(torch, out_t, labels, full["dice_eps"])
    loss_t.backward()

    assert abs(loss - loss_t.item()) <= 1e-12 * abs(loss_t.item())
    assert rel_err(out, out_t.detach().numpy()) <= 1e-10
    assert rel_err(dx, xt.grad.numpy()) <= 1e-10
    torch_params = dict(tmodel.named_parameters())
    assert set(torch_params) == {n for n, _ in model.named_parameters()}
    for pname, p in model.named_parameters():
        assert rel_err(p.grad, torch_params[pname].grad.numpy()) <= 1e-10, pname
    torch_buffers = dict(tmodel.named_buffers())
    for bname, b in model.named_buffers():      # batch-norm running statistics
        assert rel_err(b, torch_buffers[bname].numpy()) <= 1e-10, bname


def test_global_average_pool_keeps_the_network_whatever_the_input_size():
    """global_pool "avg": the same parameters (count, names, and -- same seed -- values) at every
    input size, and the head reads each channel's mean over the last block's extent."""
    config = {**TINY["cosmoflow"], "dropout": 0.0, "global_pool": "avg"}
    models = [build_model("cosmoflow", {**config, "input_shape": (4, s, s, s)}, None, seed=3, dtype=np.float64)
              for s in (8, 16, 28)]
    states = [m.state_dict() for m in models]
    assert all(s.keys() == states[0].keys() for s in states)
    assert all(np.array_equal(s[k], states[0][k]) for s in states for k in s)
    assert models[0].head[0].weight.data.shape == (config["fc1_size"], 2 * config["conv_size"])
    flat = build_model("cosmoflow", {**config, "global_pool": "none", "input_shape": (4, 16, 16, 16)}, None, seed=3)
    assert sum(p.data.size for p in flat.parameters()) > sum(p.data.size for p in models[1].parameters())
    model = models[2]                                     # 28 -> 7^3 after two blocks: an odd extent
    x, _ = batch(model, 2, seed=4)
    model.eval()
    pooled = model.features.forward(x)
    assert pooled.shape == (2, 2 * config["conv_size"], 1, 1, 1)
    last = x
    for layer in model.features.children()[:-1]:          # the conv blocks without the pool
        last = layer.forward(last)
    assert last.shape[2:] == (7, 7, 7)
    assert np.allclose(pooled[:, :, 0, 0, 0], last.mean(axis=(2, 3, 4)), rtol=1e-12, atol=1e-12)


def test_dice_metric_is_mean_hard_dice():
    model = build_model("unet3d", {**TINY["unet3d"], "levels": 1}, None, seed=0, dtype=np.float64)
    x, labels = batch(model, 2, seed=2)
    out = model.forward(x)
    _, _, metrics = model.loss(out, labels)
    pred = out.argmax(1)
    dice = [2 * np.sum((pred == k) & (labels == k)) / (np.sum(pred == k) + np.sum(labels == k))
            for k in range(model.num_classes)]
    assert abs(metrics["dice"] - np.mean(dice)) <= 1e-12


# ---------------------------------------------------------------- training
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_sgd_steps_reduce_the_loss_on_a_fixed_batch(name):
    config = {**TINY[name], "dropout": 0.0} if name == "cosmoflow" else TINY[name]
    model = build_model(name, config, None, seed=0, dtype=np.float64)
    x, target = batch(model, 4, seed=3)
    if name == "unet3d":                  # learnable labels: the class is a band of channel 0
        target = np.digitize(x[:, 0], [-0.5, 0.5])
    lr = 0.05 if name == "cosmoflow" else 1.0
    losses, scores = [], []
    for _ in range(6):
        model.zero_grad()
        loss, dout, metrics = model.loss(model.forward(x), target)
        model.backward(dout)
        for p in model.parameters():
            p.data -= lr * p.grad
        losses.append(loss)
        scores.append(metrics["dice"] if "dice" in metrics else -metrics["mae"])
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.9 * losses[0], losses
    assert scores[-1] > scores[0], scores        # Dice up, MAE down


# ---------------------------------------------------------------- the MLPerf HPC reference network
#: github.com/mlcommons/hpc, cosmoflow/models/cosmoflow.py (build_model: Conv3D(conv_size * 2**i,
#: kernel_size=2, padding='same') -> LeakyReLU -> MaxPool3D(2), five times; Flatten; Dense(fc1) ->
#: LeakyReLU -> Dropout; Dense(fc2) -> LeakyReLU -> Dropout; Dense(4, tanh) * 1.2) with
#: cosmoflow/configs/cosmo.yaml (128^3 x 4 samples, conv_size 32, fc1 128, fc2 64, dropout 0.5)
MLPERF_REFERENCE = {"sample": (4, 128, 128, 128), "kernel": 2, "widths": [32, 64, 128, 256, 512],
                    "dense": [128, 64, 4], "dropout": 0.5, "leaky_slope": 0.3, "output_scale": 1.2}


def test_mlperf_preset_is_the_mlperf_reference_network():
    """Kernel sizes, paddings ('same', TensorFlow's: 0 before, 1 after for kernel 2), widths, pools
    and the dense head of ``--preset mlperf`` are the reference's; mlperf-k3 keeps kernel 3."""
    from refimpl.functional.args import padding_sides
    from refimpl.models.cosmoflow import CosmoFlow, check_config
    ref = MLPERF_REFERENCE
    config = check_config(PRESETS["cosmoflow"]["mlperf"])
    assert tuple(config["input_shape"]) == ref["sample"] and config["dropout"] == ref["dropout"]
    assert (config["leaky_slope"], config["output_scale"]) == (ref["leaky_slope"], ref["output_scale"])
    layers = CosmoFlow.describe(PRESETS["cosmoflow"]["mlperf"])
    convs = [lay for lay in layers if lay["kind"] == "conv3d"]
    pools = [lay for lay in layers if lay["kind"] == "max_pool3d"]
    same = padding_sides("same", (ref["kernel"],) * 3)
    assert same == ((0, 1),) * 3
    assert [c["c_out"] for c in convs] == ref["widths"]
    assert all(c["kernel"] == (2, 2, 2) and c["stride"] == (1, 1, 1) and c["in_dhw"] == c["out_dhw"]
               and padding_sides(c["padding"], c["kernel"]) == same for c in convs)
    assert [p["kernel"] for p in pools] == [(2, 2, 2)] * 5 and [p["out_dhw"][0] for p in pools] == [64, 32, 16, 8, 4]
    assert [lay["kind"] for lay in layers[:3]] == ["conv3d", "leaky_relu", "max_pool3d"]
    dense = [lay for lay in layers if lay["kind"] in ("flatten_linear", "linear")]
    assert [d["c_out"] for d in dense] == ref["dense"] and dense[0]["c_in"] == 512 * 4 ** 3
    k3 = [lay for lay in CosmoFlow.describe(PRESETS["cosmoflow"]["mlperf-k3"]) if lay["kind"] == "conv3d"]
    assert all(c["kernel"] == (3, 3, 3) and c["padding"] == (1, 1, 1) for c in k3)
    assert [c["c_out"] for c in k3] == ref["widths"]


def test_tiny_same_preset_builds_kernel_2_same_convs():
    model = build_model("cosmoflow", "tiny-same", None, seed=0)
    convs = [m for _, m in model.named_modules() if type(m).__name__ == "Conv3d"]
    assert convs and all(c.kernel_size == (2, 2, 2) and c.padding == (0, 1, 0, 1, 0, 1) for c in convs)
