"""The order a person expects for names that carry numbers: request ids (`req-2` before
`req-10`, `cmpl-…-3` before `cmpl-…-12`), wherever a list of them is shown."""

from __future__ import annotations

import re

_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key: runs of digits compare as numbers, the rest as text."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in _DIGITS.split(name) if p)
