"""Settings honoured and validated everywhere: the REFIMPL_* variables (refimpl.settings) and
the run config of ``refimpl train`` (refimpl.config), each bad value refused in one line that
names it and what is allowed."""
import os
import subprocess
import sys

import pytest

from refimpl import backend, config, settings
from refimpl.config import DEFAULTS, effective_settings, merge, resume_config, validate
from refimpl.settings import SETTINGS, check_environment, env_setting

# ---------------------------------------------------------------- environment variables

# every registered variable: (text, value) it accepts, and a text it refuses
GOOD = {
    "REFIMPL_BACKEND": [("numpy", "numpy"), (" numpy ", "numpy"), ("", "numpy")],
    "REFIMPL_CUDA_AWARE": [("1", True), ("TRUE", True), ("yes", True), ("On", True), ("0", False),
                           ("false", False), ("NO", False), ("off", False), ("", False)],
    "REFIMPL_CONV_ALGORITHM": [("auto", "auto"), ("im2col", "im2col"), ("winograd", "winograd")],
    "REFIMPL_CONV_SCHEDULE": [("auto", "auto"), ("host", "host"), ("device", "device")],
    "REFIMPL_THREADS": [("1", 1), (" 3 ", 3), ("", None)],
    "REFIMPL_ALLOCATOR": [("retain", "retain"), ("system", "system")],
    "REFIMPL_DEBUG": [("1", True), ("off", False)],
    "REFIMPL_KINDS": [("", ())],
    "REFIMPL_TF32": [("1", True), ("off", False), ("", False)],
    "REFIMPL_CUDA_KERNELS": [("0", False), ("yes", True), ("", True)],
    "REFIMPL_EXAMPLES": [("10", 10)],
    "REFIMPL_MPI_EXAMPLES": [("7", 7)],
    "REFIMPL_MPI_TIMEOUT": [("60", 60), ("", 900)],
}
BAD = {
    "REFIMPL_BACKEND": ("torch", "one of numpy, cupy"),
    "REFIMPL_CUDA_AWARE": ("maybe", "a boolean"),
    "REFIMPL_TF32": ("tf32", "a boolean"),
    "REFIMPL_CUDA_KERNELS": ("fused", "a boolean"),
    "REFIMPL_CONV_ALGORITHM": ("Winograd", "one of auto, im2col, winograd"),
    "REFIMPL_CONV_SCHEDULE": ("gpu", "one of auto, host, device"),
    "REFIMPL_THREADS": ("2x", "a positive integer"),
    "REFIMPL_ALLOCATOR": ("pool", "one of retain, system"),
    "REFIMPL_DEBUG": ("verbose", "a boolean"),
    "REFIMPL_KINDS": ("toy_kind.txt", "a comma-separated list of Python files"),
    "REFIMPL_EXAMPLES": ("0", "a positive integer"),
    "REFIMPL_MPI_EXAMPLES": ("many", "a positive integer"),
    "REFIMPL_MPI_TIMEOUT": ("-5", "a positive integer"),
}


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No REFIMPL_* variable of the calling shell leaks into these tests."""
    for name in [n for n in os.environ if n.startswith("REFIMPL_")]:
        monkeypatch.delenv(name)


def test_every_variable_is_tested():
    assert set(GOOD) == set(SETTINGS) == set(BAD)
    assert all(s.description and s.allowed for s in SETTINGS.values())


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_variable_accepts_its_values(monkeypatch, name):
    assert env_setting(name) == SETTINGS[name].default          # unset: the default
    for text, value in GOOD[name]:
        monkeypatch.setenv(name, text)
        assert env_setting(name) == value, text
        assert check_environment()[name] == value


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_variable_refuses_a_bad_value_in_one_line(monkeypatch, name):
    text, allowed = BAD[name]
    monkeypatch.setenv(name, text)
    for call in (lambda: env_setting(name), check_environment):
        with pytest.raises(ValueError) as err:
            call()
        message = str(err.value)
        assert "\n" not in message
        assert message.startswith(f"{name} must be {allowed}") and repr(text) in message


def test_existing_readers_parse_through_settings(monkeypatch):
    """The conv algorithm, thread count, allocator and CUDA-aware switch read the registry."""
    from refimpl.kernels import _threads
    from refimpl.functional.conv3d import ALGORITHMS, is_reference
    from refimpl.parallel import buffers
    assert ALGORITHMS == ("auto", "im2col", "winograd", "reference")
    monkeypatch.setenv("REFIMPL_CONV_ALGORITHM", "im2col")
    monkeypatch.setenv("REFIMPL_THREADS", "3")
    assert not is_reference(None) and _threads.thread_count() == 3
    monkeypatch.setenv("REFIMPL_CONV_ALGORITHM", "reference")
    assert is_reference(None)
    monkeypatch.setenv("REFIMPL_CONV_ALGORITHM", " reference ")          # stripped, as every setting
    assert is_reference(None)
    monkeypatch.setenv("REFIMPL_CONV_ALGORITHM", "Reference")
    with pytest.raises(ValueError, match="REFIMPL_CONV_ALGORITHM must be one of"):
        is_reference(None)
    monkeypatch.setenv("REFIMPL_CONV_ALGORITHM", "im2col")
    monkeypatch.setenv("REFIMPL_ALLOCATOR", "system")
    assert backend.tune_allocator() is False
    monkeypatch.setattr(buffers, "_cuda_aware", None)            # as after import: read on first use
    monkeypatch.setenv("REFIMPL_CUDA_AWARE", "maybe")
    with pytest.raises(ValueError, match="REFIMPL_CUDA_AWARE must be a boolean"):
        buffers.cuda_aware()
    monkeypatch.setenv("REFIMPL_CUDA_AWARE", "ON")
    assert buffers.cuda_aware() is True


def test_unknown_variable_refused_with_the_closest_name(monkeypatch):
    monkeypatch.setenv("REFIMPL_THREAD", "2")
    with pytest.raises(ValueError, match=r"unknown environment variable REFIMPL_THREAD='2': "
                                         r"did you mean REFIMPL_THREADS\?"):
        check_environment()
    with pytest.raises(ValueError, match="REFIMPL_WHATEVER.*refimpl reads REFIMPL_BACKEND"):
        check_environment({"REFIMPL_WHATEVER": "1"})
    assert check_environment({"OMP_NUM_THREADS": "2", "REFIMPL_THREADS": "2"})["REFIMPL_THREADS"] == 2


def test_cupy_backend_refused_without_a_gpu(monkeypatch):
    """CuPy importable or not, no CUDA device here: REFIMPL_BACKEND=cupy is refused, clearly."""
    reason = settings.cupy_unavailable()
    if reason is None:
        pytest.skip("a CUDA device is available: cupy is a valid backend here")
    monkeypatch.setenv("REFIMPL_BACKEND", "cupy")
    with pytest.raises(ValueError) as err:
        check_environment()
    message = str(err.value)
    assert message.startswith("REFIMPL_BACKEND='cupy' cannot be used: CuPy")
    assert "use numpy here" in message and "\n" not in message
    with pytest.raises(ValueError, match="backend 'cupy' asked for but CuPy"):
        backend.set_backend("cupy")


def test_bad_backend_variable_does_not_break_import():
    """Read at the first use: import works, the first use (or the CLI's check) names it."""
    env = dict(os.environ, REFIMPL_BACKEND="cuda", REFIMPL_CUDA_AWARE="maybe", REFIMPL_THREADS="x")
    code = ("import refimpl, refimpl.backend as b, refimpl.parallel.buffers, refimpl.functional.conv3d\n"
            "try:\n    b.backend_name()\nexcept ValueError as err:\n    print(err)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("REFIMPL_BACKEND must be one of numpy, cupy, strict, got 'cuda'")


def test_importing_settings_is_cheap():
    code = "import sys, refimpl.settings; print(sorted({'numpy', 'cupy'} & set(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr


# ---------------------------------------------------------------- run config: environment

def test_backend_and_cuda_aware_from_the_environment(monkeypatch):
    assert (merge({})["backend"], merge({})["cuda_aware"]) == ("numpy", False)
    monkeypatch.setenv("REFIMPL_CUDA_AWARE", "yes")
    assert merge({})["cuda_aware"] is True
    monkeypatch.setenv("REFIMPL_CUDA_AWARE", "off")
    assert merge({"cuda_aware": True})["cuda_aware"] is True                 # a flag (or TOML) wins
    monkeypatch.setattr(settings, "cupy_unavailable", lambda: None)         # as on a GPU machine
    monkeypatch.setenv("REFIMPL_BACKEND", "cupy")
    assert merge({})["backend"] == "cupy"
    assert merge({"backend": "numpy"})["backend"] == "numpy"
    monkeypatch.setenv("REFIMPL_BACKEND", "CUPY")
    with pytest.raises(ValueError, match="REFIMPL_BACKEND must be one of numpy, cupy, strict, got 'CUPY'"):
        merge({})


# ---------------------------------------------------------------- run config: every key checked

BAD_VALUES = {
    "model": "resnet", "preset": "huge", "model_config": ["dropout", 0.2], "data": 3,
    "generate": "yes", "gen_samples": 0, "gen_val_samples": -1, "gen_seed": 1.5, "cache": 1,
    "check_data": "none", "log1p": 1, "normalize": "true", "grid": {"Pn": 2}, "global_batch": 0,
    "steps": 2.0, "epochs": "3", "optimizer": "lamb", "lr": -0.1, "momentum": "high",
    "nesterov": None, "weight_decay": float("nan"), "betas": [0.9], "eps": True, "base_batch": 0,
    "warmup_steps": -1, "schedule": "cosine", "decay": {"300": 0.25}, "warmup_epochs": -2,
    "dtype": "float16", "seed": -1, "out": "", "resume": "no", "overwrite": 0, "break_lock": "yes", "data_changed_ok": "true",
    "checkpoint_every": 0, "validate_every": None, "log_every": 0.5, "quiet": "false", "plot": [],
    "allreduce": "butterfly", "allreduce_options": {"colors": 2}, "bucket_mb": -1, "overlap": "on", "optimizer_sharding": "yes", "compress": "int4", "error_feedback": "maybe",
    "priority": "output-first", "chunk_mb": -0.5, "backend": "jax", "cuda_aware": 1,
    "stall_timeout": -1.0,
}


def test_every_key_has_a_rule_and_a_bad_value():
    assert set(config.RULES) == set(DEFAULTS) == set(BAD_VALUES)


@pytest.mark.parametrize("key", sorted(DEFAULTS))
def test_every_key_refuses_a_bad_value(key):
    cfg = merge({})
    cfg[key] = BAD_VALUES[key]
    with pytest.raises(ValueError) as err:
        validate(cfg)
    message = str(err.value)
    assert key in message and "\n" not in message


@pytest.mark.parametrize("layer", [
    {"grid": "2,1,1,1"}, {"grid": [1, 2, 2, 1]}, {"data": "d", "generate": False}, {"lr": 1},
    {"betas": (0.5, 0.0)}, {"decay": "300:0.25,400:0.125", "schedule": "step"}, {"stall_timeout": 0},
    {"allreduce": "ring"}, {"model": "unet3d", "preset": "default"}, {"log1p": True},
])
def test_good_values_accepted(layer):
    merge(layer)


def test_grid_and_stall_timeout():
    assert merge({"grid": [1, 2, 2, 1]})["grid"] == "1,2,2,1"
    assert merge({})["stall_timeout"] == 600.0 and "stall_timeout" not in config.IDENTITY_KEYS
    with pytest.raises(ValueError, match="grid must be 4 or 5 comma-separated integers"):
        merge({"grid": "2,x,1,1"})
    with pytest.raises(ValueError, match="grid dims must have 4 entries .* or 5"):
        merge({"grid": "2,2"})
    with pytest.raises(ValueError, match="grid dims entry Pd must be an integer >= 1"):
        merge({"grid": [1, 0, 1, 1]})


def test_preset_of_another_model_refused():
    with pytest.raises(ValueError, match=r"preset must be one of \['default', 'small', 'tiny'\] "
                                         r"for model unet3d, got 'mlperf'"):
        merge({"model": "unet3d", "preset": "mlperf"})


@pytest.mark.parametrize("model, overrides, match", [
    ("cosmoflow", {"dropout": "high"}, r"model_config\['dropout'\] must be a number in \[0, 1\), got 'high'"),
    ("cosmoflow", {"dropout": 1.0}, r"model_config\['dropout'\]"),
    ("cosmoflow", {"conv_size": -4}, r"model_config\['conv_size'\] must be an integer >= 1"),
    ("cosmoflow", {"fc1_size": 0}, r"model_config\['fc1_size'\]"),
    ("cosmoflow", {"kernel_size": 0}, r"model_config\['kernel_size'\] must be an integer >= 1"),
    ("cosmoflow", {"input_shape": [4, 16, 16]}, r"model_config\['input_shape'\] must be 4 positive"),
    ("cosmoflow", {"input_shape": 16}, r"model_config\['input_shape'\] must be 4 positive"),
    ("cosmoflow", {"input_shape": [4, 18, 16, 16]}, r"model_config\['input_shape'\].*18.*divisible by 4"),
    ("cosmoflow", {"output_scale": 0}, r"model_config\['output_scale'\] must be a number > 0"),
    ("cosmoflow", {"leaky_slope": "0.3"}, r"model_config\['leaky_slope'\] must be a number"),
    ("cosmoflow", {"conv_sise": 4}, r"unknown cosmoflow model_config key\(s\) \['conv_sise'\]"),
    ("unet3d", {"loss": "focal"}, r"model_config\['loss'\] must be one of ce, dice, ce\+dice"),
    ("unet3d", {"levels": 0}, r"model_config\['levels'\] must be an integer >= 1"),
    ("unet3d", {"num_classes": 1}, r"model_config\['num_classes'\] must be an integer >= 2"),
    ("unet3d", {"class_weights": [1.0, -1.0, 1.0]}, r"model_config\['class_weights'\] must be 3"),
    ("unet3d", {"class_weights": "equal"}, r"model_config\['class_weights'\]"),
    ("unet3d", {"bn_momentum": 2}, r"model_config\['bn_momentum'\] must be a number in \[0, 1\]"),
    ("unet3d", {"dice_eps": 0}, r"model_config\['dice_eps'\] must be a number > 0"),
    ("unet3d", {"bn_eps": True}, r"model_config\['bn_eps'\]"),
])
def test_model_config_refused_in_one_line(model, overrides, match):
    with pytest.raises(ValueError, match=match) as err:
        merge({"model": model, "model_config": overrides})
    assert "\n" not in str(err.value)


def test_model_config_accepts_lists_from_toml():
    cfg = merge({"model": "unet3d", "model_config": {"input_shape": [2, 8, 8, 8], "levels": 1,
                                                     "class_weights": [1, 0.5, 2.0]}})
    assert effective_settings(cfg)["model_config"]["input_shape"] == (2, 8, 8, 8)


# ---------------------------------------------------------------- effective settings and resume

def saved_run(**layer):
    """The config a first run saves: merged, then what resolve_run writes back into it."""
    cfg = merge(layer)
    cfg.update(global_batch=4, grid="1,1,1,1")
    return cfg


def test_effective_settings_resolve_the_defaults():
    e = effective_settings(merge({}))
    assert (e["optimizer"], e["lr"], e["base_batch"], e["warmup_epochs"], e["decay"]) == \
        ("adam", 0.001, None, None, "")
    assert e["model_config"]["dropout"] == 0.5 and e["model_config"]["kernel_size"] == 3
    assert effective_settings(merge({"optimizer": "sgd"}))["lr"] == config.DEFAULT_LR["sgd"]
    from refimpl.optim import MLPERF_COSMOFLOW
    m = effective_settings(merge({"schedule": "mlperf"}))
    assert (m["optimizer"], m["lr"], m["base_batch"], m["warmup_epochs"]) == \
        ("sgd", MLPERF_COSMOFLOW["lr"], MLPERF_COSMOFLOW["base_batch"], MLPERF_COSMOFLOW["warmup_epochs"])
    assert m["decay"] == "32:0.25,64:0.125"
    given = merge({"lr": 0.5, "base_batch": 8, "warmup_epochs": 0, "schedule": "mlperf"})
    assert [effective_settings(given)[k] for k in ("lr", "base_batch", "warmup_epochs")] == [0.5, 8, 0]


@pytest.mark.parametrize("saved_layer, given", [
    ({}, {"lr": 0.001}),                                   # Adam's default lr
    ({}, {"optimizer": "adam", "lr": 0.001}),
    ({"optimizer": "sgd"}, {"lr": 0.01}),                  # SGD's default lr
    ({}, {"model_config": {"dropout": 0.5}}),              # the tiny preset's value
    ({}, {"model_config": {"kernel_size": 3}}),            # the model's default
    ({}, {"preset": "tiny", "betas": (0.9, 0.999), "decay": ""}),
    ({"schedule": "mlperf"}, {"lr": 0.001, "optimizer": "sgd", "base_batch": 64, "warmup_epochs": 4,
                              "decay": "32:0.25, 64:0.125"}),
    ({"decay": "400:0.125,300:0.25", "schedule": "step"}, {"decay": "300:0.25,400:0.125"}),
])
def test_resume_accepts_repeating_the_effective_settings(saved_layer, given):
    cfg, notes = resume_config(saved_run(**saved_layer), dict(given, resume=True, steps=9))
    assert cfg["steps"] == 9 and cfg["resume"] is True and notes == []


@pytest.mark.parametrize("saved_layer, given, match", [
    ({}, {"lr": 0.002}, r"lr = 0.002 differs from the checkpoint's 0.001"),
    ({}, {"optimizer": "sgd"}, r"optimizer = 'sgd' differs from the checkpoint's 'adam'"),
    ({}, {"model_config": {"dropout": 0.2}}, r"model_config\['dropout'\] = 0.2 differs .* 0.5"),
    ({"schedule": "mlperf"}, {"base_batch": 32}, r"base_batch = 32 differs from the checkpoint's 64"),
    ({}, {"seed": 1}, r"seed = 1 differs from the checkpoint's 0"),
])
def test_resume_refuses_a_different_setting(saved_layer, given, match):
    with pytest.raises(ValueError, match=match):
        resume_config(saved_run(**saved_layer), dict(given, resume=True))


def test_resume_precedence_of_the_environment(monkeypatch):
    """Flag, else the environment variable, else the checkpoint's value."""
    saved = saved_run(cuda_aware=True)
    assert resume_config(saved, {"resume": True})[0]["cuda_aware"] is True
    monkeypatch.setenv("REFIMPL_CUDA_AWARE", "0")
    assert resume_config(saved, {"resume": True})[0]["cuda_aware"] is False
    assert resume_config(saved, {"resume": True, "cuda_aware": True})[0]["cuda_aware"] is True
    saved = dict(saved_run(), backend="cupy")                # written on a GPU machine
    monkeypatch.setenv("REFIMPL_BACKEND", "numpy")
    assert resume_config(saved, {"resume": True})[0]["backend"] == "numpy"
    assert resume_config(saved, {"resume": True, "backend": "cupy"})[0]["backend"] == "cupy"


def test_resume_notes_another_grid():
    saved = saved_run()
    assert resume_config(saved, {"resume": True, "grid": [1, 1, 1, 1]})[1] == []
    notes = resume_config(saved, {"resume": True, "grid": "2,1,1,1"})[1]
    assert len(notes) == 1 and "not bit for bit" in notes[0]


def test_norm_flag_and_model_config_key():
    """``refimpl train --norm group`` lands in [model_config] (as --model-parallel does); the TOML
    key is checked like every model setting, num_groups against the U-Net's widths."""
    from refimpl.cli import build_parser
    from refimpl.commands.train import given_settings
    args = build_parser().parse_args(["train", "--model", "unet3d", "--norm", "instance", "--model-parallel", "filter"])
    given = given_settings(args)
    assert given["model_config"] == {"model_parallel": "filter", "norm": "instance"}
    e = effective_settings(merge(given))["model_config"]
    assert (e["norm"], e["num_groups"], e["model_parallel"]) == ("instance", 8, "filter")
    assert effective_settings(merge({"model": "unet3d"}))["model_config"]["norm"] == "batch"
    for bad, match in (({"norm": "layer"}, r"model_config\['norm'\] must be one of batch, group, instance"),
                       ({"norm": 1}, r"model_config\['norm'\]"),
                       ({"norm": "group", "num_groups": 3}, r"model_config\['num_groups'\] = 3 must divide"),
                       ({"num_groups": 2.5}, r"model_config\['num_groups'\] must be an integer")):
        with pytest.raises(ValueError, match=match):
            merge({"model": "unet3d", "model_config": bad})
    with pytest.raises(ValueError, match=r"unknown cosmoflow model_config key\(s\) \['norm'\]"):
        merge({"model": "cosmoflow", "model_config": {"norm": "group"}})
