"""What `mstrace serve` needs beyond the engine's configuration. Declared like
EngineConfig (scheduler/options.py), so flags, TOML keys, bounds and meta.json agree."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from scheduler.options import OUTPUT, SERVER, check_fields, option, parse_path

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(slots=True)
class ServeOptions:
    host: str = option("127.0.0.1", "Address to bind. Another than loopback without --api-key prints a "
                       "warning: anyone who can reach it can use the model.", SERVER)
    port: int = option(8000, "TCP port; 0 takes a free one (the line 'serving on URL' says which).", SERVER,
                       ge=0, le=65535, refusal="{flag} must be in 0..65535, got {value}")
    api_key: str | None = option(None, "Require 'Authorization: Bearer KEY' on every /v1 route.", SERVER)
    served_model_name: str | None = option(None, "The model's name in the API (default: --model).", SERVER)
    max_body_bytes: int = option(1 << 20, "Largest request body accepted; a larger one gets 413.", SERVER, ge=1024)
    send_buffer_bytes: int = option(256 << 10, "Kernel send buffer of each connection (SO_SNDBUF): what a slow "
                                    "client's socket may hold before writes to it wait. 0: the kernel's "
                                    "autotuning (up to MBs).", SERVER, ge=0)
    shutdown_timeout_s: float = option(30.0, "On SIGTERM or Ctrl-C: how long requests in flight may run "
                                       "before they are aborted; then the trace is committed.", SERVER, ge=0)
    out: Path | None = option(None, "Trace directory (default: a new folder under traces/).", OUTPUT,
                              parse=parse_path)
    force: bool = option(False, "Replace the trace already in --out.", OUTPUT)

    def validate(self) -> None:
        """Each field against its own declaration; ConfigError with the first problem."""
        check_fields(self)
