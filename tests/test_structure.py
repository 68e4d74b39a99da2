"""The shape of the tree: math, speed and messages apart, and no circle between its parts.

Imports are read from the source (module level and inside functions alike), grouped by the
top-level unit of ``refimpl`` they live in (``functional``, ``kernels``, ``oracle``,
``failstop``, ...).  The rules:

- no two units import each other, directly or through others (a circle means neither can
  be read, tested or replaced without the other);
- ``kernels`` never imports ``functional``: the fast routes serve the reference, never the
  other way round (``functional`` calls them through one dispatch point per op);
- ``commands`` (the CLI) is imported by nothing but ``cli``: the library never reaches up
  into argument parsing (the oracle once did, for its check harness).
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "refimpl"


def unit_imports() -> dict:
    """{unit: {units it imports}} over every module of refimpl/."""
    edges = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        package = module if rel.name == "__init__" else module.rsplit(".", 1)[0]
        unit = module.split(".")[1] if "." in module else "(root)"
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                names = [target] if node.module or not node.level else [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "refimpl" and len(parts) > 1 and parts[1] != unit:
                    edges.setdefault(unit, set()).add(parts[1])
    return edges


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
