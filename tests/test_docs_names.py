"""Every `Class.method` and `package.module.name` the docs name exists in the code: a
renamed function leaves no doc pointing at nothing (docs/engine.md once named
`Executor.forward` long after it was gone)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support.cli import REPO

PACKAGES = ("scheduler", "probes", "tracing", "importers", "viewer", "mstrace")
CLASS_ATTR = re.compile(r"`([A-Z][A-Za-z0-9]+)\.([a-z_][a-z_0-9]*)(?:\(\))?`")
DOTTED = re.compile(r"`((?:" + "|".join(PACKAGES) + r")(?:\.[a-z_][a-z_0-9]*)+)(?:\(\))?`")


def _docs() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _classes() -> dict[str, set[str]]:
    """Every class in the packages, with the names its body defines (methods, fields)."""
    out: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        for p in (REPO / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.ClassDef):
                    names = out.setdefault(node.name, set())
                    for item in node.body:
                        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                            names.add(item.name)
                        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                            names.add(item.target.id)
                        elif isinstance(item, ast.Assign):
                            names.update(t.id for t in item.targets if isinstance(t, ast.Name))
    return out


def _defines(module: Path, name: str) -> bool:
    tree = ast.parse(module.read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name:
            return True
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            return True  # a package's re-export is its public name (mstrace/__init__.py)
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
    return False


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    path = REPO.joinpath(*parts)
    if path.is_dir() or path.with_suffix(".py").exists():
        return True  # a package or a module
    module = REPO.joinpath(*parts[:-1]).with_suffix(".py")
    if REPO.joinpath(*parts[:-1]).is_dir():
        module = REPO.joinpath(*parts[:-1], "__init__.py")
    return module.exists() and _defines(module, parts[-1])


def test_every_class_member_the_docs_name_exists() -> None:
    classes = _classes()
    missing = [f"{d.relative_to(REPO)}: {c}.{a}" for d in _docs() for c, a in CLASS_ATTR.findall(d.read_text())
               if c in classes and a not in classes[c]]
    unknown = sorted({f"{c}" for d in _docs() for c, _ in CLASS_ATTR.findall(d.read_text())
                      if c not in classes and c[0].isupper() and not c.isupper()})
    assert missing == []
    assert unknown == []  # a class the docs name that the code does not define at all


def test_every_module_path_the_docs_name_exists() -> None:
    missing = [f"{d.relative_to(REPO)}: {m}" for d in _docs() for m in DOTTED.findall(d.read_text())
               if not _resolves(m)]
    assert missing == []


def test_every_source_file_the_docs_name_exists() -> None:
    """`core/kv_fence.py` from the repository or a package's root; a bare `backend.py`
    (named inside its section) anywhere in the tree."""
    roots = [REPO, *(REPO / p for p in (*PACKAGES, "bench", "tests"))]
    names = {p.name for r in roots[1:] for p in r.rglob("*.py")}
    missing = [f"{d.relative_to(REPO)}: {f}" for d in _docs() for f in PY_PATH.findall(d.read_text())
               if not (any((r / f).exists() for r in roots) if "/" in f else f in names)]
    assert missing == []


PY_PATH = re.compile(r"`([A-Za-z0-9_./-]+\.py)(?::[0-9-]+)?`")
