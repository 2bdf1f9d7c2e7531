"""The package's import graph has no cycle: module A imports B (at the top or inside a function,
``from . import b`` included) and B never imports A, directly or through others, so each
module can be read after the ones it uses."""
from __future__ import annotations

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[2] / "clover_gguf"


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_edges(root: pathlib.Path = PKG) -> dict[str, set[str]]:
    """Module -> the package modules it imports (``clover_gguf.x.y`` names)."""
    files = {module_name(p): p for p in root.rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import name`: the submodule pkg.name when there is one, else pkg
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for t in targets:
                while t and t not in files:  # clover_gguf.convert.convert.main -> its module
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    edges[mod].add(t)
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_find_cycle_finds_a_cycle_and_accepts_a_dag():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_import_edges_resolve_relative_and_function_level_imports(tmp_path):
    pkg = tmp_path / "clover_gguf"
    (pkg / "cli").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text("def f():\n    from . import placement\n")
    (pkg / "placement.py").write_text("from .model import Model\n")
    (pkg / "cli" / "__init__.py").write_text("from . import run\n")
    (pkg / "cli" / "run.py").write_text("from .. import model\nfrom ..placement import fit\n")
    global PKG
    saved, PKG = PKG, pkg
    try:
        edges = import_edges(pkg)
    finally:
        PKG = saved
    assert edges["clover_gguf.model"] == {"clover_gguf.placement"}
    assert edges["clover_gguf.cli"] == {"clover_gguf.cli.run"}
    assert edges["clover_gguf.cli.run"] == {"clover_gguf.model", "clover_gguf.placement"}
    assert find_cycle(edges) == ["clover_gguf.model", "clover_gguf.placement", "clover_gguf.model"]


def test_package_imports_have_no_cycle():
    edges = import_edges()
    assert "clover_gguf.model" in edges and edges["clover_gguf.cli.run"]
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
