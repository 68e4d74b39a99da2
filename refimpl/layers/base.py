"""``LayerKind``: what refimpl knows about one kind of layer; ``WindowKind``: a halo'd window op.

The base class describes a layer that is pointwise in space (output voxel v reads input voxel
v only: no halo, the output keeps the input's extent) and has no parameters; a kind overrides
what differs.  ``spec`` below is anything that carries a layer's arguments by check-layer's
names (``refimpl.check.LayerCheck``, ``refimpl.oracle.suite.CaseSpec``): ``input`` (N, C, D,
H, W), ``out_channels``, ``kernel``, ``stride``, ``padding``, ``dilation``,
``output_padding`` (normalised 3-tuples; ``padding`` the per-side 6-tuple (d_lo, d_hi, h_lo,
h_hi, w_lo, w_hi) where it is asymmetric: ``spec_padding`` reads either), ``model_parallel``
and ``options``: {name: value} of the options the kind declares (``LayerKind.options``:
pooling's ``ceil_mode``, the convs' ``groups``, ...; ``spec_option`` reads one, its default
where the spec has none).

A kind declares its options (``Option``: name, type, default, check-layer flag, help,
validation) and its statistics (``Statistic``: the per-rank partial tensors the partitioned
layer reduces, with their shapes); check-layer's flags, the suite keys, ``LayerCheck``,
``CaseSpec``, the case files and ``run-torch`` are built from them and list none.

Constructors import refimpl.nn inside the method: the oracle imports this registry in one
process without MPI, and the partitioned layers import mpi4py.
"""
from __future__ import annotations

from ..functional.args import padding_sides
from ..parallel.partition import conv_halo_plan, needed_input_range, window_output_extent
from .options import spec_option

def spec_padding(spec) -> tuple:
    """``spec.padding`` (a 3-tuple, or the per-side 6-tuple) as (lo, hi) per axis."""
    return padding_sides(spec.padding, spec.kernel, spec.dilation, spec.stride)


class LayerKind:
    """A layer pointwise in space, without parameters (subclasses say what differs)."""

    #: the name users type (``refimpl check-layer NAME``, a suite's ``layer = ...``)
    name = ""
    #: its output extent per spatial axis, as a formula (what a report quotes to a result of
    #: the wrong shape); "" for a kind whose output has its input's shape
    output_size_rule = ""
    #: the window arguments this kind reads besides the input shape (out_channels, kernel,
    #: stride, padding, dilation, output_padding); the others are accepted and ignored, as
    #: check-layer always has (they also word check-layer's --help)
    hyper_parameters: tuple = ()
    #: its own options (``Option``): check-layer's flags, suite keys, ``spec.options``; an option
    #: of another kind given a value other than its default is refused ("--flag applies to ...")
    options: tuple = ()
    #: the partial tensors its partitioned layer reduces over ranks (``Statistic``); a kind with
    #: statistics also derives them per rank (``rank_partials``) and has the 'local-stats' plant
    statistics: tuple = ()
    #: --model-parallel modes: 'filter' splits the output channels over the model axis,
    #: 'channel' the input channels; 'none': every model rank computes the whole layer
    model_modes: tuple = ("none",)
    #: every output channel reads every input channel (a conv): split by input channel, a rank
    #: computes partial sums of every output channel (reduce-scattered), and its backward needs
    #: dy of every output channel; a channel-wise layer (pooling, batch norm) needs neither
    mixes_channels = False
    #: whether outputs read inputs of other ranks' blocks (a halo exchange, and its adjoint)
    has_halo = False
    #: whether dx reads the forward's tensors (max pooling's argmax of x, batch norm's statistics);
    #: False where dx is a linear map of dy alone (convs, average pooling): an error in the forward
    #: is then never the cause of one in dx (the oracle's ``trace_consequences``)
    dx_reads_forward = True
    #: weight axes of the (output, input) channels: where a model-parallel weight is cut
    weight_axes = (0, 0)
    #: the padding forms it takes: 'any' (int, 3-tuple, per-side 6-tuple, 'valid', 'same') or
    #: 'symmetric' (an int or a 3-tuple: conv_transpose3d, as PyTorch)
    padding_forms = "any"

    # ------------------------------------------------------------ hyper-parameters

    def default_stride(self, kernel) -> tuple:
        return (1, 1, 1)

    def validate(self, spec) -> None:
        """This kind's rules beyond the generic ones: ValueError, raised on every rank alike
        before any message (refimpl/check.py calls it on normalised arguments)."""
        from . import all_options, names_taking
        if "output_padding" not in self.hyper_parameters and spec.output_padding != (0, 0, 0):
            raise ValueError(f"--output-padding applies to {' / '.join(names_taking('output_padding'))} only")
        mine, known = self.option_names(), all_options()
        for name, value in (getattr(spec, "options", None) or {}).items():
            if name not in mine and name in known and value != known[name].default:
                raise ValueError(f"{known[name].applies_flag} applies to {' / '.join(names_taking(name))} only")

    def option_names(self) -> tuple:
        return tuple(o.name for o in self.options)

    def statistic_names(self) -> tuple:
        return tuple(s.name for s in self.statistics)

    def output_channels(self, spec) -> int:
        return spec.input[1]

    def output_extent(self, spec) -> tuple:
        """(Do, Ho, Wo) of the whole layer's output."""
        return tuple(spec.input[2:])

    def may_use_winograd(self, spec, algorithm: str) -> bool:
        """Whether the partitioned layer may run Winograd (float32 checks then allow its rounding)."""
        return False

    # ------------------------------------------------------------ parameters

    def parameter_shapes(self, spec):
        """(weight shape, bias shape) of the whole layer, or None for a layer without parameters."""
        return None

    def draw_parameters(self, rng, spec) -> dict:
        """The oracle's random {'w', 'b'} (float64), drawn right after x and before dy."""
        return {}

    def check_init(self, rng, shape):
        """Values check-layer draws for a parameter of ``shape`` in place of the layer's own
        initialisation, or None to keep it (an identity init would hide a wrong scale)."""
        return None

    # ------------------------------------------------------------ reference math (refimpl.functional)

    def forward(self, spec, x, w, b) -> tuple:
        """(y, saved): the whole layer's output and what ``backward`` needs."""
        raise NotImplementedError(f"layer kind {self.name} has no reference forward")

    def backward(self, spec, dy, saved) -> tuple:
        """(dx, dw, db) of ``forward`` (dw, db None without parameters)."""
        raise NotImplementedError(f"layer kind {self.name} has no reference backward")

    def reference(self, spec, x, w, b, dy) -> tuple:
        """(y, dx, dw, db) of the unpartitioned layer: the oracle of check-layer and of the cases,
        computed by refimpl.functional's math alone (``reference_only``: no kernel)."""
        from ..functional import reference_only
        with reference_only():
            y, saved = self.forward(spec, x, w, b)
            return (y,) + tuple(self.backward(spec, dy, saved))

    # ------------------------------------------------------------ constructors (refimpl.nn)

    def local(self, spec, *, rng, dtype):
        """The unpartitioned layer of one process."""
        raise NotImplementedError(f"layer kind {self.name} has no local layer")

    def partitioned(self, spec, *, grid, rng, dtype):
        """The layer on ``grid``: spatially partitioned, and split over the model axis as
        ``spec.model_parallel`` asks."""
        raise NotImplementedError(f"layer kind {self.name} has no partitioned layer")

    # ------------------------------------------------------------ partitioning (pure index math)

    def halo_plan(self, spec, spatial_dims):
        """The halo plan the partitioned layer executes (None: no halo, each rank reads its own block)."""
        return None

    def input_window(self, spec, axis: int, o: int) -> tuple:
        """Input range [lo, hi) (clipped to the domain) that output ``o`` reads along ``axis``."""
        return o, o + 1

    # ------------------------------------------------------------ oracle

    def rank_partials(self, spec, inputs, layout):
        """A rank's partial quantities where masking dy cannot derive them (a layer whose
        outputs depend on whole-tensor statistics): {name: (array, offset)}; None: the oracle
        derives them by linearity (refimpl/oracle/expect.py)."""
        return None

    def reduction_length(self, spec, tensor: str, out_shape) -> tuple:
        """(K, what K counts): the terms summed into one element of ``tensor``; the oracle's
        tolerance grows as sqrt(K) (refimpl/oracle/compare.py)."""
        raise NotImplementedError(f"layer kind {self.name} has no reduction lengths")

    def known_mistakes(self, case, dtype):
        """(message, (y, dx)) pairs: the global y and dx a known mistake of a partitioned
        implementation produces (refimpl/oracle/diagnose.py names the one that matches)."""
        return ()

    #: the cause of a per-channel affine error (got == a_c * want + b_c), where this kind can
    #: make one; None: no such diagnosis
    affine_mistake = None
    #: the cause diagnose.py names where a rank's outputs are those of its own input block alone
    #: (every cell beyond it read as padding), ``{who}`` the rank; None: named as padding applied
    #: at the internal faces
    no_halo_mistake = None

    def window_values(self, spec, patches, w, b, counts):
        """Outputs of windows from their cells, for diagnose.py to rebuild a rank's block with a
        suspected mistake in the cells or in where the windows start: ``patches`` (N, C, Do, Ho,
        Wo, kd, kh, kw) float64 with the padding filled (``pad_value``), ``counts`` the cells of
        each window (Do, Ho, Wo) inside the padded domain and inside the domain.  None: this
        kind's outputs are not windows of its input."""
        return None

    def output_size_rules(self, spec, axis: int) -> tuple:
        """(what a wrong output-size rule does, the extent it gives along ``axis``): the rules
        partitioned codes get wrong; diagnose.py names the one that gives a wrong-shaped
        result's extent."""
        return ()

    # ------------------------------------------------------------ PyTorch twin (torch passed in:
    # refimpl imports torch only in refimpl/oracle/torch_adapter.py)

    def torch_forward(self, spec, tf, x, w, b):
        """The whole layer with ``tf`` = torch.nn.functional."""
        raise NotImplementedError(f"layer kind {self.name} has no PyTorch twin")

    def torch_block(self, spec, tf, lo, x_needed, w, b, shift_axis=None):
        """Rank ``lo``'s output block from its needed input block, with ``tf``.  ``shift_axis``:
        pad one more at the low end of that axis, one less at the high end (a planted bug)."""
        return self.torch_forward(spec, tf, x_needed, w, b)

    def torch_ranks(self, case, inputs, torch, plant):
        """Every rank's results where a rank's outputs are not a function of its needed block
        alone ({rank: {name: array}}); None: the adapter runs ``torch_block`` per rank."""
        return None


    # ------------------------------------------------------------ planner (refimpl/plan.py)
    # ``layer`` below is the planner's record of one layer of a model (``refimpl.plan.Layer``:
    # name, channels c_in / c_out, global in_dhw / out_dhw, kernel, stride, padding, weights,
    # model-axis ``split`` / ``split_in``, input_grad); ``rank`` is one rank of a grid
    # (``refimpl.plan.RankView``: its samples n_r, grid dims / coords, helpers pricing messages).

    #: the name of this kind in the planner's tables, JSON and machine files (several registry
    #: kinds may share one: max_pool3d and avg_pool3d cost the same); '' if it is not priced
    plan_label = ""
    #: its output channels follow a channel-split input (a channel-wise layer keeps the split)
    plan_channelwise = True
    #: ``refimpl plan --calibrate`` measures this kind's rate per shape (``Machine.conv_gflops``)
    plan_calibrated = False
    #: a memory-bound kind's price: elements/s of one forward + backward the planner assumes
    #: until ``refimpl plan --calibrate`` measures it with ``plan_measure_rate`` (then the
    #: machine file's ``[element_rates]`` entry of the kind's name: ``Machine.element_rate``);
    #: None: not priced per element (convs per shape, dense layers at the GEMM rate)
    plan_element_rate: float | None = None

    def plan_halo(self, layer, spatial_dims):
        """The halo plan the layer executes on a (Pd, Ph, Pw) grid (None: no halo)."""
        return None

    def plan_splits(self, layer) -> bool:
        """Whether the layer uses the model axis (a grid with Pm > 1 needs one such layer)."""
        return layer.split != "none"

    def plan_split_channels(self, layer) -> int:
        """The channels the model axis divides (Pm may not exceed them)."""
        return layer.c_in if layer.split == "channel" else layer.c_out

    def plan_weight_taps(self, layer) -> int:
        """Weight entries per (output, input) channel pair."""
        return 1

    def plan_param_sizes(self, layer, pm, m, width) -> list:
        """Elements of each parameter (weight, then bias if any) model rank ``m`` of ``pm``
        holds: the slices ``nn/model_parallel.py`` keeps (filter / row splits: the output rows;
        channel splits: the input columns of the weight and the output slice of the bias).
        ``width(channels)``: rank m's share of ``channels``."""
        kvol = self.plan_weight_taps(layer)
        weight = layer.c_out * layer.c_in * kvol
        has_bias = layer.weights > weight
        f, c = layer.c_out, layer.c_in
        if layer.split != "none" and pm > 1:
            if layer.split == "channel":
                c = width(layer.c_in)
            f_bias = width(layer.c_out)
            if layer.split != "channel":
                f = f_bias
        else:
            f_bias = f
        return [f * c * kvol] + ([f_bias] if has_bias else [])

    def plan_cost(self, layer, rank, cost) -> float:
        """Fill ``cost`` (``refimpl.plan.LayerCost``: flops, halo, model-axis messages, saved
        and transient bytes, comm_s) with one step of ``layer`` on ``rank``; return its compute
        seconds.  Default: nothing to pay."""
        return 0.0

    def plan_output_extent(self, layer, in_dhw) -> tuple:
        """(D, H, W) of the output for the input extent ``in_dhw`` (calibration inputs)."""
        return tuple(in_dhw)

    def plan_measure_rate(self, x, rng, timed) -> float:
        """Elements/s of one forward + backward of this kind on the float32 calibration block
        ``x`` (N, C, D, H, W) by refimpl's functions, ``timed(fn)`` the best seconds of ``fn()``
        (``plan_element_rate`` kinds; ``rng`` for a gradient)."""
        raise NotImplementedError(f"layer kind {self.name} declares a plan_element_rate but no plan_measure_rate")

    def plan_time(self, layer, repeats, rng, best_time) -> float:
        """Seconds of one forward + backward of ``layer`` (one sample, float32) by refimpl's
        functions, ``best_time(fn, repeats)`` timing it (``plan_calibrated`` kinds only)."""
        raise NotImplementedError(f"layer kind {self.name} is not calibrated")


def plan_window_cost(layer, rank, cost, plan):
    """What every halo'd layer pays on ``rank`` for its halo ``plan`` (forward exchange, and
    the adjoint when the layer computes dX): bytes, messages, seconds (messages + copies).
    Returns (v_in, v_out, v_need, c_halo): the rank's owned input, output and work-array
    voxels and the channels the halo carries (the whole input after a filter-parallel
    conv's allgather)."""
    scoords = rank.scoords
    owned, needed = plan.owned(scoords), plan.needed(scoords)
    v_in, v_out = rank.volume(owned), rank.volume(plan.outputs(scoords))
    v_need = rank.volume([(min(a, c), max(b, d)) for (a, b), (c, d) in zip(owned, needed)])
    c_halo = layer.c_in if layer.split in ("filter", "filter-replicated") else rank.c_local(layer)
    for adjoint in (False, True) if layer.input_grad else (False,):
        b, msgs, s = rank.halo(plan, c_halo, adjoint)
        cost.halo_bytes += b
        cost.halo_messages += msgs
        cost.halo_s += s + rank.halo_copies_s(plan, c_halo, adjoint)
    return v_in, v_out, v_need, c_halo


class ChannelAffineKind(LayerKind):
    """A layer whose parameters are a scale and a shift per channel (the normalisations: batch,
    group and instance norm): their shapes, the oracle's draw and check-layer's initialisation."""

    def parameter_shapes(self, spec):
        return (spec.input[1],), (spec.input[1],)

    def draw_parameters(self, rng, spec):
        c = spec.input[1]
        return {"w": rng.uniform(0.5, 1.5, c), "b": rng.standard_normal(c)}

    def check_init(self, rng, shape):
        """A random scale and shift: the layer's own (1, 0) would hide a wrong gamma or beta."""
        return rng.uniform(0.5, 1.5, shape)

    #: memory-bound (sums, normalise; backward sums, dx): elements/s until calibrated
    plan_element_rate = 1e9

    def plan_reference(self, channels):
        """(forward(x, weight, bias) -> (y, cache), backward(dy, cache) -> (dx, dw, db)): the
        functional op the planner's calibration times for ``channels`` channels."""
        raise NotImplementedError(f"layer kind {self.name} names no functional op to calibrate")

    def plan_measure_rate(self, x, rng, timed):
        """Elements/s of ``plan_reference``'s forward + backward on ``x``."""
        c = x.shape[1]
        w, b = rng.uniform(0.5, 1.5, c).astype(x.dtype), rng.standard_normal(c).astype(x.dtype)
        dy = rng.standard_normal(x.shape).astype(x.dtype)
        forward, backward = self.plan_reference(c)

        def step():
            _, cache = forward(x, w, b)
            backward(dy, cache)
        return x.size / timed(step)


class WindowKind(LayerKind):
    """A window op (conv, pooling): outputs partitioned in blocks, each reading a window of
    the input through a halo; the padding holds ``pad_value``."""

    has_halo = True
    #: what the padding holds (max pooling: -inf, so that padding never wins)
    pad_value = 0.0
    output_size_rule = "floor((n + p_lo + p_hi - d(k-1) - 1)/s) + 1 for a conv or pooling (ceil_mode: ceil)"

    def output_extent(self, spec) -> tuple:
        p, ceil = spec_padding(spec), spec_option(spec, "ceil_mode")
        return tuple(window_output_extent(spec.input[2 + a], spec.kernel[a], spec.stride[a], p[a],
                                          spec.dilation[a], ceil) for a in range(3))

    def halo_plan(self, spec, spatial_dims):
        return conv_halo_plan(spec.input[2:], spatial_dims, spec.kernel, spec.stride, spec.padding, spec.dilation,
                              spec_option(spec, "ceil_mode"))

    def input_window(self, spec, axis, o):
        return needed_input_range(o, o + 1, spec.kernel[axis], spec.stride[axis], spec_padding(spec)[axis],
                                  spec.dilation[axis], spec.input[2 + axis], spec_option(spec, "ceil_mode"))[0]

    def output_size_rules(self, spec, axis):
        n, k, s, d = spec.input[2 + axis], spec.kernel[axis], spec.stride[axis], spec.dilation[axis]
        lo, hi = spec_padding(spec)[axis]
        ceil = spec_option(spec, "ceil_mode")

        def extent(k=k, s=s, p=lo + hi, d=d, ceil=ceil):
            span = n + p - d * (k - 1) - 1
            return (-(-span // s) if ceil else span // s) + 1
        rules = []
        if d > 1:
            rules.append((f"ignores dilation (the dilated kernel spans {d * (k - 1) + 1}, not {k})", extent(d=1)))
        if lo + hi:
            rules.append((f"ignores padding ({lo} + {hi})", extent(p=0)))
            if hi != lo:
                rules.append((f"pads {lo} on both sides (the high side pads {hi})", extent(p=2 * lo)))
        if s > 1 and "ceil_mode" in self.option_names():     # a conv has no ceil_mode to get wrong
            rules.append(("rounds up (ceil_mode)" if not ceil else "rounds down (no ceil_mode)",
                          extent(ceil=not ceil)))
        return tuple(rules)

    def torch_window(self, spec, tf, x, w, b, padding, ceil_mode=False):
        """The op with ``tf`` and an explicit symmetric padding (the global run's, or 0 on a padded
        block) and, for pooling, ``ceil_mode``."""
        raise NotImplementedError(f"layer kind {self.name} has no PyTorch twin")

    def torch_forward(self, spec, tf, x, w, b):
        """PyTorch takes symmetric padding only: an asymmetric one is padded explicitly first (then
        PyTorch's ceil_mode may keep one window more than the per-side rule: cropped)."""
        p, ceil = spec_padding(spec), spec_option(spec, "ceil_mode")
        if all(lo == hi for lo, hi in p):
            return self.torch_window(spec, tf, x, w, b, tuple(lo for lo, _ in p), ceil)
        pads = [v for a in reversed(range(3)) for v in p[a]]     # torch's pad lists the last axis first
        y = self.torch_window(spec, tf, tf.pad(x, pads, value=self.pad_value), w, b, 0, ceil)
        return y[(Ellipsis,) + tuple(slice(0, n) for n in self.output_extent(spec))]

    def torch_block(self, spec, tf, lo, x_needed, w, b, shift_axis=None):
        """Pad the part of rank lo's windows that the clip to the domain removed, then run the
        op unpadded."""
        k, s, p, d = spec.kernel, spec.stride, [q for q, _ in spec_padding(spec)], spec.dilation
        pads = []
        for a in reversed(range(3)):             # torch's pad lists the last axis first
            (i0, i1), (o0, o1) = lo.needed[a], lo.outputs[a]
            low = i0 - (s[a] * o0 - p[a])
            high = (s[a] * (o1 - 1) - p[a] + d[a] * (k[a] - 1) + 1) - i1
            if shift_axis == a:
                low, high = low + 1, high - 1
            pads += [low, high]
        xp = tf.pad(x_needed, pads, value=self.pad_value) if any(pads) else x_needed
        return self.torch_window(spec, tf, xp, w, b, 0)
