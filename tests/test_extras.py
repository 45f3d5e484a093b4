"""viewer/extras.py's map against the installed package's own metadata (pyproject's extras), so the
one-line "install mstrace[X]" names the extra that really provides the missing module."""

from __future__ import annotations

import functools
import importlib.metadata as md
import importlib.util
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from viewer.extras import _LATE, MODULES, for_module, message, missing


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _direct(extra: str) -> list[Requirement]:
    """Requirements of mstrace[extra], with mstrace[a,b] inside it expanded."""
    out: list[Requirement] = []
    for r in map(Requirement, md.requires("mstrace") or []):
        if r.marker is None or not r.marker.evaluate({"extra": extra}):
            continue
        if _norm(r.name) == "mstrace":
            out += [x for e in sorted(r.extras) for x in _direct(e)]
        else:
            out.append(r)
    return out


@functools.cache
def _installed() -> dict[str, list[str]]:
    return {_norm(d.metadata["Name"]): d.requires or [] for d in md.distributions()}


def _closure(extra: str) -> set[str]:
    """Every distribution mstrace[extra] installs, transitively (markers evaluated here)."""
    seen: set[str] = set()
    todo = [r.name for r in _direct(extra)]
    while todo:
        name = _norm(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        reqs = _installed().get(name, [])  # none: a marker-excluded platform package (uvloop on Windows)
        todo += [r.name for r in map(Requirement, reqs) if r.marker is None or r.marker.evaluate({"extra": ""})]
    return seen


@functools.cache
def _owners() -> dict[str, str]:
    """Each installed file's path -> its distribution."""
    out: dict[str, str] = {}
    for d in md.distributions():
        name = _norm(d.metadata["Name"])
        out |= {str(d.locate_file(f)): name for f in d.files or ()}
    return out


def _provider(module: str) -> set[str]:
    """The distributions that hold `module` (a namespace package's: any file under its folders)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None, module
    if spec.origin:
        return {_owners()[spec.origin]}
    dirs = tuple(str(Path(d)) + "/" for d in spec.submodule_search_locations or ())
    return {dist for path, dist in _owners().items() if path.startswith(dirs)}


@pytest.mark.parametrize("extra", sorted(MODULES))
def test_each_module_is_installed_by_its_extra(extra: str) -> None:
    closure = _closure(extra)
    for module in MODULES[extra]:
        assert _provider(module) & closure, f"{module} is not installed by mstrace[{extra}] ({sorted(closure)})"


def test_every_package_of_an_extra_has_a_module_in_the_map() -> None:
    """A package added to an extra without a module here would fail with a traceback, not the line."""
    modules = [m for ms in MODULES.values() for m in ms] + list(_LATE)
    provided = set().union(*(_provider(m) for m in modules))
    extras = md.metadata("mstrace").get_all("Provides-Extra") or []
    for extra in extras:
        if extra in ("test", "all"):
            continue
        for r in _direct(extra):
            if r.marker is not None and not r.marker.evaluate({"extra": extra}):
                continue
            name = _norm(r.name)
            if extra == "bench" and name != "aiohttp":
                continue  # bench/'s peers (transformers serve, lm-eval): scripts, not commands
            assert name in provided, f"mstrace[{extra}]'s {r.name} provides no module in viewer/extras.py"


def test_all_is_every_command_extra() -> None:
    assert {_norm(r.name) for r in _direct("all")} >= {_norm(r.name) for e in MODULES if e != "bench"
                                                       for r in _direct(e)}


def test_a_missing_module_names_its_extra() -> None:
    assert for_module("torch.cuda") == "engine"
    assert for_module("opentelemetry.exporter.otlp.proto.http.trace_exporter") == "otlp"
    assert for_module("opentelemetry.sdk.trace") == "engine"
    assert for_module("google.protobuf.message") == "engine"
    assert for_module("textual") == "tui"
    assert for_module("yaml") is None and for_module(None) is None
    assert missing(*MODULES) is None  # the suite's venv has them all
    assert message("mstrace run", "engine", "torch") == (
        "mstrace run needs torch, which is not installed: install mstrace[engine] (pip install 'mstrace[engine]')")
