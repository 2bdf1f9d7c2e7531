"""Layout rules of the native engine (native/), checked on the files on disk:

- the module graph has no cycle: a module is a path under native/ without its extension
  (model/attention.c and model/attention.h are one module); A -> B when a file of A has a quoted
  ``#include`` that resolves to a file of B (relative to the including file, then native/include,
  then native/);
- no file under native/ is longer than MAX_LINES lines."""
from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
NATIVE = ROOT / "native"
MAX_LINES = 900
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def native_files(native: pathlib.Path = NATIVE) -> list[pathlib.Path]:
    return sorted(p for p in native.rglob("*") if p.is_file())


def module_of(path: pathlib.Path, native: pathlib.Path) -> str:
    rel = path.relative_to(native).as_posix()
    return rel.rsplit(".", 1)[0] if "." in rel.rsplit("/", 1)[-1] else rel


def resolve(name: str, including: pathlib.Path, native: pathlib.Path) -> pathlib.Path | None:
    for base in (including.parent, native / "include", native):
        p = (base / name).resolve()
        if p.is_file() and native.resolve() in p.parents:
            return p
    return None


def module_graph(native: pathlib.Path = NATIVE) -> dict[str, set[str]]:
    """Module -> the modules its files include (quoted includes only; self-edges dropped)."""
    native = native.resolve()
    graph: dict[str, set[str]] = {}
    for f in native_files(native):
        if f.suffix not in (".c", ".h", ".cu", ".cuh", ".cpp"):
            continue
        a = module_of(f, native)
        graph.setdefault(a, set())
        for name in INCLUDE.findall(f.read_text(errors="replace")):
            p = resolve(name, f, native)
            if p is not None and (b := module_of(p, native)) != a:
                graph[a].add(b)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [m0, m1, ..., m0], or None (depth-first search, iterative)."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = {m: WHITE for m in graph}
    for start in sorted(graph):
        if color[start] != WHITE:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        color[start] = GREY
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                color[node] = BLACK
                stack.pop()
                path.pop()
                continue
            if color.get(nxt, WHITE) == GREY:
                return path[path.index(nxt):] + [nxt]
            if color.get(nxt, WHITE) == WHITE:
                color[nxt] = GREY
                graph.setdefault(nxt, set())
                stack.append((nxt, iter(sorted(graph[nxt]))))
                path.append(nxt)
    return None


def long_files(native: pathlib.Path = NATIVE, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    out = []
    for f in native_files(native):
        n = len(f.read_bytes().splitlines())
        if n > limit:
            out.append((f.relative_to(native).as_posix(), n))
    return out


def test_native_module_graph_is_acyclic():
    graph = module_graph()
    assert len(graph) > 20  # the walk saw the tree
    cycle = find_cycle(graph)
    assert cycle is None, "include cycle between modules: " + " -> ".join(cycle)


def test_no_native_file_over_the_line_limit():
    too_long = long_files()
    assert not too_long, f"files under native/ over {MAX_LINES} lines: {too_long}"


def test_the_checks_catch_a_cycle_and_a_long_file(tmp_path):
    """The checks on a small tree laid out as native/ was before the split: quants.c includes
    dot.h and dot.c includes quants.h (a cycle through includes resolved next to the file), and a
    file over the limit."""
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "clover.h").write_text("/* public */\n")
    (tmp_path / "quants.h").write_text('#include "clover.h"\n')
    (tmp_path / "quants.c").write_text('#include "quants.h"\n#include "dot.h"\n')
    (tmp_path / "dot.h").write_text("\n")
    (tmp_path / "dot.c").write_text('#include "dot.h"\n#include "quants.h"\n')
    (tmp_path / "model.c").write_text('#include "clover.h"\n' + "x;\n" * (MAX_LINES + 1))
    cycle = find_cycle(module_graph(tmp_path))
    assert cycle is not None and set(cycle) == {"quants", "dot"}
    assert long_files(tmp_path) == [("model.c", MAX_LINES + 2)]
    (tmp_path / "dot.c").write_text('#include "dot.h"\n')
    assert find_cycle(module_graph(tmp_path)) is None


def test_every_quoted_include_resolves():
    """Quoted includes name files of the tree (or the emulator's CUDA headers), so the graph
    above sees every edge."""
    native = NATIVE.resolve()
    missing = []
    for f in native_files(native):
        if f.suffix not in (".c", ".h", ".cu", ".cuh", ".cpp"):
            continue
        for name in INCLUDE.findall(f.read_text(errors="replace")):
            if resolve(name, f, native) is None:
                missing.append(f"{f.relative_to(native)}: {name}")
    assert not missing
