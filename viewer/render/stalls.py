"""`mstrace stalls` as text: each stall's wait cycle, waits, streams, KV pool and thread stacks."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from probes.waits import DEVICE_THREAD
from viewer.analysis.order import natural_key
from viewer.analysis.stalls import StallRecord, interesting_frames
from viewer.render.text import trace_heading

RECENT_OPS = 5


def _when(meta: dict[str, Any], ts_ns: int) -> str:
    """Seconds since the run started; a killed run (the usual case after a deadlock)
    has no `run` in meta.json, so fall back to wall time through the clock anchor."""
    start = (meta.get("run") or {}).get("start_ns")
    if isinstance(start, int):
        return f"+{(ts_ns - start) / 1e9:.3f} s into the run"
    clock = meta.get("clock") or {}
    mono, unix = clock.get("anchor_monotonic_ns"), clock.get("anchor_unix_ns")
    if isinstance(mono, int) and isinstance(unix, int):
        from datetime import datetime

        return datetime.fromtimestamp((ts_ns - mono + unix) / 1e9).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    return f"ts {ts_ns}"


def kv_line(kv: dict[str, Any]) -> str:
    """The KV pool when it stalled, in words: "64 blocks, 3 free, 2 fenced; held by req-0 (7),
    req-3 (12), ...; largest free run 2" (a run only where the layout is contiguous)."""
    parts = [f"{kv.get('num_blocks', '?')} blocks, {kv.get('free', '?')} free, {kv.get('fenced', 0)} fenced"]
    holders = kv.get("holders") or {}
    if holders:
        shown = sorted(holders.items(), key=lambda kv_: natural_key(kv_[0]))[:8]
        more = f", and {len(holders) - len(shown)} more" if len(holders) > len(shown) else ""
        parts.append("held by " + ", ".join(f"{rid} ({n})" for rid, n in shown) + more)
    if kv.get("largest_free_run") is not None:
        parts.append(f"largest free run {kv['largest_free_run']}")
    return "KV pool: " + "; ".join(parts)


def render_stalls(console: Console, trace: str, meta: dict[str, Any], recs: list[StallRecord]) -> None:
    trace_heading(console, trace, f"  {len(recs)} stall(s)")
    if not recs:
        console.print("[green]no stalls: no wait outlasted the watchdog's timeout[/]")
        return
    for n, r in enumerate(recs, 1):
        console.rule(f"stall {n}/{len(recs)}  {_when(meta, r.ts_ns)}  rank {r.rank}  step {r.step}")
        console.print(Text.assemble(
            (r.waiter, "bold"), f" waited {r.waited_ns / 1e9:.2f} s for ", (r.what, "bold"),
            f" (to be signalled by {r.signaller}; boundary {r.boundary})",
        ))
        for nj in r.never_joined:
            last = f"#{nj['last_seq']}" if nj["last_seq"] >= 0 else "none"
            console.print(Text.assemble(
                (f"rank {nj['rank']} never joined", "bold red"),
                f" this collective: the last one it issued was {last} (from its collectives history)"))
        if r.cycle:
            console.print(Text.assemble("wait cycle: ", (r.cycle, "bold red")))
        else:
            console.print(Text("no wait cycle: the signaller is slow, dead, or never coming", style="yellow"))

        waits = Table(title="active waits", title_justify="left", header_style="bold")
        for col in ("waiter", "waits for", "signaller", "waited s", "thread"):
            waits.add_column(col, justify="right" if col == "waited s" else "left")
        thread_names = {s.get("thread_id"): str(s.get("name")) for s in r.stacks}
        for w in sorted(r.waits, key=lambda w: -int(w.get("waited_ns", 0))):
            waits.add_row(str(w.get("waiter")), str(w.get("what")), str(w.get("signaller")),
                          f"{int(w.get('waited_ns', 0)) / 1e9:.2f}",
                          "on the device" if w.get("thread_id") == DEVICE_THREAD
                          else thread_names.get(w.get("thread_id"), str(w.get("thread_id"))))
        console.print(waits)
        extra = r.graph[len(r.waits):]
        if extra:
            console.print("resource edges: " + "; ".join(f"{e['src']} -> {e['label']} -> {e['dst']}" for e in extra),
                          highlight=False)

        if r.streams:
            st = Table(title="streams", title_justify="left", header_style="bold")
            for col in ("stream", "queue", "in progress", f"last {RECENT_OPS} ops (label step us)", "error"):
                st.add_column(col)
            for s in r.streams:
                cur = s.get("in_progress")
                cur_s = "—" if not cur else (
                    f"{cur.get('label')} ({(r.ts_ns - int(cur.get('since_ns', r.ts_ns))) / 1e6:.0f} ms)"
                    if isinstance(cur, dict) else str(cur))
                recent = [f"{op[0]} {op[1]} {(op[3] - op[2]) / 1e3:.0f}"
                          for op in list(s.get("recent") or [])[-RECENT_OPS:] if len(op) >= 4]
                st.add_row(str(s.get("stream", "?")), str(s.get("queue_depth", "")), cur_s,
                           "\n".join(recent) or "—", str(s.get("error") or "—"))
            console.print(st)

        if r.kv:
            console.print(kv_line(r.kv), highlight=False)

        waiting = {int(w.get("thread_id", 0)) for w in r.waits}
        console.print(Text("thread stacks (waiting threads first, innermost frames):", style="bold"))
        for s in sorted(r.stacks, key=lambda s: (s.get("thread_id") not in waiting, str(s.get("name")))):
            frames = list(s.get("frames") or [])
            mark = " [waiting]" if s.get("thread_id") in waiting else ""
            if s.get("thread_id") in waiting:
                hidden, kept = interesting_frames(frames)
            else:
                hidden, kept = interesting_frames(frames, keep=1)  # other threads: where they are, briefly
            console.print(Text(f"  {s.get('name')} ({s.get('thread_id')}){mark}"
                               + (f", {hidden} frames hidden" if hidden else ""),
                               style="bold" if mark else ""))
            for f in kept:
                console.print(Text("    " + f.rstrip("\n").replace("\n", "\n    "), style="dim" if not mark else ""))
