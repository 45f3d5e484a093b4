"""`mstrace leaks` as text: leaked, still-held and reclaimed KV blocks, and fragmentation."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from viewer.analysis.leaks import HeldBlocks, LeakReport
from viewer.render.text import trace_heading


def _ranges(ids: Sequence[int | None]) -> str:
    """[1,2,3,7,9,10] -> "1-3, 7, 9-10": a leaked table is usually a few runs (None: a null block id)."""
    out: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and (b := ids[j]) is not None and ids[j + 1] == b + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ", ".join(out)


def _held_table(title: str, rows: list[HeldBlocks]) -> Table:
    t = Table(title=title, title_justify="left", header_style="bold")
    for col in ("request", "status", "finish", "blocks", "block ids"):
        t.add_column(col, justify="right" if col == "blocks" else "left")
    for h in rows:
        t.add_row(h.request_id or "(none)", h.status, h.finish_reason or "—", str(len(h.block_ids)),
                  _ranges(h.block_ids))
    return t


def render_leaks(console: Console, trace: str, rep: LeakReport) -> None:
    trace_heading(console, trace, f"  {rep.events} block events replayed")
    if not rep.run_ended:
        console.print("[yellow]the run did not finish cleanly: blocks of requests not in `requests` "
                      "are counted as still running, not leaked[/]")
    cap = f"{rep.capacity}" + (" (inferred: meta.json has no kv_blocks)" if rep.capacity_inferred else "")
    console.print(f"KV pool at the end: {rep.final_free}/{cap} blocks free, {rep.final_held} held", highlight=False)
    if rep.leaks:
        console.print(Text(f"{rep.leaked_blocks} leaked block(s) in {len(rep.leaks)} request(s)", style="bold red"))
        console.print(_held_table("leaked blocks", rep.leaks))
    else:
        console.print("[green]no leaks: every finished request released its blocks[/]")
    if rep.still_running:
        console.print(_held_table("held by requests still running when the trace ended", rep.still_running))
    if rep.reclaimed:
        t = Table(title=f"reclaimed by the engine's GC: {rep.reclaimed_blocks} block(s)", title_justify="left",
                  header_style="bold")
        for col in ("request", "blocks", "block ids"):
            t.add_column(col, justify="right" if col == "blocks" else "left")
        for rid, ids in rep.reclaimed.items():
            t.add_row(rid or "(none)", str(len(ids)), _ranges(ids))
        console.print(t)
    else:
        console.print("no blocks reclaimed")
    rng = rep.frag_range()
    if rng is None:
        console.print("fragmentation: no block-table snapshots in this trace (--snapshot-every 0?)")
    else:
        worst = max(rep.fragmentation, key=lambda f: f.frag_index)
        ratios = [f.free_ratio for f in rep.fragmentation]
        console.print(
            f"fragmentation over {len(rep.fragmentation)} snapshots: index min {rng[0]:.3f} max {rng[1]:.3f} "
            f"(1 - largest free run / free blocks); free ratio {min(ratios):.1%}-{max(ratios):.1%}; "
            f"worst at step {worst.step}: {worst.free_blocks} free, largest run {worst.largest_free_run}",
            highlight=False,
        )
    if rep.num_anomalies:
        console.print(Text(f"{rep.num_anomalies} event(s) the replay could not reconcile:", style="yellow"))
        for a in rep.anomalies[:10]:
            console.print(Text("  " + a))
