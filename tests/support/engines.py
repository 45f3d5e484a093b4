"""Running an Engine to the end from a test (a helper module, not a test module)."""

from __future__ import annotations

from scheduler.engine import Engine


def drive(eng: Engine, limit: int = 2000) -> None:
    """Rounds until the engine has nothing left; an engine still busy after `limit` fails."""
    for _ in range(limit):
        if not eng.has_work():
            return
        if eng.step() is None:
            eng.wait_for_arrivals(0.05)
    raise AssertionError("engine did not finish")
