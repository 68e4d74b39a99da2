"""The registry: ``Algorithm`` (steps, cost, options, halves), ``Option``, ``register``, and what
is derived from them (``check_options``, ``predicted_time``, ``option_help``).

Nothing here imports mpi4py: the command line is built from this registry before MPI starts.
"""
from __future__ import annotations

import inspect
import numbers
from dataclasses import dataclass
from typing import Callable, NamedTuple

COST_ARGUMENTS = ("n", "p", "alpha", "beta", "gamma")   # cost(n, p, alpha, beta, gamma, **options)
STEP_ARGUMENTS = ("flat", "msgs")                     # steps(flat, msgs, **options)


@dataclass(frozen=True)
class Option:
    """One option of an algorithm: a keyword argument of its steps and of its cost, given as
    ``refimpl train --allreduce-option NAME=VALUE`` or in the ``[allreduce_options]`` table.

    ``check(value, p)`` raises ValueError (one line naming the option and what is allowed)
    unless ``value`` is allowed; with ``p`` None it checks only what does not depend on the
    number of ranks (the run config, before the grid is known).  ``default`` is the default of
    the keyword in the steps and the cost (None: the algorithm picks from p).  ``examples``: the
    values the tests run besides the default.
    """
    name: str
    default: object
    allowed: str                   # in words, for --help, docs and errors: "an int >= 1"
    check: Callable
    examples: tuple = ()


class Halves(NamedTuple):
    """How an allreduce splits into a reduce-scatter and an allgather: step generators
    ``(flat, msgs)`` of each half; after the first, rank r holds the sum of block r
    (``partition.block_range``)."""
    label: str
    reduce_scatter: Callable
    allgather: Callable


@dataclass(frozen=True)
class Algorithm:
    """One allreduce algorithm, everything about it in one place.

    - ``steps(flat, msgs, **options)``: the step generator (``collectives`` runs it);
    - ``cost(n, p, alpha, beta, gamma, **options)``: its alpha-beta-gamma time in seconds of one
      allreduce of n bytes on p >= 2 ranks (``predicted_time``, the planner);
    - ``options``: its ``Option``-s, keyword arguments of both ``steps`` and ``cost``;
    - ``halves(p)``: its ``Halves`` on p ranks, or None when it has no reduce-scatter half there
      (``collectives.reduce_scatter`` then runs the whole allreduce, and MPI's Allgatherv);
    - ``blocking(flat, msgs)``: the blocking form when it is not the steps run to the end
      (native: MPI_Allreduce rather than Iallreduce + Wait);
    - ``summary``: one line for --help and the docs.
    """
    name: str
    summary: str
    steps: Callable
    cost: Callable
    options: tuple = ()
    halves: Callable | None = None
    blocking: Callable | None = None

    def option(self, name: str) -> Option:
        return next(o for o in self.options if o.name == name)


ALGORITHMS: dict[str, Algorithm] = {}


def register(algorithm: Algorithm) -> Algorithm:
    """Add ``algorithm`` to ``ALGORITHMS``; ValueError unless it is complete and consistent:
    a new name, a generator for steps, a cost formula, and options that are exactly the keyword
    arguments of steps and cost beyond their fixed ones, with the same defaults."""
    name = algorithm.name
    if not (isinstance(name, str) and name.isidentifier()):
        raise ValueError(f"an allreduce algorithm's name must be an identifier, got {name!r}")
    if name in ALGORITHMS:
        raise ValueError(f"allreduce algorithm {name!r} is already registered")
    if not (isinstance(algorithm.summary, str) and algorithm.summary):
        raise ValueError(f"allreduce algorithm {name!r} has no summary")
    if not inspect.isgeneratorfunction(algorithm.steps):
        raise ValueError(f"allreduce algorithm {name!r}: steps must be a generator function "
                         f"steps(flat, msgs, **options), got {algorithm.steps!r}")
    if not callable(algorithm.cost):
        raise ValueError(f"allreduce algorithm {name!r} has no cost formula: give "
                         f"cost(n, p, alpha, beta, gamma, **options), its alpha-beta-gamma time "
                         f"(predicted_time and refimpl plan price every algorithm with it)")
    names = [o.name for o in algorithm.options]
    if len(set(names)) != len(names):
        raise ValueError(f"allreduce algorithm {name!r} declares an option twice: {names}")
    for fn, fixed in ((algorithm.steps, STEP_ARGUMENTS), (algorithm.cost, COST_ARGUMENTS)):
        params = list(inspect.signature(fn).parameters.values())
        if tuple(q.name for q in params[:len(fixed)]) != fixed:
            raise ValueError(f"allreduce algorithm {name!r}: {fn.__name__} must take ({', '.join(fixed)}, "
                             f"**options), got {inspect.signature(fn)}")
        keywords = {q.name: q.default for q in params[len(fixed):]}
        if set(keywords) != set(names):
            raise ValueError(f"allreduce algorithm {name!r}: the options of {fn.__name__} {sorted(keywords)} "
                             f"are not the declared options {sorted(names)}")
        for option in algorithm.options:
            if keywords[option.name] != option.default:
                raise ValueError(f"allreduce algorithm {name!r}: option {option.name} defaults to "
                                 f"{option.default!r}, {fn.__name__} to {keywords[option.name]!r}")
    for option in algorithm.options:
        for value in ((option.default,) if option.default is not None else ()) + tuple(option.examples):
            option.check(value, None)          # the default and the examples must be allowed
    ALGORITHMS[name] = algorithm
    return algorithm


def algorithm_named(name) -> Algorithm:
    """The registered algorithm ``name``; ValueError naming the registered ones."""
    if not isinstance(name, str) or name not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {sorted(ALGORITHMS)}, got {name!r}")
    return ALGORITHMS[name]


def describe_options(algorithm: Algorithm) -> str:
    """'colors (an int >= 1, the number of trees k; default 2)', or 'none'.  An option whose
    default is None says in ``allowed`` what the algorithm picks."""
    return ", ".join(f"{o.name} ({o.allowed}{'' if o.default is None else f'; default {o.default!r}'})"
                     for o in algorithm.options) or "none"


def check_options(name, options: dict, p: int | None = None) -> None:
    """ValueError (one line) unless ``name`` is registered and ``options`` are its options with
    allowed values; ``p`` None: only what does not depend on the number of ranks.  Depends only
    on arguments all ranks share, so every rank raises alike, before any message."""
    algorithm = algorithm_named(name)
    unknown = sorted(set(options) - {o.name for o in algorithm.options})
    if unknown:
        raise ValueError(f"algorithm {name!r} takes no option(s) {unknown}; its options: "
                         f"{describe_options(algorithm)}")
    for key, value in options.items():
        option = algorithm.option(key)
        if value is None and option.default is None:
            continue
        option.check(value, p)


def predicted_time(algorithm: str, n_bytes: float, p: int, alpha: float, beta: float,
                   gamma: float = 0.0, **options) -> float:
    """Alpha-beta-gamma prediction (seconds) of one allreduce of ``n_bytes`` on ``p`` ranks.

    ``alpha``: seconds per message, ``beta``: seconds per byte sent, ``gamma``: seconds per
    byte reduced.  ``options``: the algorithm's (``check_options``).  Each algorithm's
    ``cost`` gives the formula (its module's docstring derives it); one rank costs nothing.
    """
    spec = algorithm_named(algorithm)
    if p < 1:
        raise ValueError(f"p must be >= 1, got {p}")
    check_options(algorithm, options, p)
    if p == 1:
        return 0.0
    return spec.cost(float(n_bytes), p, alpha, beta, gamma, **options)


def is_int(value) -> bool:
    """An integer (Python or NumPy), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def option_help() -> str:
    """The options of every algorithm that has any, for --help."""
    return "; ".join(f"{a.name}: {describe_options(a)}" for a in ALGORITHMS.values() if a.options)
