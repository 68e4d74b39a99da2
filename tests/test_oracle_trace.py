"""``refimpl oracle trace``: whole-model step traces, the PyTorch twin as a peer, and the checker.

Every trace here is tiny (8^3 inputs, 2 samples) and generated once per module; the
PyTorch twin passes on every grid in both dtypes (float32 over several seeds: no false
alarm), each planted mistake is named at its layer, tensor and rank with its diagnosis,
and a hand-written results file whose one layer is 1.01 × too large on one rank (the
error carried on through the later layers) is named at exactly that layer.
"""
from __future__ import annotations

import json

import numpy
import pytest

h5py = pytest.importorskip("h5py")

from refimpl.cli import main  # noqa: E402
from refimpl.oracle import trace as T  # noqa: E402
from refimpl.oracle import trace_check as C  # noqa: E402

COSMO_INPUT, UNET_INPUT = (2, 4, 8, 8, 8), (2, 1, 8, 8, 8)
GRIDS = [(1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 2)]


def make_trace(directory, model, grid, seed=0, dtypes=T.DTYPES, steps=1, optimizer="sgd", preset="tiny",
               split=("none", 1), shape=None, norm="batch"):
    """``split``: (model_parallel, model_parallel_blocks) for a 5-entry grid's model axis;
    ``norm``: the U-Net's normalisation."""
    shape = shape or (COSMO_INPUT if model == "cosmoflow" else UNET_INPUT)
    path = directory / (f"{model}-{preset}.{'-'.join(map(str, shape))}.{'-'.join(map(str, grid))}.s{seed}.{'-'.join(dtypes)}."
                        f"k{steps}{optimizer}.{split[0]}{split[1]}.{norm}.h5")
    if not path.exists():
        T.write_trace(T.TraceSpec(model, preset, shape, grid, steps, tuple(dtypes), seed, optimizer, *split, norm),
                      str(path))
    return str(path)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """Generate each trace once: path = traces(model, grid, ...)."""
    directory = tmp_path_factory.mktemp("traces")
    return lambda model, grid, **kw: make_trace(directory, model, grid, **kw)


def torch_results(trace_path, out, plant=None):
    pytest.importorskip("torch")
    from refimpl.oracle import trace_torch
    trace = T.load_trace(trace_path)
    trace_torch.write_results(str(out), trace, trace_torch.run_trace(trace, trace_torch.parse_plant(plant, trace)))
    return trace


def judged(trace, results, names=None):
    return C.check_trace(trace, C.load_peer(str(results), trace, names))


# ---------------------------------------------------------------- layers and the reference itself

def test_layers_are_the_models_modules_in_forward_order(capsys):
    from refimpl.models import UNet3D
    assert main(["oracle", "trace", "layers", "--model", "unet3d", "--preset", "tiny", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    model = T.reference_model("unet3d", "tiny")
    assert [r["name"] for r in rows] == [n for n, m in model.named_modules() if n and not m.children()]
    described = {e["name"]: e for e in UNet3D.describe(model.config)}
    for r in rows:
        if r["name"] in described:
            assert r["kind"] == described[r["name"]]["kind"]
            assert r["shape"][2:] == list(described[r["name"]]["out_dhw"])
    assert next(r for r in rows if r["name"] == "dec0.0")["inputs"] == ["up0", "enc0.5"]
    assert main(["oracle", "trace", "layers", "--model", "cosmoflow", "--preset", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "features.3  conv3d" in out and "head.2      dropout" in out and "14 layers" in out


@pytest.mark.parametrize("model", ["cosmoflow", "unet3d"])
def test_the_trace_is_the_models_own_step(traces, model):
    """The layer-by-layer walk gives the model's forward, loss and gradients; the blocks are
    the balanced blocks of the grid."""
    trace = T.load_trace(traces(model, (1, 1, 2, 2), dtypes=("float64",)))
    data = trace.data["float64"]
    net = T.build_reference(trace.spec)
    T.load_parameters(net, data["initial"])
    out = net.forward(data["x"])
    loss, dout, _ = net.loss(out, data["target"])
    net.backward(dout)
    step = data["steps"][0]
    assert loss == pytest.approx(step["loss"], rel=1e-13)
    numpy.testing.assert_allclose(out, step["tensors"][trace.layers[-1]["name"]]["y"], rtol=1e-12, atol=1e-14)
    for name, p in net.named_parameters():
        layer, attr = name.rsplit(".", 1)
        numpy.testing.assert_allclose(p.grad, step["tensors"][layer][T.PARAM_TENSORS[attr]], rtol=1e-10, atol=1e-14)
    with h5py.File(trace.path) as h5:
        first = trace.layers[0]["name"]
        block = h5[f"float64/step/0/{first}/rank/3/y"]
        assert list(block.attrs["offset"]) == [0, 0, 0, 4, 4] and block.shape[2:] == (8, 4, 4)


# ---------------------------------------------------------------- a correct peer passes

#: (model, preset, input): CosmoFlow's tiny, its even-kernel tiny-same (MLPerf's kernel 2 'same': one
#: cell of padding after, none before) and small (four conv blocks of 16 to 128 channels, at 16^3);
#: the U-Net's tiny
PASSING = [("cosmoflow", "tiny", None), ("cosmoflow", "tiny-same", None), ("cosmoflow", "small", (2, 4, 16, 16, 16)),
           ("unet3d", "tiny", None)]


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "-".join(map(str, g)))
@pytest.mark.parametrize("model, preset, shape", PASSING, ids=[f"{m}-{p}" for m, p, _ in PASSING])
def test_torch_twin_passes(traces, tmp_path, model, preset, shape, grid):
    trace = torch_results(traces(model, grid, preset=preset, shape=shape), tmp_path / "r.h5")
    findings = judged(trace, tmp_path / "r.h5")
    assert [f.where for f in findings if f.status != "pass"] == []
    assert {f.dtype for f in findings} == {"float64", "float32"} and {f.phase for f in findings} == \
        {"forward", "loss", "backward", "update"}


def test_torch_twin_passes_the_small_cosmoflow(traces, tmp_path):
    """small: four conv blocks of 16 to 128 channels (at 32^3, the smallest input its four
    halvings leave more than one cell)."""
    trace = torch_results(traces("cosmoflow", (1, 2, 1, 2), preset="small", shape=(2, 4, 32, 32, 32)),
                          tmp_path / "r.h5")
    findings = judged(trace, tmp_path / "r.h5")
    assert [f.where for f in findings if f.status != "pass"] == [] and len(findings) == 136


@pytest.mark.parametrize("grid", [(1, 3, 1, 1), (2, 1, 2, 2)], ids=lambda g: "-".join(map(str, g)))
def test_torch_twin_passes_unet_on_uneven_and_hybrid_grids(traces, tmp_path, grid):
    trace = torch_results(traces("unet3d", grid), tmp_path / "r.h5")
    assert [f.where for f in judged(trace, tmp_path / "r.h5") if f.status != "pass"] == []


def test_float32_has_no_false_alarm_over_seeds(traces, tmp_path):
    """The float32 tolerances come from an error analysis on the peer's input: a correct
    float32 peer passes on every seed (6 CosmoFlow, 5 U-Net)."""
    alarms = []
    for model, seeds in (("cosmoflow", range(1, 7)), ("unet3d", range(1, 6))):
        for seed in seeds:
            trace = torch_results(traces(model, (1, 2, 1, 1), seed=seed, dtypes=("float32",)), tmp_path / "r.h5")
            alarms += [f"{model} seed {seed}: {f.where}" for f in judged(trace, tmp_path / "r.h5")
                       if f.status != "pass"]
    assert alarms == []


MODEL_PARALLEL = [("cosmoflow", (1, 2, 1, 1, 2), ("filter", 2)), ("cosmoflow", (2, 1, 1, 1, 2), ("channel", 1)),
                  ("cosmoflow", (1, 1, 1, 1, 3), ("channel", 2)), ("unet3d", (1, 1, 2, 1, 2), ("filter", 1)),
                  ("unet3d", (1, 1, 1, 1, 3), ("channel", 1))]


@pytest.mark.parametrize("model, grid, split", MODEL_PARALLEL,
                         ids=[f"{m}-{s[0]}{s[1]}-{'-'.join(map(str, g))}" for m, g, s in MODEL_PARALLEL])
def test_torch_twin_passes_with_model_parallelism(traces, tmp_path, model, grid, split):
    """A 5-entry grid: the split layers' y / dx blocks hold model rank m's channels, their dw /
    db its share of the parameter (with offsets); the gathers are the split model's names."""
    trace = torch_results(traces(model, grid, split=split), tmp_path / "r.h5")
    findings = judged(trace, tmp_path / "r.h5")
    assert [f.where for f in findings if f.status != "pass"] == []
    assert {f.dtype for f in findings} == {"float64", "float32"}
    gathers = [e["name"] for e in trace.layers if e["kind"] == "gather"]
    assert gathers == (["features.6", "head.6"] if model == "cosmoflow" else ["bottleneck.6"])
    split_layer = [e for e in trace.layers if e["split"] != "none" and e["kind"] == "conv3d"][-1]
    pm = grid[4]
    with h5py.File(tmp_path / "r.h5") as h5:
        base = f"float64/step/0/{split_layer['name']}/rank"
        channels = [h5[f"{base}/{m}/y"].attrs["offset"][1] for m in range(pm)]
        widths = [h5[f"{base}/{m}/y"].shape[1] for m in range(pm)]
        weight_axis = 1 if split_layer["split"] == "channel" else 0
        shares = [h5[f"{base}/{m}/dw"].shape[weight_axis] for m in range(pm)]
    c = split_layer["y_shape"][1]
    assert channels == [sum(widths[:m]) for m in range(pm)] and sum(widths) == c and min(widths) >= c // pm
    whole = trace.data["float64"]["initial"][split_layer["params"]["dw"]].shape[weight_axis]
    assert sum(shares) == whole


@pytest.mark.parametrize("mode", ["filter", "channel"])
def test_the_unet_with_split_levels(tmp_path, capsys, mode):
    """--model-config's model_parallel_levels: the deepest level's encoder and decoder blocks split
    as the bottleneck, each with its gather; the twin passes them, and a planted halo error in the
    split decoder is found there."""
    pytest.importorskip("torch")
    config = tmp_path / "split.toml"
    config.write_text("model_parallel_levels = 1\n")
    path, good, bad = (str(tmp_path / n) for n in ("t.h5", "good.h5", "bad.h5"))
    assert main(["oracle", "trace", "generate", "--model", "unet3d", "--grid", "1,2,1,1,2", "--model-parallel", mode,
                 "--model-config", str(config), "--out", path]) == 0
    trace = torch_results(path, good)
    assert [e["name"] for e in trace.layers if e["kind"] == "gather"] == ["enc1.6", "bottleneck.6", "dec1.6"]
    assert {e["name"] for e in trace.layers if e["split"] != "none"} >= {"enc1.0", "enc1.3", "dec1.0", "dec1.3"}
    assert main(["oracle", "trace", "check", path, good]) == 0
    torch_results(path, bad, plant="halo:dec1.3:1")
    assert main(["oracle", "trace", "check", path, bad]) == 1
    assert "forward dec1.3 y (rank 1)" in capsys.readouterr().out


@pytest.mark.parametrize("norm", ["group", "instance"])
@pytest.mark.parametrize("grid", [(1, 2, 1, 1), (2, 1, 2, 1), (1, 1, 2, 1, 2)], ids=lambda g: "-".join(map(str, g)))
def test_the_unet_with_group_or_instance_norm(traces, tmp_path, norm, grid):
    """--norm group / instance: the twin (torch's GroupNorm / InstanceNorm3d) passes in float64
    and float32, on a model axis too; each rank's local statistics are named as such."""
    split = ("filter", 1) if len(grid) == 5 else ("none", 1)
    trace = torch_results(traces("unet3d", grid, norm=norm, split=split), tmp_path / "r.h5")
    assert {e["kind"] for e in trace.layers} >= {f"{norm}_norm3d"}
    assert [f.where for f in judged(trace, tmp_path / "r.h5") if f.status != "pass"] == []
    trace = torch_results(traces("unet3d", grid, norm=norm, split=split, dtypes=("float64",)), tmp_path / "bad.h5",
                          "local-stats:enc1.4")
    first = next(f for f in judged(trace, tmp_path / "bad.h5") if f.status == "fail")
    assert (first.layer, first.tensor) == ("enc1.4", "y")
    assert f"{norm}-norm statistics of each failing rank's own block" in first.diagnosis
    assert "not reduced over the spatial group" in first.diagnosis


def test_float32_has_no_false_alarm_with_model_parallelism(traces, tmp_path):
    """Five seeds of CosmoFlow split over a model axis (filter, 2 blocks), float32: no alarm."""
    alarms = []
    for seed in range(1, 6):
        trace = torch_results(traces("cosmoflow", (1, 2, 1, 1, 2), seed=seed, dtypes=("float32",),
                                     split=("filter", 2)), tmp_path / "r.h5")
        alarms += [f"seed {seed}: {f.where}" for f in judged(trace, tmp_path / "r.h5") if f.status != "pass"]
    assert alarms == []


MP_PLANTS = [
    ("cosmoflow", (1, 2, 1, 1, 2), ("filter", 2), "halo:features.3:1", "forward", "features.3", "y", [1],
     "rank 1 read zeros beyond its D high face"),
    ("cosmoflow", (1, 2, 1, 1, 2), ("channel", 2), "adjoint-halo:features.3:3", "backward", "features.3", "dx", [3],
     "the adjoint halo exchange is missing"),
    ("cosmoflow", (1, 2, 1, 1, 2), ("channel", 2), "dw-unsummed:features.3:2", "backward", "features.3", "dw", [2],
     "own contribution only"),
    ("unet3d", (1, 1, 2, 1, 2), ("filter", 1), "local-stats:bottleneck.4", "forward", "bottleneck.4", "y",
     [0, 1, 2, 3], "not reduced over the spatial group"),
    ("unet3d", (1, 1, 2, 1, 2), ("channel", 1), "halo:bottleneck.3:1", "forward", "bottleneck.3", "y", [1],
     "rank 1 read zeros beyond its H high face"),
    ("cosmoflow", (2, 1, 1, 1, 2), ("filter", 1), "update-skip:head.3:1", "update", "head.3.weight", "update", [1],
     "rank 1 did not apply the update"),
]


@pytest.mark.parametrize("model, grid, split, plant, phase, layer, tensor, ranks, diagnosis", MP_PLANTS,
                         ids=[p[3].split(":")[0] + "-" + p[0] + "-" + p[2][0] for p in MP_PLANTS])
def test_a_plant_is_named_with_model_parallelism(traces, tmp_path, model, grid, split, plant, phase, layer, tensor,
                                                  ranks, diagnosis):
    trace = torch_results(traces(model, grid, dtypes=("float64",), split=split), tmp_path / "bad.h5", plant)
    fails = [f for f in judged(trace, tmp_path / "bad.h5") if f.status == "fail"]
    first = fails[0]
    assert (first.phase, first.layer, first.tensor, first.ranks) == (phase, layer, tensor, ranks), first.where
    assert diagnosis in first.diagnosis


def test_parameter_shares_without_offset_are_placed_by_the_split(traces, tmp_path, capsys):
    """A model-parallel peer's dw / db shares and y / dx blocks without an ``offset`` lie where
    the trace's split puts them; a share of another size needs one (exit 2)."""
    path = traces("cosmoflow", (1, 2, 1, 1, 2), dtypes=("float64",), split=("channel", 2))
    trace = torch_results(path, tmp_path / "r.h5")
    with h5py.File(tmp_path / "r.h5", "a") as h5:
        h5.visititems(lambda name, obj: obj.attrs.__delitem__("offset") if "offset" in obj.attrs else None)
    assert [f.where for f in judged(trace, tmp_path / "r.h5") if f.status != "pass"] == []
    with h5py.File(tmp_path / "r.h5", "a") as h5:
        del h5["float64/step/0/features.3/rank/1/dw"]
        h5["float64/step/0/features.3/rank/1/dw"] = numpy.ones((8, 3, 3, 3, 3))
    assert main(["oracle", "trace", "check", path, str(tmp_path / "r.h5")]) == 2
    assert "is neither the whole parameter (8, 4, 3, 3, 3) nor rank 1's share" in capsys.readouterr().err


def test_the_layers_of_a_split_model(capsys):
    assert main(["oracle", "trace", "layers", "--model", "cosmoflow", "--model-parallel", "filter",
                 "--model-parallel-blocks", "2"]) == 0
    out = capsys.readouterr().out
    assert "features.6  gather" in out and "head.7      linear" in out and "16 layers" in out
    assert out.count("channels split") == 12 and "model_parallel filter" in out


def test_two_adam_steps_pass_and_the_cli_says_so(traces, tmp_path, capsys):
    path = traces("cosmoflow", (1, 2, 1, 1), steps=2, optimizer="adam", dtypes=("float64",))
    torch_results(path, tmp_path / "r.h5")
    assert main(["oracle", "trace", "check", path, str(tmp_path / "r.h5"), "--json", str(tmp_path / "rep.json")]) == 0
    assert capsys.readouterr().out.startswith("PASS")
    report = json.loads((tmp_path / "rep.json").read_text())
    assert report["ok"] and report["first_finding"] is None and {f["step"] for f in report["findings"]} == {0, 1}


# ---------------------------------------------------------------- planted mistakes are named

PLANTS = [
    ("cosmoflow", (1, 2, 1, 1), "halo:features.3:1", "forward", "features.3", "y", [1],
     "rank 1 read zeros beyond its D low face"),
    ("cosmoflow", (1, 1, 2, 2), "inner-padding:features.0", "forward", "features.0", "y", [0, 1, 2, 3],
     "padding applied at internal faces"),
    ("unet3d", (1, 1, 2, 2), "halo:dec0.0:0", "forward", "dec0.0", "y", [0], "forward halo exchange"),
    ("cosmoflow", (1, 2, 1, 1), "adjoint-halo:features.3:1", "backward", "features.3", "dx", [1],
     "the adjoint halo exchange is missing"),
    ("unet3d", (1, 1, 2, 2), "adjoint-halo:enc1.3:2", "backward", "enc1.3", "dx", [2],
     "the adjoint halo exchange is missing"),
    ("unet3d", (1, 3, 1, 1), "halo:pool0:0", "forward", "pool0", "y", [0], "pooled without its halo"),
    ("unet3d", (1, 3, 1, 1), "stride-phase:pool0:1", "forward", "pool0", "y", [1], "strided windows misplaced"),
    ("unet3d", (1, 1, 2, 2), "local-stats:enc1.1", "forward", "enc1.1", "y", [0, 1, 2, 3],
     "not reduced over the spatial group"),
    ("unet3d", (2, 1, 1, 1), "local-stats:dec0.4", "forward", "dec0.4", "y", [0, 1],
     "not reduced over the data group"),
    ("cosmoflow", (1, 1, 2, 2), "dw-unsummed:features.3:2", "backward", "features.3", "dw", [2],
     "own contribution only"),
    ("cosmoflow", (2, 1, 1, 1), "dw-count:head.3", "backward", "head.3", "dw", [0, 1],
     "1/2 of the expected"),
    ("cosmoflow", (1, 2, 1, 1), "loss-count", "loss", "loss", "loss", [None], "the loss is 2 × the expected"),
    ("cosmoflow", (1, 1, 2, 2), "update-skip:features.0:3", "update", "features.0.weight", "update", [3],
     "rank 3 did not apply the update"),
    # every kind a second time, in another layer (of the other model where it has one) and on another grid
    ("unet3d", (1, 2, 1, 1), "inner-padding:enc1.0", "forward", "enc1.0", "y", [0, 1],
     "padding applied at internal faces"),
    ("cosmoflow", (1, 3, 1, 1), "stride-phase:features.2:1", "forward", "features.2", "y", [1],
     "strided windows misplaced"),
    ("unet3d", (1, 1, 2, 2), "dw-unsummed:enc0.0:1", "backward", "enc0.0", "dw", [1], "own contribution only"),
    ("unet3d", (1, 2, 1, 1), "dw-count:enc0.3", "backward", "enc0.3", "dw", [0, 1], "1/2 of the expected"),
    ("cosmoflow", (1, 1, 2, 2), "loss-count", "loss", "loss", "loss", [None], "the loss is 4 × the expected"),
    ("unet3d", (2, 1, 1, 1), "update-skip:dec0.0:1", "update", "dec0.0.weight", "update", [1],
     "rank 1 did not apply the update"),
]


@pytest.mark.parametrize("model, grid, plant, phase, layer, tensor, ranks, diagnosis", PLANTS,
                         ids=[p[2].split(":")[0] + "-" + p[0] for p in PLANTS])
def test_each_plant_is_named_first(traces, tmp_path, model, grid, plant, phase, layer, tensor, ranks, diagnosis):
    trace = torch_results(traces(model, grid, dtypes=("float64",)), tmp_path / "bad.h5", plant)
    fails = [f for f in judged(trace, tmp_path / "bad.h5") if f.status == "fail"]
    first = fails[0]
    assert (first.phase, first.layer, first.tensor, first.ranks) == (phase, layer, tensor, ranks), first.where
    assert diagnosis in first.diagnosis
    # the mistake is one layer's: nothing in another layer is a finding of its own
    assert {f.layer.rsplit(".", 1)[0] if f.phase == "update" else f.layer for f in fails} <= \
        {layer.rsplit(".", 1)[0] if phase == "update" else layer}


def test_a_skipped_update_drifts_and_the_later_steps_follow_from_it(traces, tmp_path):
    """Rank 3 keeps features.0's old parameters: its later blocks of features.0 are computed
    with them; the first step's update is the finding, the rest follows from it."""
    trace = torch_results(traces("cosmoflow", (1, 1, 2, 2), steps=2, dtypes=("float64",)), tmp_path / "bad.h5",
                          "update-skip:features.0:3")
    findings = judged(trace, tmp_path / "bad.h5")
    assert [(f.step, f.layer, f.ranks) for f in findings if f.status == "fail"] == \
        [(0, "features.0.weight", [3]), (0, "features.0.bias", [3])]
    drift = next(f for f in findings if f.step == 1 and f.layer == "features.0" and f.tensor == "y")
    assert drift.status == "follows" and drift.ranks == [3] and "drifted between ranks" in drift.diagnosis


def test_a_plant_through_the_cli_exits_1_and_names_the_cell(traces, tmp_path, capsys):
    pytest.importorskip("torch")
    path, bad = traces("cosmoflow", (1, 2, 1, 1), dtypes=("float64",)), str(tmp_path / "bad.h5")
    assert main(["oracle", "trace", "run-torch", path, "--out", bad, "--plant", "halo:features.0:0"]) == 0
    assert main(["oracle", "trace", "check", path, bad]) == 1
    out = capsys.readouterr().out
    assert "first finding: float64 step 0 forward features.0 y (rank 0): rank 0 read zeros beyond its D high face" in out
    assert "first at global index [0, 0, 3, 0, 0] (rank 0)" in out
    assert "follows from features.0 y (forward): features.1 y" in out


def test_a_long_follow_list_is_shortened_and_both_dtypes_share_a_line():
    """A wrong early layer makes every later tensor follow: the line names the first and last
    few and a count, one line for both dtypes when they list the same; --verbose lists all."""
    from types import SimpleNamespace
    from refimpl.commands.oracle_trace import FOLLOWS_LISTED, _follow_lines
    note = "follows from features.0 y (forward)"
    names = [f"features.{i} y" for i in range(1, FOLLOWS_LISTED + 4)]
    follows = [SimpleNamespace(note=note, dtype=d, step=s, layer=n.split()[0], tensor="y")
               for d in ("float64", "float32") for s in (0, 1) for n in names]
    follows.append(SimpleNamespace(note=note, dtype="float32", step=2, layer="head.0", tensor="dx"))
    lines = _follow_lines(follows, 3, verbose=False)
    assert lines[0] == (f"    float64 {note}: step 0: features.1 y, features.2 y, features.3 y, ... "
                        f"features.{FOLLOWS_LISTED + 2} y, features.{FOLLOWS_LISTED + 3} y ({len(names)} tensors); "
                        f"step 1: features.1 y, features.2 y, features.3 y, ... features.{FOLLOWS_LISTED + 2} y, "
                        f"features.{FOLLOWS_LISTED + 3} y ({len(names)} tensors)")
    assert lines[1].startswith(f"    float32 {note}: step 0:") and lines[1].endswith("; step 2: head.0 dx")
    assert lines[-1] == "    (--verbose or --json lists every following tensor)"
    both = _follow_lines([f for f in follows if f.step < 2], 2, verbose=True)
    assert len(both) == 1 and both[0].startswith(f"    float64 and float32 {note}: step 0: ")
    assert all(n in both[0] for n in names) and "..." not in both[0]


# ---------------------------------------------------------------- --model-config: your model's configuration

def test_a_trace_of_your_configuration_checks_its_twin_and_finds_a_plant(tmp_path, capsys):
    """--model-config sets config keys over the preset (here a train config file: only its
    [model_config] is read): the trace, the PyTorch twin and the check all take the same model;
    the overrides are in the trace's spec and digest; a planted halo error is still named."""
    pytest.importorskip("torch")
    config = tmp_path / "run.toml"
    config.write_text('lr = 0.1\n[model_config]\nconv_size = 3\nkernel_size = 2\nglobal_pool = "avg"\n'
                      'leaky_slope = 0.1\ndropout = 0.2\n')
    path, good, bad = (str(tmp_path / n) for n in ("t.h5", "good.h5", "bad.h5"))
    assert main(["oracle", "trace", "layers", "--model", "cosmoflow", "--model-config", str(config), "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["features.3"]["shape"][1] == 6 and rows["head.0"]["kind"] == "flatten_linear"
    assert main(["oracle", "trace", "generate", "--model", "cosmoflow", "--grid", "1,2,1,1", "--steps", "2",
                 "--model-config", str(config), "--out", path]) == 0
    assert "kernel_size = 2" in capsys.readouterr().out
    trace = T.load_trace(path)
    assert trace.spec.overrides == {"conv_size": 3, "kernel_size": 2, "global_pool": "avg", "leaky_slope": 0.1,
                                    "dropout": 0.2}
    assert trace.spec.config()["kernel_size"] == 2
    plain = T.TraceSpec("cosmoflow", "tiny", trace.spec.input, trace.spec.grid)
    assert "overrides" not in plain.as_json() and T.digest(plain) != T.digest(trace.spec)
    torch_results(path, good)
    assert main(["oracle", "trace", "check", path, good]) == 0
    torch_results(path, bad, plant="halo:features.3:0")
    assert main(["oracle", "trace", "check", path, bad]) == 1
    assert "first finding: float64 step 0 forward features.3 y (rank 0)" in capsys.readouterr().out


@pytest.mark.parametrize("text, message", [
    ("conv_sise = 3\n", "cosmoflow has no config key 'conv_sise'; its keys: conv_size"),
    ("[model_config]\ninput_shape = [4, 8, 8, 8]\n", "--model-config sets 'input_shape': give it with --input"),
    ("model_parallel = 'filter'\n", "give it with --model-parallel"),
    ("kernel_size = 0\n", "with --model-config['kernel_size'] must be an integer >= 1, got 0"),
    ("model_config = 3\n", "'model_config' must be a table"),
])
def test_a_bad_model_config_is_refused(tmp_path, capsys, text, message):
    config = tmp_path / "m.toml"
    config.write_text(text)
    assert main(["oracle", "trace", "generate", "--model", "cosmoflow", "--grid", "1,1,1,1", "--model-config",
                 str(config), "--out", str(tmp_path / "t.h5")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "t.h5").exists()


def test_run_torch_refuses_a_loss_its_twin_lacks(tmp_path, capsys):
    pytest.importorskip("torch")
    config, path = tmp_path / "m.toml", str(tmp_path / "t.h5")
    config.write_text('loss = "dice"\n')
    assert main(["oracle", "trace", "generate", "--model", "unet3d", "--grid", "1,1,1,1", "--dtype", "float64",
                 "--model-config", str(config), "--out", path]) == 0
    assert main(["oracle", "trace", "run-torch", path, "--out", str(tmp_path / "r.h5")]) == 2
    assert "(preset 'tiny' with --model-config) has loss 'dice'" in capsys.readouterr().err


# ---------------------------------------------------------------- a hand-written results file

def write_buggy_step(trace, path, bugs, offsets=True, dx_scale=1.0):
    """A results file written by hand: refimpl's layers, each computing right on what it
    receives, except that ``bugs`` ({layer: (rank, factor)}) scale one rank's block of
    that layer's y (and, as the adjoint, of the gradient at its output); ``dx_scale``
    multiplies the loss's gradient (the data-parallel convention: Pn)."""
    data, spec = trace.data["float64"], trace.spec
    model = T.build_reference(spec)
    T.load_parameters(model, data["initial"])
    layers = T.model_layers("cosmoflow", model)
    masks = data["steps"][0]["masks"]
    sick = {name: (T.rank_slices(trace.layer(name)["y_shape"], spec.grid, r), f) for name, (r, f) in bugs.items()}
    acts, xs = {"input": data["x"]}, {}
    for layer in layers:
        xs[layer.name] = acts[layer.inputs[0]]
        acts[layer.name] = T.forward(layer, xs[layer.name], masks.get(layer.name))
        if layer.name in sick:
            acts[layer.name][sick[layer.name][0]] *= sick[layer.name][1]
    loss, dy, _ = model.loss(acts[layers[-1].name], data["target"])
    dy = dy * dx_scale
    grads = {}
    for layer in reversed(layers):
        if layer.name in sick:
            dy = dy.copy()
            dy[sick[layer.name][0]] *= sick[layer.name][1]         # the adjoint of the scaled block
        dx, g = T.backward(layer, xs[layer.name], dy, masks.get(layer.name))
        grads[layer.name] = {"dx": dx, **g}
        dy = dx
    with h5py.File(path, "w") as h5:
        h5.attrs["trace_digest"] = trace.digest
        h5["float64/step/0/loss"] = loss
        for layer in layers:
            for r in range(spec.ranks):
                for t, array in (("y", acts[layer.name]), ("dx", grads[layer.name]["dx"])):
                    sl = T.rank_slices(array.shape, spec.grid, r)
                    block = h5.create_dataset(f"float64/step/0/{layer.name}/rank/{r}/{t}", data=array[sl])
                    if offsets:
                        block.attrs["offset"] = [s.start for s in sl]
            for t in layer.params:
                h5[f"float64/step/0/{layer.name}/global/{t}"] = grads[layer.name][t] / dx_scale


def test_one_layer_one_rank_scaled_is_named_and_the_rest_follows(traces, tmp_path):
    """Rank 1's block of features.3's y is 1.01 × right; every later layer computes right on
    what it receives (the error travels on, forward and backward), as a real bug's would."""
    trace = T.load_trace(traces("cosmoflow", (1, 2, 1, 1), dtypes=("float64",)))
    write_buggy_step(trace, tmp_path / "mine.h5", {"features.3": (1, 1.01)})
    findings = judged(trace, tmp_path / "mine.h5")
    fails = [f for f in findings if f.status == "fail"]
    assert [(f.layer, f.tensor, f.ranks) for f in fails] == [("features.3", "y", [1])]
    assert f"{fails[0].scale:.6g}" == "1.01" and fails[0].first_index[2] >= 2     # rank 1 holds D 2..3
    follows = {(f.layer, f.tensor) for f in findings if f.status == "follows"}
    assert {("features.4", "y"), ("head.7", "y"), ("features.3", "dx"), ("features.3", "dw")} <= follows


def test_the_data_parallel_gradient_convention_is_recognised(traces, tmp_path, capsys):
    """Each of Pn sample groups normalising its loss by its own samples gives dx of Pn × the
    global loss's (DDP, refimpl): no finding, a note; a wrong loss is still a finding."""
    path = traces("cosmoflow", (2, 1, 1, 1), dtypes=("float64",))
    trace = T.load_trace(path)
    write_buggy_step(trace, tmp_path / "ddp.h5", {}, dx_scale=2.0)
    findings = judged(trace, tmp_path / "ddp.h5")
    assert [f.where for f in findings if f.status != "pass"] == []
    assert any(f.phase == "convention" and "2 × the global loss's" in f.note for f in findings)
    assert main(["oracle", "trace", "check", path, str(tmp_path / "ddp.h5")]) == 0
    assert "note: float64 step 0: the input gradients carry 2 × the global loss's" in capsys.readouterr().out
    trace_torch = torch_results(path, tmp_path / "bad.h5", "loss-count")
    first = next(f for f in judged(trace_torch, tmp_path / "bad.h5") if f.status == "fail")
    assert first.phase == "loss" and "2 × the expected" in first.diagnosis


def test_a_second_independent_bug_later_is_named_too(traces, tmp_path):
    trace = T.load_trace(traces("cosmoflow", (1, 2, 1, 1), dtypes=("float64",)))
    write_buggy_step(trace, tmp_path / "mine.h5", {"features.3": (1, 1.01), "head.3": (0, 0.5)})
    fails = [f for f in judged(trace, tmp_path / "mine.h5") if f.status == "fail"]
    # the dense head is replicated over the spatial ranks: both hold the wrong block
    assert [(f.layer, f.tensor, f.ranks) for f in fails] == [("features.3", "y", [1]), ("head.3", "y", [0, 1])]
    assert f"{fails[1].scale:.6g}" == "0.5"


def test_the_layer_level_diagnoses_apply_to_a_traced_layer(traces, tmp_path):
    """A pattern the trace has no test of its own for (a block shifted by one cell) is
    named by diagnose.py, run on the layer as a layer-level case on the peer's input."""
    path = traces("cosmoflow", (1, 2, 2, 1), dtypes=("float64",))
    trace = torch_results(path, tmp_path / "r.h5")
    with h5py.File(tmp_path / "r.h5", "a") as h5:
        block = h5["float64/step/0/features.3/rank/1/y"]
        shifted = block[()]
        shifted[..., 1:] = shifted[..., :-1].copy()
        block[...] = shifted
    first = next(f for f in judged(trace, tmp_path / "r.h5") if f.status == "fail")
    assert (first.layer, first.tensor, first.ranks) == ("features.3", "y", [1])
    assert "shifted by +1 along W" in first.diagnosis


def test_any_subset_is_judged(traces, tmp_path, capsys):
    """Forward only, some layers, some ranks: what is there is judged; a layer whose input
    the peer did not report is judged on the trace's (and says so)."""
    path = traces("cosmoflow", (1, 1, 2, 2), dtypes=("float64",))
    trace = torch_results(path, tmp_path / "r.h5", "halo:features.3:2")
    with h5py.File(tmp_path / "r.h5", "a") as h5:
        step = h5["float64/step/0"]
        for name in ("loss", "update", "features.2", "head.3"):
            del step[name]
        for name in list(step):
            for r in list(step[f"{name}/rank"]):
                for t in list(step[f"{name}/rank/{r}"]):
                    if t != "y" or r == "3":
                        del step[f"{name}/rank/{r}/{t}"]
    findings = judged(trace, tmp_path / "r.h5")
    assert {f.phase for f in findings} == {"forward"}
    first = next(f for f in findings if f.status == "fail")
    assert (first.layer, first.ranks) == ("features.3", [2]) and "rank 2 read zeros" in first.diagnosis
    assert "input from the trace (features.2 not fully reported)" in first.note
    assert main(["oracle", "trace", "check", path, str(tmp_path / "r.h5")]) == 1
    assert "first finding: float64 step 0 forward features.3 y (rank 2)" in capsys.readouterr().out


def test_a_peer_with_its_own_split_is_judged_and_located(traces, tmp_path):
    """torch.chunk's split (W = 4 over 3 ranks: 2, 2, 0; the trace's is 2, 1, 1), every block
    with its offset: a right peer passes, and a wrong block is found on the peer's own rank."""
    from refimpl.parallel.partition import ceil_block_range
    path = traces("cosmoflow", (1, 1, 1, 3), dtypes=("float64",))
    trace = torch_results(path, tmp_path / "r.h5")

    def rechunk(sick=None):
        with h5py.File(tmp_path / "r.h5", "a") as h5:
            step = h5["float64/step/0"]
            for name in [n for n in step if n not in ("loss", "update")]:
                for t in ("y", "dx"):
                    shape = trace.layer(name)["y_shape" if t == "y" else "x_shape"]
                    if len(shape) != 5 or f"{name}/rank/0/{t}" not in step:
                        continue
                    whole = numpy.zeros(shape)
                    for r in step[f"{name}/rank"]:
                        block = step[f"{name}/rank/{r}/{t}"]
                        whole[tuple(slice(o, o + n) for o, n in zip(block.attrs["offset"], block.shape))] = block[()]
                        del step[f"{name}/rank/{r}/{t}"]
                    for r in range(3):
                        w0, w1 = ceil_block_range(shape[4], 3, r)
                        block = whole[..., w0:w1] * (1.01 if (name, t, r) == sick else 1.0)
                        step.create_dataset(f"{name}/rank/{r}/{t}", data=block).attrs["offset"] = [0, 0, 0, 0, w0]

    rechunk()
    assert [f.where for f in judged(trace, tmp_path / "r.h5") if f.status != "pass"] == []
    rechunk(sick=("features.3", "y", 1))
    first = next(f for f in judged(trace, tmp_path / "r.h5") if f.status == "fail")
    assert (first.layer, first.tensor, first.ranks) == ("features.3", "y", [1])
    assert 2 <= first.first_index[4] < 4 and f"{first.scale:.6g}" == "1.01"      # rank 1's chunk: W [2, 4)


def test_blocks_without_offset_are_the_traces_blocks(traces, tmp_path):
    trace = T.load_trace(traces("cosmoflow", (1, 1, 2, 2), dtypes=("float64",)))
    write_buggy_step(trace, tmp_path / "mine.h5", {}, offsets=False)
    assert [f.where for f in judged(trace, tmp_path / "mine.h5") if f.status != "pass"] == []


# ---------------------------------------------------------------- names, help, bad input

def test_peer_names_map_onto_the_trace(traces, tmp_path):
    path = traces("cosmoflow", (1, 1, 1, 1), dtypes=("float64",))
    trace = torch_results(path, tmp_path / "r.h5")
    with h5py.File(tmp_path / "r.h5", "a") as h5:
        h5.move("float64/step/0/features.3", "float64/step/0/net.conv2")
        h5.move("float64/step/0/update/head.6.bias", "float64/step/0/update/out.bias")
    (tmp_path / "names.toml").write_text('"net.conv2" = "features.3"\n"out.bias" = "head.6.bias"\n')
    names = C.load_names(str(tmp_path / "names.toml"), trace)
    assert [f for f in judged(trace, tmp_path / "r.h5", names) if f.status != "pass"] == []
    assert main(["oracle", "trace", "check", path, str(tmp_path / "r.h5")]) == 2         # unknown layer
    (tmp_path / "bad.toml").write_text('"net.conv2" = "features.33"\n')
    assert main(["oracle", "trace", "check", path, str(tmp_path / "r.h5"), "--names", str(tmp_path / "bad.toml")]) == 2


def test_help_texts(capsys):
    for argv, words in ((["oracle", "--help"], ["trace ACTION", "refimpl oracle trace --help"]),
                        (["oracle", "trace", "--help"], ["layers", "generate", "run-torch", "check", "follow"]),
                        (["oracle", "trace", "generate", "--help"], ["--grid", "--steps", "--optimizer", "--dtype"]),
                        (["oracle", "trace", "run-torch", "--help"], ["halo:LAYER:R", "update-skip"]),
                        (["oracle", "trace", "check", "--help"], ["--names", "--json"])):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 0
        out = capsys.readouterr().out
        assert all(w in out for w in words), (argv, out)


BAD = [
    (["generate", "--model", "cosmoflow", "--grid", "1,2,1", "--out", "t.h5"], "--grid must be 4 or 5 positive integers"),
    (["generate", "--model", "cosmoflow", "--grid", "1,1,1,1,16", "--model-parallel", "filter", "--out", "t.h5"],
     "--grid Pm=16: layer features.3 splits 8 channels over the model axis"),
    (["generate", "--model", "cosmoflow", "--grid", "1,1,1,1", "--norm", "group", "--out", "t.h5"],
     "--norm is the U-Net's"),
    (["generate", "--model", "unet3d", "--grid", "1,1,1,1", "--norm", "layer", "--out", "t.h5"],
     "--norm must be one of batch, group, instance"),
    (["generate", "--model", "cosmoflow", "--grid", "1,1,1,1,2", "--model-parallel", "rows", "--out", "t.h5"],
     "--model-parallel must be one of none, filter, channel"),
    (["generate", "--model", "unet3d", "--grid", "1,1,1,1,2", "--model-parallel", "filter",
      "--model-parallel-blocks", "2", "--out", "t.h5"], "--model-parallel-blocks is CosmoFlow's"),
    (["generate", "--model", "cosmoflow", "--grid", "1,1,1,1,2", "--model-parallel", "filter",
      "--model-parallel-blocks", "3", "--out", "t.h5"], "exceeds n_conv_layers = 2"),
    (["generate", "--model", "cosmoflow", "--grid", "3,1,1,1", "--out", "t.h5"], "must be divisible by the grid's"),
    (["generate", "--model", "cosmoflow", "--grid", "1,1,1,1", "--steps", "0", "--out", "t.h5"], "--steps must be"),
    (["generate", "--model", "cosmoflow", "--grid", "1,1,1,1", "--dtype", "float16", "--out", "t.h5"], "--dtype must be"),
    (["generate", "--model", "cosmoflow", "--grid", "1,1,1,1", "--optimizer", "lamb", "--out", "t.h5"],
     "--optimizer must be one of sgd, adam"),
    (["generate", "--model", "cosmoflow", "--preset", "huge", "--grid", "1,1,1,1", "--out", "t.h5"], "no cosmoflow preset"),
    (["generate", "--model", "cosmoflow", "--input", "2,4,6,6,6", "--grid", "1,1,1,1", "--out", "t.h5"],
     "must be divisible by 4"),
    (["generate", "--model", "cosmoflow", "--grid", "1,1,1,1", "--out", "t.txt"], "ending in .h5"),
    (["layers", "--model", "unet3d", "--input", "2,1,8"], "--input must be 5 positive integers"),
    (["generate", "--model", "unet3d", "--preset", "default", "--grid", "1,1,1,1", "--out", "t.h5"],
     "GiB: give a smaller --input"),
]


@pytest.mark.parametrize("argv, message", BAD, ids=[m for _, m in BAD])
def test_bad_arguments_exit_2_with_a_clear_message(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    assert main(["oracle", "trace", *argv]) == 2
    assert message in capsys.readouterr().err


def test_unusable_files_exit_2(traces, tmp_path, capsys):
    path = traces("cosmoflow", (1, 2, 1, 1), dtypes=("float64",))
    other = traces("cosmoflow", (1, 1, 1, 1), dtypes=("float64",))
    torch_results(other, tmp_path / "other.h5")
    assert main(["oracle", "trace", "check", path, str(tmp_path / "other.h5")]) == 2
    assert "made for trace digest" in capsys.readouterr().err
    data = open(path, "rb").read()
    (tmp_path / "cut.h5").write_bytes(data[: len(data) // 2])
    assert main(["oracle", "trace", "check", str(tmp_path / "cut.h5"), str(tmp_path / "other.h5")]) == 2
    assert "not a readable HDF5 file" in capsys.readouterr().err
    with h5py.File(tmp_path / "typed.h5", "w") as h5:
        h5.attrs["trace_digest"] = T.load_trace(path).digest
        h5["float64/step/0/features.0/rank/0/y"] = numpy.zeros((2, 4, 4, 8, 8), dtype=numpy.float32)
    assert main(["oracle", "trace", "check", path, str(tmp_path / "typed.h5")]) == 2
    assert "dtype float32, expected float64" in capsys.readouterr().err
    assert main(["oracle", "trace", "run-torch", path, "--out", str(tmp_path / "x.h5"), "--plant", "halo:head.0:1"]) == 2
    assert "needs a window layer" in capsys.readouterr().err
    uneven = traces("unet3d", (1, 3, 1, 1), dtypes=("float64",))       # D blocks 3, 3, 2: pool0 of rank 0 reads past
    assert main(["oracle", "trace", "run-torch", uneven, "--out", str(tmp_path / "x.h5"), "--plant", "halo:pool0:1"]) == 2
    assert "rank 1's windows of pool0 stay inside its own block" in capsys.readouterr().err
    dice = str(tmp_path / "dice.h5")                 # the U-Net's 'default' preset trains on ce+dice
    assert main(["oracle", "trace", "generate", "--model", "unet3d", "--preset", "default", "--input", "2,1,8,8,8",
                 "--grid", "1,1,1,1", "--dtype", "float64", "--out", dice]) == 0
    assert main(["oracle", "trace", "run-torch", dice, "--out", str(tmp_path / "x.h5")]) == 2
    assert "has loss 'ce+dice'" in capsys.readouterr().err
    with h5py.File(tmp_path / "empty.h5", "w") as h5:
        h5.attrs["trace_digest"] = T.load_trace(path).digest
    assert main(["oracle", "trace", "check", path, str(tmp_path / "empty.h5")]) == 2
    assert "holds nothing to judge" in capsys.readouterr().err
