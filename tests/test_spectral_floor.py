"""refimpl/data/spectral_floor.py: the binned spectra, the ridge fit, and the floor falling with volume."""
import math

import numpy
import pytest

from refimpl.data import cosmo
from refimpl.data import spectral_floor as sf


def test_shells_cover_every_mode_from_the_fundamental_to_the_corner():
    bins = sf.SpectrumBins((16, 16, 16), 8)
    k = cosmo.wavenumbers((16, 16, 16))
    assert bins.modes.sum() == (k > 0).sum() == bins.keep.sum()       # every k > 0 in one shell
    assert bins.edges[0] < 2 * math.pi / 16 < bins.edges[1] and bins.edges[-1] > math.pi * math.sqrt(3)
    assert numpy.allclose(numpy.diff(numpy.log(bins.edges)), numpy.log(bins.edges[1] / bins.edges[0]))


def test_features_are_the_log_shell_means_of_the_power():
    """White noise of variance v has |F(k)|^2 / volume = v on average in every shell; a plane wave
    puts all its power in the shell of its wavenumber."""
    rng = numpy.random.default_rng(0)
    shape = (24, 24, 24)
    bins = sf.SpectrumBins(shape, 6)
    noise = 3.0 * rng.standard_normal((2,) + shape)
    f = bins.features(noise).reshape(2, 6)
    big = bins.modes >= 100                    # shells with enough modes for a 15 % test
    assert numpy.allclose(f[:, big], math.log(9.0), atol=0.15)
    d = numpy.arange(24)[:, None, None] * numpy.ones(shape)
    wave = numpy.cos(2 * math.pi * 3 * d / 24)[None]                    # k = 2 pi 3 / 24 along D
    g = bins.features(wave)
    shell = numpy.digitize(2 * math.pi * 3 / 24, bins.edges) - 1
    assert g.argmax() == shell and (numpy.delete(g, shell) < -30).all()   # the rest: the 1e-30 floor


def test_features_reject_wrong_shapes_and_bins():
    with pytest.raises(ValueError, match="bins must be a positive integer"):
        sf.SpectrumBins((8, 8, 8), 0)
    with pytest.raises(ValueError, match="without a Fourier mode"):
        sf.SpectrumBins((4, 4, 4), 40)
    with pytest.raises(ValueError, match=r"x must be \(C, 8, 8, 8\)"):
        sf.SpectrumBins((8, 8, 8), 4).features(numpy.zeros((1, 8, 8, 4)))


def test_fit_recovers_a_quadratic_map_and_clips_to_the_target_range():
    rng = numpy.random.default_rng(1)
    x = rng.standard_normal((200, 3))
    y = numpy.stack([0.1 * x[:, 0] - 0.05 * x[:, 1] * x[:, 2], 0.03 * x[:, 2] ** 2 - 0.1], axis=1)
    assert numpy.abs(y).max() < 1                                      # inside the clip
    model = sf.fit(x, y)
    assert model["lam"] == 0.0 and model["cv_mae"] < 1e-10              # exact: no penalty wins
    assert numpy.allclose(sf.predict(model, x), y, atol=1e-10)
    assert sf.predict(model, 100 * x).min() == -1.0 and sf.predict(model, 100 * x).max() == 1.0
    total, per = sf.mae(numpy.zeros((2, 2)), [[1.0, -1.0], [0.5, 0.0]])
    assert total == 0.625 and per.tolist() == [0.75, 0.5]


def test_fit_penalises_when_features_are_noise():
    """More coefficients than the data support: cross-validation picks a penalty."""
    rng = numpy.random.default_rng(2)
    x, y = rng.standard_normal((60, 8)), rng.uniform(-1, 1, (60, 2))
    assert sf.fit(x, y)["lam"] > 0


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError, match="same n"):
        sf.fit(numpy.zeros((5, 2)), numpy.zeros((4, 1)))
    with pytest.raises(ValueError, match="finite"):
        sf.fit(numpy.full((5, 2), numpy.nan), numpy.zeros((5, 1)))
    with pytest.raises(ValueError, match="folds"):
        sf.fit(numpy.zeros((5, 2)), numpy.zeros((5, 1)), folds=6)


def floor_mae(size, n_train=192, n_val=96, seed=40_000):
    """The floor's validation MAE from generated samples of one size (cosmo.generate_universe,
    counts as the network reads them: log(1 + counts))."""
    bins = sf.SpectrumBins((size,) * 3, 4)
    pairs = [cosmo.generate_universe(i, seed, size) for i in range(n_train + n_val)]
    features = numpy.stack([bins.features(numpy.log1p(x)) for x, _ in pairs])
    targets = numpy.stack([y for _, y in pairs]).astype(numpy.float64)
    model = sf.fit(features[:n_train], targets[:n_train])
    return sf.mae(sf.predict(model, features[n_train:]), targets[n_train:])[0]


def test_the_floor_falls_with_the_volume():
    """The experiment's premise, on the floor alone: the same targets (same seed) measured from
    64 times the volume are estimated clearly better."""
    small, large = floor_mae(8), floor_mae(32)
    assert large < 0.8 * small and small < 0.4, (small, large)       # 0.5: what a constant scores
