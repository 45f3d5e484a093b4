"""docs/json.md names exactly the keys `report`, `diff`, `stalls` and `leaks` print with --json,
and exactly the fields of their result dataclasses (the JSON is derived from them)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import REPO, mstrace
from tests.support.tiny_runs import DEADLOCK, TinyRuns
from viewer.analysis.diff import DiffResult
from viewer.analysis.leaks import LeaksResult
from viewer.analysis.records import KEY, OPAQUE, json_paths
from viewer.analysis.report import ReportResult
from viewer.analysis.stalls import StallsResult
from viewer.analysis.whatif import WhatIfResult

DOC = REPO / "docs" / "json.md"


def documented() -> dict[str, dict[str, bool]]:
    """{command: {key path: optional}}; `status` and `trace` belong to every command on one
    trace (diff has each side's inside `a` and `b`)."""
    text = DOC.read_text()
    out: dict[str, dict[str, bool]] = {}
    for name, body in re.findall(r"^## (.+?)\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S):
        keys = {k: "*only" in meaning for k, meaning in re.findall(r"^\| `([^`]+)` \|[^|]*\|(.*)\|$", body, flags=re.M)}
        cmd = name.split()[0].strip("`")
        out[cmd] = keys
    common = out.pop("Common:")
    return {cmd: keys if cmd == "diff" else {**common, **keys} for cmd, keys in out.items()}


def produced(obj: Any, maps: list[str], path: str = "") -> set[str]:
    """The key paths of a JSON object, with `[]` for list elements and the documented
    `<name>` placeholder for the keys of a map."""
    for m in maps:  # a map: its keys are data, not names
        prefix = m.rsplit(".", 1)[0]
        if path == prefix:
            return {m}
    if isinstance(obj, dict):
        out: set[str] = set()
        for k, v in obj.items():
            out |= produced(v, maps, f"{path}.{k}" if path else k)
        return out or {path}
    if isinstance(obj, list) and obj and all(isinstance(x, dict) for x in obj):
        return set().union(*(produced(x, maps, path + "[]") for x in obj))
    return {path}


@pytest.fixture(scope="module")
def traces(tiny_runs: TinyRuns, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    # the session's leak run (test_stalls, test_export) and deadlock run (test_stalls)
    leak = tiny_runs("--requests", "16", "--inject", "leak", "--no-gc", "--snapshot-every", "4", "-q").out
    dl = tiny_runs(*DEADLOCK, "--cpu-device", "process", "-q", exit_code=3, timeout=120).out
    imported = tmp_path_factory.mktemp("json") / "imported"
    p = mstrace("import", str(REPO / "tests" / "data" / "kineto" / "hta_nccl_data.json.gz"), "--out", str(imported))
    assert p.returncode == 0, p.stderr
    return {"leak": leak, "deadlock": dl, "imported": imported}


@pytest.mark.parametrize("cmd,trace", [("report", "leak"), ("leaks", "leak"), ("stalls", "deadlock"),
                                       ("diff", "leak"), ("report", "imported"), ("whatif", "leak")])
def test_documented_keys_are_exactly_the_printed_ones(traces, cmd, trace):
    docs = documented()[cmd]
    maps = [k for k in docs if "<" in k]
    args = [str(traces["deadlock"])] if cmd == "diff" else []  # diff: the leak run against the stalled one
    p = mstrace(cmd, str(traces[trace]), *args, "--json")
    assert p.returncode in (0, 1), p.stderr  # 1: leaks and stalls found what they look for
    got = produced(json.loads(p.stdout), maps)

    def under(child: str, parent: str) -> bool:  # an empty list or a null object stands for its keys
        return child == parent or child.startswith(parent + ".") or child.startswith(parent + "[]")

    undocumented = sorted(g for g in got if not any(under(k, g) for k in docs))
    assert undocumented == [], f"{cmd} --json prints keys docs/json.md does not describe"
    # a key under an optional one (`imported.format` under `imported`) is as optional as it
    optional = {k for k, opt in docs.items() if opt}
    missing = sorted(k for k in docs if not any(under(k, o) for o in optional) and not any(under(k, g) for g in got))
    assert missing == [], f"docs/json.md describes {cmd} keys it does not print"


RESULTS: dict[str, type] = {"report": ReportResult, "diff": DiffResult, "stalls": StallsResult, "leaks": LeaksResult,
                            "whatif": WhatIfResult}


def _segments(path: str) -> list[str]:
    return [KEY if s.startswith("<") else s for s in path.split(".")]


def _covers(doc: list[str], field: list[str]) -> bool:
    """The doc's key names the field's path, or an object holding it (`per_rank.<rank>`), or a
    key inside a field whose shape the type leaves open (a dict of Any: `stalls[].kv.free`)."""
    def prefix(short: list[str], long: list[str]) -> bool:
        return len(short) <= len(long) and all(a == b or KEY in (a, b) for a, b in zip(short, long, strict=False))

    return prefix(doc, field) or (field[-1] == OPAQUE and prefix(field[:-1], doc))


def undocumented_and_stale(cls: type, cmd: str) -> tuple[list[str], list[str]]:
    docs = [_segments(k) for k in documented()[cmd]]
    fields = [_segments(p) for p in json_paths(cls)]
    undocumented = sorted(".".join(f) for f in fields if not any(_covers(d, f) for d in docs))
    stale = sorted(".".join(d) for d in docs if not any(_covers(d, f) for f in fields))
    return undocumented, stale


@pytest.mark.parametrize("cmd", sorted(RESULTS))
def test_documented_keys_are_exactly_the_result_fields(cmd):
    """No trace needed: a field added to a result without its line in docs/json.md fails here,
    whichever traces the test above happens to make."""
    undocumented, stale = undocumented_and_stale(RESULTS[cmd], cmd)
    assert undocumented == [], f"{cmd}: fields of {RESULTS[cmd].__name__} docs/json.md does not describe"
    assert stale == [], f"docs/json.md describes {cmd} keys {RESULTS[cmd].__name__} has no field for"


def test_a_field_added_without_a_doc_is_caught():
    @dataclass(slots=True)
    class Grown(LeaksResult):
        oops: int = 0

    assert undocumented_and_stale(Grown, "leaks") == (["oops"], [])
