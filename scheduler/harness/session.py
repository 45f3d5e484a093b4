"""One traced engine's life, owned by one object: `run`, `serve` and `run --live`'s child
all go through `TracedSession`.

It opens the trace (one line where the folder cannot be written), writes meta.json before
the engine exists (a run killed while its model loads still leaves a trace that reads),
starts the engine (a failure to start is one line and leaves nothing behind), and, however
the session ends, closes the engine and what the caller hands it to close, then writes the
end record after the last commit: a trace that has it is whole.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn

from probes.clock import wall_anchor
from scheduler.harness.runner import run_meta, start_meta
from tracing.run_status import end_record, first_line

if TYPE_CHECKING:
    from scheduler.config import EngineConfig
    from scheduler.device.device_process import DeviceSeed
    from scheduler.engine import Engine
    from scheduler.harness.workload import WorkloadItem
    from scheduler.hops.sender import OutputSink
    from scheduler.parallel.coordinator import Coordinator
    from scheduler.parallel.worker import RankSeed
    from tracing.writer import TraceWriter

Fail = Callable[..., NoReturn]  # (message, exit code = 2)
NO_DETAIL = "the run ended without saying why"


def open_trace(out: Path, made: Path | None, fail: Fail) -> TraceWriter:
    """The trace's writer, or one line and exit 2 where `out` cannot be written (a read-only
    file system, no permission): nothing was run, so nothing is said to be flushed."""
    from tracing.writer import TraceWriter

    try:
        return TraceWriter(out)  # makes the folders and takes the writer's lock: the first writes
    except OSError as e:
        remove_unstarted(made, out)
        fail(f"cannot write a trace to {out}: {e.strerror or e}")


def remove_unstarted(made: Path | None, out: Path) -> None:
    """Undo a session that never started: the folder it made, or what it put in an empty --out."""
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)
        return
    for p in out.iterdir() if out.is_dir() else ():
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def fork_device_seeds(cfg: EngineConfig, runs: int) -> list[DeviceSeed | None]:
    """The device processes that `runs` sessions of `cfg` will hand their engines, forked
    now: a command calls it before it runs a torch op or starts a thread (DeviceSeed says
    why); None for each where the engine has no device process, or where a fork is not
    safe here (the engine then starts its own, scheduler/device/device_process.py)."""
    from scheduler.device.backend import runs_device_process
    from scheduler.device.device_process import DeviceSeed

    seeds = DeviceSeed.fork(runs) if runs_device_process(cfg) else None
    return list(seeds) if seeds is not None else [None] * runs


def fork_rank_seeds(cfg: EngineConfig) -> list[RankSeed]:
    """A TP/PP run's other ranks, forked now for the same reason as `fork_device_seeds`
    (such a run has no device process, so the two never fork in one command); none under
    torchrun (its agent starts every rank) or where a fork is not safe here (the ranks are
    then fresh interpreters, scheduler/parallel/launch.py)."""
    if cfg.world_size == 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return []
    from scheduler.parallel.worker import RankSeed

    return RankSeed.fork(cfg.world_size - 1)


class TracedSession:
    """`with TracedSession(...) as s: engine = s.start(sinks); ...; s.timing(...); s.ended("complete")`.

    `made`: the folder this session created, removed again if the engine never starts.
    Leaving the block by an exception records why: Ctrl-C is `interrupted`, a stall
    `stalled`, anything else `error` with its first line."""

    def __init__(self, cfg: EngineConfig, out: Path, made: Path | None, items: list[WorkloadItem], source: str,
                 fail: Fail, device_seed: DeviceSeed | None = None) -> None:
        self.cfg, self.out, self.made, self.items, self.source, self.fail = cfg, out, made, items, source, fail
        self.device_seed = device_seed  # the engine's device process, forked early (DeviceSeed)
        self.anchor = wall_anchor()  # one anchor for meta.json and the spans, so they agree exactly
        self.writer = open_trace(out, made, fail)
        self.writer.write_meta(start_meta(cfg, items, source, self.anchor))
        self.engine: Engine | None = None
        self.state, self.detail = "error", NO_DETAIL
        self._span: tuple[int | None, int | None, int, dict[str, Any] | None] = (None, None, 0, None)
        self._requests: int | None = None
        self._closers: list[Callable[[bool], str | None]] = []
        self._extra: dict[str, Any] = {}  # more of the end record (run --torch-profile's cost)

    def start(self, sinks: list[OutputSink], parallel: Callable[[], Coordinator] | None = None) -> Engine:
        """The engine, after `parallel()` has started a TP/PP run's other ranks."""
        from scheduler.engine import Engine
        from scheduler.model.config import ModelLoadError
        from scheduler.options import ConfigError

        try:
            coord = parallel() if parallel is not None else None
            if coord is not None:
                self.on_close(coord.close)  # STOP on success; else terminate, then kill: no rank outlives it
            engine = Engine(self.cfg, sinks=sinks, trace=self.writer, parallel=coord, device_seed=self.device_seed)
        except (ModelLoadError, ConfigError, ValueError) as e:
            self.detail = str(e)
            self.fail(self.detail)
        except Exception as e:  # noqa: BLE001 - e.g. a device process or rank that failed to start
            self.detail = first_line(e)
            self.fail(f"the engine could not start: {self.detail}")
        self.engine = engine
        self.writer.write_meta(run_meta(engine, self.items, self.source, self.anchor))
        return engine

    def on_close(self, close: Callable[[bool], str | None]) -> None:
        """Something to close after the engine, before the last commit; it is told whether
        the session completed (a TP coordinator stops its ranks, or kills them), and returns
        what went wrong in closing it, which makes a completed session an error."""
        self._closers.append(close)

    def ended(self, state: str, detail: str = "") -> None:
        """How the session ended, where it did not end by an exception (`complete`, or what
        a server's loop reports: `stalled`, `error`)."""
        self.state, self.detail = state, detail

    def timing(self, start_ns: int | None, end_ns: int | None, rounds: int, cpu: dict[str, Any] | None = None,
               requests: int | None = None) -> None:
        """The loop's own clock and rounds, for the end record; `requests`: meta.json's
        workload count where requests came as they came (serve)."""
        self._span = (start_ns, end_ns, rounds, cpu)
        self._requests = requests

    def record(self, key: str, value: Any) -> None:
        """One more entry of the end record (meta.json `run.<key>`)."""
        self._extra[key] = value

    def __enter__(self) -> TracedSession:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        from scheduler.stall_guard import EngineStalled

        if ev is not None:
            if isinstance(ev, KeyboardInterrupt):
                self.state, self.detail = "interrupted", "Ctrl-C"
            elif isinstance(ev, EngineStalled):
                self.state, self.detail = "stalled", str(ev)
            elif self.detail == NO_DETAIL:
                self.state, self.detail = "error", first_line(ev)
            else:
                self.state = "error"
        engine = self.engine
        try:
            if engine is not None:
                engine.close()
        except BaseException as e:
            if self.state == "complete":  # the run's threads failed as they stopped, or Ctrl-C came then
                self.state, self.detail = ("interrupted", "Ctrl-C") if isinstance(e, KeyboardInterrupt) \
                    else ("error", first_line(e))
            raise
        finally:
            problem = None
            for close in self._closers:
                problem = close(self.state == "complete") or problem
            if problem and self.state == "complete":
                self.state, self.detail = "error", problem
            else:
                problem = None
            if self.device_seed is not None:  # one no engine took
                self.device_seed.close()
            self._commit_end(engine)
        if problem:  # the run's exit code for a failure, as a failed engine thread gets
            self.fail(f"the run failed: {problem}; trace flushed to {self.out}", 4)

    def _commit_end(self, engine: Engine | None) -> None:
        meta = (run_meta(engine, self.items, self.source, self.anchor) if engine is not None
                else start_meta(self.cfg, self.items, self.source, self.anchor))
        submitted = engine.submitted if engine is not None else 0
        if self._requests is not None:
            meta["workload"]["requests"] = self._requests
        meta["run"] = {**end_record(self.state, self.detail, submitted, *self._span), **self._extra}
        if engine is not None and (times := engine.device_stream_times()):
            meta["run"]["device_stream_times"] = times  # report's backend.device_waiting_share
        try:
            self.writer.close(meta)  # the end record comes after the last commit
        except OSError as e:  # a full disk, a vanished folder: the trace is not whole, say so
            self.fail(f"could not write the trace to {self.out}: {e}")
        if engine is None and self.state == "error":  # no engine ever ran: nothing of it stays behind
            remove_unstarted(self.made, self.out)
