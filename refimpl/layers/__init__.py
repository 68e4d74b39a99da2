"""The layer registry: per kind of layer, everything refimpl knows about it, in one entry.

A kind (``conv3d``, ``max_pool3d``, ...) is a ``LayerKind``: its hyper-parameters and their
rules, its reference forward and backward (refimpl/functional, convs with the reference
algorithm), its local, spatially partitioned and model-parallel constructors (refimpl/nn),
its PyTorch twin, and what the oracle needs to derive and diagnose every rank's blocks.
check-layer (refimpl/check.py) and the oracle (refimpl/oracle/) look a kind up by the name a
user types and never branch on the name, so a new layer is its functional op, one entry here
and its test (docs/contributing.md, "Adding a layer").

    base.py        LayerKind (pointwise in space, no parameters) and WindowKind (a halo'd window op)
    conv.py        conv3d, conv_transpose3d
    pool.py        max_pool3d, avg_pool3d
    batch_norm.py  batch_norm3d
    norm.py        group_norm3d, instance_norm3d: planner hooks only for now (in PLAN_ONLY)
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
from .norm import KINDS as _NORM_KINDS
from .plan_only import KINDS as _PLAN_ONLY_KINDS
from .pool import AvgPool3dKind, MaxPool3dKind

#: name -> kind, in the order check-layer lists them
REGISTRY: dict[str, LayerKind] = {}


def register(kind: LayerKind) -> LayerKind:
    """Add ``kind`` under its name (a test may add its own: pytest's monkeypatch.setitem)."""
    if not kind.name or kind.name in REGISTRY:
        raise ValueError(f"layer kind {kind.name!r}: needs a name no other kind has")
    REGISTRY[kind.name] = kind
    return kind


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
    return [name for name, kind in REGISTRY.items() if argument in kind.hyper_parameters]


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


for kind in (Conv3dKind(), ConvTranspose3dKind(), MaxPool3dKind(), AvgPool3dKind(), BatchNorm3dKind()):
    register(kind)
for kind in (*_PLAN_ONLY_KINDS, *_NORM_KINDS):
    if kind.name in REGISTRY or kind.name in PLAN_ONLY:
        raise ValueError(f"layer kind {kind.name!r}: needs a name no other kind has")
    PLAN_ONLY[kind.name] = kind
del kind

__all__ = ["LayerKind", "WindowKind", "REGISTRY", "PLAN_ONLY", "register", "lookup", "names", "names_taking",
           "plan_kind"]
