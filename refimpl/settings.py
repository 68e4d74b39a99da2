"""The ``REFIMPL_*`` environment variables: one registry, one parser per variable.

Why one place: each variable used to be parsed where it was read, each with its
own rules (one lower-cased its value, one did not, one took any unknown word
for "off"), and a misspelt name (``REFIMPL_THREAD=2``) passed silently.  Here
every variable refimpl reads is registered with its parser, its allowed values
and what it does; the readers call ``env_setting(name)``, and the ``refimpl``
command calls ``check_environment()`` before any work, so a bad value or an
unknown ``REFIMPL_`` name stops it with one line naming the variable, the value
and what is allowed (the same line on every rank: mpiexec gives every rank the
same environment).

Rules shared by every variable: surrounding whitespace is ignored, and an empty
value means unset, i.e. the default (as for Python's own ``PYTHON*`` variables,
so ``REFIMPL_CUDA_AWARE= cmd`` switches it off); names of choices are matched
exactly (lower case); booleans take 1/0, true/false, yes/no, on/off in any case.

Importing this module is cheap (the standard library only): CuPy is imported
only to validate ``REFIMPL_BACKEND=cupy``.
"""
from __future__ import annotations

import difflib
import os
from typing import Any, Callable, NamedTuple

PREFIX = "REFIMPL_"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class Setting(NamedTuple):
    """One environment variable: ``parse`` turns its (stripped, non-empty) text into the
    value or raises ValueError (empty message: the text is not among ``allowed``;
    otherwise the reason why an allowed-looking value cannot be used here)."""
    name: str
    parse: Callable[[str], Any]
    allowed: str                 # completes "NAME must be ..."
    default: Any                 # the value when unset or empty
    description: str
    choices: tuple = ()          # the allowed names, for settings that are a choice
    test_only: bool = False      # read by the test suite, not by refimpl itself
    plain_choice: bool = False   # parse only checks that the text is one of choices


def _choice(*names):
    def parse(text):
        if text not in names:
            raise ValueError()
        return text
    return parse


def _boolean(text):
    word = text.lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError()


def _positive_int(text):
    try:
        n = int(text)
    except ValueError:
        raise ValueError() from None
    if n < 1 or str(n) != text:          # refuse "+2", "02", "2_0": say what you mean
        raise ValueError()
    return n


def cupy_unavailable() -> str | None:
    """Why the cupy backend cannot run here (None: it can).  The one check of it, shared by
    ``REFIMPL_BACKEND`` and ``backend.set_backend``."""
    try:
        import cupy
    except ImportError as err:
        return f"CuPy cannot be imported ({err}; pip install 'refimpl[gpu]')"
    try:
        available = cupy.is_available()
    except Exception as err:                          # a broken CUDA install raises here
        return f"CuPy finds no usable CUDA device ({type(err).__name__}: {err})"
    return None if available else "CuPy finds no CUDA device (cupy.is_available() is False)"


def _backend(text):
    name = _choice("numpy", "cupy", "strict")(text)
    if name == "cupy":
        reason = cupy_unavailable()
        if reason:
            raise ValueError(f"{reason}; use numpy here, or cupy on a machine with a CUDA device")
    return name


def _python_files(text):
    """Comma-separated paths of Python files that exist, as absolute paths (REFIMPL_KINDS)."""
    paths = [t.strip() for t in text.split(",")]
    if any(not p.endswith(".py") or p == ".py" for p in paths):
        raise ValueError()
    for p in paths:
        if not os.path.isfile(p):
            raise ValueError(f"no such file {p} (a path relative to the current directory, or absolute)")
    return tuple(dict.fromkeys(os.path.abspath(p) for p in paths))


_BOOLEAN = "a boolean: 1, true, yes, on or 0, false, no, off (any case)"
_POSITIVE = "a positive integer"


def _choice_setting(name, names, default, description):
    return Setting(name, _choice(*names), "one of " + ", ".join(names), default, description,
                   choices=tuple(names), plain_choice=True)


_REGISTRY = (
    Setting("REFIMPL_BACKEND", _backend, "one of numpy, cupy, strict", "numpy",
            "array module of the run: numpy (host), cupy (CUDA device) or strict (host memory "
            "behaving like a device array: refuses and counts what would synchronise; for CI)",
            choices=("numpy", "cupy", "strict")),
    Setting("REFIMPL_TF32", _boolean, _BOOLEAN, False,
            "let float32 matrix products on a GPU round to TF32 (10 mantissa bits; faster on tensor "
            "cores): a speed/precision trade, refused by check-layer, the oracle and float64 runs "
            "(refimpl/precision.py; CUPY_TF32 set in the environment counts as asking)"),
    Setting("REFIMPL_CUDA_AWARE", _boolean, _BOOLEAN, False,
            "hand device buffers to MPI directly (MPI built with CUDA support) instead of "
            "staging them through host memory"),
    _choice_setting("REFIMPL_CONV_ALGORITHM", ("auto", "im2col", "winograd", "reference"), "auto",
                    "conv algorithm of every conv layer: auto (Winograd where it pays), im2col "
                    "(the tiled im2col + GEMM everywhere), winograd, or reference (the plain math of "
                    "refimpl/functional/conv3d.py: pad, one slice per tap, one GEMM)"),
    _choice_setting("REFIMPL_CONV_SCHEDULE", ("auto", "host", "device"), "auto",
                    "how im2col convs are scheduled: auto (by where the arrays live), host "
                    "(cache-sized tiles on worker threads: CPUs) or device (a few large "
                    "operations: GPUs); the same sums, added in another order"),
    Setting("REFIMPL_CUDA_KERNELS", _boolean, _BOOLEAN, True,
            "on a GPU, run pooling, batch, group and instance norm, dropout and the losses as refimpl's own CUDA kernels "
            "(one per pass; refimpl/kernels/_cuda.py); 0: the reference's array operations instead"),
    Setting("REFIMPL_THREADS", _positive_int, _POSITIVE, None,
            "worker threads for the memory-bound passes of convs, pooling, batch norm and "
            "activations (default: the BLAS threads)"),
    _choice_setting("REFIMPL_ALLOCATOR", ("retain", "system"), "retain",
                    "retain: glibc's malloc keeps freed memory for reuse; system: malloc as is"),
    Setting("REFIMPL_KINDS", _python_files, "a comma-separated list of Python files (FILE.py)", (),
            "layer kinds of your own: every refimpl command first runs these files, each of which "
            "registers one or more kinds (refimpl.layers.register; docs/contributing.md, 'Adding a layer')"),
    Setting("REFIMPL_DEBUG", _boolean, _BOOLEAN, False,
            "show Python tracebacks on failures (default: one-line errors)"),
    Setting("REFIMPL_EXAMPLES", _positive_int, _POSITIVE, 25,
            "tests: hypothesis examples per property test", test_only=True),
    Setting("REFIMPL_MPI_EXAMPLES", _positive_int, _POSITIVE, 25,
            "tests: hypothesis examples per property test run under mpiexec", test_only=True),
    Setting("REFIMPL_MPI_TIMEOUT", _positive_int, _POSITIVE, 900,
            "tests: seconds before an mpiexec test run counts as hung", test_only=True),
)

#: Every ``REFIMPL_*`` variable refimpl (or its test suite) reads, by name.
SETTINGS: dict[str, Setting] = {s.name: s for s in _REGISTRY}


def parse_setting(name: str, text: str):
    """``text`` as the value of the variable ``name`` (empty: the default); ValueError of one
    line naming the variable, the value and the allowed values."""
    setting = SETTINGS[name]
    stripped = str(text).strip()
    if not stripped:
        return setting.default
    try:
        return setting.parse(stripped)
    except ValueError as err:
        reason = str(err)
        if reason:
            raise ValueError(f"{name}={text!r} cannot be used: {reason}") from None
        raise ValueError(f"{name} must be {setting.allowed}, got {text!r} "
                         f"({setting.description})") from None


def env_setting(name: str, environ=None):
    """The validated value of the variable ``name`` (its default when unset or empty)."""
    environ = os.environ if environ is None else environ
    text = environ.get(name)
    setting = SETTINGS[name]
    if text is None:
        return setting.default
    if setting.plain_choice and text in setting.choices:   # itself, without a call (read per conv call)
        return text
    return parse_setting(name, text)


def is_set(name: str, environ=None) -> bool:
    """Whether ``name`` is given a value (set and not empty) in the environment."""
    if name not in SETTINGS:
        raise KeyError(f"{name} is not a registered refimpl setting")
    environ = os.environ if environ is None else environ
    return bool(environ.get(name, "").strip())


def check_environment(environ=os.environ) -> dict:
    """Validate every ``REFIMPL_*`` variable in ``environ``: a registered one must parse, an
    unknown one is refused with the closest known name (a typo must not pass silently).
    Returns {name: value} of the registered variables (defaults for the unset ones);
    ValueError of one line on the first problem, in the order of the names."""
    values = {name: setting.default for name, setting in SETTINGS.items()}
    for name in sorted(n for n in environ if n.startswith(PREFIX)):
        if name not in SETTINGS:
            close = difflib.get_close_matches(name, list(SETTINGS), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ValueError(f"unknown environment variable {name}={environ[name]!r}: {hint}"
                             f"refimpl reads {', '.join(SETTINGS)}")
        values[name] = parse_setting(name, environ[name])
    return values


__all__ = ["Setting", "SETTINGS", "PREFIX", "parse_setting", "env_setting", "is_set",
           "check_environment", "cupy_unavailable"]
