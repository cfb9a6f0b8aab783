"""The package's structure, checked by reading its imports: no import circle between its modules,
every import points down the layers of ``docs/architecture.md``, and the library never imports
the benchmark harness (the repository's top-level ``bench/``, which is not in the wheel).

Every ``import`` and ``from ... import`` counts, function-local ones included: an import moved
into a function still ties the two modules together."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import moeflow

pytestmark = pytest.mark.unit

PACKAGE = Path(moeflow.__file__).parent

# docs/architecture.md's layers, bottom up: a module may import its own layer and those below
LAYERS: tuple[tuple[str, ...], ...] = (
    ("kernels", "types", "checks"),
    ("config",),
    ("routing", "experts"),
    ("dispatch", "storage"),
    ("layer",),
    ("parallel", "integrations"),
    ("testing", "__init__"),
    ("checkpoint", "compat", "bench"),
    ("models",),
    ("train", "convert"),
    ("serve",),
    ("cli",),
    ("__main__",),
)


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The moeflow modules ``path`` imports (``from moeflow.a import b`` names ``moeflow.a.b``
    where that is a module, else ``moeflow.a``)."""
    found: set[str] = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] in ("moeflow", "bench"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, *([base] if base else [])])
            if base.split(".")[0] not in ("moeflow", "bench"):
                continue
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: {i for i in imports_of(p, known) if i in known and i != m} for m, p in mods.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module}: its package {top!r} is in no layer of LAYERS (docs/architecture.md)")


def test_no_import_circle():
    assert circles(import_graph()) == []


def test_imports_point_down_the_layers():
    up = [f"{m} (layer {layer_of(m)}) imports {i} (layer {layer_of(i)})"
          for m, targets in import_graph().items() for i in sorted(targets) if layer_of(i) > layer_of(m)]
    assert up == [], "\n".join(up)


def test_the_library_never_imports_the_harness():
    hits = [f"{module_name(p)} imports {i}" for p in sorted(PACKAGE.rglob("*.py"))
            for i in sorted(imports_of(p, set())) if i.split(".")[0] == "bench"]
    assert hits == [], "\n".join(hits)


def test_the_checkers_see_what_they_look_for():
    graph = {"moeflow.a": {"moeflow.b"}, "moeflow.b": {"moeflow.c"}, "moeflow.c": {"moeflow.a"}, "moeflow.d": set()}
    assert circles(graph) == [["moeflow.a", "moeflow.b", "moeflow.c"]]
    assert layer_of("moeflow.kernels.x") == 0 and layer_of("moeflow.cli.main") == layer_of("moeflow.cli")
    assert layer_of("moeflow") == layer_of("moeflow.testing")
