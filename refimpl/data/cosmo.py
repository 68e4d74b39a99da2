"""CosmoFlow-like synthetic universes: lognormal fields whose power spectrum is the target.

CosmoFlow (Mathuriya et al. 2018) regresses 4 cosmological parameters from 3D
dark-matter particle counts at 4 redshifts.  We keep that learning problem and
replace the N-body simulation by a model whose statistics are exact:

1. A Gaussian random field ``g`` on a periodic grid with unit voxel spacing,
   drawn in Fourier space from the power spectrum (k in radians per voxel)::

       P(k) = A * (k / k0)^n_s * exp(-(k / k_d)^2),     P(0) = 0,   k0 = 0.5

   as ``g = irfftn(sqrt(P) * rfftn(w))`` with ``w`` unit white noise, so that
   ``P`` is the variance per Fourier mode in per-voxel units (P == 1 would be
   white noise of variance 1).  Like sigma_8 in cosmology the amplitude is
   given as an rms, ``sigma``: A is set so that the variance inside the
   Nyquist sphere, ``(1 / 2 pi^2) int_0^pi P(k) k^2 dk``, equals sigma^2 (the
   field's variance is a little larger: the cube's corners add modes).
2. Channel ``c`` is the field at redshift ``z_c`` (``z = linspace(0, 3, C)``;
   4 channels like the CosmoFlow 2019 data), scaled by the growth factor
   ``D_c = (1 + z_c)^(-gamma)`` and made a positive density by the lognormal
   transform ``rho_c = exp(D_c g - D_c^2 var(g) / 2)`` (mean ~1).
3. Counts-like values: ``Poisson(mean_count * rho_c)`` particles per voxel
   (CosmoFlow inputs are counts; the MLPerf reference applies log1p to them).
   ``mean_count=None`` returns the density itself.

The 4 targets (``PARAM_NAMES``) are sigma, n_s, log10 k_d and gamma, each
drawn uniformly in its range and stored as ``unitPar`` mapped linearly to
[-1, 1] (CosmoFlow's name and convention).  Larger volumes hold more Fourier
modes, so the spectrum (hence the parameters) is estimated better: the variance
of a binned P(k) estimate falls like 1 / (modes per bin) ~ 1 / volume.

Sample ``i`` of a dataset with seed ``s`` comes from ``default_rng(s + i)``
alone, so it does not depend on how many ranks generate or in what order.
Generation is host-side NumPy, one sample at a time (peak memory a few float64
copies of one channel); it is data preparation, not training.
"""
from __future__ import annotations

import math

import numpy

PARAM_NAMES = ("sigma", "spectral_index", "log10_damping_k", "growth_index")
PARAM_RANGES = numpy.array([
    (0.3, 1.0),             # sigma: rms of the Gaussian field (sets A)
    (-2.5, -1.0),           # n_s: slope of P(k) below the damping scale
    (math.log10(0.5), math.log10(2.0)),  # log10 k_d, k_d in rad/voxel (Nyquist = pi)
    (0.5, 1.5),             # gamma: growth factor D(z) = (1 + z)^-gamma
])
PIVOT_K = 0.5
MAX_REDSHIFT = 3.0


def to_unit(phys):
    """Physical parameters (..., 4) -> unitPar in [-1, 1]: 2 (p - lo) / (hi - lo) - 1."""
    lo, hi = PARAM_RANGES[:, 0], PARAM_RANGES[:, 1]
    return 2.0 * (numpy.asarray(phys, dtype=numpy.float64) - lo) / (hi - lo) - 1.0


def from_unit(unit):
    """unitPar in [-1, 1] (..., 4) -> physical parameters (inverse of ``to_unit``)."""
    lo, hi = PARAM_RANGES[:, 0], PARAM_RANGES[:, 1]
    return lo + (numpy.asarray(unit, dtype=numpy.float64) + 1.0) * (hi - lo) / 2.0


def redshifts(channels: int):
    """Redshift of each channel: evenly spaced in [0, 3] (one channel: z = 0)."""
    return numpy.linspace(0.0, MAX_REDSHIFT, channels)


def wavenumbers(shape):
    """|k| in radians per voxel on the rfftn grid of a real field of ``shape`` (D, H, W)."""
    kd = 2 * math.pi * numpy.fft.fftfreq(shape[0])[:, None, None]
    kh = 2 * math.pi * numpy.fft.fftfreq(shape[1])[None, :, None]
    kw = 2 * math.pi * numpy.fft.rfftfreq(shape[2])[None, None, :]
    return numpy.sqrt(kd * kd + kh * kh + kw * kw)   # (D, H, W//2 + 1)


def _shape(k, n_s, k_d):
    """(k / k0)^n_s exp(-(k / k_d)^2) for k > 0, 0 at k = 0."""
    safe_k = numpy.where(k > 0, k, 1.0)
    return numpy.where(k > 0, (safe_k / PIVOT_K) ** n_s * numpy.exp(-(safe_k / k_d) ** 2), 0.0)


def amplitude(phys) -> float:
    """A such that (1 / 2 pi^2) int_0^pi P(k) k^2 dk = sigma^2 (midpoint rule, 2^16 points)."""
    sigma, n_s, log10_kd, _ = phys
    steps = 1 << 16
    k = (numpy.arange(steps) + 0.5) * (math.pi / steps)
    integral = float(numpy.sum(_shape(k, n_s, 10.0 ** log10_kd) * k * k)) * (math.pi / steps)
    return sigma * sigma * 2 * math.pi ** 2 / integral


def power_spectrum(k, phys):
    """P(k) = A (k / k0)^n_s exp(-(k / k_d)^2), with P(0) = 0 (zero-mean field)."""
    _, n_s, log10_kd, _ = phys
    k = numpy.asarray(k, dtype=numpy.float64)
    return amplitude(phys) * _shape(k, n_s, 10.0 ** log10_kd)


def gaussian_field(shape, phys, rng):
    """Zero-mean Gaussian field (D, H, W) float64 with power spectrum ``power_spectrum``."""
    white = rng.standard_normal(shape)
    modes = numpy.fft.rfftn(white)
    modes *= numpy.sqrt(power_spectrum(wavenumbers(shape), phys))
    return numpy.fft.irfftn(modes, s=shape, axes=(0, 1, 2))


def measure_power_spectrum(field, bins: int = 16):
    """Radially averaged |rfftn(field)|^2 / volume: (mean k, P estimate, modes) per k bin.

    The estimator of ``power_spectrum`` for a field made by ``gaussian_field``;
    its relative scatter per bin is about sqrt(2 / modes).
    """
    field = numpy.asarray(field, dtype=numpy.float64)
    power = numpy.abs(numpy.fft.rfftn(field)) ** 2 / field.size
    k = wavenumbers(field.shape)
    edges = numpy.linspace(0.0, math.pi, bins + 1)
    which = numpy.digitize(k.ravel(), edges) - 1
    keep = (k.ravel() > 0) & (which >= 0) & (which < bins)
    modes = numpy.bincount(which[keep], minlength=bins)
    total = numpy.bincount(which[keep], weights=power.ravel()[keep], minlength=bins)
    k_sum = numpy.bincount(which[keep], weights=k.ravel()[keep], minlength=bins)
    with numpy.errstate(invalid="ignore", divide="ignore"):
        return k_sum / modes, total / modes, modes


def draw_parameters(rng):
    """Targets of one universe: unitPar uniform in [-1, 1]^4 (float64)."""
    return rng.uniform(-1.0, 1.0, size=len(PARAM_NAMES))


def generate_universe(index: int, seed: int, size, channels: int = 4, mean_count=64.0):
    """Sample ``index``: (full (C, D, H, W) float32, unitPar (4,) float32).

    ``full`` holds Poisson counts with mean ``mean_count`` per voxel, or the
    positive lognormal density itself when ``mean_count`` is None.
    """
    from ..functional.args import triple
    shape = triple(size, "size", minimum=1)
    if channels < 1:
        raise ValueError(f"channels must be >= 1, got {channels}")
    if mean_count is not None and not mean_count > 0:
        raise ValueError(f"mean_count must be > 0 or None, got {mean_count}")
    rng = numpy.random.default_rng(seed + index)
    unit = draw_parameters(rng)
    phys = from_unit(unit)
    g = gaussian_field(shape, phys, rng)                     # (D, H, W)
    variance = float(numpy.mean(g * g))
    full = numpy.empty((channels,) + shape, dtype=numpy.float32)
    for c, z in enumerate(redshifts(channels)):
        growth = (1.0 + z) ** (-phys[3])
        density = numpy.exp(growth * g - 0.5 * growth * growth * variance)
        full[c] = density if mean_count is None else rng.poisson(mean_count * density)
    return full, unit.astype(numpy.float32)


__all__ = ["PARAM_NAMES", "PARAM_RANGES", "PIVOT_K", "amplitude", "to_unit", "from_unit", "redshifts",
           "wavenumbers", "power_spectrum", "gaussian_field", "measure_power_spectrum",
           "draw_parameters", "generate_universe"]
