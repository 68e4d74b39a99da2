"""Kinds the planner prices but check-layer cannot check (yet): activations, dense layers, the gather.

They have no reference op, constructors or oracle hooks here (those would make them
check-layer kinds), only the planner's (``LayerKind.plan_*``): they are registered in
``PLAN_ONLY`` (refimpl/layers/__init__.py), not in ``REGISTRY``, so check-layer, the oracle
and a case file never offer or accept them.  A kind that gains its check hooks moves to its
own module and ``REGISTRY``, keeping its planner hooks.
"""
from __future__ import annotations

import math

from .base import LayerKind


class _Activation(LayerKind):
    """A pointwise activation: memory-bound, its input kept for backward."""

    plan_label = "act"
    #: elements/s of forward + backward until calibrated
    plan_element_rate = 2e9

    def plan_measure_rate(self, x, rng, timed):
        """Elements/s of the functional forward and backward (``reference``) on ``x``."""
        forward, backward = self.reference()
        dy = rng.standard_normal(x.shape).astype(x.dtype)
        return x.size / timed(lambda: (forward(x), backward(dy, x)))

    def reference(self):
        """(forward(x), backward(dy, x)): the functional op (refimpl/functional/activations.py)."""
        raise NotImplementedError

    def plan_cost(self, layer, rank, cost):
        """Elements at its element rate (forward + backward)."""
        n_r, f_local, v_block = rank.n_r, rank.f_local(layer), rank.block_voxels(layer)
        cost.flops = 2.0 * n_r * f_local * v_block
        compute_s = n_r * f_local * v_block / rank.machine.element_rate(self)
        cost.saved_bytes = n_r * f_local * v_block * rank.itemsize
        return compute_s


class ReLUKind(_Activation):
    name = "relu"

    def reference(self):
        from ..functional import relu, relu_backward
        return relu, relu_backward


class LeakyReLUKind(_Activation):
    name = "leaky_relu"

    def reference(self):
        from ..functional import leaky_relu, leaky_relu_backward
        return leaky_relu, leaky_relu_backward


class GatherKind(LayerKind):
    """Channel-split -> replicated: an allgather of the channels over the model axis
    (``nn/model_parallel.py`` GatherFeatures); the identity on Pm = 1."""

    name = "gather"
    plan_label = "gather"
    plan_channelwise = False

    def plan_splits(self, layer):
        return True

    def plan_split_channels(self, layer):
        return layer.c_in

    def plan_cost(self, layer, rank, cost):
        per_channel = rank.n_r * rank.block_voxels(layer)
        if rank.pm > 1:
            cost.model_bytes = rank.moved_bytes(layer.c_in, per_channel)
            cost.model_messages = rank.pm - 1
            alpha, beta = rank.machine.group_link(rank.model_group)
            cost.comm_s = cost.model_messages * alpha + cost.model_bytes * beta
        return 0.0


class LinearKind(LayerKind):
    """A dense layer d_in -> d_out: 2 N_r d_out d_in FLOPs per pass (forward, dW, dX) at
    ``Machine.gemm_gflops``; Gholami's 1.5-D splits over the model axis (``row``: rows split,
    input replicated, dX allreduced over the model group; ``row-split``: rows split, input
    feature-split, gathered forward and reduce-scattered backward)."""

    name = "linear"
    plan_label = "linear"
    plan_channelwise = False

    def plan_inputs(self, layer, rank) -> int:
        """Input features the rank multiplies."""
        return layer.c_in

    def plan_spatial_reduce(self, layer, rank, cost, f_local) -> None:
        """Messages over the spatial group (none: a dense layer runs replicated on it)."""

    def plan_cost(self, layer, rank, cost):
        pm, n_r, itemsize, machine = rank.pm, rank.n_r, rank.itemsize, rank.machine
        f_local = rank.f_local(layer)
        d_in = self.plan_inputs(layer, rank)
        cost.flops = 2.0 * n_r * f_local * d_in * 3
        compute_s = cost.flops / (machine.gemm_gflops * 1e9)
        cost.saved_bytes = n_r * d_in * itemsize
        self.plan_spatial_reduce(layer, rank, cost, f_local)
        if layer.split == "row-split" and pm > 1:
            b = 2 * rank.moved_bytes(layer.c_in, n_r)
            cost.model_bytes, cost.model_messages = b, 2 * (pm - 1)
            alpha, beta = machine.group_link(rank.model_group)
            cost.comm_s += cost.model_messages * alpha + b * beta
        elif layer.split == "row" and pm > 1:              # dx of the replicated input allreduced
            n_bytes = n_r * d_in * itemsize
            cost.model_allreduce_bytes = n_bytes
            cost.comm_s += rank.allreduce_s(n_bytes, rank.model_group)
        return compute_s


class FlattenLinearKind(LinearKind):
    """Flatten + dense on a spatially split input: each rank multiplies its block's columns
    and the partial products are allreduced over the spatial group (nn/spatial.py
    SpatialFlattenLinear; it keeps the whole weight on every spatial rank)."""

    name = "flatten_linear"
    plan_label = "flatten_linear"

    def plan_inputs(self, layer, rank):
        return layer.c_in // math.prod(layer.in_dhw) * rank.block_voxels(layer)

    def plan_spatial_reduce(self, layer, rank, cost, f_local):
        if math.prod(rank.sdims) > 1:
            n_bytes = rank.n_r * f_local * rank.itemsize
            cost.spatial_bytes = n_bytes
            cost.comm_s += rank.allreduce_s(n_bytes, rank.spatial_group)


KINDS = (ReLUKind(), LeakyReLUKind(), GatherKind(), LinearKind(), FlattenLinearKind())
