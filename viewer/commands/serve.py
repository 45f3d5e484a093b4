"""`mstrace serve`: the engine behind an OpenAI-compatible HTTP API, traced like `run`.

Threads: uvicorn's event loop on the main thread (routes, SSE writes), the
scheduling thread (scheduler/serving/engine_loop.py), the tokenizer pool and the
sender, as in `run`. SIGTERM or Ctrl-C: stop accepting, let requests in flight
finish for --shutdown-timeout-s, abort the rest, then commit the trace and exit 0.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from rich.console import Console
from rich.markup import escape

from scheduler.config import EngineConfig
from scheduler.serving.options import LOOPBACK, ServeOptions

if TYPE_CHECKING:
    from scheduler.device.device_process import DeviceSeed


def execute_serve(cfg: EngineConfig, opts: ServeOptions, console: Console, fail: Callable[..., NoReturn]) -> None:
    from scheduler.harness.session import fork_device_seeds
    from scheduler.model.config import ModelConfig, ModelLoadError
    from scheduler.model.loader import safetensors_files
    from scheduler.model.presets import resolve_model
    from scheduler.options import ConfigError
    from viewer.commands.run import check_device, check_out, claim_out

    if cfg.world_size > 1:
        fail("serve runs one rank: --tp/--pp > 1 are for `mstrace run`")
    if cfg.mode == "all":
        fail("--mode all runs a workload three times; serve one mode: serial, timeslice or overlap")
    try:
        cfg.validate()
        opts.validate()
        cfg = replace(cfg, cpu_device=cfg.resolved_cpu_device())
        seed = fork_device_seeds(cfg, 1)[0]  # before a preset's first build runs a torch op
        model_dir = resolve_model(cfg.model)
        context = ModelConfig.from_file(model_dir / "config.json").max_position_embeddings
        safetensors_files(model_dir)  # a folder without weights fails here, before anything is made
        check_device(cfg.device)
    except (ConfigError, FileNotFoundError, ValueError, ModelLoadError) as e:
        fail(str(e))
    out = opts.out or Path("traces") / datetime.now().strftime("serve-%Y%m%d-%H%M%S")
    check_out(out, opts.force, fail)  # removed (--force) only once the port is bound
    try:
        sock = socket.create_server((opts.host, opts.port), family=socket.AF_INET6 if ":" in opts.host
                                    else socket.AF_INET)
        if opts.send_buffer_bytes:  # accepted connections inherit it
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, opts.send_buffer_bytes)
    except OSError as e:
        fail(f"cannot listen on {opts.host}:{opts.port}: {e.strerror or e}")
    claim_out(out, opts.force, fail)
    made = not out.exists()  # removed again if the engine never starts
    if opts.host not in LOOPBACK and not opts.api_key:
        print(f"warning: serving on {opts.host} without --api-key: anyone who can reach this address "
              "can use the model", file=sys.stderr, flush=True)
    _serve(cfg, opts, context, out, made, sock, console, fail, seed)


def _serve(cfg: EngineConfig, opts: ServeOptions, context: int, out: Path, made: bool, sock: socket.socket,
           console: Console, fail: Callable[..., NoReturn], seed: DeviceSeed | None) -> None:
    import uvicorn

    from scheduler.harness.runner import TraceRequestsSink
    from scheduler.harness.session import TracedSession
    from scheduler.serving.app import ServerState, make_app
    from scheduler.serving.chat import ChatTemplate
    from scheduler.serving.engine_loop import EngineLoop
    from scheduler.serving.http_protocol import TimedHttpProtocol
    from scheduler.serving.metrics import ServerMetrics
    from scheduler.serving.protocol import created
    from scheduler.serving.responses import Responder
    from scheduler.serving.streams import ResponseStreams
    from viewer.commands.live_cost import LiveCost
    from viewer.commands.live_cost import collector as live_collector
    from viewer.commands.run import say_dtype

    source = f"serve:{opts.host}:{sock.getsockname()[1]}"
    engine: Any = None
    try:
        with TracedSession(cfg, out, out if made else None, [], source, fail, seed) as session:
            writer = session.writer
            # (the engine is made below: these run only once it serves)
            streams = ResponseStreams(lambda rid, why: engine.request_abort(rid, why),
                                      lambda token: engine.tokenizer.token_text(token) if engine.tokenizer
                                      else (str(token), False))
            name = opts.served_model_name or cfg.model
            metrics = ServerMetrics(name, context)
            live = LiveCost()  # the cost table as the trace is committed: mstrace:boundary_seconds_total
            writer.tap("probes", live.on_probes)
            writer.tap("steps", live.on_steps)
            metrics.registry.register(live_collector(live, (name, "0")))
            engine = session.start([TraceRequestsSink(writer), streams, metrics])
            metrics.engine = engine
            say_dtype(engine)
            loop = EngineLoop(engine, lambda st: metrics.on_round(st.dur_ns, st.num_prefill_tokens, st.num_sampled),
                              on_fail=streams.fail_all)
            http_buf = writer.buffer("probes") if cfg.probes else None
            responder = Responder(streams,
                                  lambda p, sp, rid, special: engine.submit(p, sp, rid, add_special_tokens=special),
                                  engine.request_abort, http_buf, lambda: engine.step_no,
                                  engine.tokenizer.decode if engine.tokenizer else None, writer.buffer("timeline"))
            chat = ChatTemplate(engine.model_dir, engine.tokenizer.special_prefix() if engine.tokenizer else "")
            st = ServerState(loop, metrics, responder, chat, name,
                             engine.model_config.max_position_embeddings, opts.api_key, created())
            app = make_app(st, opts.max_body_bytes)
            server = uvicorn.Server(uvicorn.Config(app, http=TimedHttpProtocol, log_level="warning",
                                                   access_log=False, lifespan="off",
                                                   timeout_graceful_shutdown=max(1, int(opts.shutdown_timeout_s))))
            loop.start()
            host, port = sock.getsockname()[:2]
            host = f"[{host}]" if ":" in host else host  # an IPv6 address in a URL
            console.print(f"serving {escape(name)} on http://{host}:{port} (trace: {escape(str(out))}); "
                          "Ctrl-C stops", highlight=False)
            # asyncio warns on every write to a socket whose client just left, until the
            # disconnect reaches the route: with many clients leaving, a flood on stderr
            logging.getLogger("asyncio").setLevel(logging.ERROR)
            # uvicorn stops on SIGTERM/SIGINT, then raises the signal again for the handler it
            # found: SIGTERM's must not kill the process before the trace is committed.
            signal.signal(signal.SIGTERM, lambda *_: None)
            try:
                try:
                    server.run(sockets=[sock])
                except KeyboardInterrupt:
                    pass
                loop.stop(opts.shutdown_timeout_s, streams.open_ids())
            finally:
                session.timing(loop.start_ns or None, loop.end_ns or None, loop.rounds, None, engine.submitted)
            h = loop.health()
            session.ended(*{"stopped": ("complete", ""), "stalled": ("stalled", h.detail)}.get(
                h.state, ("error", h.detail)))
    finally:
        sock.close()
    state, detail = session.state, session.detail
    console.print(f"trace written to [bold]{escape(str(out))}[/]", soft_wrap=True)
    if state == "stalled":
        fail(f"the engine stalled: {detail}; see `mstrace stalls {out}`", 3)
    if state != "complete":
        fail(f"the engine failed: {detail}; trace flushed to {out}", 4)
