"""What one round leaves in the trace: the moments it passed, the host probe rows they
make, and its `steps` row, whose fields are the schema's own columns (tests/test_store.py
checks the names against tracing/schema.py, so their order cannot drift).

In overlap mode a round launches batch N and collects batch N-1: its `steps` row counts
the batch it launched (`num_prefill_*`, `num_decode_*`), while `dur_device_ns` and
`collect_ns` are the collected batch's (docs/trace-schema.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from probes.boundaries import BATCH_PREPARE, BOOKKEEPING, RESPONSE_SEND
from probes.clock import now_ns

if TYPE_CHECKING:
    from probes.recorder import ProbeRow
    from scheduler.core.batch import ScheduleBatch
    from scheduler.device.prepared import Launch


@dataclass(slots=True)
class InFlight:
    """A batch launched and not yet collected, with its launches (one per stream)."""

    batch: ScheduleBatch
    launches: list[Launch]


class StepsRow(NamedTuple):
    step: int
    mode: str
    ts_ns: int
    dur_ns: int
    dur_host_ns: int
    dur_device_ns: int
    num_prefill_reqs: int
    num_prefill_tokens: int
    num_decode_reqs: int
    num_decode_tokens: int
    blocks_used: int
    blocks_free: int
    num_waiting: int
    num_running: int
    out_queue_depth: int
    collect_ns: int  # when the collected batch's tokens were read (0: none collected)
    blocks_fenced: int


class RoundClock:
    """The moments of one round, stamped as it passes them, and the host rows between them:
    intake and scheduling (bookkeeping), the launch (batch_prepare), the barrier (the
    scheduler_barrier rows come from the wait itself), collect and housekeeping
    (bookkeeping, less a defrag pause, which is its own row), the hand-off (response_send)."""

    __slots__ = ("start", "scheduled", "launched", "synced", "pause", "housekept", "sent")

    def __init__(self) -> None:
        self.start = now_ns()
        self.scheduled = self.launched = self.synced = self.housekept = self.sent = 0
        self.pause = (0, 0)  # a defrag pause's (start, end) inside housekeeping

    def host_rows(self, buf: list[ProbeRow], rank: int, step: int, launched: bool) -> None:
        buf.append((self.start, self.scheduled - self.start, BOOKKEEPING, "host", rank, step))
        if launched:
            buf.append((self.scheduled, self.launched - self.scheduled, BATCH_PREPARE, "host", rank, step))
        p0, p1 = self.pause
        if p1:
            buf.append((self.synced, p0 - self.synced, BOOKKEEPING, "host", rank, step))
            buf.append((p1, self.housekept - p1, BOOKKEEPING, "host", rank, step))
        else:
            buf.append((self.synced, self.housekept - self.synced, BOOKKEEPING, "host", rank, step))

    def send_row(self, buf: list[ProbeRow], rank: int, step: int) -> None:
        buf.append((self.housekept, self.sent - self.housekept, RESPONSE_SEND, "host", rank, step))
