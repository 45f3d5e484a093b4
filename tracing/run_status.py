"""How a run ended, from its end-of-run record (meta.json `run`).

`mstrace run` writes the record after the writer's last commit, whatever the
outcome it can still observe: `complete`, `stalled` (a wait passed its timeout),
`error` (an exception ended the run) or `interrupted` (Ctrl-C). A trace without
it was killed, or is still being written (its writer lock is held): `truncated`.
Every command says so on its first line when the state is not `complete`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tracing.store_lock import live_ranks

STATES = ("complete", "truncated", "stalled", "error", "interrupted")


@dataclass(slots=True)
class RunStatus:
    state: str
    detail: str = ""  # the stall or error message
    live: bool = False  # truncated because a writer is still running
    submitted: int | None = None  # requests the run had submitted when it ended
    workload: int | None = None  # requests in the workload
    clipped: dict[str, int] = field(default_factory=dict)  # rows past the last committed round, per table

    @property
    def complete(self) -> bool:
        return self.state == "complete"

    def headline(self) -> str | None:
        """The one line every command prints first for an incomplete trace (None when complete)."""
        if self.state == "complete":
            line = None
        elif self.state == "truncated" and self.detail:  # an imported file cut off mid-write
            line = f"TRUNCATED: {self.detail}"
        elif self.state == "truncated":
            line = ("TRUNCATED: the run is still being written; showing its committed flushes so far"
                    if self.live else
                    "TRUNCATED: no end-of-run record (the run was killed); showing its committed flushes")
        elif self.state == "stalled":
            line = f"STALLED: the run ended in a stall: {self.detail}"
        elif self.state == "error":
            line = f"FAILED: the run ended in an error: {self.detail}"
        else:
            of = f" of {self.workload}" if self.workload is not None else ""
            line = f"INTERRUPTED (Ctrl-C) after {self.submitted}{of} requests were submitted"
        clipped = ", ".join(f"{n} {t} rows" for t, n in sorted(self.clipped.items()) if n)
        if clipped:
            line = f"{line or 'note'}; clipped {clipped} past the last committed round"
        return line

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_status(root: Path, meta: dict[str, Any]) -> RunStatus:
    workload = (meta.get("workload") or {}).get("requests")
    run = meta.get("run")
    if not isinstance(run, dict):
        return RunStatus("truncated", live=bool(live_ranks(root)), workload=workload)
    state = run.get("status", "complete")  # records from before `status` existed were clean finishes
    if state not in STATES or (state == "truncated" and "import" not in meta):
        state = "error"  # only an import records `truncated` (its source file was cut off)
    return RunStatus(state, str(run.get("detail") or ""), submitted=run.get("submitted"), workload=workload)


def end_record(state: str, detail: str, submitted: int, start_ns: int | None, end_ns: int | None,
               steps: int | None, cpu: dict[str, Any] | None = None) -> dict[str, Any]:
    """meta.json `run`, written once the last flush is committed. `cpu`: the run's CPU
    time (probes/cpu.py), when it ended cleanly; the writer adds its own cost (`writer`)."""
    rec: dict[str, Any] = {"status": state, "detail": detail, "submitted": submitted, "start_ns": start_ns,
                           "end_ns": end_ns, "steps": steps}
    if cpu is not None:
        rec["cpu"] = cpu
    return rec


def first_line(e: BaseException) -> str:
    """An error's first line, for a run's one-line detail (its type's name when it says nothing)."""
    return (str(e).strip().splitlines() or [""])[0] or type(e).__name__
