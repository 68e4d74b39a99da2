"""Generators, HDF5 layout, hyperslab reader, loader and ``refimpl datagen`` (one process)."""
import argparse
import itertools
import os

import numpy
import pytest

h5py = pytest.importorskip("h5py", reason="h5py is not installed: pip install 'refimpl[test]'")

from refimpl.data import cosmo  # noqa: E402
from refimpl.data.layout import write_split  # noqa: E402
from refimpl.data.loader import Loader  # noqa: E402
from refimpl.data.reader import HDF5Reader, block_slices  # noqa: E402
from refimpl.data.segmentation import class_means, generate_segmentation, paint_ellipsoid  # noqa: E402


def write_cosmo(path, count=3, size=16, channels=4, first=0, layout="single", chunk=8):
    write_split(path, lambda i: cosmo.generate_universe(i, 7, size, channels), count, first,
                {"generator": "cosmoflow", "seed": 7}, layout=layout, chunk_edge=chunk)
    return path


def write_raw(path, **datasets):
    with h5py.File(path, "w") as f:
        for key, value in datasets.items():
            f[key] = value
    return path


def good_arrays(n=2, c=2, size=(4, 6, 8)):
    rng = numpy.random.default_rng(0)
    return (rng.uniform(0, 5, (n, c) + size).astype(numpy.float32),
            rng.uniform(-1, 1, (n, 4)).astype(numpy.float32))


# -- cosmoflow generator -------------------------------------------------------------------

def test_universe_is_deterministic_per_sample_index():
    a, ta = cosmo.generate_universe(3, 10, 12)
    b, tb = cosmo.generate_universe(3, 10, 12)
    c, tc = cosmo.generate_universe(0, 13, 12)      # sample i comes from seed + i alone
    d, _ = cosmo.generate_universe(4, 10, 12)
    assert numpy.array_equal(a, b) and numpy.array_equal(ta, tb)
    assert numpy.array_equal(a, c) and numpy.array_equal(ta, tc)
    assert not numpy.array_equal(a, d)


def test_universe_values_and_targets():
    for i in range(4):
        full, unit = cosmo.generate_universe(i, 0, (8, 12, 10), channels=4)
        assert full.shape == (4, 8, 12, 10) and full.dtype == numpy.float32
        assert unit.shape == (4,) and unit.dtype == numpy.float32
        assert numpy.all(numpy.abs(unit) <= 1.0)
        assert numpy.all(full >= 0) and numpy.array_equal(full, numpy.round(full))   # counts
        assert 40 < full.mean() < 90                                                   # ~64 per voxel
        density, _ = cosmo.generate_universe(i, 0, 12, channels=2, mean_count=None)
        assert numpy.all(density > 0) and numpy.all(numpy.isfinite(density))


def test_unit_parameters_round_trip():
    unit = numpy.random.default_rng(1).uniform(-1, 1, (5, 4))
    phys = cosmo.from_unit(unit)
    assert numpy.allclose(cosmo.to_unit(phys), unit)
    assert numpy.allclose(cosmo.from_unit([-1] * 4), cosmo.PARAM_RANGES[:, 0])
    assert numpy.allclose(cosmo.from_unit([1] * 4), cosmo.PARAM_RANGES[:, 1])


def test_measured_power_spectrum_is_unbiased():
    phys = cosmo.from_unit([0.2, -0.3, 0.5, 0.0])
    field = cosmo.gaussian_field((40, 40, 40), phys, numpy.random.default_rng(5))
    k, p, modes = cosmo.measure_power_spectrum(field, bins=12)
    use = (modes > 50) & (k < 2.0)
    ratio = p[use] / cosmo.power_spectrum(k[use], phys)
    assert use.sum() >= 5 and abs(numpy.mean(ratio) - 1) < 0.1, ratio


def fitted_slope(field, phys):
    """n_s from a log-log fit of the measured P(k) with the (known) damping divided out."""
    k, p, modes = cosmo.measure_power_spectrum(field, bins=32)
    k_d = 10.0 ** phys[2]
    use = (modes > 0) & (k < 1.5 * k_d)
    return numpy.polyfit(numpy.log(k[use]), numpy.log(p[use]) + (k[use] / k_d) ** 2, 1,
                         w=numpy.sqrt(modes[use]))[0]


def test_spectral_slope_tracks_target_better_in_larger_volumes():
    """The learning problem is real: n_s is readable from the data, and more so with more modes."""
    errors = {}
    for size in (16, 40):
        fitted, true = [], []
        for i in range(10):
            density, unit = cosmo.generate_universe(i, 100, size, channels=1, mean_count=None)
            phys = cosmo.from_unit(unit)
            fitted.append(fitted_slope(numpy.log(density[0].astype(numpy.float64)), phys))
            true.append(phys[1])
        errors[size] = numpy.sqrt(numpy.mean((numpy.array(fitted) - true) ** 2))
        if size == 40:
            assert numpy.corrcoef(fitted, true)[0, 1] > 0.9
    assert errors[40] < 0.5 * errors[16], errors


def test_channels_follow_the_growth_factor():
    """log rho_c = D_c g - const, so std(log rho_c) / std(log rho_0) = (1 + z_c)^-gamma."""
    density, unit = cosmo.generate_universe(2, 3, 16, channels=4, mean_count=None)
    gamma = cosmo.from_unit(unit)[3]
    logs = numpy.log(density.astype(numpy.float64))
    ratios = logs.reshape(4, -1).std(axis=1) / logs[0].std()
    assert numpy.allclose(ratios, (1 + cosmo.redshifts(4)) ** -gamma, rtol=1e-4)


def test_universe_rejects_bad_arguments():
    with pytest.raises(ValueError, match="size"):
        cosmo.generate_universe(0, 0, (4, 0, 4))
    with pytest.raises(ValueError, match="channels"):
        cosmo.generate_universe(0, 0, 4, channels=0)
    with pytest.raises(ValueError, match="mean_count"):
        cosmo.generate_universe(0, 0, 4, mean_count=-1.0)


# -- segmentation generator ------------------------------------------------------------------

def test_segmentation_deterministic_and_covers_classes():
    a, la = generate_segmentation(2, 5, (16, 20, 12), channels=2, classes=4)
    b, lb = generate_segmentation(0, 7, (16, 20, 12), channels=2, classes=4)
    assert numpy.array_equal(a, b) and numpy.array_equal(la, lb)
    assert a.shape == (2, 16, 20, 12) and a.dtype == numpy.float32
    assert la.shape == (16, 20, 12) and la.dtype == numpy.uint8
    for i in range(4):
        _, labels = generate_segmentation(i, 0, 24, classes=5)
        assert len(numpy.unique(labels)) >= 4 and labels.max() < 5


def test_segmentation_image_is_class_mean_plus_noise():
    full, labels = generate_segmentation(1, 0, 24, channels=3, classes=4, noise=0.2)
    means = class_means(4, 3)
    for k in numpy.unique(labels):
        voxels = full[:, labels == k]                      # (C, n)
        if voxels.shape[1] > 200:
            assert numpy.allclose(voxels.mean(axis=1), means[k], atol=0.05)
            assert numpy.allclose(voxels.std(axis=1), 0.2, atol=0.05)


def test_paint_ellipsoid_volume_is_rotation_invariant():
    rng = numpy.random.default_rng(0)
    for _ in range(3):
        q, _ = numpy.linalg.qr(rng.standard_normal((3, 3)))
        labels = numpy.zeros((40, 40, 40), numpy.uint8)
        paint_ellipsoid(labels, 3, (20.0, 19.5, 20.3), (12.0, 8.0, 5.0), q)
        expected = 4 / 3 * numpy.pi * 12 * 8 * 5
        assert abs((labels == 3).sum() / expected - 1) < 0.03
        assert set(numpy.unique(labels)) == {0, 3}


def test_segmentation_rejects_bad_arguments():
    with pytest.raises(ValueError, match="classes"):
        generate_segmentation(0, 0, 8, classes=1)
    with pytest.raises(ValueError, match="noise"):
        generate_segmentation(0, 0, 8, noise=-1)


# -- HDF5 layout and reader -------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["single", "per-sample"])
def test_round_trip_and_attributes(tmp_path, layout):
    path = write_cosmo(str(tmp_path / ("val.h5" if layout == "single" else "val")),
                       count=3, size=(8, 12, 16), first=5, layout=layout)
    with HDF5Reader(path) as reader:
        assert reader.num_samples == 3 and reader.kind == "cosmoflow"
        assert reader.sample_shape == (4, 8, 12, 16) and reader.target_shape == (4,)
        assert reader.attrs["first_index"] == 5 and reader.attrs["version"] == 1
        assert reader.attrs["generator"] == "cosmoflow" and reader.attrs["layout"] == layout
        for i in range(3):
            x, y = reader.read(i)
            full, unit = cosmo.generate_universe(5 + i, 7, (8, 12, 16))
            assert numpy.array_equal(x, full) and numpy.array_equal(y, unit)


def test_segmentation_round_trip(tmp_path):
    path = str(tmp_path / "seg.h5")
    write_split(path, lambda i: generate_segmentation(i, 1, (8, 8, 12), channels=2, classes=3),
                2, 0, {"generator": "segmentation", "params": {"classes": 3}})
    with HDF5Reader(path, spatial_block=block_slices((8, 8, 12), (1, 2, 3), (0, 1, 2))) as reader:
        assert reader.kind == "segmentation" and reader.classes == 3
        x, y = reader.read(1)
        full, labels = generate_segmentation(1, 1, (8, 8, 12), channels=2, classes=3)
        assert numpy.array_equal(x, full[:, :, 4:8, 8:12]) and numpy.array_equal(y, labels[:, 4:8, 8:12])
        assert y.dtype == numpy.uint8 and reader.bytes_read == x.nbytes + y.nbytes


def test_block_slices_tile_the_volume_row_major():
    shape, grid = (7, 5, 4), (3, 2, 1)
    count = numpy.zeros(shape, int)
    for coords in itertools.product(*(range(p) for p in grid)):
        count[block_slices(shape, grid, coords)] += 1
    assert numpy.all(count == 1)
    assert block_slices(shape, grid, (2, 1, 0)) == (slice(5, 7), slice(3, 5), slice(0, 4))
    with pytest.raises(ValueError, match="coords"):
        block_slices(shape, grid, (3, 0, 0))


@pytest.mark.parametrize("layout", ["single", "per-sample"])
def test_reader_reads_exactly_its_hyperslab(tmp_path, layout):
    size = (12, 10, 9)
    path = write_cosmo(str(tmp_path / ("d.h5" if layout == "single" else "d")), size=size,
                       layout=layout, chunk=4)
    whole = [cosmo.generate_universe(i, 7, size)[0] for i in range(3)]
    for grid in [(1, 1, 1), (2, 2, 2), (3, 1, 2), (5, 2, 1)]:
        full_bytes = 0
        for coords in itertools.product(*(range(p) for p in grid)):
            block = block_slices(size, grid, coords)
            with HDF5Reader(path, spatial_block=block) as reader:
                x, y = reader.read(2)
                assert numpy.array_equal(x, whole[2][(slice(None),) + block])
                share = 4 * numpy.prod([s.stop - s.start for s in block]) * 4
                assert reader.bytes_read == share + y.nbytes       # payload: exactly the share
                full_bytes += reader.bytes_read - y.nbytes
        assert full_bytes == whole[2].nbytes                        # the shares add up to a sample


def test_file_bytes_read_stay_near_the_share(tmp_path):
    """With chunks aligned to the blocks, HDF5 pulls little more than the block from disk."""
    path = write_cosmo(str(tmp_path / "d.h5"), count=2, size=32, chunk=16)
    block = block_slices((32, 32, 32), (2, 2, 2), (1, 0, 1))
    with HDF5Reader(path, spatial_block=block) as reader:
        reader.read(1)
        share = reader.bytes_read
        assert share == 4 * 16 ** 3 * 4 + 16
        assert share <= reader.file_bytes_read < share + 64 * 1024
        assert reader.file_bytes_read < os.path.getsize(path) / 8


def test_empty_block_reads_nothing(tmp_path):
    path = write_cosmo(str(tmp_path / "d.h5"), size=(3, 4, 4))
    block = block_slices((3, 4, 4), (8, 1, 1), (5, 0, 0))      # p > n: an empty block
    with HDF5Reader(path, spatial_block=block) as reader:
        x, y = reader.read(0)
        assert x.shape == (4, 0, 4, 4) and reader.bytes_read == y.nbytes


def test_cache_and_log1p(tmp_path):
    path = write_cosmo(str(tmp_path / "d.h5"))
    block = block_slices((16, 16, 16), (2, 1, 1), (1, 0, 0))
    raw = HDF5Reader(path, spatial_block=block).read(1)[0]
    with HDF5Reader(path, spatial_block=block, cache=True, log1p=True) as reader:
        x1, _ = reader.read(1)
        after_first = reader.bytes_read
        x2, _ = reader.read(1)
        assert x2 is x1 and reader.bytes_read == after_first and reader.cache_hits == 1
        assert numpy.allclose(x1, numpy.log1p(raw)) and reader.cache_bytes == after_first
        xb, yb = reader.read_batch([1, 0, 1])
        assert xb.shape == (3, 4, 8, 16, 16) and yb.shape == (3, 4)
        assert numpy.array_equal(xb[2], x1) and reader.cache_hits == 3


def test_reader_restricted_to_its_samples(tmp_path):
    path = write_cosmo(str(tmp_path / "d.h5"))
    with HDF5Reader(path, samples=[0, 2]) as reader:
        reader.read(2)
        with pytest.raises(ValueError, match="sample 1"):
            reader.read(1)
        with pytest.raises(ValueError, match="sample index 3"):
            reader.read(3)


# -- bad files --------------------------------------------------------------------------------

def test_bad_shapes_and_dtypes(tmp_path):
    full, unit = good_arrays()
    cases = {
        "shape": (dict(full=full[0], unitPar=unit), "'full' must be 5-D"),
        "dtype": (dict(full=full.astype(numpy.float64), unitPar=unit), "'full' must be float32"),
        "target_dtype": (dict(full=full, unitPar=unit.astype(numpy.float64)), "'unitPar' must be float32"),
        "missing_full": (dict(unitPar=unit), "missing dataset 'full'"),
        "missing_target": (dict(full=full), "missing dataset 'unitPar'"),
        "count": (dict(full=full, unitPar=unit[:1]), "'unitPar' holds 1 samples"),
        "labels": (dict(full=full, labels=numpy.zeros((2, 4, 6, 7), numpy.uint8)), "'labels' must be"),
    }
    for name, (datasets, message) in cases.items():
        path = write_raw(str(tmp_path / f"{name}.h5"), **datasets)
        with pytest.raises(ValueError, match=message) as err:
            HDF5Reader(path)
        assert path in str(err.value)
    with pytest.raises(ValueError, match="not a readable HDF5 file"):
        (tmp_path / "junk.h5").write_bytes(b"not hdf5")
        HDF5Reader(str(tmp_path / "junk.h5"))
    with pytest.raises(ValueError, match="neither"):
        HDF5Reader(str(tmp_path / "absent.h5"))


def test_nan_is_reported_for_the_local_block_only(tmp_path):
    full, unit = good_arrays(n=3)
    full[2, 1, 3, 0, 0] = numpy.nan                         # depth 3: in the upper half only
    path = write_raw(str(tmp_path / "nan.h5"), full=full, unitPar=unit)
    lower = block_slices((4, 6, 8), (2, 1, 1), (0, 0, 0))
    upper = block_slices((4, 6, 8), (2, 1, 1), (1, 0, 0))
    HDF5Reader(path, spatial_block=lower).read(2)           # its block is clean
    reader = HDF5Reader(path, spatial_block=upper)
    reader.read(1)
    with pytest.raises(ValueError, match=r"nan\.h5: dataset 'full' sample 2 holds NaN or Inf"):
        reader.read(2)
    unit[0, 1] = numpy.inf
    path = write_raw(str(tmp_path / "inf.h5"), full=good_arrays()[0], unitPar=unit[:2])
    with pytest.raises(ValueError, match="'unitPar' sample 0"):
        HDF5Reader(path).read(0)


def test_bad_labels_block_and_divisibility(tmp_path):
    full, _ = good_arrays()
    labels = numpy.zeros((2, 4, 6, 8), numpy.int32)
    labels[1, 0, 0, 0] = -1
    path = write_raw(str(tmp_path / "lab.h5"), full=full, labels=labels)
    with pytest.raises(ValueError, match="'labels' sample 1 holds labels outside"):
        HDF5Reader(path).read(1)
    with pytest.raises(ValueError, match="divisible_by"):
        HDF5Reader(path, divisible_by=4)                   # W = 6 is not a multiple of 4
    HDF5Reader(path, divisible_by=(4, 2, 8))
    with pytest.raises(ValueError, match=r"spatial_block\[1\]"):
        HDF5Reader(path, spatial_block=(slice(0, 4), slice(2, 7), slice(None)))


def test_per_sample_file_with_another_shape(tmp_path):
    path = write_cosmo(str(tmp_path / "dir"), count=3, size=8, layout="per-sample")
    full, unit = good_arrays(n=1, c=4, size=(8, 8, 4))
    write_raw(os.path.join(path, "000001.hdf5"), full=full[0], unitPar=unit[0])
    reader = HDF5Reader(path)
    reader.read(2)
    with pytest.raises(ValueError, match=r"000001\.hdf5: dataset 'full' is float32 \(4, 8, 8, 4\)"):
        reader.read(1)


# -- loader -----------------------------------------------------------------------------------

def test_loader_splits_the_global_batch(tmp_path):
    path = write_cosmo(str(tmp_path / "d.h5"), count=10, size=4)
    reader = HDF5Reader(path)
    loaders = [Loader(reader, global_batch=5, data_rank=n, data_size=3, seed=4) for n in range(3)]
    assert loaders[0].steps_per_epoch == 2
    for epoch, step in [(0, 0), (0, 1), (3, 1)]:
        parts = [ld.local_indices(epoch, step) for ld in loaders]
        assert [len(p) for p in parts] == [2, 2, 1]
        assert sum(parts, ()) == tuple(loaders[0].global_indices(epoch, step))
    seen = loaders[0].global_indices(0, 0).tolist() + loaders[0].global_indices(0, 1).tolist()
    assert len(set(seen)) == 10                                # an epoch visits each sample once
    assert not numpy.array_equal(loaders[0].order(0), loaders[0].order(1))
    batch = loaders[1].next_batch()
    assert batch.x.shape == (2, 4, 4, 4, 4) and batch.y.shape == (2, 4)
    assert numpy.array_equal(batch.x[1], reader.read(batch.indices[1])[0])


def test_loader_resumes_exactly(tmp_path):
    path = write_cosmo(str(tmp_path / "d.h5"), count=7, size=4)
    first = Loader(HDF5Reader(path), global_batch=3, seed=9)
    taken = [first.next_batch() for _ in range(3)]              # crosses the epoch boundary
    assert [(b.epoch, b.step) for b in taken] == [(0, 0), (0, 1), (1, 0)]
    state = first.state_dict()
    second = Loader(HDF5Reader(path), global_batch=3, seed=9)
    second.load_state_dict(state)
    for a, b in zip(list(first), list(second)):
        assert (a.epoch, a.step, a.indices) == (b.epoch, b.step, b.indices)
        assert numpy.array_equal(a.x, b.x)
    assert (first.epoch, first.step) == (2, 0)
    with pytest.raises(ValueError, match="seed"):
        Loader(HDF5Reader(path), global_batch=3, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="global_batch"):
        Loader(HDF5Reader(path), global_batch=8)


# -- datagen command and atomic writes ----------------------------------------------------------

def datagen(*argv):
    from refimpl.commands import datagen as command
    parser = argparse.ArgumentParser(prog="refimpl datagen")
    command.add_arguments(parser)
    return command.run(parser.parse_args([str(a) for a in argv]))


def test_datagen_is_registered():
    from refimpl.cli import COMMANDS
    assert COMMANDS["datagen"][0] == "refimpl.commands.datagen"


def test_datagen_refuses_the_data_of_a_running_job(tmp_path, capsys):
    """OUT/data of a live run (its OUT/.lock held: here by this process) is not replaced; once
    the lock is released it is; the identity a checkpoint records (data/identity.py)
    changes with the seed and the layout, not with a regeneration of the same data."""
    from refimpl.data.identity import changes, data_identity
    from refimpl.run_lock import RunLock
    run = tmp_path / "run"
    assert datagen("cosmoflow", "--out", run / "data", "--samples", 3, "--size", 8, "--quiet") == 0
    first = data_identity(run / "data" / "train.h5")
    with RunLock(run).acquire():
        assert datagen("cosmoflow", "--out", run / "data", "--samples", 3, "--size", 8, "--overwrite",
                       "--quiet") == 2
        err = capsys.readouterr().err
        assert "lies in the directory of a running job" in err and str(run / ".lock") in err
    assert datagen("cosmoflow", "--out", run / "data", "--samples", 3, "--size", 8, "--overwrite", "--quiet") == 0
    assert changes(first, data_identity(run / "data" / "train.h5")) == []          # the same data again
    assert datagen("cosmoflow", "--out", run / "data", "--samples", 3, "--size", 8, "--seed", 5, "--overwrite",
                   "--quiet") == 0
    assert changes(first, data_identity(run / "data" / "train.h5")) == ["writer's seed 0 -> 5"]
    assert datagen("cosmoflow", "--out", run / "per", "--samples", 3, "--size", 8, "--layout", "per-sample",
                   "--quiet") == 0
    per = data_identity(run / "per" / "train")
    assert per["samples"] == 3 and changes(first, per)[0] == "layout single -> per-sample"
    with h5py.File(run / "data" / "train.h5", "a") as f:      # the same attributes, other content
        f["full"][1, :, 4] += 1.0
    assert changes(first, data_identity(run / "data" / "train.h5")) != []


def test_datagen_writes_valid_files(tmp_path, capsys):
    out = tmp_path / "cosmo"
    assert datagen("cosmoflow", "--out", out, "--samples", 3, "--val-samples", 2, "--size", "8,8,4",
                   "--seed", 11, "--quiet") == 0
    with HDF5Reader(str(out / "train.h5"), divisible_by=4) as train, \
            HDF5Reader(str(out / "val.h5")) as val:
        assert (train.num_samples, val.num_samples) == (3, 2)
        assert train.sample_shape == (4, 8, 8, 4) and val.attrs["first_index"] == 3
        assert numpy.array_equal(val.read(1)[0], cosmo.generate_universe(4, 11, (8, 8, 4))[0])
    out = tmp_path / "seg"
    assert datagen("segmentation", "--out", out, "--samples", 2, "--val-samples", 0, "--size", 8,
                   "--classes", 3, "--channels", 2, "--layout", "per-sample", "--quiet") == 0
    assert sorted(os.listdir(out)) == ["train"]
    with HDF5Reader(str(out / "train")) as reader:
        x, y = reader.read(1)
        assert reader.kind == "segmentation" and x.shape == (2, 8, 8, 8) and y.max() < 3
    assert datagen("segmentation", "--out", out, "--samples", 2, "--size", 8, "--layout", "per-sample",
                   "--quiet") == 2                                  # exit 2: bad input
    assert "exists" in capsys.readouterr().err
    assert datagen("segmentation", "--out", tmp_path / "bad", "--classes", 1, "--quiet") == 2
    assert "classes" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "bad" / "train.h5")


@pytest.mark.parametrize("kind", ["cosmoflow", "segmentation"])
def test_datagen_writes_the_same_files_on_any_number_of_workers(tmp_path, capsys, kind):
    """Each sample comes from its own index (seed + i), and the writer takes the workers'
    samples in order: one thread and five write the same datasets."""
    for workers in ("1", "5"):
        assert datagen(kind, "--out", tmp_path / workers, "--samples", 7, "--val-samples", 3, "--size", 8,
                       "--workers", workers, "--quiet") == 0
    for split in ("train.h5", "val.h5"):
        with h5py.File(tmp_path / "1" / split, "r") as a, h5py.File(tmp_path / "5" / split, "r") as b:
            assert sorted(a) == sorted(b) and a["full"].shape[0] == (7 if split == "train.h5" else 3)
            for key in a:
                assert numpy.array_equal(a[key][()], b[key][()])
    assert datagen(kind, "--out", tmp_path / "0", "--workers", "0", "--quiet") == 2
    assert "--workers must be >= 1, got 0" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "0" / "train.h5")


def test_datagen_leaves_no_split_of_an_earlier_dataset(tmp_path, capsys):
    """A split the new dataset does not write (no validation samples now, or the other layout)
    would be read beside it: refused without --overwrite, removed with it once the new dataset
    is complete."""
    out = tmp_path / "d"
    assert datagen("cosmoflow", "--out", out, "--samples", 2, "--val-samples", 2, "--size", 8, "--quiet") == 0
    assert datagen("cosmoflow", "--out", out, "--samples", 2, "--val-samples", 0, "--size", 8, "--quiet",
                   "--layout", "per-sample") == 2
    err = capsys.readouterr().err
    assert "train.h5" in err and "val.h5" in err and "from an earlier dataset would stay beside this one" in err
    assert sorted(os.listdir(out)) == ["train.h5", "val.h5"]
    assert datagen("cosmoflow", "--out", out, "--samples", 2, "--val-samples", 0, "--size", 8, "--quiet",
                   "--layout", "per-sample", "--overwrite") == 0
    assert sorted(os.listdir(out)) == ["train"]


@pytest.mark.parametrize("layout", ["single", "per-sample"])
def test_failed_write_leaves_no_final_file(tmp_path, layout):
    target = str(tmp_path / ("train.h5" if layout == "single" else "train"))

    def failing(i):
        if i == 2:
            raise RuntimeError("simulated crash")
        return cosmo.generate_universe(i, 0, 4)

    with pytest.raises(RuntimeError, match="simulated"):
        write_split(target, failing, 4, 0, {}, layout=layout)
    assert os.listdir(tmp_path) == []                           # neither final nor temporary
    write_cosmo(target, count=2, size=4, layout=layout)          # a good dataset ...
    with pytest.raises(RuntimeError, match="simulated"):
        write_split(target, failing, 4, 0, {}, layout=layout)    # ... survives a failed rewrite
    assert os.listdir(tmp_path) == [os.path.basename(target)]
    assert HDF5Reader(target).num_samples == 2
    write_cosmo(target, count=3, size=4, layout=layout)          # a successful rewrite replaces it
    assert HDF5Reader(target).num_samples == 3 and os.listdir(tmp_path) == [os.path.basename(target)]
