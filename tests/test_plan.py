"""The planner (refimpl/plan.py, refimpl plan): its layer lists are the models refimpl builds,
its paper-scale conclusions hold, and bad input is refused with exit 2.

Byte and message counts against real runs: tests/mpi/test_plan_mpi.py; step time and
memory against measured runs: scripts/bench_plan.py (docs/planner.md)."""
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from launcher import run_launched
from refimpl.models import PRESETS, build_model
from refimpl.plan import (MAX_RANKS, Layer, Machine, conv_key, factorizations, load_machine, model_layers,
                          parse_bytes, plan_grid, rank_costs, save_machine, search)

ENV = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMI_"))}
GIB = 2 ** 30


def cli(*args):
    return subprocess.run([sys.executable, "-m", "refimpl", "plan", *args], capture_output=True, text=True,
                          env=ENV, timeout=300)


@pytest.mark.parametrize("model, config", [
    ("cosmoflow", "tiny"), ("cosmoflow", "small"), ("cosmoflow", "mlperf"), ("unet3d", "tiny"),
    ("unet3d", "default"),
    ("cosmoflow", dict(PRESETS["cosmoflow"]["small"], model_parallel="channel", model_parallel_blocks=2)),
    ("cosmoflow", dict(PRESETS["cosmoflow"]["small"], global_pool="avg", input_shape=(4, 48, 48, 48))),
    ("unet3d", dict(PRESETS["unet3d"]["small"], model_parallel="filter"))])
def test_layer_lists_are_the_models(model, config):
    """Every planned layer with parameters is the built model's module of that name, with
    as many parameters; and the model has no parameters the plan misses."""
    layers = model_layers(model, config)
    built = build_model(model, config, None)
    modules = dict(built.named_modules())
    counts = {name: sum(p.data.size for p in mod.parameters()) for name, mod in modules.items()
              if not list(mod.named_modules())[1:] and list(mod.parameters())}
    planned = {lay.name: lay.weights for lay in layers if lay.weights}
    assert planned == counts
    assert all(lay.name in modules for lay in layers)


def test_factorizations():
    assert sorted(factorizations(4, 2)) == [(1, 4), (2, 2), (4, 1)]
    grids = list(factorizations(2048, 5))
    assert len(grids) == 1365 == len(set(grids)) and all(a * b * c * d * e == 2048 for a, b, c, d, e in grids)
    # only divisors are tried: a large prime has its 5 tuples at once, 720720 = 2^4 3^2 5 7 11 13
    # its C(8,4) C(6,4) 5^4 = 656250
    assert sorted(factorizations(1_000_000_007, 5))[0] == (1, 1, 1, 1, 1_000_000_007)
    assert len(list(factorizations(1_000_000_007, 5))) == 5
    assert sum(1 for _ in factorizations(720720, 5)) == 656250


def test_search_prices_the_grids_that_cut_the_fewest_voxels():
    """At most max_grids grids are priced, those whose blocks cut the fewest voxels; the best of
    them is the best of all (the grids of one model axis differ mostly by their halos)."""
    layers = model_layers("cosmoflow", "small")
    layers_mp = model_layers("cosmoflow", dict(PRESETS["cosmoflow"]["small"], model_parallel="filter"))
    full = search(layers, 64, 16, layers_mp=layers_mp, max_grids=10 ** 6)
    capped = search(layers, 64, 16, layers_mp=layers_mp, max_grids=8)
    assert full.grids == capped.grids and full.runnable == capped.runnable > capped.priced == 8
    assert full.priced == full.runnable == sum(p.feasible for p in full)
    assert sum(p.feasible for p in capped) == 8 and capped[0].dims == full[0].dims
    unrunnable = [p for p in full if not p.feasible]
    assert len(unrunnable) == full.grids - full.runnable and all(p.why for p in unrunnable)
    with pytest.raises(ValueError, match=f"1 to {MAX_RANKS} ranks"):
        search(layers, MAX_RANKS + 1, 16)


def test_512_cube_cosmoflow_needs_spatial_splitting():
    """Oyama et al.: a 512^3 CosmoFlow sample does not fit a 16 GiB rank without splitting it."""
    layers = model_layers("cosmoflow", dict(PRESETS["cosmoflow"]["mlperf"], input_shape=(4, 512, 512, 512)))
    machine = Machine(mem_per_rank=16 * GIB)
    for pn in (1, 8, 64):                      # one sample per rank, or more: never fits
        plan = plan_grid(layers, (pn, 1, 1, 1, 1), pn, machine)
        assert not plan.feasible and "per rank" in plan.why and plan.memory_bytes > 16 * GIB
    assert plan_grid(layers, (1, 2, 2, 2, 1), 1, machine).feasible          # split 8 ways, it fits


def test_2048_ranks_batch_64_mix_spatial_and_data():
    layers = model_layers("cosmoflow", dict(PRESETS["cosmoflow"]["mlperf"], input_shape=(4, 512, 512, 512)))
    plans = search(layers, 2048, 64, Machine(mem_per_rank=16 * GIB), top=5)
    best = plans[0]
    pn, pd, ph, pw, pm = best.dims
    assert best.feasible and pn > 1 and pd * ph * pw > 1 and best.family == "hybrid data+spatial"
    # pure data parallelism cannot even use the ranks: at most one sample group per sample
    assert not any(p.dims == (2048, 1, 1, 1, 1) and p.feasible for p in search(layers, 2048, 64))


def test_fc_heavy_model_prefers_a_model_split():
    """Gholami et al.: with a large dense layer, Pr > 1 (the model axis) beats pure data
    parallelism, and the optimum is neither pure data nor pure model parallel."""
    cfg = {"input_shape": (4, 64, 64, 64), "conv_size": 8, "n_conv_layers": 2, "fc1_size": 2048,
           "fc2_size": 1024}
    plain, split = model_layers("cosmoflow", cfg), model_layers("cosmoflow", dict(cfg, model_parallel="filter"))
    times = {pm: plan_grid(plain if pm == 1 else split, (16 // pm, 1, 1, 1, pm), 16, Machine()).step_s
             for pm in (1, 2, 4, 8, 16)}
    best = min(times, key=times.get)
    assert 1 < best < 16 and times[best] < 0.9 * times[1]
    # the reason: the gradient allreduce of the dense weights shrinks with Pm
    ar = {pm: plan_grid(plain if pm == 1 else split, (16 // pm, 1, 1, 1, pm), 16, Machine()).allreduce_s
          for pm in (1, 4)}
    assert ar[4] < ar[1] / 3


def test_machine_files_round_trip(tmp_path):
    machine = Machine(gflops=12.5, alpha=3e-6, ranks_per_node=8, mem_per_rank=parse_bytes("2GiB"))
    path = tmp_path / "m.toml"
    path.write_text(save_machine(machine))
    assert load_machine(str(path)) == machine
    path.write_text("gflops = 10\nbandwidth = 3\n")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['bandwidth'\]"):
        load_machine(str(path))
    path.write_text("alpha = -1\n")
    with pytest.raises(ValueError, match="alpha must be a positive number"):
        load_machine(str(path))
    rates = (("conv 4->16 k3x3x3 s1x1x1 no-dx @32x32x32", 40.0), ("conv_transpose 8->4 k2x2x2 s2x2x2 @8x8x8", 9.5))
    machine = Machine(conv_gflops=rates, pack_bandwidth_w=1e9,
                      element_rates=(("batch_norm3d", 2.5e8), ("leaky_relu", 6e8)))
    path.write_text(save_machine(machine))
    assert load_machine(str(path)) == machine
    for table, match in (('conv_gflops = 3\n', "conv_gflops must be a table"),
                         ('[conv_gflops]\n"conv 4->16 k3 s1" = 1.0\n', "is not like"),
                         ('[conv_gflops]\n"conv 4->16 k3x3x3 s1x1x1 @8x8x8" = 0\n', "must be a positive number"),
                         ('bn_rate = 1e9\nact_rate = 2e9\n', r"act_rate, bn_rate: a kind's rate is no longer a "
                                                              r"machine key; the \[element_rates\] table .*batch_norm3d"),
                         ('[element_rates]\nbatchnorm = 1e9\n', "'batchnorm' is not a layer kind with an element "
                                                                "rate .*leaky_relu"),
                         ('[element_rates]\nconv3d = 1e9\n', "'conv3d' is not a layer kind with an element rate"),
                         ('[element_rates]\nrelu = -2\n', r"\[element_rates\] 'relu' must be a positive number")):
        path.write_text(table)
        with pytest.raises(ValueError, match=match):
            load_machine(str(path))


def test_conv_rate_per_shape():
    """Machine.conv_rate: the measured rate of the shape at the block's voxel count, log-log
    interpolated between two measurements, the nearest outside them; the nearest measured
    shape of the same kind, kernel, stride and dX for another channel pair; gflops when none."""
    wide = Layer("c", "conv", 16, 32, (32,) * 3, (32,) * 3, (3, 3, 3), padding=(1, 1, 1))
    machine = Machine(gflops=7.0, conv_gflops=(("conv 16->32 k3x3x3 s1x1x1 @16x16x16", 40.0),
                                               ("conv 16->32 k3x3x3 s1x1x1 @32x32x32", 160.0),
                                               ("conv 4->16 k3x3x3 s1x1x1 no-dx @32x32x32", 20.0)))
    assert machine.conv_rate(wide, 16 ** 3) == pytest.approx(40.0)
    assert machine.conv_rate(wide, 32 ** 3) == pytest.approx(160.0)
    assert machine.conv_rate(wide, (16 ** 3 * 32 ** 3) ** 0.5) == pytest.approx(80.0)   # geometric midpoint
    assert machine.conv_rate(wide, 10) == pytest.approx(40.0) and machine.conv_rate(wide, 10 ** 9) == pytest.approx(160.0)
    from dataclasses import replace
    assert machine.conv_rate(replace(wide, c_in=32, c_out=64), 32 ** 3) == pytest.approx(160.0)   # nearest shape
    assert machine.conv_rate(replace(wide, c_in=4, c_out=16, input_grad=False), 8) == pytest.approx(20.0)
    assert machine.conv_rate(replace(wide, kernel=(5, 5, 5)), 32 ** 3) == 7.0     # no such kernel measured
    # the planner charges a conv its flops at that rate
    (cost,) = rank_costs([wide], (1,) * 5, (0,) * 5, 1, 4, machine)
    assert cost.compute_s == pytest.approx(cost.flops / 160e9)


def test_halo_copies_cost_most_across_width():
    """A halo exchange also copies (the work array, the faces packed): the planner charges a
    split across W (strided faces, the slowest pack) more than one across D, nothing on one rank."""
    layers = model_layers("cosmoflow", "small")
    machine = Machine(pack_bandwidth_d=20e9, pack_bandwidth_h=10e9, pack_bandwidth_w=1e9)
    halo = {dims: plan_grid(layers, dims, 4, machine).halo_s for dims in
            [(1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2), (2, 1, 1, 1)]}
    assert halo[(2, 1, 1, 1)] == 0
    assert halo[(1, 2, 1, 1)] < halo[(1, 1, 2, 1)] < halo[(1, 1, 1, 2)]
    same = Machine(pack_bandwidth_d=5e9, pack_bandwidth_h=5e9, pack_bandwidth_w=5e9)
    assert plan_grid(layers, (1, 2, 1, 1), 4, same).halo_s == pytest.approx(plan_grid(layers, (1, 1, 1, 2), 4, same).halo_s)


@pytest.mark.parametrize("text, value", [("16GiB", 16 * GIB), ("512 MB", 512 * 10 ** 6), ("1.5e9", 1_500_000_000),
                                         ("2kib", 2048)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("args, message", [
    (["--model", "resnet", "--batch", "4", "--ranks", "4"], "invalid choice"),
    (["--batch", "4", "--ranks", "4", "--mem-per-rank", "16 gigs"], "a memory size must be"),
    (["--batch", "4", "--ranks", "4", "--mem-per-rank=-1GiB"], "a memory size must be"),
    (["--preset", "small", "--batch", "4", "--ranks", "8", "--grid", "2,2,1,1"], "holds 4 ranks, not --ranks 8"),
    (["--preset", "small", "--batch", "4", "--ranks", "6", "--grid", "1,6,1,1,1", "--sample", "4"],
     "must be divisible by 16"),
    (["--preset", "tiny", "--batch", "2", "--ranks", "32", "--grid", "1,32,1,1"], "Pd = 32 ranks on an extent of 16"),
    (["--preset", "tiny", "--batch", "3", "--ranks", "2", "--grid", "2,1,1,1"], "do not divide the batch"),
    (["--preset", "nope", "--batch", "4", "--ranks", "4"], "no cosmoflow preset 'nope'"),
    (["--batch", "4"], "--ranks is required"),
    (["--batch", "0", "--ranks", "4"], "--batch must be a positive integer"),
    (["--ranks", "0"], "--ranks must be a positive integer, got 0"),      # not the --batch it defaults
    (["--preset", "tiny", "--batch", "4", "--ranks", "2", "--allreduce", "foo"], "--allreduce must be one of"),
    (["--batch", "64", "--ranks", "1000000007"], "--ranks 1000000007 is more than the 1048576 (2^20) ranks"),
    (["--batch", "4", "--ranks", "4", "--max-grids", "0"], "--max-grids must be >= 1"),
    (["--calibrate", "--stall-timeout", "-1"], "--stall-timeout must be a number of seconds >= 0"),
    (["--calibrate", "--stall-timeout", "nan"], "--stall-timeout must be a number of seconds >= 0"),
])
def test_bad_input_exits_2(args, message):
    proc = cli(*args)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len([line for line in proc.stderr.splitlines() if line.startswith("refimpl")]) == 1, proc.stderr


@pytest.mark.parametrize("ranks, batch, runnable", [
    (1_000_000_007, 64, None),      # a prime above the maximum: refused at once
    (1_048_573, 64, 0),             # the largest prime below it: 3 grids, none can run
    (720_720, 64, 4509),            # 115724 grids (656250 tuples), thousands runnable: priced 24
])
def test_large_rank_counts_answer_within_seconds(ranks, batch, runnable):
    started = time.monotonic()
    proc = cli("--batch", str(batch), "--ranks", str(ranks), "--top", "3")
    elapsed = time.monotonic() - started
    assert elapsed < 10, elapsed
    if runnable is None:
        assert proc.returncode == 2 and "more than the 1048576" in proc.stderr, proc.stderr
        return
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[:3]              # the machine's line, then the search's
    assert any(f"ranks, {runnable} can run it," in line for line in first), first
    if runnable > 24:
        assert "priced the 24 whose blocks cut the fewest voxels (--max-grids N for more)" in proc.stdout


def table_rows(lines, header_start):
    """The rows of the table whose header starts with ``header_start``, split at two or more spaces."""
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(header_start))
    rows = []
    for line in lines[start:]:
        if not line.strip():
            break
        rows.append(re.split(r" {2,}", line.strip()))
    return rows


def test_tables_keep_wide_numbers_apart():
    """A 65536^3 sample: step times of 5e11 ms and petabytes of memory still leave every column
    apart (the widths come from the content)."""
    proc = cli("--sample", "65536", "--batch", "8", "--ranks", "8", "--top", "4")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for header_start, width in (("#", 10), ("layer", 10)):
        header, *rows = table_rows(lines, header_start)
        assert len(header) == width and len(rows) >= 4, header
        assert all(len(row) == width for row in rows), rows
    assert "166407742350.8" in proc.stdout         # the step of the data-parallel grid, whole


def test_cli_table_json_and_plot(tmp_path):
    proc = cli("--model", "unet3d", "--preset", "small", "--batch", "4", "--ranks", "8", "--top", "3",
               "--json", str(tmp_path / "p.json"), "--plot", str(tmp_path / "p.png"), "--base-batch", "2",
               "--critical-batch", "2")
    assert proc.returncode == 0, proc.stderr
    assert "why" in proc.stdout and "linear scaling" in proc.stdout and "exceeds the critical batch" in proc.stdout
    report = json.loads((tmp_path / "p.json").read_text())
    assert len(report["grids"]) == 3 and report["grids"][0]["feasible"]
    steps = [g["step_s"] for g in report["grids"]]
    assert steps == sorted(steps)
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_explicit_grid_explained():
    proc = cli("--preset", "small", "--batch", "8", "--ranks", "8", "--grid", "2,2,2,1")
    assert proc.returncode == 0 and "features.3" in proc.stdout and "slowest rank" in proc.stdout


def test_calibrate_under_mpiexec(tmp_path):
    pytest.importorskip("mpi4py")
    env = dict(ENV, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    out = tmp_path / "here.toml"
    proc = run_launched([shutil.which("mpiexec"), "--oversubscribe", "-n", "2", sys.executable, "-m", "refimpl",
                         "plan", "--calibrate", "--preset", "tiny", "--save-machine", str(out)],
                        env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    machine = load_machine(str(out))
    assert machine.gflops > 0.1 and 0 < machine.alpha < 1e-2 and 0 < machine.beta < 1e-6
    assert proc.stdout.count("calibrated") == 1        # rank 0 reports
    # every conv shape of the model measured on two inputs, each rate on stdout once
    shapes = {conv_key(lay) for lay in model_layers("cosmoflow", "tiny") if lay.kind == "conv"}
    assert len(machine.conv_gflops) == 2 * len(shapes)
    assert {key.split(" @")[0] for key, _ in machine.conv_gflops} == shapes
    assert all(proc.stdout.count(key + ":") == 1 for key, _ in machine.conv_gflops)
    for name in ("gemm_gflops", "mem_bandwidth", "pack_bandwidth_w"):
        assert getattr(machine, name) != getattr(Machine(), name), name     # measured, not the default
    # every kind that declares an element rate measured by its own micro-benchmark, none other
    from refimpl.layers import PLAN_ONLY, REGISTRY
    declared = {k.name for k in (*REGISTRY.values(), *PLAN_ONLY.values()) if k.plan_element_rate is not None}
    assert {"batch_norm3d", "group_norm3d", "instance_norm3d", "max_pool3d", "relu", "leaky_relu"} <= declared
    assert dict(machine.element_rates).keys() == declared and all(r > 0 for _, r in machine.element_rates)


def test_bench_plan_smoke(tmp_path):
    """scripts/bench_plan.py runs grids for real and reports predicted next to measured."""
    pytest.importorskip("mpi4py")
    from pathlib import Path
    script = Path(__file__).resolve().parent.parent / "scripts" / "bench_plan.py"
    env = dict(ENV, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    proc = run_launched([sys.executable, str(script), "--model", "unet3d", "--preset", "tiny", "--batch", "2",
                         "--ranks", "2", "--repeats", "1", "--model-parallel", "filter",
                         "--json", str(tmp_path / "b.json")], env=env, timeout=600)   # (it runs mpiexec)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "b.json").read_text())
    grids = {tuple(r["grid"]) for r in report["rows"]}
    assert (1, 1, 1, 1, 2) in grids and len(grids) >= 4
    assert all(r["measured_s"] > 0 and r["predicted_peak_bytes"] > 0 for r in report["rows"])


def test_optimizer_sharding_divides_the_state():
    """--optimizer-sharding: the optimizer state is the rank's 1/|G| block (G: the data x spatial
    ranks holding the same parameters), the rest of the memory and the time unchanged."""
    layers = model_layers("cosmoflow", "small")
    for dims in [(4, 1, 1, 1), (2, 2, 1, 1), (1, 1, 1, 1)]:
        plain = plan_grid(layers, dims, 8, Machine(), optimizer="adam")
        shard = plan_grid(layers, dims, 8, Machine(), optimizer="adam", optimizer_sharding=True)
        group = dims[0] * dims[1] * dims[2] * dims[3]
        state = 2 * plain.grad_bytes
        assert plain.memory_bytes - shard.memory_bytes == state - -(-state // group)
        assert shard.step_s == plain.step_s


PAPER_SCALE = ("--model", "cosmoflow", "--preset", "mlperf", "--sample", "512", "--batch", "64", "--ranks", "2048",
               "--mem-per-rank", "16GiB")


def test_first_lines_say_uncalibrated_and_tie():
    """The README's paper-scale plan says in its first lines what it priced (model, preset,
    sample size, batch, ranks), that it runs on default constants (and how to calibrate),
    and that its top grids are a tie at the model's resolution, with how to pick among them;
    the machine's constants come last."""
    proc = cli(*PAPER_SCALE)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    first = lines[:4]
    assert first[0] == "plan: cosmoflow preset mlperf, samples (C, D, H, W) = (4, 512, 512, 512), batch 64, 2048 ranks"
    assert first[1].startswith("uncalibrated: default machine constants") and \
        "refimpl plan --calibrate" in first[1], first
    assert lines[-1].startswith("machine: Machine(") and not any("Machine(" in line for line in lines[:-1])
    assert "sent KiB  sent msgs" in proc.stdout
    tie = next(line for line in first if line.startswith("tie: "))
    count, spread = re.search(r"the top (\d+) grids are within ([\d.]+) % of the best", tie).groups()
    assert int(count) >= 10 and float(spread) < 1, tie
    assert "fewer spatial ranks" in tie and "less memory" in tie and "calibrate" in tie, tie


def test_batch_defaults_to_one_sample_per_rank():
    proc = cli("--model", "cosmoflow", "--preset", "tiny", "--ranks", "4")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == ("plan: cosmoflow preset tiny, samples (C, D, H, W) = (4, 16, 16, 16), "
                                           "batch 4 (the default: one sample per rank), 4 ranks")


def test_tie_rule():
    """A tie is the grids within TIE of the best; among them the fewest spatial ranks, then the
    least memory, is the suggestion; a clear winner gets no tie line."""
    from types import SimpleNamespace as G

    from refimpl.commands.plan import TIE, tie_note
    a = G(dims=(1, 4, 1, 1, 1), step_s=1.0, memory_bytes=10)
    b = G(dims=(2, 2, 1, 1, 1), step_s=1.0 + TIE / 2, memory_bytes=20)
    c = G(dims=(4, 1, 1, 1, 1), step_s=1.0 + TIE / 2, memory_bytes=30)
    far = G(dims=(4, 1, 1, 1, 1), step_s=1.0 + 2 * TIE, memory_bytes=5)
    assert tie_note([a, far]) is None
    note = tie_note([a, b, c, far])
    assert "the top 3 grids" in note and "(4, 1, 1, 1, 1)" in note, note


def test_progress_on_stderr_only_for_a_long_search(monkeypatch, capsys):
    """A search past PROGRESS_AFTER_S reports how many grids are priced on stderr (stdout stays
    the plan); a quick one prints nothing there."""
    from refimpl import backend
    from refimpl import cli as refimpl_cli
    from refimpl.commands import plan as plan_command
    monkeypatch.setattr(backend, "_backend", backend._backend)     # main() sets numpy: undone after the test
    argv = ["plan", "--preset", "small", "--batch", "8", "--ranks", "8", "--max-grids", "6"]
    assert refimpl_cli.main(argv) == 0
    quick = capsys.readouterr()
    assert "of 6 grids" not in quick.err and "grids of 8 ranks" in quick.out
    monkeypatch.setattr(plan_command, "PROGRESS_AFTER_S", 0.0)
    assert refimpl_cli.main(argv) == 0
    slow = capsys.readouterr()
    lines = [line for line in slow.err.splitlines() if line.startswith("refimpl plan: search: priced")]
    assert lines and lines[-1].startswith("refimpl plan: search: priced 6 of 6 grids"), slow.err
    assert "of 6 grids" not in slow.out


def test_cupy_backend_setting_does_not_block_the_planner():
    """REFIMPL_BACKEND=cupy (set for a GPU job) leaves the planner, which works on host arrays,
    running where CuPy finds no GPU; a misspelt value is still refused."""
    env = dict(ENV, REFIMPL_BACKEND="cupy")
    proc = subprocess.run([sys.executable, "-m", "refimpl", "plan", "--preset", "small", "--batch", "8",
                           "--ranks", "8", "--grid", "2,2,2,1"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0 and "slowest rank" in proc.stdout, proc.stderr
    env["REFIMPL_BACKEND"] = "cuda"
    proc = subprocess.run([sys.executable, "-m", "refimpl", "plan", "--batch", "8", "--ranks", "8"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2 and "REFIMPL_BACKEND must be one of" in proc.stderr, proc.stderr
