"""Data: synthetic generators, the HDF5 layout, the spatially parallel reader and loader.

- ``cosmo``: CosmoFlow-like universes (lognormal fields; targets = power-spectrum parameters).
- ``segmentation``: 3D volumes of labelled ellipsoids with a noisy C-channel image.
- ``layout``: the documented HDF5 layout (docs/data.md) and its atomic writer.
- ``reader``: ``HDF5Reader`` reads only a rank's samples and spatial hyperslab (+ cache).
- ``loader``: ``Loader`` splits a shuffled global batch over the data-parallel group.

h5py is imported only where files are opened, so importing this package is cheap.
"""
from .cosmo import generate_universe
from .layout import write_split
from .loader import Batch, Loader
from .reader import HDF5Reader, block_slices
from .segmentation import generate_segmentation

__all__ = ["generate_universe", "generate_segmentation", "write_split", "HDF5Reader",
           "block_slices", "Batch", "Loader"]
