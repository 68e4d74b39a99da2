"""The allreduce algorithms, one module each, and the registry that lists them.

Every algorithm is a module that declares, side by side:

- its **steps**: a *step generator* ``steps(flat, msgs, **options)``, a plain function that
  reduces a 1-D contiguous buffer ``flat`` in place, posts one round of non-blocking messages
  (``msgs.send`` / ``msgs.recv``: Isend / Irecv), ``yield``-s their requests, and after the
  round has completed does the local work (add what arrived, pick the next partner);
  ``parallel/collectives.py`` runs it over MPI, blocking or a round at a time;
- its **cost**: ``cost(n, p, alpha, beta, gamma, **options)``, the time of one allreduce of n
  bytes on p >= 2 ranks in the model of Thakur, Rabenseifner & Gropp (2005): a message of n
  bytes costs ``alpha + n*beta``, reducing n bytes locally ``n*gamma``; ``p'`` is the largest
  power of two <= p and ``lg`` the base-2 logarithm.  The module docstring derives it;
- its **options**: ``Option(name, default, allowed, check, examples)``, keyword arguments of
  both the steps and the cost (``refimpl train --allreduce-option NAME=VALUE``);
- optionally its **halves** (reduce-scatter, allgather) and its **blocking** form;

and ends in ``ALGORITHM = Algorithm(...)``.  ``register`` refuses an incomplete one (no cost
formula, options that are not the keyword arguments of steps and cost, ...), so the planner
never prices an algorithm by another's formula.

``ALGORITHMS`` (name -> Algorithm, in the order below) is the one list: ``predicted_time``,
the choices of ``--allreduce``, the options ``--allreduce-option`` accepts, the tests'
parametrisation and the check of docs/communication.md's table all come from it.  Nothing in
this package imports ``mpi4py.MPI``, so the command line is built from it before MPI starts.

Adding an algorithm: a module like ``ring.py``, one line in the list below, a row in
docs/communication.md's table of algorithms, and a hand-computed value of its cost in
tests/test_cost_model.py; tests/mpi/ check its result against ``MPI_Allreduce`` by themselves.
"""
from __future__ import annotations

from . import halving_doubling, hierarchical, multicolor, native, recursive_doubling, ring
from .hierarchical import check_group_size, default_group_size
from .registry import (ALGORITHMS, Algorithm, Halves, Option, algorithm_named, check_options, describe_options,
                       option_help, predicted_time, register)

for _module in (native, ring, recursive_doubling, halving_doubling, multicolor, hierarchical):
    register(_module.ALGORITHM)


def configurations() -> list[tuple[str, dict]]:
    """(name, options) of every algorithm with its defaults, then with each example value of
    each option: what the tests run."""
    return [(a.name, {}) for a in ALGORITHMS.values()] + \
        [(a.name, {o.name: v}) for a in ALGORITHMS.values() for o in a.options for v in o.examples]


__all__ = ["ALGORITHMS", "Algorithm", "Halves", "Option", "algorithm_named", "check_options", "check_group_size",
           "configurations", "default_group_size", "describe_options", "option_help", "predicted_time",
           "register"]
