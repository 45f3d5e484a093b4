"""The TUI's layout pinned as SVG snapshots (pytest-textual-snapshot) at 80x24 and 160x48,
on a trace with fixed numbers (tests/support/tui_trace.py). After a deliberate layout change:
`pytest tests/test_tui_snapshots.py --snapshot-update`, and look at the new SVGs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.tui_trace import synthetic_trace
from viewer.tui.top_app import TopApp
from viewer.tui.view_app import ViewApp

SIZES = [(80, 24), (160, 48)]


@pytest.fixture
def trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    synthetic_trace(tmp_path / "trace", rounds=60, leak=True)
    monkeypatch.chdir(tmp_path)  # the view's header shows the path as given: the same in every run
    return "trace"


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_top_layout(snap_compare, trace: str, size: tuple[int, int]) -> None:
    assert snap_compare(TopApp(trace), terminal_size=size)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_view_layout(snap_compare, trace: str, size: tuple[int, int]) -> None:
    assert snap_compare(ViewApp(trace), terminal_size=size)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_view_round_detail_layout(snap_compare, trace: str, size: tuple[int, int]) -> None:
    """The round's summary on top, its timeline, then its requests beside its blocks."""
    assert snap_compare(ViewApp(trace), terminal_size=size, press=["enter"])


def test_view_request_detail_layout(snap_compare, trace: str) -> None:
    assert snap_compare(ViewApp(trace), terminal_size=(80, 24), press=["enter", "enter"])


def test_view_sort_picker_layout(snap_compare, trace: str) -> None:
    assert snap_compare(ViewApp(trace), terminal_size=(80, 24), press=["s"])


def test_view_rounds_sorted_by_a_boundary_in_two_keys(snap_compare, trace: str) -> None:
    """`s`, then the unattributed column's key: the rounds it cost most first, the column in view.
    The column is scrolled into view after the table's refresh; under load the snapshot could
    catch the frame between (CI, once: the header a few cells short of the body's scroll), so
    it waits for the queue to drain twice, past that refresh and the scroll's own."""

    async def sort(pilot: Any) -> None:
        await pilot.press("s", "b")
        await pilot.pause()
        await pilot.pause()

    assert snap_compare(ViewApp(trace), terminal_size=(80, 24), run_before=sort)
