"""Synthetic 3D segmentation volumes: rotated ellipsoids of K-1 classes on background.

Labels (D, H, W): class 0 is background; ``objects`` ellipsoids with random
centres, semi-axes and orientations are painted in order (a later object covers
an earlier one), object j having class ``1 + j % (K - 1)`` so that every
foreground class is drawn.  The image (C, D, H, W) is the per-class mean
intensity ``class_means(K, C)[label]`` plus Gaussian noise of std ``noise``:
a network has to use context (smoothing over the noise), not a single voxel.

The class means are a fixed function of (K, C), not of the seed, so every
sample of every dataset shares them; sample ``i`` with seed ``s`` comes from
``default_rng(s + i)`` alone.  Host-side NumPy, one sample at a time.
"""
from __future__ import annotations

import numpy

from ..functional.args import triple


def class_means(classes: int, channels: int):
    """(K, C) mean intensities in [0, 1]: channel c maps class k to ((2c+1) k mod K) / (K-1).

    Channel 0 is k / (K - 1), so any two classes differ by >= 1/(K-1) there;
    the other channels permute the levels (2c+1 and K need not be coprime:
    they then repeat some levels, which is harmless).
    """
    k = numpy.arange(classes)[:, None]
    c = numpy.arange(channels)[None, :]
    return ((2 * c + 1) * k % classes) / max(classes - 1, 1)


def random_rotation(rng):
    """A uniformly random 3x3 rotation matrix (QR of a Gaussian matrix, signs fixed)."""
    q, r = numpy.linalg.qr(rng.standard_normal((3, 3)))
    q = q * numpy.sign(numpy.diag(r))
    if numpy.linalg.det(q) < 0:
        q[:, 0] = -q[:, 0]
    return q


def paint_ellipsoid(labels, value, centre, semi_axes, rotation) -> None:
    """Set ``labels`` to ``value`` inside the ellipsoid |R^T (x - centre) / semi_axes| <= 1.

    Only the bounding box of the ellipsoid (radius max(semi_axes) around the
    centre) is visited, so cost scales with the object, not the volume.
    """
    reach = float(max(semi_axes))
    box = tuple(slice(max(0, int(numpy.floor(c - reach))), min(n, int(numpy.ceil(c + reach)) + 1))
                for c, n in zip(centre, labels.shape))
    if any(s.start >= s.stop for s in box):
        return
    grids = numpy.meshgrid(*(numpy.arange(s.start, s.stop) for s in box), indexing="ij")
    offset = numpy.stack([g - c for g, c in zip(grids, centre)], axis=-1)   # (d, h, w, 3)
    local = offset @ rotation / numpy.asarray(semi_axes)                    # body frame
    inside = numpy.einsum("...i,...i->...", local, local) <= 1.0
    labels[box][inside] = value


def generate_segmentation(index: int, seed: int, size, channels: int = 1, classes: int = 4,
                          noise: float = 0.3, objects=None):
    """Sample ``index``: (full (C, D, H, W) float32, labels (D, H, W) uint8).

    ``objects`` ellipsoids (default 2 (K - 1)) with semi-axes between 8% and 25%
    of the extent along each axis.
    """
    shape = triple(size, "size", minimum=1)
    if channels < 1:
        raise ValueError(f"channels must be >= 1, got {channels}")
    if not 2 <= classes <= 256:
        raise ValueError(f"classes must be in [2, 256] (labels are uint8), got {classes}")
    if noise < 0:
        raise ValueError(f"noise must be >= 0, got {noise}")
    objects = 2 * (classes - 1) if objects is None else objects
    if objects < classes - 1:
        raise ValueError(f"objects must be >= classes - 1 = {classes - 1}, got {objects}")
    rng = numpy.random.default_rng(seed + index)
    extent = numpy.asarray(shape, dtype=numpy.float64)
    labels = numpy.zeros(shape, dtype=numpy.uint8)                          # (D, H, W)
    for j in range(objects):
        centre = rng.uniform(0.15, 0.85, size=3) * extent
        semi_axes = numpy.maximum(rng.uniform(0.08, 0.25, size=3) * extent, 1.0)
        paint_ellipsoid(labels, 1 + j % (classes - 1), centre, semi_axes, random_rotation(rng))
    means = class_means(classes, channels)                                   # (K, C)
    full = numpy.moveaxis(means[labels], -1, 0)                              # (C, D, H, W)
    full = full + noise * rng.standard_normal(full.shape)
    return full.astype(numpy.float32), labels


__all__ = ["class_means", "random_rotation", "paint_ellipsoid", "generate_segmentation"]
