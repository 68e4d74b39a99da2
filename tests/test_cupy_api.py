"""Every array-module call refimpl makes through ``xp`` must exist in CuPy.

No GPU is lent to this project, but ``import cupy`` works without one; this
test scans refimpl's source for ``xp.<name>[.<name>...]`` and checks each path
resolves on the cupy module, so the GPU path cannot drift into NumPy-only calls
(``numpy.add.at`` has no CuPy twin, for example: use backend.scatter_add).
"""
import re
from pathlib import Path

import pytest

cupy = pytest.importorskip("cupy", reason="cupy is not installed: pip install 'refimpl[gpu]'")

SRC = Path(__file__).resolve().parent.parent / "refimpl"
XP_CALL = re.compile(r"\bxp\.([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)")


def xp_paths():
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for m in XP_CALL.finditer(code):
                found.setdefault(m.group(1), f"{path.relative_to(SRC.parent)}:{lineno}")
    return found


def resolve(module, dotted):
    obj = module
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def test_scan_finds_calls():
    assert len(xp_paths()) >= 5, "the scan should find refimpl's xp calls"


def test_every_xp_call_exists_in_cupy():
    missing = []
    for dotted, where in xp_paths().items():
        # attribute access on an array method chain (xp.foo(...).bar) is cut by the regex at '('
        try:
            resolve(cupy, dotted)
        except AttributeError:
            missing.append(f"xp.{dotted} ({where})")
    assert not missing, "not in CuPy: " + ", ".join(missing)
