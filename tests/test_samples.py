"""The sample traces in traces/ (traces/make_samples.py) are current and every analysis command
reads them: a schema change that leaves them behind fails here (re-make them)."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.support.cli import REPO, mstrace
from tracing.reader import Trace, read_table
from tracing.schema import SCHEMA_VERSION, TABLES

SAMPLES = REPO / "traces"
NAMES = ("sample-serial", "sample-overlap", "sample-deadlock")


@pytest.mark.parametrize("name", NAMES)
def test_a_sample_was_written_with_this_trees_schema(name):
    root = SAMPLES / name
    assert json.loads((root / "meta.json").read_text())["schema_version"] == SCHEMA_VERSION
    for table, schema in TABLES.items():
        assert read_table(root, table).schema.names == schema.names, (name, table)
    assert sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) < 200_000  # a few hundred KB in all


def test_the_analysis_commands_read_the_samples(tmp_path):
    # a copy: the commands must not need to write into the repository's traces
    for n in NAMES:
        shutil.copytree(SAMPLES / n, tmp_path / n)
    serial, overlap, dl = (tmp_path / n for n in NAMES)
    assert Trace.open(serial).status.complete and Trace.open(dl).status.state == "stalled"
    assert mstrace("report", str(serial)).returncode == 0
    assert mstrace("diff", str(serial), str(overlap)).returncode == 0
    assert mstrace("leaks", str(serial)).returncode == 0
    p = mstrace("stalls", str(dl))
    assert p.returncode == 1 and "wait cycle" in p.stdout, p.stderr  # findings: the injected cycle
