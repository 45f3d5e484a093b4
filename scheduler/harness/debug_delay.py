"""The truth harness's known delays (`--debug-delay-ms PLACE=MS`, test-only, hidden).

A delay of a known length at one place in the round lets a test check that the
cost table charges it to the right row of each view and to no other
(tests/test_truth.py). Off by default: see scheduler/harness/faults.py, which holds them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from probes.clock import now_ns

DEVICE_COMPUTE = "device_compute"  # inside the forward, on the device
BOOKKEEPING = "bookkeeping"
BATCH_PREPARE = "batch_prepare"
RESPONSE_SEND = "response_send"
BETWEEN_ROUNDS = "between_rounds"  # host time after a round's last probe, before the next round
PLACES = (DEVICE_COMPUTE, BOOKKEEPING, BATCH_PREPARE, RESPONSE_SEND, BETWEEN_ROUNDS)



def parse(specs: list[str] | tuple[str, ...]) -> tuple[tuple[str, float], ...]:
    """["bookkeeping=2", ...] -> (("bookkeeping", 2.0), ...); ValueError with one line."""
    out: dict[str, float] = {}
    for spec in specs:
        place, sep, ms = spec.partition("=")
        if not sep or place not in PLACES:
            raise ValueError(f"--debug-delay-ms takes PLACE=MS with PLACE one of {', '.join(PLACES)}, got {spec!r}")
        try:
            value = float(ms)
        except ValueError:
            raise ValueError(f"--debug-delay-ms {place}: {ms!r} is not a number of ms") from None
        if not value >= 0 or value == float("inf"):  # NaN fails the first test
            raise ValueError(f"--debug-delay-ms {place}: must be a finite number of ms >= 0")
        out[place] = out.get(place, 0.0) + value
    return tuple(out.items())


def delay_ns(delays: tuple[tuple[str, float], ...], place: str) -> int:
    return int(dict(delays).get(place, 0.0) * 1e6)


def hold(ns: int) -> int:
    """Busy-hold the calling thread for at least `ns`, as real work would; returns how long it
    held. Spun, not slept: a sleep ends late by however long the woken thread waits for a core.
    A spin can still end late (descheduled at its deadline, on a loaded machine), so the
    harness compares rows against what was held, not against what was asked for."""
    start = now_ns()
    until = start + ns
    t = start
    while t < until:
        t = now_ns()
    return t - start


class HeldForward:
    """A model whose every forward is followed by a known hold (the device_compute place),
    put in the model's stead at construction, so the round itself never checks for it.
    `held_ns` is what the holds took where the host can time them (a CPU device); a GPU's
    hold is a kernel the host does not wait for, so there it stays None."""

    def __init__(self, model: Callable[..., Any], ns: int, hold: Callable[[int], int | None] = hold) -> None:
        self.model, self.ns, self._hold = model, ns, hold
        self.count = 0
        self.held_ns: int | None = 0

    def __call__(self, *args: Any) -> Any:
        out = self.model(*args)
        took = self._hold(self.ns)
        self.count += 1
        self.held_ns = None if took is None or self.held_ns is None else self.held_ns + took
        return out

    def tally(self) -> tuple[int, int] | None:
        """(count, held_ns) of the holds so far, or None where they were not timed."""
        return None if self.held_ns is None else (self.count, self.held_ns)


class Held:
    """What each host place actually held, for meta.json (`debug_delays`)."""

    def __init__(self) -> None:
        self.count: dict[str, int] = {}
        self.ns: dict[str, int] = {}

    def hold(self, place: str, ns: int) -> None:
        self.add(place, 1, hold(ns))

    def add(self, place: str, count: int, held_ns: int) -> None:
        self.count[place] = self.count.get(place, 0) + count
        self.ns[place] = self.ns.get(place, 0) + held_ns

    def to_dict(self) -> dict[str, dict[str, int]]:
        return {p: {"count": self.count[p], "held_ns": self.ns[p]} for p in self.count}
