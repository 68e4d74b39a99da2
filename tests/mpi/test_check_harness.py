"""The check harness (refimpl/check.py) runs any kind of the layer registry, one added by a test too.

``ChannelAffine`` (y = w_c * x + b_c, a per-channel scale and shift: pointwise in space,
channel-splittable) is registered here for the length of a test, as a contributor adds a kind to
refimpl/layers/ (docs/contributing.md, "Adding a layer"); ``check_layer`` then runs it on
every grid of the world size, the model axis included, and finds it equal to its reference,
while a partitioned layer that is off by one part in 1e6 is refused.  Every registered kind's
local layer computes its reference.  Plain pytest runs this as a 1-rank world,
tests/test_mpiexec.py under mpiexec with 2, 3, 4, 6 and 8 ranks.
"""
import numpy as np
import pytest

from refimpl import layers
from refimpl.check import LayerCheck, check_layer, rel_err
from refimpl.nn import Module
from refimpl.parallel.channels import channel_range
from refimpl.parallel.grid import all_grids


class ChannelAffine(Module):
    """y = w_c * x + b_c on this rank's block (its channel slice of w and b when split by
    channel); dw and db are this rank's partial sums, which the harness (or gradient
    synchronisation) reduces."""

    def __init__(self, channels, dtype, shard=None, error=0.0):
        super().__init__()
        self.weight = self.add_parameter("weight", np.ones(channels, dtype))
        self.bias = self.add_parameter("bias", np.zeros(channels, dtype))
        self.weight.shard = self.bias.shard = shard
        self.error = error

    def forward(self, x):
        self._save(x)
        return (x * self.weight.data.reshape(1, -1, 1, 1, 1) + self.bias.data.reshape(1, -1, 1, 1, 1)) \
            * (1.0 + self.error)

    def backward(self, dy):
        x, = self._saved()
        self.weight.accumulate_grad((dy * x).sum(axis=(0, 2, 3, 4)))
        self.bias.accumulate_grad(dy.sum(axis=(0, 2, 3, 4)))
        return dy * self.weight.data.reshape(1, -1, 1, 1, 1)


class ChannelAffineKind(layers.LayerKind):
    """The registry entry: what check_layer needs (the base class supplies the rest of a
    pointwise layer: no halo, the input's extent, check-layer's generic rules)."""

    name = "channel_affine"
    model_modes = ("none", "channel")

    def __init__(self, error=0.0):
        self.error = error            # a wrong partitioned layer: y off by this relative amount

    def check_init(self, rng, shape):
        return rng.uniform(0.5, 1.5, shape)           # not the identity init

    def forward(self, spec, x, w, b):
        return x * w.reshape(1, -1, 1, 1, 1) + b.reshape(1, -1, 1, 1, 1), (x, w)

    def backward(self, spec, dy, saved):
        x, w = saved
        return dy * w.reshape(1, -1, 1, 1, 1), (dy * x).sum(axis=(0, 2, 3, 4)), dy.sum(axis=(0, 2, 3, 4))

    def partitioned(self, spec, *, grid, rng, dtype):
        c = spec.input[1]
        if spec.model_parallel == "none":
            return ChannelAffine(c, dtype, error=self.error)
        start, stop = channel_range(c, grid.model_dims, grid.model_coord)
        return ChannelAffine(stop - start, dtype, shard=(0, start, stop, c), error=self.error)


@pytest.fixture
def channel_affine(monkeypatch):
    """Registers ChannelAffineKind for one test; returns a function registering a variant."""
    def register(error=0.0):
        monkeypatch.setitem(layers.REGISTRY, ChannelAffineKind.name, ChannelAffineKind(error))
    register()
    return register


def test_a_kind_added_by_a_test_runs_on_every_grid(comm, all_ranks_agree, channel_affine):
    size = comm.Get_size()
    spatial, model = all_grids(size), [g for g in all_grids(size, model=True) if g[4] > 1]
    for grid in spatial + model:
        mode = "channel" if len(grid) == 5 else "none"
        for dtype in ("float64", "float32") if grid in spatial[:1] + model[:1] else ("float64",):
            check = LayerCheck(layer="channel_affine", input=(grid[0] + 1, 4 * size, 5, 3, 4), grid=grid,
                               model_parallel=mode, dtype=dtype, seed=size)
            report = comm.bcast(check_layer(check, comm), root=0)
            all_ranks_agree(report["ok"] and set(report["max_rel_err"]) == {"y", "dx", "dw", "db"}
                            and report["tolerance"] == {"float64": 1e-10, "float32": 1e-5}[dtype],
                            f"grid {grid} {dtype}: {report}")


def test_a_wrong_partitioned_layer_is_refused(comm, all_ranks_agree, channel_affine):
    channel_affine(error=1e-6)
    check = LayerCheck(layer="channel_affine", input=(2, 3, 4, 4, 4), grid=(1, comm.Get_size(), 1, 1))
    report = comm.bcast(check_layer(check, comm), root=0)
    y_err = report["max_rel_err"]["y"]
    all_ranks_agree(not report["ok"] and 0.5e-6 < y_err < 2e-6 and report["max_rel_err"]["dx"] <= 1e-10,
                    f"{report}")


def test_the_kind_is_validated_by_the_registry_rules(channel_affine):
    """Generic rules (grid, batch) and the kind's declarations (its modes, no output padding)."""
    with pytest.raises(ValueError, match="does not apply to channel_affine \\(it takes: none, channel\\)"):
        LayerCheck(layer="channel_affine", input=(2, 3, 4, 4, 4), grid=(1, 1, 1, 1), model_parallel="filter")
    with pytest.raises(ValueError, match="--output-padding applies to conv_transpose3d only"):
        LayerCheck(layer="channel_affine", input=(2, 3, 4, 4, 4), grid=(1, 1, 1, 1), output_padding=1)
    with pytest.raises(ValueError, match="at most one rank per channel"):
        LayerCheck(layer="channel_affine", input=(2, 3, 4, 4, 4), grid=(1, 1, 1, 1, 4), model_parallel="channel")
    with pytest.raises(ValueError, match="layer must be one of conv3d, .*, channel_affine, got 'scale'"):
        LayerCheck(layer="scale", input=(2, 3, 4, 4, 4), grid=(1, 1, 1, 1))


@pytest.mark.parametrize("name", layers.names())
def test_every_kinds_local_layer_computes_its_reference(name):
    """The registry's two views of a kind agree on one process: its refimpl.nn layer (with the
    oracle's parameters) and its reference forward and backward."""
    kind = layers.lookup(name)
    check = LayerCheck(layer=name, input=(2, 3, 7, 6, 5), grid=(1, 1, 1, 1), out_channels=4, padding=1)
    rng = np.random.default_rng(0)
    layer = kind.local(check, rng=rng, dtype=np.float64)
    params = kind.draw_parameters(rng, check)
    for attribute, key in (("weight", "w"), ("bias", "b")):
        if getattr(layer, attribute, None) is not None:
            getattr(layer, attribute).data[...] = params[key]
    x = rng.standard_normal(check.input)
    y = layer.forward(x)
    dy = rng.standard_normal(y.shape)
    dx = layer.backward(dy)
    grads = [getattr(layer, a).grad if getattr(layer, a, None) is not None else None for a in ("weight", "bias")]
    want = kind.reference(check, x, params.get("w"), params.get("b"), dy)
    errors = {k: rel_err(got, ref) for k, got, ref in zip(("y", "dx", "dw", "db"), [y, dx] + grads, want)}
    assert all(e is None or e <= 1e-10 for e in errors.values()), errors
    assert (errors["dw"] is None) == (kind.parameter_shapes(check) is None), errors
