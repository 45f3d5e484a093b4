"""The commit record of a trace: which part files hold its rows.

A part file is only data; a part is *committed* once the manifest of the process
that wrote it names it. Each writing process (a rank) owns one manifest,
`manifest.json` for rank 0 and `manifest-r<r>.json` for rank r, replaced
atomically (write, then rename) once per flush. A flush writes every table's new
part first and commits them all with one manifest write, so a reader that honours
the manifests sees, for every table, exactly the rows of the committed flushes:
a kill between two part writes leaves files no manifest names, and they are ignored.

Compaction commits the same way: the merged part is written, then one manifest
write swaps it in for the parts it replaces, and only then are those files removed.
A kill at any moment leaves either the old parts or the new one committed, never
both and never neither.

Traces from before manifests existed (meta.json without `store`) have none: every
`part-*.parquet` counts as committed (`legacy_parts`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracing.durable import fsync_dir, replace_durably

STORE = "manifest-v1"  # meta.json["store"] of traces whose parts are committed by manifests
MANIFEST_FORMAT = 1
SEALED = -1  # level of a part that reached the compaction target: never merged again

_MANIFEST_NAME = re.compile(r"manifest(?:-r(\d+))?\.json")
_PART_SEQ = re.compile(r"part-(?:r\d+-)?(\d+)\.parquet")


def part_prefix(rank: int) -> str:
    return "part-" if rank == 0 else f"part-r{rank}-"


def part_rank(name: str) -> int:
    """The rank that wrote a part, from its file name."""
    return int(name[len("part-r"):].split("-", 1)[0]) if name.startswith("part-r") else 0


class ManifestError(Exception):
    """A manifest that cannot be trusted. str(e) is one line."""


@dataclass(slots=True)
class PartEntry:
    file: str  # the part's file name inside its table folder
    rows: int
    nbytes: int  # in-memory (Arrow) size when written: bounds a compaction batch's memory
    level: int  # 0: one flush; k: merged k times; SEALED: at the compaction target
    row_groups: int = 1

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "rows": self.rows, "nbytes": self.nbytes, "level": self.level,
                "row_groups": self.row_groups}


@dataclass(slots=True)
class Manifest:
    rank: int
    epoch: int = 0  # commits so far
    next_seq: int = 0  # the next part number: names are never reused
    tables: dict[str, list[PartEntry]] = field(default_factory=dict)  # commit order

    def new_name(self) -> str:
        name = f"{part_prefix(self.rank)}{self.next_seq:06d}.parquet"
        self.next_seq += 1
        return name

    def to_json(self) -> dict[str, Any]:
        return {"format": MANIFEST_FORMAT, "rank": self.rank, "epoch": self.epoch, "next_seq": self.next_seq,
                "tables": {t: [e.to_json() for e in es] for t, es in self.tables.items()}}

    @classmethod
    def from_json(cls, obj: Any, where: str) -> Manifest:
        try:
            if obj.get("format") != MANIFEST_FORMAT:
                raise ManifestError(f"{where} has format {obj.get('format')!r}; this mstrace reads "
                                    f"{MANIFEST_FORMAT}")
            tables: dict[str, list[PartEntry]] = {}
            for t, es in obj["tables"].items():
                entries = [PartEntry(str(e["file"]), int(e["rows"]), int(e["nbytes"]), int(e["level"]),
                                     int(e.get("row_groups", 1))) for e in es]
                names = [e.file for e in entries]
                if len(set(names)) != len(names):
                    dup = next(n for n in names if names.count(n) > 1)
                    raise ManifestError(f"{where} lists {t}/{dup} twice")
                if any(not _PART_SEQ.fullmatch(n) for n in names):
                    bad = next(n for n in names if not _PART_SEQ.fullmatch(n))
                    raise ManifestError(f"{where} names {t}/{bad!r}, which is not a part file name")
                tables[str(t)] = entries
            return cls(int(obj["rank"]), int(obj["epoch"]), int(obj["next_seq"]), tables)
        except ManifestError:
            raise
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"corrupt {where}: {type(e).__name__}: {e}") from None


def manifest_path(root: Path, rank: int) -> Path:
    return root / ("manifest.json" if rank == 0 else f"manifest-r{rank}.json")


def write_manifest(root: Path, m: Manifest) -> None:
    """The commit point: an atomic replace, so a reader sees the old or the new record whole;
    its data fsynced before the rename and the folder after it, so a crash of the machine
    keeps the old record or the new (tracing/durable.py)."""
    path = manifest_path(root, m.rank)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(m.to_json(), separators=(",", ":")))
    replace_durably(tmp, path)
    fsync_dir(root)


def read_manifests(root: Path) -> list[Manifest]:
    """Every rank's manifest, rank order."""
    out = []
    for p in sorted(root.glob("manifest*.json")):
        if not _MANIFEST_NAME.fullmatch(p.name):
            continue
        try:
            obj = json.loads(p.read_text())
        except FileNotFoundError:
            continue  # listed by the glob, gone since: nothing removes manifests, so a damaged trace
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ManifestError(f"corrupt {p.name}: {e}") from None
        if not isinstance(obj, dict):
            raise ManifestError(f"corrupt {p.name}: not an object")
        m = Manifest.from_json(obj, p.name)
        expect = int(_MANIFEST_NAME.fullmatch(p.name).group(1) or 0)  # type: ignore[union-attr]
        if m.rank != expect:
            raise ManifestError(f"{p.name} says it is rank {m.rank}'s")
        out.append(m)
    return sorted(out, key=lambda m: m.rank)


def legacy_parts(root: Path, table: str) -> list[str]:
    """A trace without manifests: every whole part (temporary files excluded) counts."""
    return sorted(p.name for p in (root / table).glob("part-*.parquet") if _PART_SEQ.fullmatch(p.name))


def max_seq_on_disk(root: Path, rank: int, tables: list[str]) -> int:
    """The highest part number rank `rank` has used in any table (-1: none): a
    new name must not collide with an uncommitted leftover either."""
    prefix = part_prefix(rank)
    best = -1
    for t in tables:
        d = root / t
        if not d.is_dir():
            continue
        for p in d.iterdir():
            name = p.name.lstrip(".").removesuffix(".tmp")
            m = _PART_SEQ.fullmatch(name)
            if m and name.startswith(prefix) and (rank != 0 or not name.startswith("part-r")):
                best = max(best, int(m.group(1)))
    return best
