"""Both implementations of the analyses' inner loops (viewer/analysis/native.py): the C
ones where the install built them, and numpy's fallback, which must give the same answers."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from viewer.analysis import native


@contextmanager
def c_loops(on: bool) -> Iterator[None]:
    """The C loops (on) or numpy's fallback (off) for the block."""
    if on and not native.AVAILABLE:
        pytest.skip("the C loops were not built")
    was = native.AVAILABLE
    native.AVAILABLE = on
    try:
        yield
    finally:
        native.AVAILABLE = was
