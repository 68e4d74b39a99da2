"""A reference estimator of the CosmoFlow targets: ridge regression on binned power spectra.

The network of scripts/experiment_volume.py is scored by its validation MAE on the
4 unit-scaled targets (``unitPar``).  How good *could* that score be at a given
sample size?  The generator (refimpl/data/cosmo.py) draws every sample's field
from a power spectrum set by the targets, so the spectrum measured from the
sample carries (nearly) all it says about them, with a sampling noise that falls
as the volume grows.  This module turns that into a number, computed directly
and with NumPy only:

1. ``SpectrumBins``: each channel of ``log(1 + counts)`` (what the network reads,
   before its per-channel standardisation) is Fourier transformed, and
   ``|F(k)|^2 / volume`` is averaged over the modes in each of ``bins``
   logarithmic shells of |k|, from the fundamental ``2 pi / S`` to the cube's
   corner ``pi sqrt(3)``; the features are the logs of those averages:
   ``channels x bins`` numbers per sample.  (The Poisson counts' shot noise and
   the lognormal transform make them a biased estimate of ``D_c^2 P(k)``; the
   regression learns around that.)
2. ``fit``: a ridge regression of the targets on the standardised features and
   all their pairwise products (degree 2: the map from a spectrum to the
   parameters is not linear, e.g. the amplitude is a ratio of integrals), its
   penalty chosen by ``folds``-fold cross-validation of the MAE on the
   *training* samples alone.
3. ``predict``: the fitted map, clipped to the targets' range [-1, 1].

The floor is fitted on the same training samples the network learns from and
scored on the same validation samples with the same metric, so both see the
same information.  It is an *estimate* of the best score: the best member of a
simple family, not a proven bound.  A network that beats it has found more than
this summary holds (the spectrum's finer shape, or what the lognormal transform
and the counts put beyond the spectrum); a network far above it has not learned
all the spectrum says.  Pilot runs (16^3 and 32^3, 1024 training samples, data
apart from the experiment's) chose logarithmic shells and degree 2 with a
cross-validated penalty over linear shells, degree 1 or an unpenalised fit:
degree 2 without a penalty over-fits 561 coefficients to 1024 samples.
"""
from __future__ import annotations

import math

import numpy

from .cosmo import wavenumbers

#: the ridge penalties tried, per training sample (the penalty is ``lam * n``)
LAMBDAS = (0.0, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)


class SpectrumBins:
    """The shells of |k| for samples of spatial ``shape`` (D, H, W), and their features.

    Logarithmic shells put as many bins on the large scales, where a bigger volume adds
    modes (and the slope n_s shows before the damping), as on the small ones.
    """

    def __init__(self, shape, bins: int = 8):
        shape = tuple(int(n) for n in shape)
        if len(shape) != 3 or min(shape) < 2:
            raise ValueError(f"shape must be 3 spatial extents >= 2, got {shape}")
        if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
            raise ValueError(f"bins must be a positive integer, got {bins!r}")
        k = wavenumbers(shape).ravel()
        lowest = 2 * math.pi / max(shape)                     # the fundamental of the longest axis
        self.edges = numpy.geomspace(lowest * (1 - 1e-9), math.pi * math.sqrt(3) * (1 + 1e-9), bins + 1)
        which = numpy.digitize(k, self.edges) - 1
        self.keep = (k > 0) & (which >= 0) & (which < bins)
        self.which = which[self.keep]
        self.modes = numpy.bincount(self.which, minlength=bins)
        if not self.modes.all():
            raise ValueError(f"{bins} logarithmic bins leave shell(s) {numpy.flatnonzero(self.modes == 0).tolist()} "
                             f"without a Fourier mode at size {shape}: use fewer bins")
        self.shape, self.bins = shape, bins

    def features(self, x):
        """x (C, D, H, W) -> log of the mean |rfftn(x_c - mean)|^2 / volume per shell, (C * bins,) float64."""
        x = numpy.asarray(x, dtype=numpy.float64)
        if x.ndim != 4 or x.shape[1:] != self.shape:
            raise ValueError(f"x must be (C, {', '.join(map(str, self.shape))}), got {x.shape}")
        x = x - x.mean(axis=(1, 2, 3), keepdims=True)
        power = numpy.abs(numpy.fft.rfftn(x, axes=(1, 2, 3))) ** 2 / math.prod(self.shape)
        out = numpy.empty((x.shape[0], self.bins))
        for c in range(x.shape[0]):
            out[c] = numpy.bincount(self.which, weights=power[c].ravel()[self.keep], minlength=self.bins)
        # a constant channel has no power: a floor keeps the log finite
        return numpy.log(numpy.maximum(out / self.modes, 1e-30)).ravel()


def quadratic(z):
    """(n, f) standardised features -> (n, 1 + f + f(f+1)/2): a constant, z, and z_i z_j for i <= j."""
    i, j = numpy.triu_indices(z.shape[1])
    return numpy.concatenate([numpy.ones((len(z), 1)), z, z[:, i] * z[:, j]], axis=1)


def _ridge(a, y, penalty):
    """argmin |a w - y|^2 + penalty |w[1:]|^2 (the constant is not penalised)."""
    reg = penalty * numpy.eye(a.shape[1])
    reg[0, 0] = 0.0
    if penalty == 0.0:
        return numpy.linalg.lstsq(a, y, rcond=None)[0]
    return numpy.linalg.solve(a.T @ a + reg, a.T @ y)


def fit(features, targets, lambdas=LAMBDAS, folds: int = 5) -> dict:
    """The floor's regression from training ``features`` (n, f) to ``targets`` (n, T).

    Returns {"mean", "std", "weights", "lam", "cv_mae"}: the standardisation, the
    ridge weights on ``quadratic`` features, and the penalty per sample the
    ``folds``-fold cross-validation chose (fold of sample i: i % folds) with its MAE.
    """
    f = numpy.asarray(features, dtype=numpy.float64)
    y = numpy.asarray(targets, dtype=numpy.float64)
    if f.ndim != 2 or y.ndim != 2 or len(f) != len(y):
        raise ValueError(f"features (n, f) and targets (n, T) must have the same n, got {f.shape} and {y.shape}")
    if not numpy.isfinite(f).all() or not numpy.isfinite(y).all():
        raise ValueError("features and targets must be finite")
    if isinstance(folds, bool) or not isinstance(folds, int) or not 2 <= folds <= len(f):
        raise ValueError(f"folds must be an integer in [2, {len(f)}] (the samples), got {folds!r}")
    mean, std = f.mean(axis=0), f.std(axis=0)
    std = numpy.where(std > 0, std, 1.0)
    a = quadratic((f - mean) / std)
    fold = numpy.arange(len(f)) % folds
    scores = []
    for lam in lambdas:
        err = 0.0
        for k in range(folds):
            w = _ridge(a[fold != k], y[fold != k], lam * len(f))
            err += numpy.abs(numpy.clip(a[fold == k] @ w, -1.0, 1.0) - y[fold == k]).sum()
        scores.append(err / y.size)
    best = int(numpy.argmin(scores))
    return {"mean": mean, "std": std, "weights": _ridge(a, y, lambdas[best] * len(f)),
            "lam": float(lambdas[best]), "cv_mae": float(scores[best])}


def predict(model: dict, features):
    """Targets (n, T) of ``features`` (n, f) by a ``fit`` result, clipped to [-1, 1]."""
    f = numpy.asarray(features, dtype=numpy.float64)
    return numpy.clip(quadratic((f - model["mean"]) / model["std"]) @ model["weights"], -1.0, 1.0)


def mae(prediction, targets):
    """(mean absolute error over everything, per target (T,)): the network's metric."""
    err = numpy.abs(numpy.asarray(prediction, dtype=numpy.float64) - numpy.asarray(targets, dtype=numpy.float64))
    return float(err.mean()), err.mean(axis=0)


__all__ = ["LAMBDAS", "SpectrumBins", "quadratic", "fit", "predict", "mae"]
