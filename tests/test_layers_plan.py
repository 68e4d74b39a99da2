"""The planner prices a model's layers through the layer registry (refimpl/layers), never by name.

``Model.describe(config)`` lists the layers a model class builds (registry kinds, channels,
extents, splits); ``refimpl.plan`` turns each into a ``Layer`` and charges it what its kind's
``plan_cost`` hook says.  The kinds only the planner prices (activations, dense layers, the
gather) stay out of check-layer's registry.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from refimpl import layers, plan
from refimpl.layers.base import LayerKind
from refimpl.models import MODELS, PRESETS, build_model
from refimpl.plan import Layer, Machine, layer_of, model_layers, plan_grid, rank_costs

ROOT = Path(__file__).resolve().parents[1]

#: the nn class names each registry kind is built as (unpartitioned: build_model without a grid)
BUILT_AS = {"conv3d": ("Conv3d",), "conv_transpose3d": ("ConvTranspose3d",), "max_pool3d": ("MaxPool3d",),
            "avg_pool3d": ("AvgPool3d",),
            "batch_norm3d": ("BatchNorm3d",), "relu": ("ReLU",), "leaky_relu": ("LeakyReLU",),
            "linear": ("Linear",), "flatten_linear": ("FlattenLinear",), "gather": ("Sequential",),
            "group_norm3d": ("GroupNorm3d",), "instance_norm3d": ("InstanceNorm3d",)}

CONFIGS = [("cosmoflow", "tiny"), ("cosmoflow", "small"), ("unet3d", "tiny"),
           ("cosmoflow", dict(PRESETS["cosmoflow"]["small"], model_parallel="channel", model_parallel_blocks=2)),
           ("cosmoflow", dict(PRESETS["cosmoflow"]["tiny"], global_pool="avg", input_shape=(4, 24, 16, 8))),
           ("cosmoflow", dict(PRESETS["cosmoflow"]["tiny"], global_pool="avg", model_parallel="filter")),
           ("unet3d", dict(PRESETS["unet3d"]["tiny"], model_parallel="filter")),
           ("unet3d", dict(PRESETS["unet3d"]["tiny"], norm="group")),
           ("unet3d", dict(PRESETS["unet3d"]["tiny"], norm="instance", model_parallel="filter")),
           ("unet3d", dict(PRESETS["unet3d"]["tiny"], model_parallel="channel", model_parallel_levels=1)),
           ("unet3d", dict(PRESETS["unet3d"]["tiny"], norm="group", model_parallel="filter", model_parallel_levels=2))]


def _config(model, config):
    return dict(PRESETS[model][config]) if isinstance(config, str) else config


@pytest.mark.parametrize("model, config", CONFIGS)
def test_describe_lists_the_built_modules(model, config):
    """Each described layer is the built model's module of that name, of the class its kind
    builds, with as many parameters."""
    config = _config(model, config)
    modules = dict(build_model(model, config, None).named_modules())
    for entry in MODELS[model].describe(config):
        module = modules[entry["name"]]
        assert type(module).__name__ in BUILT_AS[entry["kind"]], entry
        assert sum(p.data.size for p in module.parameters()) == entry["weights"], entry


@pytest.mark.parametrize("model, config", CONFIGS)
def test_planned_layers_carry_their_registry_kind(model, config):
    described = MODELS[model].describe(_config(model, config))
    planned = model_layers(model, _config(model, config))
    assert [lay.op for lay in planned] == [entry["kind"] for entry in described]
    assert all(lay.kind == layers.plan_kind(lay.op).plan_label for lay in planned)
    # a hand-made record of a planner label prices as the kind first registered with that label
    assert plan.layer_kind(Layer("c", "pool", 4, 4, (8,) * 3, (4,) * 3, (2,) * 3, (2,) * 3)).name == "max_pool3d"


def test_every_described_kind_has_planner_hooks():
    kinds = {entry["kind"] for model in MODELS for preset in PRESETS[model]
             for mode in ("none", "filter") for norm in ("batch", "group", "instance")
             for extra in ([{"norm": norm}] if model == "unet3d" else [{}, {"global_pool": "avg"}])
             for entry in MODELS[model].describe(dict(PRESETS[model][preset], model_parallel=mode, **extra))}
    assert kinds == set(BUILT_AS)
    for name in kinds:
        kind = layers.plan_kind(name)
        assert kind.plan_label and type(kind).plan_cost is not LayerKind.plan_cost, name
    with pytest.raises(ValueError, match="the planner prices layers of kinds conv3d, .*not 'softmax'"):
        layers.plan_kind("softmax")


def test_planner_only_kinds_stay_out_of_check_layer():
    """relu, linear, ... lack the check hooks: check-layer, the oracle and case files never see them."""
    for name in layers.PLAN_ONLY:
        assert name not in layers.names() and name not in layers.REGISTRY
        with pytest.raises(ValueError, match="layer must be one of"):
            layers.lookup(name)
    assert not set(layers.PLAN_ONLY) & {n for arg in ("out_channels", "kernel", "dilation", "output_padding")
                                        for n in layers.names_taking(arg)}


def test_plan_dispatches_no_layer_by_name():
    """refimpl/plan.py holds no chain of layer names: every kind-specific cost is a hook."""
    source = (ROOT / "refimpl" / "plan.py").read_text()
    names = set(layers.REGISTRY) | set(layers.PLAN_ONLY) | {k.plan_label for k in (
        *layers.REGISTRY.values(), *layers.PLAN_ONLY.values())}
    quoted = {m for m in re.findall(r"""["']([a-z_0-9]+)["']""", source) if m in names}
    assert not quoted, f"refimpl/plan.py names layer kinds {sorted(quoted)}"


class _ScaleKind(LayerKind):
    """A planner-only kind of a test: a pointwise layer that costs one FLOP per element."""
    name = "test_scale"
    plan_label = "scale"

    def plan_cost(self, layer, rank, cost):
        cost.flops = 1.0 * rank.n_r * rank.f_local(layer) * rank.block_voxels(layer)
        cost.saved_bytes = int(cost.flops) * rank.itemsize
        return cost.flops / 1e9


class _SquareKind(LayerKind):
    """A planner-only memory-bound kind of a test: it declares its element rate and measures it."""
    name = "test_square"
    plan_label = "square"
    plan_element_rate = 3e9

    def plan_measure_rate(self, x, rng, timed):
        return x.size / timed(lambda: x * x)

    def plan_cost(self, layer, rank, cost):
        return rank.n_r * rank.f_local(layer) * rank.block_voxels(layer) / rank.machine.element_rate(self)


def test_a_kind_declares_its_price_and_calibration(monkeypatch, tmp_path):
    """A kind's element rate: its declared default until calibrated, then the rate its own
    micro-benchmark measured (``Machine.element_rates`` by the kind's name); the machine file
    keeps it; plan.py and Machine name no kind."""
    from refimpl.plan import calibrate, load_machine, save_machine
    monkeypatch.setitem(layers.PLAN_ONLY, _SquareKind.name, _SquareKind())
    lay = layer_of({"name": "q", "kind": "test_square", "c_in": 2, "c_out": 2, "in_dhw": (4, 4, 4),
                    "out_dhw": (4, 4, 4)})
    (cost,) = rank_costs([lay], (1,) * 5, (0,) * 5, 1, 4, Machine())
    assert cost.compute_s == 2 * 4 ** 3 / 3e9
    lines = []
    machine = calibrate(Machine(), repeats=1, report=lines.append)
    measured = dict(machine.element_rates)["test_square"]
    assert measured > 0 and measured != 3e9 and "test_square" in lines[-1]
    (cost,) = rank_costs([lay], (1,) * 5, (0,) * 5, 1, 4, machine)
    assert cost.compute_s == 2 * 4 ** 3 / measured
    path = tmp_path / "m.toml"
    path.write_text(save_machine(machine))
    assert load_machine(str(path)) == machine
    assert not [f for f in Machine.__dataclass_fields__ if f.endswith("_rate")]


def test_describe_entries_carry_the_kinds_own_options():
    """A ``describe()`` entry's extra keys are the kind's declared options, checked by them;
    any other key is refused naming the kind's options."""
    pool = layer_of({"name": "p", "kind": "max_pool3d", "c_in": 2, "c_out": 2, "in_dhw": (5, 5, 5),
                     "out_dhw": (3, 3, 3), "kernel": (2, 2, 2), "stride": (2, 2, 2), "ceil_mode": True})
    assert pool.option("ceil_mode") is True and _norm_layer("group_norm3d").option("num_groups") == 1
    assert layers.plan_kind("max_pool3d").plan_halo(pool, (2, 1, 1)).outputs((1, 0, 0))[0] == (2, 3)
    with pytest.raises(ValueError, match=r"\['num_groups'\] are neither planner fields nor options of kind "
                                         r"max_pool3d \(ceil_mode\)"):
        layer_of({"name": "p", "kind": "max_pool3d", "c_in": 2, "c_out": 2, "in_dhw": (4,) * 3, "out_dhw": (2,) * 3,
                  "num_groups": 2})
    with pytest.raises(ValueError, match="--num-groups must be a positive integer, got 0"):
        layer_of({"name": "n", "kind": "group_norm3d", "c_in": 4, "c_out": 4, "in_dhw": (4,) * 3, "out_dhw": (4,) * 3,
                  "num_groups": 0})


def test_a_new_kind_is_priced_by_its_hook_alone(monkeypatch):
    """Registering a kind with a plan_cost hook is all the planner needs (no edit of plan.py)."""
    monkeypatch.setitem(layers.PLAN_ONLY, _ScaleKind.name, _ScaleKind())
    lay = layer_of({"name": "s", "kind": "test_scale", "c_in": 4, "c_out": 4, "in_dhw": (8, 8, 8),
                    "out_dhw": (8, 8, 8)})
    assert lay.kind == "scale" and lay.op == "test_scale"
    (cost,) = rank_costs([lay], (2, 2, 1, 1, 1), (1, 1, 0, 0, 0), 4, 4, Machine())
    assert cost.kind == "scale" and cost.flops == 2 * 4 * 4 * 8 * 8 and cost.compute_s == cost.flops / 1e9
    conv = model_layers("cosmoflow", "tiny")[:1]
    assert plan_grid(conv + [lay], (1,) * 5, 2).memory_bytes > plan_grid(conv, (1,) * 5, 2).memory_bytes


@pytest.mark.parametrize("model, mode, dims, batch, step_s, memory, grad, halo, model_bytes", [
    ("cosmoflow", "filter", (2, 2, 2, 1, 2), 8, 0.13522874328000004, 65255744, 2841424, 1232896, 18944),
    ("cosmoflow", "channel", (2, 2, 1, 1, 4), 8, 0.2611880993599999, 112833600, 1563152, 1179648, 52992),
    ("unet3d", "none", (4, 2, 2, 1, 1), 4, 13.823459711562501, 1563860016, 22404748, 32260608, 0)])
def test_predictions_are_those_of_the_name_dispatching_planner(model, mode, dims, batch, step_s, memory, grad, halo,
                                                               model_bytes):
    """The numbers `refimpl plan` printed before the layers were priced by their registry hooks
    (--preset small / default, default Machine; the slowest rank's layers); CosmoFlow's since its
    activations are priced on the pooled extent they run on (nn.Sequential.run_order: less time,
    and each keeps an eighth of the input it kept)."""
    preset = "small" if model == "cosmoflow" else "default"
    layers_ = model_layers(model, dict(PRESETS[model][preset], model_parallel=mode))
    got = plan_grid(layers_, dims, batch, Machine())
    assert (got.step_s, got.memory_bytes, got.grad_bytes) == (pytest.approx(step_s, rel=1e-12), memory, grad)
    assert sum(c.halo_bytes for c in got.layers) == halo and sum(c.model_bytes for c in got.layers) == model_bytes


def _norm_layer(kind, groups=0):
    return layer_of({"name": "n", "kind": kind, "c_in": 16, "c_out": 16, "in_dhw": (8, 8, 8), "out_dhw": (8, 8, 8),
                     "weights": 32, **({"num_groups": groups} if groups else {})})


def test_group_and_instance_norm_are_priced():
    """Batch norm's rate; per-sample sums allreduced over the spatial group only: (2, N_r, G_r)
    float64 each way, nothing on a grid that splits only the samples."""
    group, instance, batch = _norm_layer("group_norm3d", 4), _norm_layer("instance_norm3d"), \
        _norm_layer("batch_norm3d")
    assert (group.kind, instance.kind, group.option("num_groups")) == ("group_norm", "instance_norm", 4)
    assert layers.plan_kind("group_norm3d") is layers.REGISTRY["group_norm3d"]   # check-layer's kind, priced
    spatial = [rank_costs([lay], (1, 2, 1, 1, 1), (0, 0, 0, 0, 0), 2, 4, Machine())[0]
               for lay in (group, instance, batch)]
    assert spatial[0].allreduce_bytes == 2 * 16 * 2 * 4 and spatial[1].allreduce_bytes == 2 * 16 * 2 * 16
    assert spatial[0].compute_s == spatial[2].compute_s and spatial[0].flops == spatial[2].flops
    (data,) = rank_costs([group], (2, 1, 1, 1, 1), (0, 0, 0, 0, 0), 2, 4, Machine())
    assert data.allreduce_bytes == 0 and data.comm_s == 0


def test_plan_cli_prices_the_unet_with_group_norm():
    import subprocess
    import sys
    for norm, label in (("group", "group_norm"), ("instance", "instance_norm")):
        proc = subprocess.run([sys.executable, "-m", "refimpl", "plan", "--model", "unet3d", "--preset", "tiny",
                               "--norm", norm, "--batch", "2", "--ranks", "4", "--grid", "1,2,2,1"],
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        rows = [line.split() for line in proc.stdout.splitlines() if line.strip().startswith(("enc0.1", "dec0.4"))]
        assert [row[:2] for row in rows] == [["enc0.1", label], ["dec0.4", label]], proc.stdout
        assert "batch_norm" not in proc.stdout and " bn " not in proc.stdout
