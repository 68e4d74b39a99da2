"""PyTorch's own OpInfo sample inputs through ``refimpl.functional`` (issue 32, item 5).

For each of eight ``torch.nn.functional`` ops, every sample that PyTorch's OpInfo database
generates (``op_db``, ``sample_inputs(device="cpu", dtype=torch.float64, requires_grad=True)``)
runs through the matching ``refimpl.functional`` op: the forward, and the backward with one
random upstream gradient (float64), on both routes (the reference math: ``reference_only()``
and ``algorithm="reference"``; and the default route, kernels included).  PyTorch's arguments
are bound to its parameter names (its defaults filled in) and passed on under refimpl's names
(``SPECS``: the renames, and which parameters are tensors), every option refimpl's function
has.  Each sample ends in one of:

- **equal**: the output (batch norm: also the running statistics) and every gradient within
  ``1e-10`` of PyTorch's, relative to the largest magnitude of PyTorch's array (batch norm's
  dx: of its natural scale, see ``_bn_dx_scale``), on both routes;
- **refused**: refimpl raises a ``ValueError`` that names an option this sample sets to a value
  other than PyTorch's default (``'groups'``, ``'ceil_mode'``, ``'padding'``, ...), or, for an
  input of a rank refimpl does not take (4-D unbatched conv input, 3-D batch norm input, 1-D
  linear input, a 0-d activation input), states the rank it needs (``x must be 5-D ...``);
- **absent**: the sample sets an option that refimpl's function does not have at all (e.g.
  ``ceil_mode`` while pooling lacks it): refimpl is not called, the option is recorded.  When
  the signature gains the option the sample goes through it (no edit here) and must be equal
  or refused as above.

Anything else fails the test: a different value or shape, any other exception, a ValueError
that names none of the sample's options, the two routes disagreeing, a forward that takes an
option its backward lacks.  ``pytest -s tests/test_opinfo.py`` prints the table of counts
(also recorded as the ``opinfo_counts`` property; in its breakdown a sample counts once per
absent option it sets); ``MIN_EQUAL`` pins how many samples per op are equal today, so a
change that starts refusing (or breaks) them shows.

Batch norm's OpInfo samples are 1-D to 4-D (none 5-D), so refimpl's ``batch_norm3d`` refuses
all of them; the row ``batch_norm[5-D view]`` runs the same samples viewed as
``(N, C, L, 1, 1)`` (``L`` the product of the remaining axes: the same statistics, for
PyTorch and refimpl alike), so its momentum/eps/training/None-weight cases are still checked.

Needs ``torch`` and ``expecttest`` (``torch.testing._internal`` imports it); skipped without.
"""
from __future__ import annotations

import functools
import inspect
import re
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import pytest

from refimpl import functional as F

torch = pytest.importorskip("torch", reason="PyTorch absent: pip install 'refimpl[oracle]'")
pytest.importorskip("expecttest", reason="torch.testing._internal needs expecttest: pip install expecttest")

RTOL = 1e-10
REQUIRED = object()                 # a torch parameter without a default


# ---------------------------------------------------------------- the mapping, op by op

@dataclass(frozen=True)
class Spec:
    """How one OpInfo's samples reach refimpl.

    ``params``: PyTorch's parameters after ``input``, in its order, with its defaults;
    ``tensors``: those that are tensors (passed as NumPy arrays, by ``call``/``grads``);
    ``rename``: PyTorch name -> refimpl name (options and tensors; for messages too);
    ``forward``/``backward``: the refimpl functions (their signatures say which options exist);
    ``call(arrays, opts)``: the forward; ``output(result)``: its output array;
    ``grads(dy, arrays, opts, result)``: {PyTorch tensor name: gradient};
    ``takes(ndim)``: the input ranks refimpl takes; ``output_only``: options that only change
    the form of PyTorch's result (dropped); ``state``: tensors updated in place (compared);
    ``backward_options``: whether ``backward`` takes the forward's options (else its cache)."""
    opinfo: str
    params: tuple
    tensors: tuple
    forward: Callable
    backward: Callable
    call: Callable
    grads: Callable
    takes: Callable
    rename: dict = field(default_factory=dict)
    output: Callable = None          # None: the result itself
    output_only: frozenset = frozenset()
    state: tuple = ()
    backward_options: bool = True
    view5d: bool = False


def _named(names, values):
    return dict(zip(names, values))


CONV_RENAME = {"input": "x", "weight": "w", "bias": "b"}
SPECS = {
    "conv3d": Spec(
        "nn.functional.conv3d",
        (("weight", REQUIRED), ("bias", None), ("stride", 1), ("padding", 0), ("dilation", 1),
         ("groups", 1)),
        ("input", "weight", "bias"), F.conv3d, F.conv3d_backward,
        call=lambda a, o: F.conv3d(a["input"], a["weight"], a["bias"], **o),
        grads=lambda dy, a, o, r: _named(("input", "weight", "bias"),
                                         F.conv3d_backward(dy, a["input"], a["weight"], **o)),
        takes=lambda ndim: ndim == 5, rename=CONV_RENAME),
    "conv_transpose3d": Spec(
        "nn.functional.conv_transpose3d",
        (("weight", REQUIRED), ("bias", None), ("stride", 1), ("padding", 0),
         ("output_padding", 0), ("groups", 1), ("dilation", 1)),
        ("input", "weight", "bias"), F.conv_transpose3d, F.conv_transpose3d_backward,
        call=lambda a, o: F.conv_transpose3d(a["input"], a["weight"], a["bias"], **o),
        grads=lambda dy, a, o, r: _named(("input", "weight", "bias"),
                                         F.conv_transpose3d_backward(dy, a["input"], a["weight"], **o)),
        takes=lambda ndim: ndim == 5, rename=CONV_RENAME),
    "max_pool3d": Spec(
        "nn.functional.max_pool3d",
        (("kernel_size", REQUIRED), ("stride", None), ("padding", 0), ("dilation", 1),
         ("ceil_mode", False), ("return_indices", False)),
        ("input",), F.max_pool3d, F.max_pool3d_backward,
        call=lambda a, o: F.max_pool3d(a["input"], **o),
        grads=lambda dy, a, o, r: {"input": F.max_pool3d_backward(dy, a["input"], **o)},
        takes=lambda ndim: ndim == 5, rename={"input": "x"},
        output_only=frozenset({"return_indices"})),      # PyTorch's indices: refimpl keeps masks
    "avg_pool3d": Spec(
        "nn.functional.avg_pool3d",
        (("kernel_size", REQUIRED), ("stride", None), ("padding", 0), ("ceil_mode", False),
         ("count_include_pad", True), ("divisor_override", None)),
        ("input",), F.avg_pool3d, F.avg_pool3d_backward,
        call=lambda a, o: F.avg_pool3d(a["input"], **o),
        grads=lambda dy, a, o, r: {"input": F.avg_pool3d_backward(dy, a["input"], **o)},
        takes=lambda ndim: ndim == 5, rename={"input": "x"}),
    "batch_norm": Spec(
        "nn.functional.batch_norm",
        (("running_mean", REQUIRED), ("running_var", REQUIRED), ("weight", None), ("bias", None),
         ("training", False), ("momentum", 0.1), ("eps", 1e-5)),
        ("input", "running_mean", "running_var", "weight", "bias"),
        F.batch_norm3d, F.batch_norm3d_backward,
        call=lambda a, o: F.batch_norm3d(a["input"], gamma=a["weight"], beta=a["bias"],
                                         running_mean=a["running_mean"],
                                         running_var=a["running_var"], **o),
        grads=lambda dy, a, o, r: _named(("input", "weight", "bias"), F.batch_norm3d_backward(dy, r[1])),
        takes=lambda ndim: ndim == 5, rename={"input": "x", "weight": "gamma", "bias": "beta"},
        output=lambda r: r[0], state=("running_mean", "running_var"), backward_options=False),
    "relu": Spec(
        "nn.functional.relu", (("inplace", False),), ("input",), F.relu, F.relu_backward,
        call=lambda a, o: F.relu(a["input"], **o),
        grads=lambda dy, a, o, r: {"input": F.relu_backward(dy, a["input"], **o)},
        takes=lambda ndim: ndim >= 1, rename={"input": "x"}, output_only=frozenset({"inplace"})),
    "leaky_relu": Spec(
        "nn.functional.leaky_relu", (("negative_slope", 0.01), ("inplace", False)), ("input",),
        F.leaky_relu, F.leaky_relu_backward,
        call=lambda a, o: F.leaky_relu(a["input"], **o),
        grads=lambda dy, a, o, r: {"input": F.leaky_relu_backward(dy, a["input"], **o)},
        takes=lambda ndim: ndim >= 1, rename={"input": "x"}, output_only=frozenset({"inplace"})),
    "linear": Spec(
        "nn.functional.linear", (("weight", REQUIRED), ("bias", None)), ("input", "weight", "bias"),
        F.linear, F.linear_backward,
        call=lambda a, o: F.linear(a["input"], a["weight"], a["bias"], **o),
        grads=lambda dy, a, o, r: _named(("input", "weight", "bias"),
                                         F.linear_backward(dy, a["input"], a["weight"], **o)),
        takes=lambda ndim: ndim == 2, rename={"input": "x", "weight": "w", "bias": "b"}),
}
SPECS["batch_norm[5-D view]"] = replace(SPECS["batch_norm"], view5d=True)

# How many samples equal PyTorch today, per row (the rest are refused or absent): a floor,
# raised as options land (the test prints the counts).
MIN_EQUAL = {"conv3d": 10, "conv_transpose3d": 5, "max_pool3d": 384, "avg_pool3d": 8,
             "batch_norm": 0, "batch_norm[5-D view]": 10, "relu": 3, "leaky_relu": 9,
             "linear": 8}


# ---------------------------------------------------------------- helpers

@functools.lru_cache(maxsize=None)
def _parameters(fn) -> frozenset:
    return frozenset(inspect.signature(fn).parameters)


def _is_default(value, default) -> bool:
    """Whether PyTorch's ``value`` means its ``default`` (``(0, 0, 0)`` for ``0``, too)."""
    if default is REQUIRED:
        return False
    if isinstance(value, (tuple, list, torch.Size)) and isinstance(default, (int, float)) \
            and not isinstance(default, bool):
        return len(value) > 0 and all(v == default for v in value)
    return type(value) is type(default) and value == default or value is default


def _numpy(t):
    return None if t is None else np.array(t.detach().numpy(), copy=True)


def _leaf(t):
    return t.detach().clone().requires_grad_(t.requires_grad)


def rel_err(got, want, floor=0.0) -> float:
    """max|got - want| / max(max|want|, floor): NaNs must sit at the same places; inf if the
    shapes differ."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return float("inf")
    if want.size == 0:
        return 0.0
    nan = np.isnan(want)
    if not np.array_equal(nan, np.isnan(got)):
        return float("inf")
    got, want = got[~nan], want[~nan]
    if want.size == 0:
        return 0.0
    diff = float(np.max(np.abs(got - want)))
    scale = max(float(np.max(np.abs(want))), floor)
    return diff / scale if scale > 0 else diff


def _bn_dx_scale(dy, arrays, opts):
    """Batch norm's dx is a difference of O(|dy| gamma inv_std) terms that can cancel (with
    two values per channel it is 0 up to rounding): its error is measured on that scale."""
    x = arrays["input"]
    if x.size == 0:
        return 0.0
    axes = (0,) + tuple(range(2, x.ndim))
    var = x.var(axis=axes) if opts.get("training", True) else arrays["running_var"]
    gamma = 1.0 if arrays["weight"] is None else np.max(np.abs(arrays["weight"]))
    return float(np.max(np.abs(dy)) * gamma / np.sqrt(np.min(var) + opts.get("eps", 1e-5)))


class Refused(Exception):
    """refimpl refused a sample acceptably: ``option`` is what its ValueError named."""

    def __init__(self, option, message):
        super().__init__(message)
        self.option = option


@dataclass
class Row:
    tried: int = 0
    equal: int = 0
    refused: int = 0                 # ValueError naming an option / the rank
    absent: int = 0                  # an option refimpl's function does not have
    why: Counter = field(default_factory=Counter)
    failures: list = field(default_factory=list)


# ---------------------------------------------------------------- one sample

def _bind(spec, sample):
    """PyTorch's arguments by name, its defaults filled in."""
    names = [name for name, _ in spec.params]
    bound = dict(spec.params)
    if len(sample.args) > len(names):
        raise AssertionError(f"{len(sample.args)} positional args for {names}")
    bound.update(zip(names, sample.args))
    bound.update(sample.kwargs)
    missing = [k for k, v in bound.items() if v is REQUIRED]
    if missing:
        raise AssertionError(f"sample lacks {missing}")
    return bound


def _options(spec, bound):
    """(opts under refimpl's names, PyTorch names of non-default options, absent options)."""
    accepted = _parameters(spec.forward)
    defaults = dict(spec.params)
    opts, set_, absent = {}, [], []
    for name, value in bound.items():
        if name in spec.tensors or name in spec.output_only:
            continue
        if not _is_default(value, defaults[name]):
            set_.append(name)
        ref = spec.rename.get(name, name)
        if ref in accepted:
            opts[ref] = tuple(value) if isinstance(value, (list, torch.Size)) else value
        elif name in set_:
            absent.append(name)
    return opts, set_, absent


def _classify_refusal(spec, err, set_, ndim):
    """The option a ValueError names (``Refused``), or None when it names none acceptable."""
    message = str(err)
    for name in set_:
        for word in {name, spec.rename.get(name, name)}:
            if re.search(rf"\b{re.escape(word)}\b", message):
                return Refused(name, message)
    if not spec.takes(ndim) and re.search(r"\d-D\b", message) \
            and re.search(rf"\b({spec.rename.get('input', 'input')}|input)\b", message):
        return Refused(f"{ndim}-D input", message)
    return None


def _torch_run(opinfo, spec, sample, seed):
    """PyTorch's output, in-place state after the call and gradients (None without grads)."""
    inp = _leaf(sample.input)
    args = [_leaf(a) if isinstance(a, torch.Tensor) else a for a in sample.args]
    kwargs = {k: _leaf(v) if isinstance(v, torch.Tensor) else v for k, v in sample.kwargs.items()}
    out = opinfo.op(inp, *args, **kwargs)
    if isinstance(out, tuple):                                  # return_indices
        out = out[0]
    named = _bind(spec, type(sample)(inp, args=tuple(args), kwargs=kwargs))
    named["input"] = inp
    state = {k: _numpy(named[k]) for k in spec.state}
    leaves = {k: named[k] for k in spec.tensors
              if isinstance(named[k], torch.Tensor) and named[k].requires_grad}
    dy = np.random.default_rng(seed).standard_normal(tuple(out.shape))
    grads = {}
    if leaves and out.requires_grad:
        got = torch.autograd.grad(out, list(leaves.values()), torch.from_numpy(dy), allow_unused=True)
        grads = {k: (torch.zeros_like(leaves[k]) if g is None else g).numpy()
                 for k, g in zip(leaves, got)}
    return _numpy(out), state, dy, grads


def _refimpl_run(spec, route, arrays, opts, set_, dy, ndim):
    """refimpl's (output, state, grads) on ``route``; ``Refused`` when it refuses acceptably."""
    arrays = {k: None if v is None else v.copy() for k, v in arrays.items()}
    fwd_opts, bwd_opts = dict(opts), {}
    if spec.backward_options:               # the forward's options, but defaults it lacks
        accepted, set_ref = _parameters(spec.backward), {spec.rename.get(n, n) for n in set_}
        lacking = [k for k in opts if k not in accepted and k in set_ref]
        if lacking:
            raise AssertionError(f"refimpl's {spec.forward.__name__} takes {lacking} but "
                                 f"{spec.backward.__name__} does not")
        bwd_opts = {k: v for k, v in opts.items() if k in accepted}
    if route == "reference":
        for o, fn in ((fwd_opts, spec.forward), (bwd_opts, spec.backward)):
            if "algorithm" in _parameters(fn):
                o["algorithm"] = "reference"
    with F.reference_only() if route == "reference" else nullcontext():
        try:
            result = spec.call(arrays, fwd_opts)
        except ValueError as err:
            refused = _classify_refusal(spec, err, set_, ndim)
            if refused is None:
                raise AssertionError(f"ValueError naming none of the sample's options {set_}: "
                                     f"{err}") from err
            return refused
        try:
            grads = spec.grads(dy, arrays, bwd_opts, result)
        except ValueError as err:
            raise AssertionError(f"the forward took the sample, the backward refused it: {err}") from err
    y = result if spec.output is None else spec.output(result)
    return np.asarray(y), {k: arrays[k] for k in spec.state}, grads


def _compare(spec, want, got, arrays, opts, dy):
    """The failures (strings) of refimpl's (output, state, grads) against PyTorch's."""
    (y_t, state_t, grads_t), (y, state, grads) = want, got
    bad = []
    if y.dtype != np.float64:
        bad.append(f"output dtype {y.dtype}")
    err = rel_err(y, y_t)
    if not err <= RTOL:
        bad.append(f"output: rel err {err:.3g} (shapes {y.shape} vs {y_t.shape})")
    for k in spec.state:
        if state_t[k] is not None and not rel_err(state[k], state_t[k]) <= RTOL:
            bad.append(f"{k} (updated in place): rel err {rel_err(state[k], state_t[k]):.3g}")
    for k, g_t in grads_t.items():
        if grads.get(k) is None:
            bad.append(f"no gradient for {k}")
            continue
        floor = _bn_dx_scale(dy, arrays, opts) if spec.state and k == "input" else 0.0
        err = rel_err(grads[k], g_t, floor)
        if not err <= RTOL:
            bad.append(f"d{k}: rel err {err:.3g} (shapes {np.shape(grads[k])} vs {g_t.shape})")
    return bad


def run_row(name, opinfo) -> Row:
    spec, row = SPECS[name], Row()
    torch.manual_seed(0)
    samples = list(opinfo.sample_inputs("cpu", torch.float64, requires_grad=True))
    for i, sample in enumerate(samples):
        if spec.view5d:
            if sample.input.ndim < 2:
                continue                                          # no channel axis to view
            n, c = sample.input.shape[:2]
            inp = sample.input.detach().reshape(n, c, -1, 1, 1).requires_grad_(sample.input.requires_grad)
            sample = type(sample)(inp, args=sample.args, kwargs=sample.kwargs)
        row.tried += 1
        where = (f"{name} sample {i}: input {tuple(sample.input.shape)}, args "
                 f"{[tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in sample.args]}, "
                 f"kwargs {sample.kwargs}")
        try:
            bound = _bind(spec, sample)
            opts, set_, absent = _options(spec, bound)
            if absent:
                row.absent += 1
                row.why.update(f"{a} (absent)" for a in absent)
                continue
            arrays = {k: _numpy(sample.input if k == "input" else bound[k]) for k in spec.tensors}
            want_y, want_state, dy, want_grads = _torch_run(opinfo, spec, sample, seed=i)
            outcomes = [_refimpl_run(spec, route, arrays, opts, set_, dy, sample.input.ndim)
                        for route in ("reference", "default")]
        except AssertionError as err:
            row.failures.append(f"{where}: {err}")
            continue
        except Exception as err:                                  # a raw error: a failure
            row.failures.append(f"{where}: {type(err).__name__}: {err}")
            continue
        refusals = [o for o in outcomes if isinstance(o, Refused)]
        if refusals:
            if len(refusals) != 2 or str(refusals[0]) != str(refusals[1]):
                said = [f"refused: {o}" if isinstance(o, Refused) else "computed" for o in outcomes]
                row.failures.append(f"{where}: the routes disagree: reference {said[0]}, default {said[1]}")
            else:
                row.refused += 1
                row.why[refusals[0].option] += 1
            continue
        bad = []
        for route, got in zip(("reference", "default"), outcomes):
            bad += [f"{route} route: {b}" for b in
                    _compare(spec, (want_y, want_state, want_grads), got, arrays, opts, dy)]
        if bad:
            row.failures.append(f"{where}: " + "; ".join(bad))
        else:
            row.equal += 1
    return row


# ---------------------------------------------------------------- the tests

ROWS: dict = {}


def format_table(rows) -> str:
    lines = [f"{'op':22} {'tried':>5} {'equal':>5} {'refused':>7} {'absent':>6} {'failed':>6}  "
             "refused/absent by option",
             "-" * 100]
    for name, r in rows.items():
        why = ", ".join(f"{k}: {v}" for k, v in sorted(r.why.items()))
        lines.append(f"{name:22} {r.tried:5} {r.equal:5} {r.refused:7} {r.absent:6} "
                     f"{len(r.failures):6}  {why}")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def op_db():
    db = pytest.importorskip("torch.testing._internal.common_methods_invocations").op_db
    threads = torch.get_num_threads()
    torch.set_num_threads(1)            # tiny samples: a thread pool per call costs 100x the op
    try:
        yield {o.name: o for o in db if o.variant_test_name == ""}
    finally:
        torch.set_num_threads(threads)
    print("\nOpInfo samples through refimpl.functional (float64; equal: within 1e-10 relative, "
          "forward and backward, both routes)\n" + format_table(ROWS))


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
@pytest.mark.parametrize("name", list(SPECS))
def test_opinfo_samples(name, op_db, record_property):
    row = ROWS[name] = run_row(name, op_db[SPECS[name].opinfo])
    record_property("opinfo_counts", format_table({name: row}))
    print("\n" + format_table({name: row}))
    assert not row.failures, f"{len(row.failures)} sample(s) failed:\n" + "\n".join(row.failures)
    assert row.tried == row.equal + row.refused + row.absent
    assert row.tried > 0
    assert row.equal >= MIN_EQUAL[name], (
        f"{name}: {row.equal} of {row.tried} samples equal PyTorch, fewer than the {MIN_EQUAL[name]} "
        f"that did: a sample now refused or absent? {dict(row.why)}")
