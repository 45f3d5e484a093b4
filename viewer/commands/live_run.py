"""`mstrace run --live`: the run in a child process, `mstrace top` on its trace here.

The engine must not share an interpreter with the TUI: a redraw holding the GIL
would show up in the very rounds it draws. So the same command line, without
`--live`, runs as a child with its output in a log; this process only tails the
trace. When the view closes, a run still going is stopped as Ctrl-C stops it (its
trace ends `interrupted`), then its report is printed and its exit code returned.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import typer

STOP_WAIT_S = 60.0
INTERRUPTED = 130  # a run stopped by Ctrl-C (typer's exit code for it)


def child_argv(argv: list[str], out: Path) -> list[str]:
    """`mstrace run ...` as typed, with --no-live and --no-force (the folder is claimed here; a
    --config file's `live = true` made the child go live too, and fail without a terminal),
    plus --out (a default one chosen here) and --quiet."""
    i = argv.index("run") if "run" in argv else -1
    rest = [a for a in argv[i + 1:] if a not in ("--live", "--force")]
    has_out = any(a == "--out" or a.startswith("--out=") for a in rest)
    return ["run", *rest, *([] if has_out else ["--out", str(out)]), "--no-live", "--no-force", "--quiet"]


def run_live(out: Path) -> None:
    """`out` is claimed (new or emptied) already, and stdout is a terminal."""
    from viewer.tui.top_app import TopApp

    log = tempfile.NamedTemporaryFile(prefix="mstrace-run-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "viewer.cli", *child_argv(sys.argv, out)], stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def state() -> str | None:
        rc = proc.poll()
        if rc is None:
            return None
        return f"the run's process exited with code {rc}; q leaves and prints its report"

    try:
        TopApp(out, process_state=state).run()
    finally:
        stop(proc)
        log.close()
    text = Path(log.name).read_text(errors="replace")
    Path(log.name).unlink(missing_ok=True)
    sys.stdout.write(text)
    sys.stdout.flush()
    if proc.returncode == INTERRUPTED:
        # the child ran --quiet and, stopped, printed only where its trace is: the report of
        # what it did until then is what the view's user came for
        from rich.console import Console

        from viewer.analysis.report import build_report
        from viewer.render.report import render_report

        render_report(Console(), build_report(out))
    if proc.returncode:
        raise typer.Exit(proc.returncode)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop a run still going as Ctrl-C stops it, and wait for its trace's last commit.

    Once the view is gone the terminal sends Ctrl-C to both processes: waiting goes on
    (the child got it too); a second one while it still flushes kills it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    for _ in range(2):
        try:
            proc.wait(STOP_WAIT_S)
            return
        except KeyboardInterrupt:
            continue
        except subprocess.TimeoutExpired:
            break
    proc.kill()
    proc.wait()
