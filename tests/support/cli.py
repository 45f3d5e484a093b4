"""Run the mstrace CLI the way a user does: a separate process (forked from a pre-imported
interpreter where that changes nothing: tests/support/zygote.py)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def mstrace(*args: str, timeout: float = 600, check_views: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """A successful `mstrace run` also has its trace's cost views checked (tests/support/views.py):
    every trace the suite makes, not only the ones a test looks at."""
    from tests.support.zygote import zygote  # a fork of a pre-imported interpreter, where it can

    z = zygote(REPO, env)
    if z is not None:
        p = z.run(list(args), REPO, timeout, env)
    else:
        p = subprocess.run([sys.executable, "-m", "viewer.cli", *args], cwd=REPO, capture_output=True, text=True,
                           timeout=timeout, env=env)
    if check_views and args and args[0] == "run" and p.returncode == 0 and "--out" in args:
        from tests.support.views import assert_views_hold

        out = Path(args[args.index("--out") + 1])
        for trace in ([out] if (out / "meta.json").exists() else sorted(d for d in out.iterdir() if d.is_dir())):
            assert_views_hold(trace)
    return p


def start_mstrace(*args: str, env: dict[str, str]) -> Any:
    """`subprocess.Popen([python, -m, viewer.cli, *args], env=env)` with its output discarded,
    forked from the zygote where it can be: as much of Popen as a test that kills a command
    uses (poll, wait, send_signal, kill, pid, returncode)."""
    from tests.support.zygote import zygote

    z = zygote(REPO, env)
    if z is not None:
        return z.start(list(args), REPO, env, os.devnull, os.devnull)
    return subprocess.Popen([sys.executable, "-m", "viewer.cli", *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


TAG = "MSTRACE_TEST_TAG"  # set in a run's environment; every process it starts inherits it
# tag -> the process groups of tagged commands forked from the test zygote, which shows its own
# environment in /proc/<pid>/environ: such a command leads a group its descendants inherit
_tag_groups: dict[str, set[int]] = {}


def tag_group(tag: str, pgid: int) -> None:
    """Count the processes of group `pgid` as tagged `tag` (tests/support/zygote.py)."""
    _tag_groups.setdefault(tag, set()).add(pgid)


def tagged_pids(tag: str, exclude: int | None = None) -> list[int]:
    """Pids of live processes whose environment carries ``TAG=tag``, or that belong to the
    process group of a tagged command the zygote forked."""
    out = []
    needle = f"{TAG}={tag}".encode()
    groups = _tag_groups.get(tag, set())
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == exclude:
            continue
        try:
            env = (d / "environ").read_bytes()
            state, _, pgrp = (d / "stat").read_text().rsplit(")", 1)[1].split()[:3]
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if state != "Z" and (int(pgrp) in groups or needle in env.split(b"\0")):
            out.append(int(d.name))
    return out


def one_line_error(p: subprocess.CompletedProcess[str]) -> str:
    """The one line a failed command printed on stderr (no traceback, nothing else)."""
    assert p.returncode != 0
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, p.stderr
    assert "Traceback" not in p.stderr
    return lines[0]


@functools.cache
def _command() -> Any:
    """The CLI's click command, built once per process. typer's test runner rebuilds it from
    the app's signatures on every invoke: 50 ms, half of a small trace's in-process report,
    and the suite runs thousands of them."""
    import typer.main

    from viewer.cli import app

    return typer.main.get_command(app)


def cli(*args: str) -> tuple[int, str, str]:
    """The CLI in this process (exit code, stdout, stderr): for analyses run many
    times in one test, where a fresh interpreter each time would dominate. As typer's
    `CliRunner.invoke`, with the command built once."""
    from typer.testing import CliRunner

    runner = CliRunner()
    cmd = _command()
    code, error = 0, None
    with runner.isolation() as (out, err, _):
        try:
            cmd.main(args=list(args), prog_name=runner.get_default_prog_name(cmd))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int | None):
                sys.stdout.write(f"{e.code}\n")
        except Exception as e:  # noqa: BLE001 - reported as a traceback, exit 99
            error = e
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            stdout = out.getvalue().decode(runner.charset, "replace").replace("\r\n", "\n")
            stderr = err.getvalue().decode(runner.charset, "replace").replace("\r\n", "\n")
    if error is not None:
        import traceback

        tb = "".join(traceback.format_exception(error))
        return 99, stdout, stderr + "Traceback (most recent call last):\n" + tb
    return code, stdout, stderr
