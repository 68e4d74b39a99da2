"""Oracle suites: a small TOML spec of layer cases, each run on one or more process grids.

A suite lists ``[[case]]`` tables; every case names a layer and its arguments exactly as
``refimpl check-layer`` takes them, and ``grids``, the process grids it is partitioned
over.  One *case file* is written per (case, grid) pair, named ``NAME.G.h5`` with the grid
written ``Pn-Pd-Ph-Pw[-Pm]``.  Top-level keys (all optional): ``description``, ``seed``
(the default seed of every case), ``dtypes`` (default ``["float64", "float32"]``).  Keys of
a case::

    name            letters, digits, '_' and '-'
    layer           a layer kind of refimpl/layers (``refimpl check-layer --help`` lists them)
    input           [N, C, D, H, W] (global)
    out_channels    conv layers (default C)
    kernel          int or [kd, kh, kw]; likewise stride, dilation, output_padding
    padding         int, [pd, ph, pw], the per-side [d_lo, d_hi, h_lo, h_hi, w_lo, w_hi],
                    "valid" or "same" (as check-layer's --padding)
    <option>        an option of the case's layer kind (``LayerKind.options``: pooling's
                    ceil_mode, the convs' groups, ...; ``refimpl check-layer --help`` lists
                    them as flags): its name, a TOML value of its type
    grids           [[Pn, Pd, Ph, Pw], ...], or 5 entries with the model axis Pm
    model_parallel  none | filter | channel (as check-layer --model-parallel)
    values          normal | ties (small integers: many equal maxima)
    seed, dtypes    as the top-level defaults

docs/oracle.md shows a whole suite.  Every case is validated by the same code as
``check-layer`` (``refimpl.check.LayerCheck``), so a suite case that loads is one
check-layer would run; any unknown key or bad value is a ``ValueError`` naming the case and
the key.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib import resources

from .. import layers
from ..check import LayerCheck
from ..layers.options import TYPE_RULES, HasOptions
from ..parallel.grid import format_grid
from ..paths import refuse_special

#: keys a case may set, with their defaults (None: check-layer's default); besides these, the
#: options of the registered layer kinds (``case_keys``)
CASE_KEYS = {"name": None, "layer": None, "input": None, "out_channels": None, "kernel": 3,
             "stride": None, "padding": 0, "dilation": 1, "output_padding": 0, "grids": None,
             "model_parallel": "none", "values": "normal", "seed": None, "dtypes": None}
SUITE_KEYS = {"seed", "dtypes", "case", "description"}
DTYPES = ("float64", "float32")
VALUES = ("normal", "ties")
SHIPPED = ("hard",)
NAME = re.compile(r"^[A-Za-z0-9_-]+$")


def case_keys() -> list:
    """Every key a case may set: ``CASE_KEYS`` and the registered kinds' options."""
    return sorted(set(CASE_KEYS) | set(layers.all_options()))


@dataclass(frozen=True)
class CaseSpec(HasOptions):
    """One layer case on one grid: everything needed to regenerate its arrays.  ``options``: the
    layer kind's options (all of them, defaults included), also read as ``spec.<name>``."""
    name: str
    layer: str
    input: tuple
    out_channels: int
    kernel: tuple
    stride: tuple
    padding: tuple
    dilation: tuple
    output_padding: tuple
    grid: tuple
    model_parallel: str
    values: str
    seed: int
    dtypes: tuple
    options: dict = field(default_factory=dict, hash=False)

    @property
    def file_name(self) -> str:
        return f"{self.name}.{format_grid(self.grid).replace(',', '-')}.h5"

    @property
    def ranks(self) -> int:
        size = 1
        for p in self.grid:
            size *= p
        return size

    def layer_check(self) -> LayerCheck:
        """check-layer's validated ``LayerCheck`` of this case (the single source of its rules)."""
        return LayerCheck(layer=self.layer, input=self.input, grid=self.grid, out_channels=self.out_channels,
                          kernel=self.kernel, stride=self.stride, padding=self.padding, dilation=self.dilation,
                          output_padding=self.output_padding, model_parallel=self.model_parallel,
                          seed=self.seed, options=self.options)


def _int_list(value, where, key):
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{where}: {key} must be an integer or a list of integers, got {value!r}")
    return values


def _padding(value, where):
    """A case's padding: "same" or "valid" as is, else integers (as check-layer's --padding)."""
    return value if isinstance(value, str) else tuple(_int_list(value, where, "padding"))


def _options(case, where) -> dict:
    """The options a case sets, each of its option's TOML type (LayerCheck validates the values)."""
    out = {}
    for key, option in layers.all_options().items():
        if key in case:
            value = case[key]
            if value is not option.default and not option.has_type(value):
                raise ValueError(f"{where}: {key} must be {TYPE_RULES[option.type]}, got {value!r}")
            out[key] = value
    return out


def _as_keys(message: str) -> str:
    """check-layer's message in a suite's words: an option's flag (``--no-count-include-pad``) as
    its key (``count_include_pad``), any other flag without its dashes."""
    for option in layers.all_options().values():
        for flag in dict.fromkeys((option.applies_flag, option.flag)):
            message = re.sub(re.escape(flag) + r"\b", option.name, message)
    return message.replace("--", "")


def parse_suite(table: dict, where: str) -> list[CaseSpec]:
    """The (case, grid) specs of a suite table; ValueError naming the case and key."""
    unknown = sorted(set(table) - SUITE_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown top-level key(s) {unknown}; known: {sorted(SUITE_KEYS)}")
    cases = table.get("case")
    if not isinstance(cases, list) or not cases or not all(isinstance(c, dict) for c in cases):
        raise ValueError(f"{where}: needs at least one [[case]] table")
    default_seed = table.get("seed", 0)
    default_dtypes = table.get("dtypes", list(DTYPES))
    specs, names = [], set()
    for index, case in enumerate(cases):
        label = f"{where}: case {case.get('name', index + 1)!r}"
        unknown = sorted(set(case) - set(case_keys()))
        if unknown:
            raise ValueError(f"{label}: unknown key(s) {unknown}; known: {case_keys()}")
        for key in ("name", "layer", "input", "grids"):
            if key not in case:
                raise ValueError(f"{label}: missing key {key!r}")
        name = case["name"]
        if not isinstance(name, str) or not NAME.match(name):
            raise ValueError(f"{label}: name must be letters, digits, '_' or '-', got {name!r}")
        if name in names:
            raise ValueError(f"{label}: the name is used twice")
        names.add(name)
        values = case.get("values", "normal")
        if values not in VALUES:
            raise ValueError(f"{label}: values must be one of {', '.join(VALUES)}, got {values!r}")
        seed = case.get("seed", default_seed)
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"{label}: seed must be a non-negative integer, got {seed!r}")
        dtypes = case.get("dtypes", default_dtypes)
        if not isinstance(dtypes, list) or not dtypes or any(d not in DTYPES for d in dtypes) \
                or len(set(dtypes)) != len(dtypes):
            raise ValueError(f"{label}: dtypes must be a list of distinct {', '.join(DTYPES)}, got {dtypes!r}")
        grids = case["grids"]
        if not isinstance(grids, list) or not grids:
            raise ValueError(f"{label}: grids must be a non-empty list of grids like [1, 2, 2, 1]")
        for grid in grids:
            g = _int_list(grid, label, "grids")
            spec = CaseSpec(name=name, layer=case["layer"], input=tuple(_int_list(case["input"], label, "input")),
                            out_channels=case.get("out_channels"),
                            kernel=tuple(_int_list(case.get("kernel", 3), label, "kernel")),
                            stride=None if case.get("stride") is None else
                            tuple(_int_list(case["stride"], label, "stride")),
                            padding=_padding(case.get("padding", 0), label),
                            dilation=tuple(_int_list(case.get("dilation", 1), label, "dilation")),
                            output_padding=tuple(_int_list(case.get("output_padding", 0), label, "output_padding")),
                            grid=tuple(g), model_parallel=case.get("model_parallel", "none"),
                            values=values, seed=seed, dtypes=tuple(dtypes),
                            options=_options(case, label))
            try:
                check = spec.layer_check()         # check-layer's rules, e.g. pooling padding
            except ValueError as err:
                raise ValueError(f"{label}, grid {list(g)}: {_as_keys(str(err))}") from None
            specs.append(CaseSpec(**{**spec.__dict__, "out_channels": check.out_channels,
                                     "kernel": check.kernel, "stride": check.stride,
                                     "padding": check.padding, "dilation": check.dilation,
                                     "output_padding": check.output_padding, "grid": check.grid,
                                     "options": check.options}))
    return specs


def load_suite(name_or_path: str) -> list[CaseSpec]:
    """A shipped suite by name (``hard``) or a TOML file; ValueError naming the problem."""
    import tomllib
    if name_or_path in SHIPPED:
        text = resources.files("refimpl.oracle.suites").joinpath(f"{name_or_path}.toml").read_text()
        return parse_suite(tomllib.loads(text), f"suite {name_or_path}")
    try:
        refuse_special(name_or_path, "suite")
        with open(name_or_path, "rb") as f:
            table = tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"suite {name_or_path!r}: no such file, and not a shipped suite "
                         f"({', '.join(SHIPPED)})") from None
    except OSError as err:
        raise ValueError(f"suite {name_or_path}: cannot read ({err.strerror})") from None
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"suite {name_or_path}: not valid TOML ({err})") from None
    return parse_suite(table, f"suite {name_or_path}")
