"""`mstrace run`: the one viewer module allowed to start the engine (and import torch)."""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from scheduler.config import MODES, EngineConfig
from scheduler.harness.run_options import RunOptions
from tracing.run_status import first_line
from viewer.analysis.report import build_report
from viewer.render.report import render_modes, render_report

if TYPE_CHECKING:
    from scheduler.device.device_process import DeviceSeed
    from scheduler.parallel.worker import RankSeed


class Fail(Protocol):
    """How a command gives up (viewer.cli.fail): the message on stderr, then exit `code`
    (its default: bad input)."""

    def __call__(self, msg: str, code: int = ...) -> NoReturn: ...


class _ProgressSink:
    def __init__(self, progress: Progress, task: int) -> None:
        self._p, self._t = progress, task

    def on_text(self, request_id: str, text: str) -> None:
        pass

    def on_finish(self, record: object, text: str) -> None:
        self._p.advance(self._t)  # type: ignore[arg-type]


def execute_run(cfg: EngineConfig, opts: RunOptions, console: Console, fail: Fail) -> None:
    from scheduler.harness.workload import (
        SyntheticSpec,
        WorkloadError,
        load_workload,
        save_workload,
        synthetic_workload,
    )
    from scheduler.options import ConfigError

    all_modes = cfg.mode == "all"
    spec = SyntheticSpec(opts.requests, opts.prompt_len, opts.output_len, opts.shared_prefix, rate=opts.rate,
                         seed=cfg.seed)
    try:
        cfg = checked(cfg, opts)
        if opts.workload is None:
            spec.check()
    except (ConfigError, WorkloadError) as e:
        fail(str(e))  # before torch is imported: a mistyped flag is said at once
    from scheduler.model.config import ModelLoadError
    from scheduler.model.presets import resolve_model

    out = opts.out or Path("traces") / datetime.now().strftime("run-%Y%m%d-%H%M%S")
    if opts.live:
        if all_modes:
            fail("--live follows one trace: choose --mode serial, timeslice or overlap")
        if not sys.stdout.isatty():  # before --force removes anything
            fail("--live draws in a terminal, and stdout is not one: drop --live")
    from scheduler.harness.session import fork_device_seeds, fork_rank_seeds

    # before a preset's first build runs a torch op
    # (none for --live: its child run forks its own, and these would sit idle beside it)
    seeds, ranks = ([None], []) if opts.live else (fork_device_seeds(cfg, 3 if all_modes else 1),
                                                   fork_rank_seeds(cfg))
    try:
        model_dir = resolve_model(cfg.model)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        fail(str(e))
    check_out(out, opts.force, fail)  # claimed (a --force'd trace removed) only once every input is checked
    if opts.torch_profile is not None and opts.torch_profile.exists() and not opts.torch_profile.is_dir():
        fail(f"--torch-profile {opts.torch_profile} is a file: it names the folder the profile goes in")
    if opts.otlp_endpoint:  # before any folder is made: a missing exporter is a usage error
        from tracing.otel import OtlpUnavailableError, otlp_exporter
        try:
            otlp_exporter(opts.otlp_endpoint)
        except OtlpUnavailableError as e:
            fail(str(e))

    from scheduler.model.config import ModelConfig
    from scheduler.model.loader import safetensors_files

    try:
        mc = ModelConfig.from_file(model_dir / "config.json")
        if cfg.world_size > 1:
            from scheduler.parallel.runner import check_shardable

            check_shardable(mc, cfg.tp, cfg.pp)
        safetensors_files(model_dir)  # a folder without weights fails here, before anything is made
        check_device(cfg.device)
        if opts.workload is not None:
            items = load_workload(opts.workload, mc.vocab_size)
            source = str(opts.workload)
            _check_prompts_have_a_tokenizer(items, model_dir, opts.workload)
        else:
            specials = set(mc.eos_token_id) | ({mc.bos_token_id} if mc.bos_token_id is not None else set())
            items = synthetic_workload(spec, mc.vocab_size, specials)
            source = f"synthetic:{spec}"
    except (WorkloadError, ModelLoadError, ConfigError) as e:
        fail(str(e))
    if opts.save_workload is not None:
        try:
            save_workload(items, opts.save_workload)
        except OSError as e:
            fail(f"--save-workload {opts.save_workload}: {e.strerror or e}")
    if opts.live:
        from viewer.commands.live_run import run_live

        claim_out(out, opts.force, fail)
        run_live(out)
        return
    claim_out(out, opts.force, fail)

    from scheduler.stall_guard import EngineStalled

    made = None if out.exists() else out  # what to remove if no run ever starts

    def one(o: RunOptions, c: EngineConfig, to: Path, made: Path | None, seed: Any, ranks: Any = None) -> None:
        """A run, its failure one line with its exit code (3 stalled, 4 failed), its trace kept."""
        try:
            _run_one(o, c, items, source, to, console, fail, made, seed, ranks)
        except EngineStalled as e:
            # The trace is flushed (the writer closes in _run_one's finally); exit 3 = stalled.
            fail(f"{e}; trace flushed to {to}, see `mstrace stalls {to}`", 3)
        except typer.Exit:  # fail() inside the run: already said (click's Exit is a RuntimeError)
            raise
        except Exception as e:  # noqa: BLE001 - a thread of the run failed: one line, and the trace
            fail(f"the run failed: {first_line(e)}; trace flushed to {to}", 4)

    if not all_modes:
        one(opts, cfg, out, made, seeds[0], ranks)
        render_report(console, build_report(out))
        console.print(f"trace written to [bold]{escape(str(out))}[/]", soft_wrap=True)
        _say_rejections(out, fail)
        return
    # The control group: the same workload through all three modes.
    outs = {}
    for mode, seed in zip(MODES, seeds, strict=True):
        outs[mode] = out / mode
        # a profile each, beside the other modes' (their one file was overwritten twice)
        o = replace(opts, torch_profile=opts.torch_profile / mode) if opts.torch_profile is not None else opts
        one(o, replace(cfg, mode=mode), outs[mode], made, seed)
        made = None  # a later mode's failure leaves the earlier modes' traces
        if mode == "serial":  # the workload's rejections: every mode rejects the same requests
            _say_rejections(outs[mode], fail)
    render_modes(console, {m: build_report(o) for m, o in outs.items()})
    console.print(f"traces written to [bold]{escape(str(out))}[/]/{{serial,timeslice,overlap}}; "
                  f"compare two with `mstrace diff {outs['serial']} {outs['overlap']}`", highlight=False)


def checked(cfg: EngineConfig, opts: RunOptions) -> EngineConfig:
    """The configuration that runs (its first mode's, for --mode all), once `opts` and the
    configuration of every mode it runs are valid; ConfigError otherwise."""
    from scheduler.options import ConfigError

    opts.validate()
    for mode in MODES if cfg.mode == "all" else (cfg.mode,):
        try:
            replace(cfg, mode=mode).validate()
        except ConfigError as e:
            raise ConfigError(f"--mode all runs {mode} too: {e}" if cfg.mode == "all" else str(e)) from None
    cfg = replace(cfg, mode="serial") if cfg.mode == "all" else cfg
    if cfg.world_size > 1:  # meta.json records what ran: serial rounds across ranks
        cfg = replace(cfg, overlap_schedule=False, split_streams=False)
    return replace(cfg, cpu_device=cfg.resolved_cpu_device())


def _say_rejections(out: Path, fail: Callable[..., NoReturn]) -> None:
    """Requests the engine refused, each distinct reason with its count, on stderr; a run
    that served none of them is bad input (exit 2)."""
    from collections import Counter

    from tracing.reader import read_table

    req = read_table(out, "requests", ["finish_reason", "finish_detail"]).to_pydict()
    # one reason, whatever its numbers: "prompt of 98 tokens needs 7 blocks" ~ "... of 246 ... 16 ..."
    why: Counter[str] = Counter()
    first: dict[str, str] = {}
    for r, d in zip(req["finish_reason"], req["finish_detail"], strict=True):
        if r == "rejected":
            key = re.sub(r"\d+", "#", d or "no reason recorded")
            why[key] += 1
            first.setdefault(key, d or "no reason recorded")
    n, total = sum(why.values()), len(req["finish_reason"])
    if not n:
        return
    shown = "; ".join(f"{c} like \"{first[k]}\"" for k, c in why.most_common(3))
    more = f"; {len(why) - 3} other reasons (mstrace report {out} --json)" if len(why) > 3 else ""
    line = f"{n} of {total} requests rejected: {shown}{more}"
    if n == total:
        fail(f"every request was rejected, none ran: {shown}{more}", 2)
    print(f"warning: {line}", file=sys.stderr, flush=True)


def check_out(out: Path, force: bool, fail: Callable[[str], NoReturn]) -> None:
    """--out must be new, empty, or (with --force) a trace to replace that no writer holds.
    Checks only: `claim_out` removes, once every other input has been checked."""
    if out.is_symlink() and force:
        fail(f"--out {out} is a symbolic link: give the folder itself")
    if out.exists() and not out.is_dir():
        fail(f"--out {out} is a file, not a folder")
    if out.exists() and any(out.iterdir()):
        if not force:
            hint = "; --force replaces it" if is_trace_folder(out) else ""
            fail(f"output folder {out} is not empty; choose another --out{hint}")
        if not is_trace_folder(out):
            fail(f"--force replaces a trace, and {out} holds other files: choose another --out")
        from tracing.store_lock import live_ranks

        for t in (out, *(p for p in out.iterdir() if p.name in MODES)):
            if live_ranks(t):  # its writer would go on into the new run's folder, corrupting both
                fail(f"{t} is being written by a running mstrace (its writer holds the trace's lock): "
                     "--force replaces only a finished or killed trace")


def claim_out(out: Path, force: bool, fail: Callable[[str], NoReturn]) -> None:
    """`check_out`, then a --force'd trace removed."""
    check_out(out, force, fail)
    if out.exists() and any(out.iterdir()):
        try:
            shutil.rmtree(out)
        except OSError as e:
            fail(f"--force could not remove {out}: {e.strerror or e}")


def is_trace_folder(path: Path) -> bool:
    """A trace, or a `--mode all` run's folder of traces (serial/, timeslice/, overlap/):
    what --force may replace. A folder of other runs' traces is not one (all were removed)."""
    def trace(p: Path) -> bool:
        return (p / "meta.json").is_file() or (p / "manifest.json").is_file()

    subs = list(path.iterdir())
    return trace(path) or (bool(subs) and all(p.name in MODES and p.is_dir() and trace(p) for p in subs))


def _check_prompts_have_a_tokenizer(items: list[Any], model_dir: Path, workload: Path) -> None:
    from scheduler.hops.tokenizer import Tokenizer, TokenizerError
    from scheduler.options import ConfigError

    first = next((i for i, it in enumerate(items) if it.prompt is not None), None)
    if first is None:
        return
    try:
        Tokenizer(model_dir)
    except TokenizerError:
        raise ConfigError(f"{workload}:{first + 1}: a prompt needs a tokenizer, and {model_dir} has none; "
                          "give input_ids instead") from None


def say_dtype(engine: Any) -> None:
    """A checkpoint that runs in another dtype than its own says so (meta.json records both)."""
    from scheduler.model.dtypes import name_of

    ran, own = engine.backend.dtype, engine.model_config.torch_dtype
    if ran != own:
        print(f"note: the checkpoint is {name_of(own)}; it runs in {name_of(ran)} on {engine.device.type} "
              f"({engine.backend.dtype_why}; --dtype {name_of(own)} keeps it)", file=sys.stderr, flush=True)


def check_device(device: str) -> None:
    import torch

    from scheduler.options import ConfigError

    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device cuda: this torch ({torch.__version__}) sees no CUDA device; "
                          "use --device cpu or auto")


def _torch_profile(opts: RunOptions, engine: Any) -> Any:
    if opts.torch_profile is None:
        return None
    from scheduler.harness.torch_profile import TorchProfile

    profile = TorchProfile(opts.torch_profile)
    profile.start(engine)
    return profile


def _say_profile_cost(cost: dict[str, Any], run_ns: int) -> None:
    share = f", {100 * cost['ranges_cost_ns'] / run_ns:.1f}% of the run" if run_ns > 0 else ""
    print(f"torch.profiler: wrote {cost['file']}; its {cost['ranges']} mstrace ranges cost "
          f"{cost['ranges_cost_ns'] / 1e6:.1f} ms ({cost['range_ns']:.0f} ns each, measured under the profiler)"
          f"{share}; `mstrace import {cost['file']} --round '^mstrace::round$'` reads it", file=sys.stderr, flush=True)


def _run_one(opts: RunOptions, cfg: EngineConfig, items: list[Any], source: str, out: Path, console: Console,
             fail: Callable[[str], NoReturn], made: Path | None, seed: DeviceSeed | None,
             ranks: Sequence[RankSeed] = ()) -> None:
    """`made`: the folder this run created, removed again if the engine never starts;
    `seed`: its device process and `ranks` its other ranks, forked early (scheduler/seeds.py)."""
    from scheduler.harness.runner import RunResult, TraceRequestsSink, run_workload
    from scheduler.harness.session import TracedSession
    from tracing.otel import SpanSink

    # progress is for a person at a terminal: on stderr, and never into a pipe or a file
    err = Console(stderr=True)
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=err, disable=opts.quiet or not err.is_terminal,
                        transient=False)
    task = progress.add_task(f"{cfg.mode} run", total=len(items))
    result = RunResult(0, 0, 0, len(items))
    try:
        with TracedSession(cfg, out, made, items, source, fail, seed) as session:
            span_sink = SpanSink(session.writer, session.anchor, opts.otlp_endpoint)
            # after the engine (its sender is drained), before the writer's last flush
            session.on_close(lambda ok: span_sink.close())
            parallel = None
            if cfg.world_size > 1:  # TP/PP: rank 0's side of the other ranks (scheduler/parallel/coordinator.py)
                from scheduler.parallel.coordinator import Coordinator

                def parallel() -> Any:
                    return Coordinator.start(cfg, out, ranks)
            engine = session.start([TraceRequestsSink(session.writer), span_sink, _ProgressSink(progress, task)],
                                   parallel)
            say_dtype(engine)
            profile = _torch_profile(opts, engine)
            try:
                with progress:
                    run_workload(engine, items, result=result)
            finally:  # `result` knows how far a run that failed got
                session.timing(result.start_ns or None, result.end_ns or None, result.steps, result.cpu)
                if profile is not None:
                    cost = profile.stop()
                    session.record("torch_profile", cost)
                    _say_profile_cost(cost, result.end_ns - result.start_ns)
            session.ended("complete")
    except KeyboardInterrupt:  # typer exits 130 without a word; say where the evidence is
        print(f"interrupted: trace flushed to {out}", file=sys.stderr, flush=True)
        raise
