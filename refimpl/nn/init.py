"""PyTorch's default initialisation, drawn from an explicit ``numpy.random.Generator``.

Conv and linear layers use ``kaiming_uniform_(a=sqrt(5))`` for the weight,
which is ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, and the same bound for the
bias.  Values are drawn in float64 on the host (the same numbers for every
dtype and backend), then cast and moved with ``refimpl.backend.asarray``.
"""
from __future__ import annotations

import math

import numpy

from ..backend import TRAIN_DTYPE, asarray, resolve_dtype


def check_rng(rng) -> numpy.random.Generator:
    if not isinstance(rng, numpy.random.Generator):
        raise ValueError("rng must be a numpy.random.Generator (e.g. numpy.random.default_rng(0)) "
                         f"so that models are reproducible, got {type(rng).__name__}")
    return rng


def uniform_fan_in(rng, shape, fan_in: int, dtype=TRAIN_DTYPE):
    """U(-1/sqrt(fan_in), 1/sqrt(fan_in)) of ``shape`` on the run's array module."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    return asarray(check_rng(rng).uniform(-bound, bound, size=shape), dtype=resolve_dtype(dtype))


def constant(shape, value: float, dtype=TRAIN_DTYPE):
    return asarray(numpy.full(shape, value), dtype=resolve_dtype(dtype))


__all__ = ["check_rng", "uniform_fan_in", "constant"]
