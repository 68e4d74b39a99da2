"""The run configuration of ``refimpl train``: defaults <- environment <- TOML file <- flags.

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

Unknown keys raise ValueError (a typo must not pass silently), and so does a
value of the wrong type or out of range, in one line naming the key and what is
allowed: ``validate`` checks every key of DEFAULTS, the [model_config] table with
the model's own ``check_config`` (the preset merged under it).  Everything here
is pure Python: every rank computes the same config and the same errors.

Precedence, lowest first:

- a new run: DEFAULTS <- the environment (``REFIMPL_BACKEND`` -> ``backend``,
  ``REFIMPL_CUDA_AWARE`` -> ``cuda_aware``, where set) <- the TOML file <- the flags;
- ``--resume``: DEFAULTS <- the checkpoint's config <- the environment <- the TOML
  file and flags.  The environment beats the checkpoint because it describes the
  machine the run continues on (a run written on GPUs may continue on CPUs).
  Settings that shape the trajectory (``IDENTITY_KEYS``) cannot change on resume;
  giving one is accepted when its *effective* value (``effective_settings``: the
  defaults the run resolves at start filled in) equals the checkpoint's, so
  repeating a default (``--lr 0.001`` of an Adam run that left lr unset) is fine.
"""
from __future__ import annotations

import copy

from .parallel.allreduce import ALGORITHMS
from .settings import env_setting, is_set

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
    "out": "runs/train", "resume": False, "overwrite": False, "break_lock": False, "data_changed_ok": False,
    "checkpoint_every": 50,
    "validate_every": 25, "log_every": 10, "quiet": False, "plot": True,
    # communication and device
    "allreduce": "native", "allreduce_options": {},   # options: the algorithm's (parallel/allreduce/)
    "bucket_mb": 25.0, "overlap": True, "backend": "numpy", "cuda_aware": False,
    "optimizer_sharding": False, "compress": "none", "error_feedback": True,
    "priority": "none", "chunk_mb": None,
    # failure detection: seconds without progress of any rank before the job is ended (0: off)
    "stall_timeout": 600.0,
}

DEFAULT_LR = {"sgd": 0.01, "adam": 0.001}

# keys a resumed run must share with its checkpoint (they change the trajectory)
IDENTITY_KEYS = ("model", "preset", "model_config", "global_batch", "optimizer", "lr", "momentum",
                 "nesterov", "weight_decay", "betas", "eps", "base_batch", "warmup_steps", "schedule",
                 "decay", "warmup_epochs", "dtype", "seed", "log1p", "normalize")

CHOICES = {
    "model": ("cosmoflow", "unet3d"), "optimizer": (None, "sgd", "adam"),
    "schedule": ("constant", "step", "mlperf"), "dtype": ("float32", "float64"),
    "backend": ("numpy", "cupy", "strict"), "check_data": ("full", "lazy"), "log1p": ("auto", True, False),
    "normalize": (True, False), "priority": ("none", "input-first"),
    # the registry of parallel/allreduce/ (it imports no mpi4py.MPI: building the command line must not
    # initialise MPI; tests/test_faults.py checks)
    "allreduce": tuple(ALGORITHMS),
}

# config keys whose default comes from an environment variable (see the precedence above)
ENVIRONMENT = {"backend": "REFIMPL_BACKEND", "cuda_aware": "REFIMPL_CUDA_AWARE"}


def read_toml(path, flag: str) -> dict:
    """The table of a TOML file as written; ValueError naming ``flag`` and the file (a FIFO or
    a device is refused before it is opened)."""
    import tomllib

    from .paths import refuse_special
    refuse_special(path, flag)
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot read ({err.strerror})") from None
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{flag} {path}: not valid TOML ({err})") from None


def load_toml(path, flag: str = "--config") -> dict:
    """The table of a TOML file, keys normalised ('-' -> '_'); ValueError naming ``flag`` and the file."""
    return {key.replace("-", "_"): value for key, value in read_toml(path, flag).items()}


def check_keys(table: dict, where: str) -> None:
    unknown = sorted(set(table) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(DEFAULTS)}")


def environment_layer(environ=None) -> dict:
    """The config keys set by environment variables (``ENVIRONMENT``), where they are set;
    ValueError naming the variable if its value is bad."""
    return {key: env_setting(name, environ) for key, name in ENVIRONMENT.items() if is_set(name, environ)}


def merge(*layers: dict) -> dict:
    """DEFAULTS, then the environment (``environment_layer``), then each layer in turn
    (None values in a layer are skipped); validated.

    ``steps`` and ``epochs`` say the same thing: a layer that sets one of them
    alone clears the other one set by an earlier layer (a flag beats the file).
    ``allreduce_options`` belong to ``allreduce``: a layer that names another algorithm and no
    options drops the options of the earlier layers.
    """
    config = copy.deepcopy(DEFAULTS)
    for layer in (environment_layer(),) + layers:
        length = [k for k in ("steps", "epochs") if layer.get(k) is not None]
        if len(length) == 1:
            config["epochs" if length[0] == "steps" else "steps"] = None
        if layer.get("allreduce") not in (None, config["allreduce"]) and layer.get("allreduce_options") is None:
            config["allreduce_options"] = {}          # another algorithm: the earlier one's options go
        for key, value in layer.items():
            if value is None:
                continue
            if key == "model_config":
                if not isinstance(value, dict):
                    raise ValueError(f"model_config must be a table of model settings, got {value!r}")
                config[key] = {**config[key], **value}
            else:
                config[key] = copy.deepcopy(value)
    if isinstance(config["grid"], (list, tuple)):
        config["grid"] = ",".join(str(p) for p in config["grid"])
    validate(config)
    return config


# ---------------------------------------------------------------- validation
# One rule per key of DEFAULTS: rule(key, value, config) raises ValueError of one line
# naming the key, the value and what is allowed.  Rules run in DEFAULTS' order, so
# ``preset`` and ``model_config`` see a checked ``model``.

def _one_of(*allowed):
    def rule(key, value, config):           # by type too: 1 is not true, 0 not false
        if not any(type(value) is type(a) and value == a for a in allowed):
            raise ValueError(f"{key} must be one of {list(allowed)}, got {value!r}")
    return rule


def _integer(minimum, optional=False):
    def rule(key, value, config):
        if optional and value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{key} must be an integer >= {minimum}{' (or unset)' if optional else ''}, "
                             f"got {value!r}")
    return rule


def _number(optional=False, positive=False):
    """A finite number >= 0; ``positive``: > 0 (a size of which 0 would mean nothing sensible)."""
    def rule(key, value, config):
        from .models.base import is_number
        if optional and value is None:
            return
        if not is_number(value) or not (value > 0 if positive else value >= 0):
            raise ValueError(f"{key} must be a number {'>' if positive else '>='} 0"
                             f"{' (or unset)' if optional else ''}, got {value!r}")
    return rule


def _boolean(optional=False):
    def rule(key, value, config):
        if not (isinstance(value, bool) or (optional and value is None)):
            raise ValueError(f"{key} must be true or false{' (or unset)' if optional else ''}, "
                             f"got {value!r}")
    return rule


def _text(optional=False):
    def rule(key, value, config):
        if not ((isinstance(value, str) and value) or (optional and value is None)):
            raise ValueError(f"{key} must be a non-empty string{' (or unset)' if optional else ''}, "
                             f"got {value!r}")
    return rule


def _preset(key, value, config):
    from .models.presets import PRESETS
    presets = sorted(PRESETS[config["model"]])
    if not isinstance(value, str) or value not in presets:
        raise ValueError(f"preset must be one of {presets} for model {config['model']}, got {value!r}")


def _model_config(key, value, config):
    from .models import CHECK_CONFIG, PRESETS
    if not isinstance(value, dict):
        raise ValueError(f"model_config must be a table of {config['model']} settings, got {value!r}")
    CHECK_CONFIG[config["model"]]({**PRESETS[config["model"]][config["preset"]], **value}, "model_config")


def _grid(key, value, config):
    from .parallel.grid import check_dims, parse_grid
    if value is None:
        return
    if isinstance(value, str):
        parse_grid(value)
    elif isinstance(value, (list, tuple)) and all(isinstance(p, int) and not isinstance(p, bool)
                                                  for p in value):
        check_dims(value)
    else:
        raise ValueError(f"grid must be 'Pn,Pd,Ph,Pw[,Pm]' or a list of 4 or 5 integers >= 1 (or unset), "
                         f"got {value!r}")


def _betas(key, value, config):
    from .models.base import is_number
    if not (isinstance(value, (list, tuple)) and len(value) == 2
            and all(is_number(b) and 0 <= b < 1 for b in value)):
        raise ValueError(f"betas must be two numbers in [0, 1) (Adam's moment decays), got {value!r}")


def _decay(key, value, config):
    from .optim import parse_decay
    if not isinstance(value, str):
        raise ValueError(f"decay must be a string of STEP:FACTOR pairs like '300:0.25,400:0.125' "
                         f"(or empty), got {value!r}")
    parse_decay(value)


def _compress(key, value, config):
    from .parallel.compress import parse
    parse(value)                                      # ValueError names the forms


def _allreduce(key, value, config):
    if not isinstance(value, str) or value not in ALGORITHMS:
        raise ValueError(f"allreduce must be one of {sorted(ALGORITHMS)}, got {value!r}")


def _allreduce_options(key, value, config):
    """A table of options of the chosen algorithm (parallel/allreduce/: each declares its own);
    what depends on the number of ranks (hierarchical's group_size dividing it) is checked when
    the gradient synchroniser is built."""
    from .parallel.allreduce import check_options
    if not isinstance(value, dict):
        raise ValueError(f"allreduce_options must be a table of options of the {config['allreduce']} allreduce, "
                         f"got {value!r}")
    try:
        check_options(config["allreduce"], value)
    except ValueError as err:
        raise ValueError(f"allreduce_options: {err}") from None


RULES = {
    "model": _one_of(*CHOICES["model"]), "preset": _preset, "model_config": _model_config,
    "data": _text(optional=True), "generate": _boolean(optional=True),
    "gen_samples": _integer(1, optional=True), "gen_val_samples": _integer(0, optional=True),
    "gen_seed": _integer(0), "cache": _boolean(), "check_data": _one_of(*CHOICES["check_data"]),
    "log1p": _one_of(*CHOICES["log1p"]), "normalize": _one_of(*CHOICES["normalize"]),
    "grid": _grid, "global_batch": _integer(1, optional=True),
    "steps": _integer(1, optional=True), "epochs": _integer(1, optional=True),
    "optimizer": _one_of(*CHOICES["optimizer"]), "lr": _number(optional=True), "momentum": _number(),
    "nesterov": _boolean(), "weight_decay": _number(), "betas": _betas, "eps": _number(),
    "base_batch": _integer(1, optional=True), "warmup_steps": _integer(0),
    "schedule": _one_of(*CHOICES["schedule"]), "decay": _decay, "warmup_epochs": _integer(0, optional=True),
    "dtype": _one_of(*CHOICES["dtype"]), "seed": _integer(0),
    "out": _text(), "resume": _boolean(), "overwrite": _boolean(), "break_lock": _boolean(),
    "data_changed_ok": _boolean(), "checkpoint_every": _integer(1),
    "validate_every": _integer(1), "log_every": _integer(1), "quiet": _boolean(), "plot": _boolean(),
    "allreduce": _allreduce, "allreduce_options": _allreduce_options, "bucket_mb": _number(positive=True),
    "overlap": _boolean(), "optimizer_sharding": _boolean(),
    "compress": _compress, "error_feedback": _boolean(),
    "priority": _one_of(*CHOICES["priority"]), "chunk_mb": _number(optional=True),
    "backend": _one_of(*CHOICES["backend"]), "cuda_aware": _boolean(),
    "stall_timeout": _number(),
}


def validate(config: dict) -> None:
    """Type and range of every key of DEFAULTS (``RULES``); ValueError naming the first bad one."""
    for key in DEFAULTS:
        RULES[key](key, config[key], config)


def effective_settings(config: dict) -> dict:
    """``config`` (validated) with the defaults the run resolves at start filled in: what
    the run actually uses, so two configs that train alike compare equal.

    - optimizer None: SGD for the mlperf schedule (MLPerf CosmoFlow), else Adam;
    - lr None: MLPerf's base lr for mlperf, else ``DEFAULT_LR[optimizer]``;
    - base_batch / warmup_epochs None: MLPerf's for mlperf (base_batch: no scaling otherwise);
    - decay: the canonical 'STEP:FACTOR,...' string; mlperf's epochs when empty;
    - model_config: the whole model config, model DEFAULTS <- preset <- [model_config].

    ``refimpl.train.resolve_run`` starts from this; ``resume_config`` compares it.
    """
    from .models import CHECK_CONFIG, PRESETS
    from .optim import MLPERF_COSMOFLOW as MLPERF
    from .optim import parse_decay
    mlperf = config["schedule"] == "mlperf"

    def given_or(key, default):
        return config[key] if config[key] is not None else default

    optimizer = given_or("optimizer", MLPERF["optimizer"] if mlperf else "adam")
    decay = parse_decay(config["decay"]) or (parse_decay(MLPERF["decay_epochs"]) if mlperf else ())
    model, preset = config["model"], config["preset"]
    return {**copy.deepcopy(config),
            "optimizer": optimizer,
            "lr": given_or("lr", MLPERF["lr"] if mlperf else DEFAULT_LR[optimizer]),
            "base_batch": given_or("base_batch", MLPERF["base_batch"] if mlperf else None),
            "warmup_epochs": given_or("warmup_epochs", MLPERF["warmup_epochs"] if mlperf else None),
            "decay": ",".join(f"{at}:{factor!r}" for at, factor in decay),
            "model_config": CHECK_CONFIG[model]({**PRESETS[model][preset], **config["model_config"]},
                                                "model_config")}


def resume_config(saved: dict, given: dict) -> tuple[dict, list[str]]:
    """The config of a resumed run: the checkpoint's, then the environment, then what was
    given explicitly (module docstring: precedence).

    A given identity key (``IDENTITY_KEYS``) whose effective value differs from the
    checkpoint's is an error: it would silently change the trajectory.  Repeating the
    checkpoint's value, or the default it resolved to, is accepted.  Returns (config, notes).
    """
    from .parallel.grid import parse_grid
    identity = {k: given[k] for k in IDENTITY_KEYS if given.get(k) is not None}
    before, after = effective_settings(merge(saved)), effective_settings(merge(saved, identity))
    for key in IDENTITY_KEYS:
        was, now = before[key], after[key]
        if key == "model_config":           # name the model setting, not the whole table
            key, was, now = next(((f"model_config[{k!r}]", was.get(k), now.get(k)) for k in now
                                  if _normal(now.get(k)) != _normal(was.get(k))), (key, was, now))
        if _normal(now) != _normal(was):
            raise ValueError(f"--resume: {key} = {now!r} differs from the checkpoint's {was!r}; a resumed "
                             "run keeps the settings it started with (start a new run with another "
                             "--out instead)")
    notes = []
    if given.get("grid") is not None and saved.get("grid") is not None \
            and _grid_dims(given["grid"]) != parse_grid(saved["grid"]):
        notes.append(f"resuming on grid {given['grid']} (checkpoint written on {saved.get('grid')}): "
                     "the run continues correctly but not bit for bit (sums are ordered differently)")
    layer = {k: v for k, v in given.items() if k not in IDENTITY_KEYS}
    return merge(saved, environment_layer(), layer), notes


def _grid_dims(grid):
    from .parallel.grid import check_dims, parse_grid
    return parse_grid(grid) if isinstance(grid, str) else check_dims(grid)


def _normal(value):
    """Compare lists and tuples alike (TOML and JSON give lists where Python wrote tuples)."""
    if isinstance(value, (list, tuple)):
        return [_normal(v) for v in value]
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    return value


__all__ = ["DEFAULTS", "DEFAULT_LR", "IDENTITY_KEYS", "CHOICES", "ENVIRONMENT", "RULES", "load_toml",
           "check_keys", "environment_layer", "merge", "validate", "effective_settings", "resume_config"]
