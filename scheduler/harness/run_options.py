"""What `mstrace run` needs beyond the engine's configuration: the workload, where
the trace goes, how the run reports. Declared like EngineConfig (scheduler/options.py):
each field carries its own bounds, and `validate` checks them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scheduler.options import OUTPUT, WORKLOAD, ConfigError, check_fields, option, parse_path


def _length_range(flag: str) -> Any:
    def parse(v: Any) -> tuple[int, int]:
        """"16-512", "64", or (in a TOML file) [16, 512] or 64 -> (min, max)."""
        try:
            if isinstance(v, list | tuple) and len(v) == 2 and all(type(x) is int for x in v):
                a, b = v
            elif type(v) is int:
                a = b = v
            elif isinstance(v, str):
                lo, _, hi = v.partition("-")
                a, b = int(lo), int(hi or lo)
            else:
                raise ValueError
        except ValueError:
            raise ConfigError(f"{flag} must look like 16-512 or 64, got {v!r}") from None
        if a < 1 or b < a:
            raise ConfigError(f"{flag} must satisfy 1 <= min <= max, got {v!r}")
        return a, b

    return parse


@dataclass(slots=True)
class RunOptions:
    workload: Path | None = option(None, "JSONL workload file; otherwise a synthetic one.", WORKLOAD, parse=parse_path)
    requests: int = option(64, "Synthetic: number of requests.", WORKLOAD, ge=1, refusal="{flag} must be >= 1")
    prompt_len: tuple[int, int] = option((32, 256), "Synthetic: prompt length range, MIN-MAX tokens.", WORKLOAD,
                                         cli_type=str, cli_default="32-256", parse=_length_range("--prompt-len"),
                                         check=_length_range("--prompt-len"))
    output_len: tuple[int, int] = option((32, 128), "Synthetic: output length range, MIN-MAX tokens.", WORKLOAD,
                                         cli_type=str, cli_default="32-128", parse=_length_range("--output-len"),
                                         check=_length_range("--output-len"))
    shared_prefix: float = option(0.25, "Synthetic: fraction of requests sharing one system prompt.", WORKLOAD,
                                  ge=0, le=1)
    rate: float = option(0.0, "Synthetic: Poisson arrival rate in requests/s; 0 = all at t=0.", WORKLOAD, ge=0)
    save_workload: Path | None = option(None, "Also write the workload that ran as JSONL.", WORKLOAD, parse=parse_path)
    out: Path | None = option(None, "Trace directory (default: a new folder under traces/).", OUTPUT, parse=parse_path)
    force: bool = option(False, "Replace the trace already in --out (a trace folder, or a --mode all run's).",
                         OUTPUT)
    quiet: bool = option(False, "No progress bar.", OUTPUT, flag="quiet", short="-q")
    live: bool = option(False, "Watch the run in `mstrace top` instead of a progress bar (the run goes on in its "
                        "own process; q leaves the view and stops the run).", OUTPUT)
    torch_profile: Path | None = option(None, "Also record the run with torch.profiler (CPU activities) into this "
                                        "folder, every boundary also a record_function range; `mstrace import` reads "
                                        "it (docs/import.md).", OUTPUT, parse=parse_path)
    otlp_endpoint: str | None = option(None, "Also send request spans to this OTLP/HTTP collector (e.g. "
                                       "http://localhost:4318); needs mstrace\\[otlp].", OUTPUT)

    def validate(self) -> None:
        """Each field against its own declaration; ConfigError with the first problem."""
        check_fields(self)
