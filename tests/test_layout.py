"""The source layout's rules, checked from the files themselves: no runtime import cycle
(lazy imports inside functions included; an import under `if TYPE_CHECKING:` is for
annotations only and never runs, so it may close a loop), no oversized module, and the
engine never reaching into the viewer."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.cli import REPO

PACKAGES = ("scheduler", "probes", "tracing", "importers", "viewer", "mstrace")
# about 600 lines (STYLE.md): a module is cut where its responsibility ends, and a cap
# near the size of the largest module only moved 20-line pieces out of the engine
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in sorted((REPO / pkg).rglob("*.py")):
            parts = list(p.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


def _annotation_only(tree: ast.AST) -> set[int]:
    """ids of the import statements under `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (
                (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
                or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")):
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def _imports(path: Path, name: str, known: dict[str, Path], runtime: bool = True) -> set[str]:
    """Every module of ours that `name` imports, wherever the import statement sits;
    `runtime`: leaving out the annotation-only ones."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    skip = _annotation_only(tree) if runtime else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_pkg else name.split(".")[:-1]
                up = here[:len(here) - node.level + 1] if node.level > 1 else here
                base = ".".join([*up, *([base] if base else [])])
            # `from a import b`: b is a module of a, or a name defined in a
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import a.b.c` of a package path: the deepest module we have
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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


def _graph(runtime: bool = True) -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(p, m, mods, runtime) for m, p in mods.items()}


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_annotation_only_imports_are_told_apart(tmp_path):
    """A loop closed only by an `if TYPE_CHECKING:` import is no runtime cycle; one closed by
    a lazy import inside a function is."""
    (tmp_path / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    import a\n")
    known = {"a": tmp_path / "a.py", "b": tmp_path / "b.py"}

    def graph(runtime: bool) -> dict[str, set[str]]:
        return {m: _imports(p, m, known, runtime) for m, p in known.items()}

    assert _cycles(graph(runtime=True)) == []
    assert _cycles(graph(runtime=False)) == [["a", "b"]]


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_engine_never_imports_the_viewer():
    bad = {m: sorted(d for d in deps if d.startswith("viewer"))
           for m, deps in _graph().items() if m.startswith("scheduler")}
    assert {m: d for m, d in bad.items() if d} == {}


def test_no_module_is_oversized():
    big = {str(p.relative_to(REPO)): n for p in _modules().values()
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert big == {}


def test_the_core_is_torch_free():
    """scheduler/core/ is the round's bookkeeping: it must import without torch."""
    import subprocess
    import sys

    mods = sorted(m for m in _modules() if m.startswith("scheduler.core."))
    code = f"import sys\nfor m in {mods!r}: __import__(m)\nprint('torch' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "False"


def test_every_trace_column_is_documented():
    """docs/trace-schema.md names every column of every table (tracing/schema.py)."""
    import re

    from tracing.schema import TABLES

    doc = (REPO / "docs" / "trace-schema.md").read_text()
    sections = dict(re.findall(r"^## (\w+) — .*?\n(.*?)(?=^## |\Z)", doc, flags=re.M | re.S))
    missing = {}
    for table, schema in TABLES.items():
        text = sections.get(table, "")
        words = set(re.findall(r"[a-z_0-9]+", text))
        gone = [c for c in schema.names if c not in words]
        if gone:
            missing[table] = gone
    assert missing == {}
