"""The run configuration of ``refimpl train``: defaults <- TOML file <- command-line flags.

One flat namespace, the flags' names with '_' for '-' (``global_batch`` is
``--global-batch``), plus a ``[model_config]`` table of overrides of the model
preset (keys of refimpl.models.<model>.DEFAULTS).  Example ``run.toml``::

    model = "cosmoflow"
    preset = "small"
    grid = "2,2,1,1"
    global_batch = 8
    steps = 500
    optimizer = "sgd"
    lr = 0.001
    base_batch = 64            # linear scaling: lr * global_batch / base_batch
    schedule = "step"
    decay = "300:0.25,400:0.125"

    [model_config]
    dropout = 0.2

Unknown keys raise ValueError (a typo must not pass silently).  Everything
here is pure Python: every rank computes the same config and the same errors.
"""
from __future__ import annotations

import copy

DEFAULTS = {
    # what to train
    "model": "cosmoflow", "preset": "tiny", "model_config": {},
    # data: a directory with train.h5 / val.h5 (refimpl datagen); none -> generate into OUT/data
    "data": None, "generate": None, "gen_samples": None, "gen_val_samples": None, "gen_seed": 1234,
    "cache": True, "check_data": "full", "log1p": "auto", "normalize": True,
    # how to split it
    "grid": None, "global_batch": None,
    # how long
    "steps": None, "epochs": None,
    # optimiser and schedule
    "optimizer": None, "lr": None, "momentum": 0.9, "nesterov": False, "weight_decay": 0.0,
    "betas": [0.9, 0.999], "eps": 1e-8, "base_batch": None, "warmup_steps": 0,
    "schedule": "constant", "decay": "", "warmup_epochs": None,
    # numerics and reproducibility
    "dtype": "float32", "seed": 0,
    # output
    "out": "runs/train", "resume": False, "overwrite": False, "checkpoint_every": 50, "validate_every": 25,
    "log_every": 1, "quiet": False, "plot": True,
    # communication and device
    "allreduce": "native", "bucket_mb": 25.0, "overlap": True, "backend": "numpy", "cuda_aware": False,
}

DEFAULT_LR = {"sgd": 0.01, "adam": 0.001}

# keys a resumed run must share with its checkpoint (they change the trajectory)
IDENTITY_KEYS = ("model", "preset", "model_config", "global_batch", "optimizer", "lr", "momentum",
                 "nesterov", "weight_decay", "betas", "eps", "base_batch", "warmup_steps", "schedule",
                 "decay", "warmup_epochs", "dtype", "seed", "log1p", "normalize")

CHOICES = {
    "model": ("cosmoflow", "unet3d"), "optimizer": (None, "sgd", "adam"),
    "schedule": ("constant", "step", "mlperf"), "dtype": ("float32", "float64"),
    "backend": ("numpy", "cupy"), "check_data": ("full", "lazy"), "log1p": ("auto", True, False),
    "normalize": (True, False),
}


def load_toml(path) -> dict:
    """The table of a TOML file, keys normalised ('-' -> '_'); ValueError naming the file."""
    import tomllib
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as err:
        raise ValueError(f"--config {path}: cannot read ({err.strerror})") from None
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"--config {path}: not valid TOML ({err})") from None
    return {key.replace("-", "_"): value for key, value in table.items()}


def check_keys(table: dict, where: str) -> None:
    unknown = sorted(set(table) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(DEFAULTS)}")


def merge(*layers: dict) -> dict:
    """DEFAULTS updated by each layer in turn (None values in a layer are skipped).

    ``steps`` and ``epochs`` say the same thing: a layer that sets one of them
    alone clears the other one set by an earlier layer (a flag beats the file).
    """
    config = copy.deepcopy(DEFAULTS)
    for layer in layers:
        length = [k for k in ("steps", "epochs") if layer.get(k) is not None]
        if len(length) == 1:
            config["epochs" if length[0] == "steps" else "steps"] = None
        for key, value in layer.items():
            if value is None:
                continue
            if key == "model_config":
                if not isinstance(value, dict):
                    raise ValueError(f"model_config must be a table, got {value!r}")
                config[key] = {**config[key], **value}
            else:
                config[key] = value
    if isinstance(config["grid"], (list, tuple)):
        config["grid"] = ",".join(str(p) for p in config["grid"])
    validate(config)
    return config


def validate(config: dict) -> None:
    """Types and ranges of the run-level keys (the model checks its own config)."""
    for key, allowed in CHOICES.items():
        if config[key] not in allowed:
            raise ValueError(f"{key} must be one of {list(allowed)}, got {config[key]!r}")
    for key in ("checkpoint_every", "validate_every", "log_every"):
        _int(config, key, 1)
    for key in ("warmup_steps", "seed", "gen_seed"):
        _int(config, key, 0)
    for key in ("global_batch", "steps", "epochs", "base_batch", "warmup_epochs", "gen_samples",
                "gen_val_samples"):
        if config[key] is not None:
            _int(config, key, 0 if key in ("warmup_epochs", "gen_val_samples") else 1)
    for key in ("lr", "momentum", "weight_decay", "eps", "bucket_mb"):
        value = config[key]
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not value >= 0):
            raise ValueError(f"{key} must be a number >= 0, got {value!r}")
    betas = config["betas"]
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2):
        raise ValueError(f"betas must be two numbers, got {betas!r}")


def _int(config, key, minimum) -> None:
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key} must be an integer >= {minimum}, got {value!r}")


def resume_config(saved: dict, given: dict) -> tuple[dict, list[str]]:
    """The config of a resumed run: the checkpoint's, with what was given explicitly on top.

    A given identity key (``IDENTITY_KEYS``) that differs from the checkpoint is an
    error: it would silently change the trajectory.  Returns (config, notes).
    """
    notes = []
    for key in IDENTITY_KEYS:
        if given.get(key) is None:
            continue
        value = given[key] if key != "model_config" else {**saved.get(key, {}), **given[key]}
        if _normal(value) != _normal(saved.get(key)):
            raise ValueError(f"--resume: {key} = {value!r} differs from the checkpoint's "
                             f"{saved.get(key)!r}; a resumed run keeps the settings it started with "
                             "(start a new run with another --out instead)")
    if given.get("grid") is not None and _normal(given["grid"]) != _normal(saved.get("grid")):
        notes.append(f"resuming on grid {given['grid']} (checkpoint written on {saved.get('grid')}): "
                     "the run continues correctly but not bit for bit (sums are ordered differently)")
    layer = {k: v for k, v in given.items() if k not in IDENTITY_KEYS}
    return merge(saved, layer), notes


def _normal(value):
    """Compare lists/tuples and '2,1,1,1' grids alike."""
    if isinstance(value, (list, tuple)):
        return [_normal(v) for v in value]
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    if isinstance(value, str) and "," in value:
        return [v.strip() for v in value.split(",")]
    return value


__all__ = ["DEFAULTS", "DEFAULT_LR", "IDENTITY_KEYS", "load_toml", "check_keys", "merge", "validate",
           "resume_config"]
