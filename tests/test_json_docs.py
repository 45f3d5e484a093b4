"""docs/json.md names exactly the keys `report`, `diff`, `stalls` and `leaks` print with --json."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import REPO, mstrace

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
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("json")
    leak, dl = root / "leak", root / "dl"
    p = mstrace("run", "--model", "tiny", "--requests", "8", "--inject", "leak", "--no-gc", "--snapshot-every", "5",
                "--out", str(leak), "-q")
    assert p.returncode == 0, p.stderr
    p = mstrace("run", "--model", "tiny", "--mode", "overlap", "--inject", "deadlock", "--wait-timeout", "2",
                "--out", str(dl), "-q", timeout=120)
    assert p.returncode == 3, p.stderr
    return {"leak": leak, "deadlock": dl}


@pytest.mark.parametrize("cmd,trace", [("report", "leak"), ("leaks", "leak"), ("stalls", "deadlock"),
                                       ("diff", "leak")])
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
    missing = sorted(k for k, optional in docs.items() if not optional and not any(under(k, g) for g in got))
    assert missing == [], f"docs/json.md describes {cmd} keys it does not print"
