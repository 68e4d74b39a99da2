"""The shape of the tree: math, speed and messages apart, and no circle between its parts.

Imports are read from the source (module level and inside functions alike), grouped by the
top-level unit of ``refimpl`` they live in (``functional``, ``kernels``, ``oracle``,
``failstop``, ...).  The rules:

- no two units import each other, directly or through others (a circle means neither can
  be read, tested or replaced without the other);
- ``kernels`` never imports ``functional``: the fast routes serve the reference, never the
  other way round (``functional`` calls them through one dispatch point per op);
- ``commands`` (the CLI) is imported by nothing but ``cli``: the library never reaches up
  into argument parsing (the oracle once did, for its check harness);
- ``failstop`` is the supervision runtime (agreement, fail-stop, the command wrapper), at most
  ``FAILSTOP_MAX_LINES`` lines; the math, the layers, the data and the messages (``nn``,
  ``data``, ``layers``, ``parallel``) never import it: they mark their phases through
  ``progress`` and write files through ``atomic``;
- no module imports a private module (``_name``) of another package: what is shared across
  packages has a public name (``functional.args``, ``refimpl.kernels.blas_held_single``);
  within its own package (and the packages below it) a private module is fine.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "refimpl"


FAILSTOP_MAX_LINES = 400
#: the packages that never import the supervision runtime
BELOW_FAILSTOP = ("nn", "data", "layers", "parallel")


def modules(root=ROOT):
    """(path, module, package) of every module under ``root`` (a copy of refimpl/ in the tests
    of these rules)."""
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        package = module if rel.name == "__init__" else module.rsplit(".", 1)[0]
        yield path, module, package


def imports(path, package):
    """(line, dotted name) for every import in ``path``, module level and inside functions alike,
    relative imports resolved: ``from .a import b`` gives ``pkg.a`` and ``pkg.a.b`` (``b`` may
    be a module or a name in it)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if node.module:
                yield node.lineno, target
            for alias in node.names:
                yield node.lineno, f"{target}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name


def is_module(name, root=ROOT) -> bool:
    """Whether dotted ``name`` (refimpl.x.y) is a module or package of the tree under ``root``."""
    path = root.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def unit_imports() -> dict:
    """{unit: {units it imports}} over every module of refimpl/."""
    edges = {}
    for path, module, package in modules():
        unit = module.split(".")[1] if "." in module else "(root)"
        for _, name in imports(path, package):
            parts = name.split(".")
            if parts[0] == "refimpl" and len(parts) > 1 and parts[1] != unit and is_module(".".join(parts[:2])):
                edges.setdefault(unit, set()).add(parts[1])
    return edges


def failstop_importers(root=ROOT) -> list:
    """'path:line' of every import of the supervision runtime from ``BELOW_FAILSTOP``."""
    found = []
    for path, module, package in modules(root):
        if module.split(".")[1:2] and module.split(".")[1] in BELOW_FAILSTOP:
            found += [f"{path.relative_to(root.parent)}:{line}" for line, name in imports(path, package)
                      if name == "refimpl.failstop" or name.startswith("refimpl.failstop.")]
    return sorted(set(found))


def private_imports(root=ROOT) -> list:
    """'path:line imports name' for every import of another package's private module."""
    found = []
    for path, module, package in modules(root):
        for line, name in imports(path, package):
            parts = name.split(".")
            for i in range(1, len(parts)):
                if not is_module(".".join(parts[:i + 1]), root):
                    break                                # a name inside a module: not a module
                if parts[i].startswith("_") and not parts[i].startswith("__"):
                    owner = ".".join(parts[:i])
                    if package != owner and not package.startswith(owner + "."):
                        found.append(f"{path.relative_to(root.parent)}:{line} imports {'.'.join(parts[:i + 1])}")
                    break
    return sorted(set(found))


def reachable(edges, start):
    seen, todo = set(), [start]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_no_circle_between_the_parts_of_the_tree():
    edges = unit_imports()
    circles = sorted((a, b) for a in edges for b in edges[a] if a in reachable(edges, b))
    assert not circles, f"units that reach each other through imports: {circles}"


def test_the_kernels_serve_the_reference_and_nothing_reaches_into_the_cli():
    edges = unit_imports()
    assert "functional" not in edges.get("kernels", set())
    assert "functional" in edges and "kernels" in edges["functional"]       # the dispatch points
    # (cli loads each command module by name, importlib.import_module: no import statement)
    assert not [u for u, targets in edges.items() if "commands" in targets and u != "cli"]


def test_failstop_is_the_supervision_runtime_only():
    lines = len((ROOT / "failstop.py").read_text().splitlines())
    assert lines <= FAILSTOP_MAX_LINES, (
        f"refimpl/failstop.py has {lines} lines (at most {FAILSTOP_MAX_LINES}): give a piece its own module, "
        "as progress, atomic, errors, watchdog and signals have theirs")
    found = failstop_importers()
    assert not found, ("these modules import the supervision runtime; mark phases with refimpl.progress, write "
                       "with refimpl.atomic, raise refimpl.errors' kinds:\n" + "\n".join(found))


def test_no_module_imports_another_packages_private_module():
    found = private_imports()
    assert not found, ("private modules imported from outside their package; give what is shared a public "
                       "name:\n" + "\n".join(found))


def test_the_rules_find_what_they_forbid(tmp_path):
    """The checks above fail on the shapes they forbid (the tree had each before issue 40)."""
    root = tmp_path / "refimpl"
    for pkg in ("nn", "data", "functional", "kernels", "parallel", "models"):
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "failstop.py").write_text("def phase(what):\n    pass\n")
    (root / "functional" / "_args.py").write_text("def triple(v):\n    return v\n")
    (root / "functional" / "conv.py").write_text("from ._args import triple\n")
    (root / "kernels" / "_threads.py").write_text("def blas_held_single():\n    pass\n")
    (root / "kernels" / "_tiles.py").write_text("from . import _threads\n")
    (root / "nn" / "module.py").write_text("from ..failstop import phase\n")
    (root / "data" / "layout.py").write_text("def f():\n    from refimpl import failstop\n")
    (root / "parallel" / "partition.py").write_text("from ..functional._args import triple\n")
    (root / "models" / "cosmoflow.py").write_text("from ..kernels import _threads\n")
    (root / "models" / "unet3d.py").write_text("import refimpl.kernels._threads\n")
    (root / "models" / "_layers.py").write_text("from .cosmoflow import _threads\n")    # a name: allowed
    assert failstop_importers(root) == ["refimpl/data/layout.py:2", "refimpl/nn/module.py:1"]
    assert private_imports(root) == ["refimpl/models/cosmoflow.py:1 imports refimpl.kernels._threads",
                                     "refimpl/models/unet3d.py:1 imports refimpl.kernels._threads",
                                     "refimpl/parallel/partition.py:1 imports refimpl.functional._args"]
