"""Bad traces, generated: every command either works or says what is wrong in one
line with exit 2; none prints a traceback, and none but `compact` changes a byte
of the trace (`compact` may only leave it readable)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.cli import cli
from tests.support.tiny_runs import TinyRuns
from tracing.schema import NEVER_NULL, TABLES

# Corruptions after which the trace is still what was committed: commands must
# succeed and show exactly the clean trace's result.
BENIGN = {"uncommitted_part", "duplicate_file", "stray_tmp"}
KINDS = ["truncate_part", "garbage_bytes", "drop_column", "mistype_column", "duplicate_in_manifest",
         "uncommitted_part", "duplicate_file", "stray_tmp", "garbage_meta", "missing_meta", "meta_not_object",
         "empty_table_folder", "missing_table_folder", "manifest_names_missing_part", "garbage_manifest",
         "missing_manifest", "manifest_rows_wrong", "manifest_not_object", "empty_part_file", "null_time"]
COMMANDS = ("report", "stalls", "leaks")


@pytest.fixture(scope="module")
def clean(tiny_runs: TinyRuns) -> Path:
    """Read only: each example corrupts a copy of it."""
    return tiny_runs("--requests", "6", "--output-len", "4-12", "--snapshot-every", "3", "--cpu-device", "thread",
                     "-q").out


@pytest.fixture(scope="module")
def clean_out(clean: Path) -> dict[str, str]:
    """Each command's --json on the clean trace: what a benign corruption must reproduce."""
    out = {}
    for c in COMMANDS:
        code, stdout, err = cli(c, str(clean), "--json")
        assert code == 0, err
        out[c] = stdout
    return out


def digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.name.endswith(".lock"):
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def committed(root: Path) -> list[tuple[str, dict]]:
    m = json.loads((root / "manifest.json").read_text())
    return [(t, e) for t, es in m["tables"].items() for e in es]


def corrupt(root: Path, kind: str, data: st.DataObject) -> None:
    parts = committed(root)
    if kind == "null_time":  # a row with no time: what no writer leaves (schema.NEVER_NULL)
        parts = [(t, e) for t, e in parts if t in NEVER_NULL]
    table, entry = data.draw(st.sampled_from(parts), label="part")
    part = root / table / entry["file"]
    man = root / "manifest.json"
    m = json.loads(man.read_text())
    if kind == "truncate_part":
        b = part.read_bytes()
        part.write_bytes(b[: data.draw(st.integers(0, len(b) - 1), label="keep")])
    elif kind == "garbage_bytes":
        b = bytearray(part.read_bytes())
        at = data.draw(st.integers(0, len(b) - 1), label="at")
        junk = data.draw(st.binary(min_size=1, max_size=64), label="junk")
        b[at:at + len(junk)] = junk
        part.write_bytes(bytes(b))
    elif kind in ("drop_column", "mistype_column"):
        t = pq.read_table(part)
        col = data.draw(st.sampled_from(t.column_names), label="column")
        if kind == "drop_column":
            t = t.drop_columns([col])
        else:
            t = t.set_column(t.column_names.index(col), col, pa.array([str(x) for x in t[col].to_pylist()]))
        pq.write_table(t, part)
    elif kind == "duplicate_in_manifest":
        m["tables"][table].append(dict(entry))
        man.write_text(json.dumps(m))
    elif kind in ("uncommitted_part", "duplicate_file"):
        name = "part-000900.parquet" if kind == "uncommitted_part" else "part-000901.parquet"
        shutil.copy(part, root / table / name)
    elif kind == "stray_tmp":
        (root / table / f".{entry['file']}.tmp").write_bytes(part.read_bytes()[:10])
    elif kind == "garbage_meta":
        (root / "meta.json").write_bytes(data.draw(st.binary(max_size=40), label="meta"))
    elif kind == "missing_meta":
        (root / "meta.json").unlink()
    elif kind == "meta_not_object":
        (root / "meta.json").write_text("[1, 2]")
    elif kind == "empty_table_folder":
        for p in (root / table).iterdir():
            p.unlink()
    elif kind == "missing_table_folder":
        shutil.rmtree(root / table)
    elif kind == "manifest_names_missing_part":
        m["tables"][table].append({**entry, "file": "part-000950.parquet"})
        man.write_text(json.dumps(m))
    elif kind == "garbage_manifest":
        man.write_bytes(data.draw(st.binary(max_size=40), label="manifest"))
    elif kind == "missing_manifest":
        man.unlink()
    elif kind == "manifest_rows_wrong":
        entry["rows"] += data.draw(st.integers(1, 5), label="extra")
        m["tables"][table] = [entry if e["file"] == entry["file"] else e for e in m["tables"][table]]
        man.write_text(json.dumps(m))
    elif kind == "manifest_not_object":
        man.write_text(json.dumps(data.draw(st.sampled_from([[], "x", 3, {"format": 1}]), label="obj")))
    elif kind == "empty_part_file":
        part.write_bytes(b"")
    elif kind == "null_time":
        t = pq.read_table(part)
        col = data.draw(st.sampled_from(NEVER_NULL[table]), label="column")
        vals = t[col].to_pylist()
        vals[data.draw(st.integers(0, len(vals) - 1), label="row")] = None
        t = t.set_column(t.column_names.index(col), col, pa.array(vals, t.schema.field(col).type))
        pq.write_table(t, part)
    else:  # pragma: no cover
        raise AssertionError(kind)


def check_outcome(cmd: tuple[str, ...], code: int, out: str, err: str, kind: str, clean_out: str | None) -> None:
    assert "Traceback" not in err and "Traceback" not in out, (kind, cmd, err[-2000:])
    assert code in (0, 2), (kind, cmd, code, err)
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:"), (kind, cmd, err)
    if kind in BENIGN:
        assert code == 0, (kind, cmd, err)
        if clean_out is not None:
            assert out == clean_out, (kind, cmd)


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("MSTRACE_CORRUPT_EXAMPLES", "200")), deadline=None,
          derandomize="MSTRACE_CORRUPT_EXAMPLES" not in os.environ, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(data=st.data())
def test_every_command_on_a_corrupted_trace_is_one_line_and_changes_nothing(
        clean: Path, clean_out: dict[str, str], data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(KINDS), label="kind")
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp) / "t"
        shutil.copytree(clean, t)
        corrupt(t, kind, data)
        before = digest(t)
        for c in COMMANDS:
            code, out, err = cli(c, str(t), "--json")
            # --json carries the trace's path; the clean run's is another folder
            check_outcome((c,), code, out.replace(str(t), str(clean)), err, kind, clean_out[c])
            assert digest(t) == before, (kind, c, "modified the trace")
        if data.draw(st.booleans(), label="diff"):
            code, out, err = cli("diff", str(clean), str(t))
            check_outcome(("diff",), code, out, err, kind, None)
            assert digest(t) == before, (kind, "diff modified the trace")
        code, out, err = cli("compact", str(t))
        check_outcome(("compact",), code, out, err, kind, None)
        if code == 2:
            assert digest(t) == before, (kind, "a refused compact modified the trace")
        else:
            code, _, err = cli("report", str(t), "--json")
            assert code == 0, (kind, "compact left an unreadable trace", err)


def test_the_corruptions_cover_every_table_and_both_outcomes(clean: Path) -> None:
    """Positive control for the property test: the clean trace has a committed part in
    every table the run writes, and a harmful corruption is really refused."""
    tables = {t for t, _ in committed(clean)}
    assert {"probes", "steps", "requests", "memory", "timeline"} <= tables <= set(TABLES)
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp) / "t"
        shutil.copytree(clean, t)
        steps = next(e for tb, e in committed(t) if tb == "steps")
        (t / "steps" / steps["file"]).write_bytes(b"PAR1 not really")
        code, _, err = cli("report", str(t))
        assert code == 2 and "corrupt steps/ table" in err, err


@pytest.mark.parametrize("change", ["drop", "mistype"])
@pytest.mark.parametrize("table,column,command", [("probes", "rank", "report"), ("memory", "block_id", "leaks")])
def test_a_part_without_a_column_read_from_its_statistics_is_refused_in_one_line(
        clean: Path, table: str, column: str, command: str, change: str) -> None:
    """The columns whose row-group statistics the sweeps read before any row (the ranks, the
    blocks): a part that lacks one, or holds it as strings, is a corrupt trace, not a
    traceback (the property test above may not draw this column)."""
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp) / "t"
        shutil.copytree(clean, t)
        part = t / table / next(e for tb, e in committed(t) if tb == table)["file"]
        p = pq.read_table(part)
        if change == "drop":
            p = p.drop_columns([column])
        else:
            p = p.set_column(p.column_names.index(column), column, pa.array([str(x) for x in p[column].to_pylist()]))
        pq.write_table(p, part)
        code, out, err = cli(command, str(t), "--json")
        check_outcome((command,), code, out, err, f"{change}_column", None)
        assert code == 2 and column in err, err
