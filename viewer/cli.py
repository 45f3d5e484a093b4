"""The mstrace command line. Analyses never import torch; only `run` does, lazily."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
import typer.rich_utils
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from viewer.commands.window_flags import Request, Rounds, TimeWindow, Worst, window_of

if TYPE_CHECKING:
    from scheduler.config import EngineConfig
    from scheduler.harness.run_options import RunOptions
    from scheduler.serving.options import ServeOptions


class _Commands(TyperGroup):
    """`run`'s and `serve`'s flags are generated from the engine's config fields
    (viewer/commands/flags.py): built only when asked for, so the analyses import nothing of
    the engine."""

    def list_commands(self, ctx: Any) -> list[str]:
        return ["run", "serve", "bench-serve", *super().list_commands(ctx)]

    def get_command(self, ctx: Any, name: str) -> Any:
        if name == "run":
            from viewer.commands.flags import click_command

            return click_command(_run, fail)
        if name == "serve":
            from scheduler.config import EngineConfig
            from scheduler.serving.options import ServeOptions
            from viewer.commands.flags import click_command

            return click_command(_serve, fail, "serve", (EngineConfig, ServeOptions),
                                 "Serve the engine over an OpenAI-compatible HTTP API and trace it.")
        if name == "bench-serve":
            from viewer.bench_serve.command import click_command as bench_command

            return bench_command(fail)
        return super().get_command(ctx, name)

    def invoke(self, ctx: Any) -> Any:
        # `mstrace report T | head`: the reader has what it wanted. Exit as Unix tools do on
        # SIGPIPE (141), silently; click alone exits 1 ("findings") and rich's console raises
        # SystemExit(1) after pointing stdout at /dev/null.
        import os

        try:
            try:
                return super().invoke(ctx)
            finally:
                sys.stdout.flush()  # here, not in click's exit, so a closed pipe is seen here
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the last flush has nowhere to fail
            raise typer.Exit(PIPE_CLOSED) from None
        except SystemExit as e:
            if e.code == 1 and os.path.samestat(os.fstat(sys.stdout.fileno()), os.stat(os.devnull)):
                raise typer.Exit(PIPE_CLOSED) from None
            raise


# The help tables' cells get a space on the right only: at 80 columns the default (one on
# each side) cut long flag names such as --no-overlap-schedule into "--no-overlap-sch…".
# typer's constant is typed from its default, (0, 1); rich's Table takes 4 values too (PaddingDimensions)
typer.rich_utils.STYLE_OPTIONS_TABLE_PADDING = (0, 1, 0, 0)  # type: ignore[assignment]

# typer's help shows every option's type beside its name, a flag's too: "--help  <bool>
# Show this message" read as if --help took a value. A flag (or a count) takes none, so
# its type cell is left empty, in every command's help (run's, serve's, bench-serve's too:
# their typer apps live in this process).
_display_type_rich = typer.core.TyperOption.display_type_rich


def _flag_shows_no_type(self: typer.core.TyperOption, ctx: Any) -> str | None:
    if self.is_flag or self.count:
        return None
    return _display_type_rich(self, ctx)


typer.core.TyperOption.display_type_rich = _flag_shows_no_type  # type: ignore[method-assign]

app = typer.Typer(
    name="mstrace",
    cls=_Commands,
    help="Capture and analyse LLM-inference scheduler traces.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"mstrace {version('mstrace')}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Capture and analyse LLM-inference scheduler traces."""


# Exit codes, documented in README's "Exit codes" (stable: CI gates on them).
OK, FINDINGS, BAD_INPUT, STALLED, FAILED, INTERRUPTED, PIPE_CLOSED = 0, 1, 2, 3, 4, 130, 141


def fail(msg: str, code: int = BAD_INPUT) -> NoReturn:
    # the message as it is: a path or a value in brackets ("runs [x]/t") is not markup
    err_console.print(f"[bold red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@contextmanager
def refused(*errors: type[Exception], io: str | None = None) -> Iterator[None]:
    """An error of these kinds (bad input the analyses name) is the command's one-line error;
    with `io`, so is an OSError ("cannot {io}: why (the file)": a read-only folder, a full disk)."""
    try:
        yield
    except errors as e:
        fail(str(e))
    except OSError as e:
        if io is None:
            raise
        fail(f"cannot {io}: {e.strerror or e}" + (f" ({e.filename})" if e.filename else ""))


def html_target(out: Path) -> None:  # --html OUT: its extra, and a file to write (one line, before any work)
    require("--html", "html")
    if not out.name or out.is_dir():
        fail(f"--html {out}: give a file to write (OUT.html), not a folder")


def require(what: str, *extras: str) -> None:
    """Exit 2 with one line if an extra that `what` needs is not installed (viewer/extras.py)."""
    from viewer.extras import message, missing

    gap = missing(*extras)
    if gap is not None:
        fail(message(what, *gap))


def _run(cfg: EngineConfig, opts: RunOptions, fail: Any = fail) -> None:
    """`fail`: this module's, naming a value from --config by the file's key (commands/flags.py)."""
    require("mstrace run", "engine", *(("otlp",) if opts.otlp_endpoint else ()), *(("tui",) if opts.live else ()))
    from viewer.commands.run import execute_run

    execute_run(cfg, opts, console, fail)


def _serve(cfg: EngineConfig, opts: ServeOptions, fail: Any = fail) -> None:
    require("mstrace serve", "engine", "serve")
    from viewer.commands.serve import execute_serve

    execute_serve(cfg, opts, console, fail)


@app.command()
def report(
    trace: Annotated[Path, typer.Argument(help="Trace directory written by `mstrace run`.")],
    json_out: Annotated[bool, typer.Option("--json", help="Plain JSON instead of tables.")] = False,
    html_out: Annotated[Path | None, typer.Option("--html", help="Also write the report, with pictures, as one "
                                                  "self-contained HTML file.")] = None,
    rounds: Rounds = None,
    time_window: TimeWindow = None,
    request: Request = None,
    worst: Worst = None,
) -> None:
    """Where each scheduling cycle's time goes: sync-cost table, throughput and latency, KV usage.
    A window (--rounds, --time, --request, --worst) chooses the rounds the --html timeline draws."""
    import json

    windowing = any(v is not None for v in (rounds, time_window, request, worst))
    if windowing and html_out is None:
        fail("--rounds, --time, --request and --worst choose what the --html page's timeline draws: "
             "add --html OUT.html")
    if html_out is not None:
        html_target(html_out)

    from tracing.reader import TraceError
    from viewer.analysis.report import build_report
    from viewer.render.report import render_report

    with refused(TraceError, io=f"write {html_out}" if html_out else f"read {trace}"):
        window = window_of(trace, rounds, time_window, request, worst)
        rep = build_report(trace)
        if html_out is not None:
            from viewer.export.html import report_html

            report_html(trace, html_out, rep, window)
    if json_out:
        print(json.dumps(rep.to_json(), indent=2))
    else:
        render_report(console, rep)
    _wrote_html(html_out)


@app.command()
def stalls(
    trace: Annotated[Path, typer.Argument(help="Trace directory written by `mstrace run`.")],
    json_out: Annotated[bool, typer.Option("--json", help="Plain JSON instead of tables.")] = False,
) -> None:
    """Waits the stall watchdog caught: the wait cycle, each stream's state, thread stacks, the KV pool."""
    import json

    from tracing.reader import Trace, TraceError
    from viewer.analysis.stalls import build_stalls
    from viewer.render.stalls import render_stalls
    from viewer.render.text import status_line

    with refused(TraceError):
        tr = Trace.open(trace)
        if "import" in tr.meta:
            fail(f"{trace} is an imported profiler trace: no watchdog ran, so no stall was caught or ruled out; "
                 f"its longest waits on the device are in `mstrace report {trace}` (waits by caller)")
        res = build_stalls(tr, str(trace))
    if json_out:
        print(json.dumps(res.to_json(), indent=2))
    else:
        status_line(console, res.status, res.trace)
        render_stalls(console, res.trace, tr.meta, res.stalls)
    if res.stalls:
        raise typer.Exit(FINDINGS)


@app.command()
def leaks(
    trace: Annotated[Path, typer.Argument(help="Trace directory written by `mstrace run`.")],
    json_out: Annotated[bool, typer.Option("--json", help="Plain JSON instead of tables.")] = False,
) -> None:
    """KV blocks still held at the end by finished requests, reclaimed blocks, and fragmentation over time."""
    import json

    from tracing.reader import Trace, TraceError
    from viewer.analysis.leaks import build_leaks
    from viewer.render.leaks import render_leaks
    from viewer.render.text import status_line

    with refused(TraceError):
        tr = Trace.open(trace)
        if "import" in tr.meta:
            fail(f"{trace} is an imported profiler trace: a profiler sees no engine's KV block table, so its "
                 "leaks cannot be known")
        if not tr.meta.get("config", {}).get("probes", True):
            fail(f"{trace} was recorded with --no-probes: it has no memory table, so its leaks cannot be known")
        res = build_leaks(tr, str(trace))
    if json_out:
        print(json.dumps(res.to_json(), indent=2))
    else:
        status_line(console, res.status, res.trace)
        render_leaks(console, res.trace, res.report)
    if res.report.leaked_blocks or res.report.num_anomalies:
        raise typer.Exit(FINDINGS)


@app.command()
def top(
    trace: Annotated[Path, typer.Argument(help="Trace directory of a running `mstrace run` or `mstrace serve`.")],
    window: Annotated[float, typer.Option("--window", help="Seconds of stream lanes shown (+/- zoom).")] = 2.0,
    rounds: Annotated[int, typer.Option("--rounds", help="Rounds in the rolling sync-cost table.")] = 64,
) -> None:
    """A live view of a run or server from its committed flushes: stream lanes, rolling cost table, latency, KV."""
    import sys

    if window <= 0 or rounds <= 0:
        fail("--window and --rounds must be positive")
    if not sys.stdout.isatty():
        fail("top draws in a terminal, and stdout is not one (for a finished trace: mstrace report)")
    require("mstrace top", "tui")
    from viewer.tui.top_app import TopApp

    TopApp(trace, lane_s=window, rounds=rounds).run()


@app.command()
def view(
    trace: Annotated[Path, typer.Argument(help="Trace directory written by `mstrace run` or `mstrace serve`.")],
    rounds: Rounds = None,
    time_window: TimeWindow = None,
    request: Request = None,
    worst: Worst = None,
) -> None:
    """Browse a finished or truncated trace: rounds and requests, sortable, with their details; stalls; leaks.
    A window (--rounds, --time, --request, --worst) reads only what it overlaps."""
    import sys

    require("mstrace view", "tui")

    from tracing.reader import TraceError

    with refused(TraceError):
        from viewer.tui.view_app import ViewApp

        app_ = ViewApp(trace, window_of(trace, rounds, time_window, request, worst))
    if not sys.stdout.isatty():
        fail("view draws in a terminal, and stdout is not one (the same tables as text: mstrace report)")
    app_.run()


@app.command("import")
def import_(
    profiles: Annotated[list[Path], typer.Argument(help="torch.profiler (Kineto) trace files, .json or .json.gz, "
                                                   "one per rank, or folders of them.")],
    out: Annotated[Path, typer.Option("--out", help="The trace directory to write (new or empty).")],
    preset: Annotated[str, typer.Option("--preset", help="Whose rounds: profiler (ProfilerStep#N), vllm, sglang.")]
    = "profiler",
    round_re: Annotated[str | None, typer.Option("--round", help="A regex naming the rounds' ranges instead of "
                                                 "the preset's.")] = None,
    maps: Annotated[list[str] | None, typer.Option("--map", help="BOUNDARY=REGEX: host ranges whose name matches "
                                                   "are that boundary's rows (repeatable).")] = None,
) -> None:
    """Import a torch.profiler trace of any PyTorch engine as an mstrace trace (report, diff, sql, export...)."""
    require("mstrace import", "import")
    from importers.kineto_import import ImportOptions, import_kineto
    from importers.kineto_stream import KinetoError

    pairs: list[tuple[str, str]] = []
    for m in maps or []:
        b, sep, rx = m.partition("=")
        if not sep or not b or not rx:
            fail(f"--map {m!r}: expected BOUNDARY=REGEX")
        pairs.append((b, rx))
    try:
        res = import_kineto(profiles, out, ImportOptions(round_re, preset, pairs))
    except KinetoError as e:
        fail(str(e))
    except OSError as e:
        fail(f"cannot write {out}: {e.strerror or e}")
    ranks = ",".join(map(str, res.ranks))
    console.print(f"{escape(str(res.out))}: {res.events} events from rank {ranks}: {res.rounds} rounds, "
                  f"{res.kernels} device activities", highlight=False, soft_wrap=True)
    for t in res.truncated:
        console.print(f"[bold yellow]TRUNCATED[/] {escape(t)}", highlight=False, soft_wrap=True)
    console.print(f"next: mstrace report {escape(str(res.out))}", highlight=False, soft_wrap=True)


@app.command()
def collect(
    out: Annotated[Path, typer.Option("--out", help="The trace directory to write (new or empty).")],
    otlp_port: Annotated[int, typer.Option("--otlp-port", help="Port of the OTLP/HTTP receiver (0: any free one).")]
    = 4318,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
) -> None:
    """Receive vLLM's or SGLang's OpenTelemetry request spans over OTLP/HTTP into a trace, until Ctrl-C."""
    from importers.otlp_collect import Collector

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        fail(f"{out} exists and is not an empty folder; choose a new --out")
    try:
        c = Collector(out, host, otlp_port)
    except OSError as e:
        fail(f"cannot collect on {host}:{otlp_port} into {out}: {e.strerror or e}")
    err_console.print(f"collecting OTLP traces on http://{host}:{c.port}/v1/traces into {escape(str(out))}; "
                      "Ctrl-C stops", highlight=False, soft_wrap=True)
    import signal

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # a service manager's SIGTERM ends it as Ctrl-C does

    # SIGINT too, explicitly: a shell that starts a command in the background without job
    # control has it ignore SIGINT, and Python then never turns Ctrl-C into KeyboardInterrupt
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        c.serve()
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a collection ends: serve() committed the rows and the end record
    console.print(f"{escape(str(out))}: {c.received} spans, {c.requests} requests"
                  + (f", {c.rejected} bodies refused" if c.rejected else "")
                  + f"; next: mstrace report {escape(str(out))}", highlight=False, soft_wrap=True)


@app.command()
def compact(
    trace: Annotated[Path, typer.Argument(help="Trace directory written by `mstrace run`.")],
) -> None:
    """Merge a trace's many small parts into few large ones (a killed run's, or an older version's)."""
    from tracing.compact_trace import compact_trace
    from tracing.reader import TraceError

    # a read-only trace, a full disk: the manifest commits all or nothing
    with refused(TraceError, io=f"compact {trace}"):
        res = compact_trace(trace)
    console.print(f"{escape(str(trace))}: {res.parts_before} parts -> {res.parts_after} ({res.merges} merges); "
                  f"removed {res.removed} uncommitted files", highlight=False, soft_wrap=True)


@app.command()
def diff(
    a: Annotated[Path, typer.Argument(help="Baseline trace directory (A).")],
    b: Annotated[Path, typer.Argument(help="Trace directory to compare with A (B).")],
    json_out: Annotated[bool, typer.Option("--json", help="Plain JSON instead of tables.")] = False,
    html_out: Annotated[Path | None, typer.Option("--html", help="Also write the diff, with A and B overlaid in "
                                                  "pictures, as one self-contained HTML file.")] = None,
) -> None:
    """Did a change pay? B - A for per-boundary cost, device idle and serving metrics, with 95% bootstrap intervals."""
    import json

    if html_out is not None:
        html_target(html_out)

    # diff runs its bootstraps on threads of its own, one per core: OpenBLAS's threads beside
    # them only contend (a 10 M-row pair's statistics, 0.94 -> 0.83 s). Read when numpy loads.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from tracing.reader import TraceError
    from viewer.analysis.diff import build_diff
    from viewer.render.diff import render_diff

    with refused(TraceError, io=f"write {html_out}" if html_out else f"read {a} and {b}"):
        d = build_diff(a, b)
        if html_out is not None:
            from viewer.export.html import diff_html

            diff_html(a, b, html_out, d)
    if json_out:
        print(json.dumps(d.to_json(), indent=2))
    else:
        render_diff(console, d)
    _wrote_html(html_out)


@app.command()
def whatif(
    trace: Annotated[Path, typer.Argument(help="Trace directory written by `mstrace run` or `mstrace serve`.")],
    mode: Annotated[str | None, typer.Option("--mode", help="Predict the run in this mode (serial, overlap; "
                                             "timeslice from a timeslice trace).")] = None,
    speedup: Annotated[list[str] | None, typer.Option("--speedup", help="BOUNDARY=FACTOR (device_compute=0.8) or "
                                                      "BOUNDARY=+-MSms per batch, as if that boundary were "
                                                      "faster; repeatable.")] = None,
    contention: Annotated[float | None, typer.Option("--contention", help="Share (0-1) of the host's work (and, "
                                                     "with --comm-overlap, of an all-reduce in flight) the device "
                                                     "cannot overlap; default: what the run measured at start-up, "
                                                     "else 0 (docs/whatif.md).")] = None,
    comm_overlap: Annotated[str | None, typer.Option("--comm-overlap", help="on or off: a TP trace's all-reduces "
                                                     "hidden behind the other half-batch, or not.")] = None,
    against: Annotated[Path | None, typer.Option("--against", help="A trace of the run predicted (the other mode, "
                                                 "the boundary changed): its numbers beside the prediction's, each "
                                                 "error, and whether it fell inside the interval.")] = None,
    rounds: Rounds = None,
    time_window: TimeWindow = None,
    json_out: Annotated[bool, typer.Option("--json", help="Plain JSON instead of tables.")] = False,
) -> None:
    """Would it pay? Predict the run under another mode or with a boundary sped up, from this trace alone
    (or a window of its rounds: --rounds, --time)."""
    import json

    from tracing.reader import TraceError
    from viewer.analysis.whatif import Speedup, WhatIfError
    from viewer.analysis.whatif import whatif as predict
    from viewer.render.whatif import render_whatif

    with refused(TraceError, WhatIfError):
        res = predict(trace, mode, [Speedup.parse(s) for s in speedup or []], contention, comm_overlap=comm_overlap,
                      against=against, window=window_of(trace, rounds, time_window, None, None))
    if json_out:
        print(json.dumps(res.to_json(), indent=2))
    else:
        render_whatif(console, res)


def _wrote_html(path: Path | None) -> None:
    """Where the page went: on stderr, so `--json` output stays one JSON document."""
    if path is not None:
        err_console.print(f"HTML written to {escape(str(path.resolve()))}", highlight=False, soft_wrap=True)


@app.command()
def export(
    trace: Annotated[Path, typer.Argument(help="Trace directory written by `mstrace run` or `mstrace serve`.")],
    perfetto: Annotated[Path | None, typer.Option("--perfetto", help="Write a Perfetto trace (TrackEvent protobuf) "
                                                  "here, for ui.perfetto.dev.")] = None,
    otlp: Annotated[str | None, typer.Option("--otlp", help="Replay the request spans to this OTLP/HTTP collector "
                                             "(e.g. http://127.0.0.1:4318).")] = None,
    rounds: Rounds = None,
    time_window: TimeWindow = None,
    request: Request = None,
    worst: Worst = None,
) -> None:
    """Take a trace where users already look: Perfetto's timeline, or an OTLP collector (Jaeger, Tempo).
    A window (--rounds, --time, --request, --worst) chooses what --perfetto writes."""
    from tracing.reader import TraceError

    if perfetto is None and otlp is None:
        fail("say where to: --perfetto OUT.pftrace and/or --otlp URL")
    windowing = any(v is not None for v in (rounds, time_window, request, worst))
    if windowing and perfetto is None:
        fail("--rounds, --time, --request and --worst choose what --perfetto writes: add --perfetto OUT.pftrace")
    require("mstrace export", *(("perfetto",) if perfetto else ()), *(("otlp",) if otlp else ()))
    with refused(TraceError, io="write or send"):
        if perfetto is not None:
            from viewer.export.perfetto import export_perfetto

            window = window_of(trace, rounds, time_window, request, worst)
            st = export_perfetto(trace, perfetto, window)
            console.print(f"{escape(str(perfetto))}: {st.packets} packets ({st.probe_rows} probe rows, {st.rounds} rounds, "
                          f"{st.requests} requests, {st.flows} flows); open it in https://ui.perfetto.dev",
                          highlight=False, soft_wrap=True)  # soft: a long path is never broken
            if window is not None:
                console.print(f"window: {escape(window.what)}; left out {st.trace_probe_rows - st.probe_rows} of "
                              f"{st.trace_probe_rows} probe rows and {st.trace_rounds - st.rounds} of "
                              f"{st.trace_rounds} rounds", highlight=False, soft_wrap=True)
        if otlp is not None:
            from viewer.export.otlp import replay_spans

            n = replay_spans(trace, otlp)
            console.print(f"{escape(otlp)}: {n.spans} spans of {n.requests} requests sent", highlight=False,
                          soft_wrap=True)


@app.command()
def sql(
    trace: Annotated[Path, typer.Argument(help="Trace directory written by `mstrace run` or `mstrace serve`.")],
    query: Annotated[str | None, typer.Argument(help="One SELECT statement; none: list the views and their columns.")] = None,
    fmt: Annotated[str, typer.Option("--format", help="table, csv or json (a list of one object per row).")] = "table",
) -> None:
    """Ask a trace anything in SQL (DuckDB, read-only): every table as a view, plus cycles, cycle_cost, request_latency."""
    import sys

    require("mstrace sql", "sql")

    from tracing.reader import TraceError
    from viewer.export.sql import SqlError, TraceDb, render

    if fmt not in ("table", "csv", "json"):
        fail(f"--format must be table, csv or json, not {fmt!r}")
    with refused(TraceError, SqlError):
        db = TraceDb(trace)
        if query is None:
            for view, cols in db.describe():
                console.print(f"[bold]{view}[/]: " + ", ".join(f"{c} {t}" for c, t in cols), highlight=False,
                              soft_wrap=True)
            return
        res = db.query(query)
    render(res, fmt, sys.stdout)


def main() -> None:
    if sys.platform == "linux":
        # Arrow's jemalloc pool, unless the user chose one: mimalloc (pyarrow's default) keeps
        # what one thread frees of another's decoded pages; `report` on 100 M probe rows
        # peaked 2.6-2.7 GB with it, 2.2-2.3 GB with jemalloc, and ran no slower (BENCHMARKS.md).
        # (Linux only: the other platforms' wheels may lack it.)
        os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "jemalloc")
    try:
        app()  # typer turns Ctrl-C into exit code 130
    except ModuleNotFoundError as e:
        # an optional module that no command's `require` foresaw: the same one line
        from viewer.extras import for_module, message

        extra = for_module(e.name)
        if extra is None:
            raise
        err_console.print(f"[bold red]error:[/] {escape(message('this command', extra, e.name or '?'))}",
                          highlight=False, soft_wrap=True)
        sys.exit(BAD_INPUT)
    finally:
        # The interpreter's last collection walks every object a run left (its requests,
        # its buffers, torch's modules): over a second, which a stopped run's user would wait.
        # Frozen, they are left to the process's end.
        gc.freeze()


if __name__ == "__main__":
    main()
