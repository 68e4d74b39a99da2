"""The layer registry: per kind of layer, everything refimpl knows about it, in one entry.

A kind (``conv3d``, ``max_pool3d``, ...) is a ``LayerKind``: its hyper-parameters and their
rules, its options (``Option``: check-layer's flags, suite keys, ``spec.options``), its
statistics (``Statistic``: the partial tensors it reduces over ranks), its reference forward
and backward (refimpl/functional, convs with the reference algorithm), its local, spatially
partitioned and model-parallel constructors (refimpl/nn), its PyTorch twin, and what the
oracle needs to derive and diagnose every rank's blocks.  check-layer (refimpl/check.py) and
the oracle (refimpl/oracle/) look a kind up by the name a user types and never branch on the
name, nor list its options, so a new layer is its functional op, its kind module, one line
here and its test (docs/contributing.md, "Adding a layer"); a kind of a user's own is
registered by a file ``$REFIMPL_KINDS`` names (``load_kinds``).

    base.py        LayerKind (pointwise in space, no parameters) and WindowKind (a halo'd window op)
    options.py     Option and Statistic: what a kind declares of its options and statistics
    conv.py        conv3d, conv_transpose3d
    pool.py        max_pool3d, avg_pool3d
    batch_norm.py  batch_norm3d
    norm.py        group_norm3d, instance_norm3d (option num_groups; per-(sample, group) statistics)
    plan_only.py   relu, leaky_relu, gather, linear, flatten_linear: kinds only the planner prices

Every kind also carries the planner's hooks (``LayerKind.plan_*``: its label in the plan's
tables, its halo plan, FLOPs, saved memory, halo and model-axis messages); refimpl/plan.py
prices a model's layers (``Model.describe``) through ``plan_kind`` and never by name.  The
kinds of plan_only.py lack check-layer's hooks, so they sit in ``PLAN_ONLY``, not in
``REGISTRY``: ``names``, ``names_taking`` and ``lookup`` (check-layer, the oracle) never see them.
"""
from __future__ import annotations

from .base import LayerKind, WindowKind
from .batch_norm import BatchNorm3dKind
from .conv import Conv3dKind, ConvTranspose3dKind
from .layer_norm import KINDS as _LAYER_NORM_KINDS
from .norm import KINDS as _NORM_KINDS
from .options import Option, Statistic
from .plan_only import KINDS as _PLAN_ONLY_KINDS
from .pool import AvgPool3dKind, MaxPool3dKind

#: name -> kind, in the order check-layer lists them
REGISTRY: dict[str, LayerKind] = {}


def register(kind: LayerKind) -> LayerKind:
    """Add ``kind`` under its name (a test may add its own: pytest's monkeypatch.setitem).  Its
    options must not shadow a window argument, nor differ from another kind's of the same name."""
    if not kind.name or kind.name in REGISTRY:
        raise ValueError(f"layer kind {kind.name!r}: needs a name no other kind has")
    known = all_options()
    for option in kind.options:
        if option.name in RESERVED:
            raise ValueError(f"layer kind {kind.name!r}: option {option.name!r} is an argument every kind has")
        if option.name in known and known[option.name] != option:
            raise ValueError(f"layer kind {kind.name!r}: option {option.name!r} differs from the one of "
                             f"{' / '.join(names_taking(option.name))} (kinds sharing an option declare the same)")
    REGISTRY[kind.name] = kind
    return kind


#: the arguments of every layer check and case besides the options (check.LayerCheck's fields)
RESERVED = frozenset({"layer", "input", "grid", "out_channels", "kernel", "stride", "padding", "dilation",
                      "output_padding", "model_parallel", "dtype", "seed", "algorithm", "options", "name",
                      "grids", "values", "dtypes"})


def all_options() -> dict:
    """name -> ``Option`` of every registered kind, in registration order (check-layer's flags,
    the suite keys)."""
    out = {}
    for kind in REGISTRY.values():
        for option in kind.options:
            out.setdefault(option.name, option)
    return out


def lookup(name: str) -> LayerKind:
    """The kind called ``name``; ValueError listing the registered ones."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"layer must be one of {', '.join(REGISTRY)}, got {name!r}") from None


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def names_taking(argument: str) -> list[str]:
    """The kinds that read ``argument`` (check-layer's --help and its 'applies to' errors)."""
    return [name for name, kind in REGISTRY.items()
            if argument in kind.hyper_parameters or argument in kind.option_names()]


#: path -> the kind names it registered, of the files $REFIMPL_KINDS named (``load_kinds``)
LOADED: dict[str, list] = {}


def load_kinds(environ=None) -> list:
    """Run the files ``$REFIMPL_KINDS`` names (comma-separated ``FILE.py``), each of which
    registers layer kinds of its own (``register``): every ``refimpl`` command calls this before
    it builds its flags, so check-layer and the oracle offer them as the built-in kinds (under
    mpiexec every rank runs the files).  A file runs once per process; returns the names it
    added.  ValueError of one line: a bad value (refimpl/settings.py), a file that fails, or one
    that registers no kind."""
    import importlib.util
    import re
    import sys

    from ..settings import env_setting
    added = []
    for path in env_setting("REFIMPL_KINDS", environ):
        if path in LOADED:
            continue
        before = set(REGISTRY)
        module_name = "refimpl_kinds_" + re.sub(r"\W", "_", path)
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module          # (dataclasses, pickle: the module is importable)
        try:
            spec.loader.exec_module(module)
        except Exception as err:                   # noqa: BLE001 -- the user's file: one line naming it
            sys.modules.pop(module_name, None)
            for name in set(REGISTRY) - before:
                del REGISTRY[name]
            raise ValueError(f"REFIMPL_KINDS: {path} failed: {type(err).__name__}: {err}") from None
        new = [name for name in REGISTRY if name not in before]
        if not new:
            raise ValueError(f"REFIMPL_KINDS: {path} registers no layer kind (call refimpl.layers.register(kind) "
                             "at the end of the file)")
        LOADED[path] = new
        added += new
    return added


#: name -> kind, for the kinds only the planner prices (no check-layer hooks: plan_only.py)
PLAN_ONLY: dict[str, LayerKind] = {}


def plan_kind(name: str) -> LayerKind:
    """The kind the planner prices a layer with: ``name`` is a registry name (``conv3d``, a
    ``Model.describe`` entry's kind) or a planner label (``conv``, ``pool``: ``plan_label``,
    the first kind registered with it); ValueError listing the priced kinds."""
    kind = REGISTRY.get(name) or PLAN_ONLY.get(name)
    if kind is None:
        kind = next((k for k in (*REGISTRY.values(), *PLAN_ONLY.values()) if k.plan_label and k.plan_label == name),
                    None)
    if kind is None or not kind.plan_label:
        priced = [n for n, k in (*REGISTRY.items(), *PLAN_ONLY.items()) if k.plan_label]
        raise ValueError(f"the planner prices layers of kinds {', '.join(priced)}, not {name!r}")
    return kind


for kind in (Conv3dKind(), ConvTranspose3dKind(), MaxPool3dKind(), AvgPool3dKind(), BatchNorm3dKind(), *_NORM_KINDS, *_LAYER_NORM_KINDS):
    register(kind)
for kind in _PLAN_ONLY_KINDS:
    if kind.name in REGISTRY or kind.name in PLAN_ONLY:
        raise ValueError(f"layer kind {kind.name!r}: needs a name no other kind has")
    PLAN_ONLY[kind.name] = kind
del kind

__all__ = ["LayerKind", "WindowKind", "Option", "Statistic", "REGISTRY", "PLAN_ONLY", "register", "lookup", "names",
           "names_taking", "all_options", "plan_kind", "load_kinds"]
