"""At 80 columns, piped: `run --help`, `report` and `diff` cut no option name or value
and keep every significance mark."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.support.cli import REPO
from tests.support.tiny_runs import TinyRuns


def at(columns: int, *args: str) -> str:
    env = {**os.environ, "COLUMNS": str(columns)}
    p = subprocess.run([sys.executable, "-m", "viewer.cli", *args], cwd=REPO, capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_run_help_fits_80_columns_whole():
    from viewer.commands.flags import all_fields

    out = at(80, "run", "--help")
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) <= 80
    for f in all_fields():
        if f.opt.hidden:
            continue
        assert f.flag in out, f.flag
        if f.cli_type in (bool, bool | None):
            assert f"--no-{f.flag[2:]}" in out, f.flag


@pytest.fixture(scope="module")
def modes(tiny_runs: TinyRuns):
    return tiny_runs("--requests", "24", "--mode", "all", "-q").out


def _widest(out: str, modes) -> int:
    # A line naming a trace holds its path, which no width can promise to fit: it is left
    # whole to the terminal's own wrap (viewer.render.text.trace_heading), so it still pastes.
    return max(len(line) for line in out.splitlines() if str(modes) not in line)


def test_report_fits_80_columns(modes):
    out = at(80, "report", str(modes / "overlap"))
    assert "…" not in out and _widest(out, modes) <= 80


def test_a_trace_heading_keeps_its_path_and_words_whole(modes):
    for args in (("report", str(modes / "overlap")), ("diff", str(modes / "serial"), str(modes / "overlap"))):
        out = at(len(str(modes)) // 2, *args)  # narrower than the path
        heads = [line for line in out.splitlines() if str(modes) in line]
        # dtype: what --dtype auto picked on this CPU (bfloat16 where it has AMX)
        assert heads and all(re.search(r"(dtype=\w+|model tiny\))$", line) for line in heads), heads


def test_diff_fits_80_columns_and_keeps_its_marks(modes):
    args = ("diff", str(modes / "serial"), str(modes / "overlap"))
    narrow, wide = at(80, *args), at(200, *args)
    assert "…" not in narrow and _widest(narrow, modes) <= 80
    assert narrow.count(" * ") + narrow.count(" *\n") == wide.count(" * ") + wide.count(" *\n")


def _commands() -> dict[str, object]:
    """Every subcommand as click builds it, `run`'s, `serve`'s and `bench-serve`'s included."""
    import typer

    from viewer.cli import app

    group = typer.main.get_command(app)
    ctx = group.make_context("mstrace", ["--help"], resilient_parsing=True)
    return {"": group, **{name: group.get_command(ctx, name) for name in group.list_commands(ctx)}}


def test_help_shows_no_type_beside_a_flag():
    """A flag takes no value: `--help  <bool>  Show this message` read as if it took one."""
    import re

    commands = _commands()
    assert {"run", "serve", "bench-serve", "report", "diff", "sql"} <= set(commands)
    for name, cmd in commands.items():
        out = at(200, *([name] if name else []), "--help")
        assert "<bool>" not in out, name
        assert re.search(r"--help +Show this message", out), (name, out)
        ctx = cmd.context_class(cmd, info_name=name or "mstrace")
        flags = [p for p in cmd.get_params(ctx) if getattr(p, "is_flag", False) and not p.hidden]
        assert flags, name  # --help at least
        for p in flags:
            line = next((ln for ln in out.splitlines() if re.search(rf"{re.escape(p.opts[0])}\b", ln)), None)
            assert line is not None, (name, p.opts[0])
            assert not re.search(r"<[\w\[\]|,. ]+>", line), (name, line)
