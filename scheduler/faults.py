"""Fault injection (--inject NAME): each fault reproduces a failure from the
seed's troubleshooting chapter on purpose, so the tooling can be shown to
catch it. Off by default."""

from __future__ import annotations

FAULTS: dict[str, str] = {
    "deadlock": "overlap mode with split streams: the main stream waits for blocks the prefill stream "
                "would free while the prefill stream waits for an event from the main stream",
    "leak": "the first request to finish dies on an exception path that skips freeing its blocks",
    "slow-sender": "the output path takes 50 ms per round to deliver tokens (a slow client)",
    "starve": "four long decodes are submitted first and pin ~90% of the KV pool",
    "stall-rank": "with --tp/--pp > 1, the last rank stops joining collectives at step 3 (it hangs "
                  "before its next all-reduce, or before its forward without TP) until the run is ended",
}

SLOW_SENDER_S = 0.05
STALL_RANK_STEP = 3


def parse_faults(names: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    for n in names:
        if n not in FAULTS:
            raise ValueError(f"unknown fault {n!r}; choose from {', '.join(FAULTS)}")
    return tuple(names)
