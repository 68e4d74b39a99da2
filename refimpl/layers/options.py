"""What a layer kind declares besides its hooks: its options (``Option``) and its statistics
(``Statistic``), and how a spec carries the options (``HasOptions``, ``spec_option``).

check-layer's flags (refimpl/commands/check_layer.py), the suite keys and ``CaseSpec``
(refimpl/oracle/suite.py), ``LayerCheck`` (refimpl/check.py) and the case files
(refimpl/oracle/casefile.py) are built from these declarations of the registered kinds
(``refimpl.layers.all_options``); none of them lists an option or a statistic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

#: what a value of each option type must be, completing "--flag must be ..."
TYPE_RULES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


@dataclass(frozen=True)
class Option:
    """One option of a layer kind (PyTorch's keyword arguments beyond the window's: pooling's
    ``ceil_mode``, the convs' ``groups``): check-layer's flag, a suite's key and a field of
    ``LayerCheck.options`` / ``CaseSpec.options`` are made from it.

    ``type``: bool (the flag is ``--name`` / ``--no-name``), int, float or str; ``default``: the
    value when not given (it is always allowed: None for "no override"); ``help``: the flag's
    help, ``{kinds}`` replaced by the kinds that take it (else they are appended); ``flag``:
    default ``--`` + the name with dashes; ``validate(value)``: True when a value of the right
    type is allowed, ``rule`` saying what is ("a positive integer"); the message of a refused
    value is "FLAG must be RULE, got VALUE".  Kinds that share an option declare the same one."""
    name: str
    type: type
    default: Any
    help: str
    flag: str = ""
    metavar: str | None = None
    validate: Callable[[Any], bool] | None = None
    rule: str = ""

    def __post_init__(self):
        if not self.name.isidentifier() or self.type not in TYPE_RULES:
            raise ValueError(f"option {self.name!r}: needs an identifier for a name and a type of "
                             f"{', '.join(t.__name__ for t in TYPE_RULES)}")
        if not self.flag:
            object.__setattr__(self, "flag", "--" + self.name.replace("_", "-"))

    @property
    def applies_flag(self) -> str:
        """The flag a user types to set it away from its default: ``--no-X`` for a bool on by default."""
        return "--no-" + self.flag[2:] if self.type is bool and self.default is True else self.flag

    def has_type(self, value) -> bool:
        if self.type is bool:
            return isinstance(value, bool)
        if self.type is float:
            return isinstance(value, (int, float)) and not isinstance(value, bool)
        return isinstance(value, self.type) and not isinstance(value, bool)

    def check(self, value):
        """``value`` if allowed (the default always is); ValueError "FLAG must be RULE, got VALUE"."""
        if value is self.default or (value == self.default and self.has_type(value)):
            return value
        if not self.has_type(value) or (self.validate is not None and not self.validate(value)):
            raise ValueError(f"{self.flag} must be {self.rule or TYPE_RULES[self.type]}, got {value!r}")
        return float(value) if self.type is float else value


@dataclass(frozen=True)
class Statistic:
    """A per-rank partial tensor the partitioned layer reduces over ranks (batch norm's
    per-channel sums ``sum_partial``, ``sumsq_partial``): a case file holds every rank's block of
    it, ``run-torch`` reports it, ``oracle check`` compares it.  ``shape(spec, layout)``: the
    whole tensor's shape with ``layout`` None (what the blocks of the ranks that share it add up
    to), else the shape of rank ``layout``'s block (``refimpl.oracle.expect.RankLayout``; where
    the block lies in the whole is the ``offset`` of ``rank_partials``).  ``backward``: a sum of
    the backward pass (of dy), which the oracle orders after the forward's tensors when it
    names the first error (``refimpl.oracle.compare.causal_index``)."""
    name: str
    about: str
    shape: Callable
    backward: bool = False


class HasOptions:
    """Attribute access to a spec's options (``LayerCheck``, ``CaseSpec``): ``spec.ceil_mode`` is
    ``spec.options["ceil_mode"]``, or the option's default where the kind does not declare it."""

    def __getattr__(self, name):
        if not name.startswith("__"):
            options = self.__dict__.get("options")
            if options is not None and name in options:
                return options[name]
            from . import all_options
            known = all_options()
            if name in known:
                return known[name].default
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def spec_option(spec, name):
    """The value of option ``name`` of ``spec`` (``spec.options``), its declared default where
    the spec has none."""
    options = getattr(spec, "options", None) or {}
    if name in options:
        return options[name]
    from . import all_options
    return all_options()[name].default
