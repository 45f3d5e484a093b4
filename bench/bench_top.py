"""What `mstrace top` costs: its own refresh on a long trace, and the run it watches.

    flock /tmp/mstrace-bench.lock .venv/bin/python bench/bench_top.py --pairs 8

1. **Refresh.** A writer process commits the history of a long run through the
   store's own TraceWriter: a real `mstrace run --model tiny` trace replicated to at
   least `--history-rows` probe rows (shifted in time and rounds, as
   bench/gen_big_trace.py does), then one more copy every `--copy-every-s` (0.5 s: about
   3.5x a real tiny run's rate of rows; 1.5 s: about its rate), as a live run's flushes
   arrive. `TopApp`, headless at 160x48, attaches and refreshes 4 times a
   second meanwhile. The app times each refresh: its feed thread's read, fold and
   snapshot (`fold`), the event loop's paint until the screen shows it (`tick`, wall and
   CPU), and the data's age from the read's start to the screen (`age`).
   `--history-trace T` (say bench/gen_big_trace.py's 100 M-row trace): T, hard-linked and
   its end record taken out, is the history, and the writer appends copies after it through
   the store's PartStore with the run's lock and manifest; `--attaches N` fresh processes
   time their first screen meanwhile.
2. **Cost to the run.** `mstrace run --model tiny --requests N` with and without a
   headless `mstrace top` attached to its trace, in alternated pairs: the run's CPU
   time per output token (meta.json run.cpu: its process and children), B/A.
3. **Cost, interleaved** (`--part interleaved`). One long saturating run; `top` runs in
   one window of each pair and is SIGSTOPped in the other, in random order: the run's
   CPU per output token, top running over stopped, per pair. This one sees through the
   machine's run-to-run spread.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import cpu_s

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "top"
TABLES = ("steps", "probes", "requests", "memory", "timeline")


def _tiny_run(out: Path, requests: int, extra: list[str] | None = None) -> None:
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "viewer.cli", "run", "--model", "tiny", "--requests", str(requests),
                    "--out", str(out), "-q", *(extra or [])], cwd=REPO, check=True, stdout=subprocess.DEVNULL)


def writer(src: Path, out: Path, history_rows: int, live_s: float, ready: Path, every_s: float) -> None:
    """The writer process: a long history committed quickly, then a copy per `every_s`."""
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "bench"))
    from gen_big_trace import shifted

    from tracing.reader import Trace
    from tracing.writer import TraceWriter

    tr = Trace.open(src)
    tables = {t: tr.table(t) for t in TABLES}
    steps = tables["steps"]
    span = int(max(a + b for a, b in zip(steps["ts_ns"].to_pylist(), steps["dur_ns"].to_pylist(), strict=True))
               - steps["ts_ns"][0].as_py()) + 1
    nstep = int(max(steps["step"].to_pylist())) + 1
    w = TraceWriter(out, flush_interval_s=3600)
    w.write_meta({k: v for k, v in tr.meta.items() if k != "run"})  # no end record: a run in progress
    bufs = {name: w.buffer(name) for name in tables}
    per_copy = tables["probes"].num_rows
    copies = -(-history_rows // per_copy)
    t_live = time.monotonic_ns()  # the live copies' clock: now, so top's windows see them arrive
    base = t_live - copies * span

    def put(k: int) -> None:
        for name, t in tables.items():
            rows = shifted(t, base + k * span - steps["ts_ns"][0].as_py(), k * nstep, f"-{k}").to_pylist()
            bufs[name].extend(tuple(r.values()) for r in rows)

    for k in range(copies):
        put(k)
        if k % 8 == 7:
            w.flush()
            w._store.compact(final=False)
    w.flush()
    ready.write_text(str(copies * per_copy))
    k = copies
    end = time.monotonic() + live_s
    while time.monotonic() < end:
        put(k)
        k += 1
        w.flush()
        w._store.compact(final=False)
        time.sleep(every_s)
    w.close()


def writer_on(src: Path, out: Path, live_s: float, ready: Path, every_s: float) -> None:
    """The writer process for a history already on disk (`--history-trace`, hard-linked into
    `out`): it takes the store's lock and manifest as the run's writer holds them, then
    commits a copy of `src` per `every_s` after the history's last round, through the
    store's own PartStore (write, commit, merge), as a live run's flushes arrive, until
    `ready`'s sibling `stop` appears (or `live_s` plus a minute, should nothing stop it)."""
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "bench"))
    import pyarrow.compute as pc
    from gen_big_trace import Source, shifted

    from tracing.compaction import Targets
    from tracing.manifest import read_manifests
    from tracing.reader import Trace
    from tracing.schema import TABLES as SCHEMAS
    from tracing.store_lock import WriterLock
    from tracing.writer import PartCache, PartStore

    lock = WriterLock.acquire(out, 0)
    store = PartStore(out, read_manifests(out)[0], SCHEMAS, Targets(), PartCache())
    steps = Trace.open(out).table("steps", ["step", "ts_ns", "dur_ns"])
    last_step = int(pc.max(steps["step"]).as_py())
    end = int(pc.max(pc.add(steps["ts_ns"], steps["dur_ns"])).as_py())
    del steps
    s = Source(src)
    # the live copies' clock: now (or past the history's end), so top's windows see them arrive
    dt = max(end, time.monotonic_ns()) + 1000 - s.t_min
    dstep = last_step + 1 - int(pc.min(s.tables["steps"]["step"]).as_py())
    k, stop, give_up = 0, ready.with_name("stop"), time.monotonic() + live_s + 60
    while True:
        added = {name: [store.write_part(name, shifted(t, dt + k * s.span, dstep + k * s.nstep, f"#live{k}"))]
                 for name, t in s.tables.items() if t.num_rows}
        store.commit(added)
        store.compact(final=False)
        if k == 0:
            ready.write_text(str(sum(e.rows for e in store.manifest.tables.get("probes", []))))
        k += 1
        if stop.exists() or time.monotonic() >= give_up:
            break
        time.sleep(every_s)
    lock.release()


def live_copy(history: Path, out: Path) -> None:
    """`history` hard-linked into `out` (no copy of its GBs), its end-of-run record taken out:
    a trace whose run is still being written, once `writer_on` holds its lock."""
    sys.path.insert(0, str(REPO))
    from tracing.writer import write_json_atomic

    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(["cp", "-al", str(history), str(out)], check=True)
    # files opened in place would be the history's: its writer locks (flocked, not replaced)
    # and any temporary a writer left (written by truncation)
    for f in [*out.glob(".writer-*.lock"), *out.rglob("*.tmp")]:
        f.unlink()
    meta = json.loads((out / "meta.json").read_text())
    meta.pop("run", None)
    (out / "meta.json").unlink()  # a link to the history's: replaced, not written through
    write_json_atomic(out / "meta.json", meta)


def refresh(src: Path, history_rows: int, live_s: float, every_s: float, history_trace: Path | None = None,
            attaches: int = 0) -> dict:
    from viewer.tui.top_app import TopApp

    out, ready, stop = OUT / "live", OUT / "ready", OUT / "stop"
    shutil.rmtree(out, ignore_errors=True)
    ready.unlink(missing_ok=True)
    stop.unlink(missing_ok=True)
    if history_trace is not None:
        live_copy(history_trace, out)
        args = ["--writer-on", str(src), str(out), str(live_s), str(ready), str(every_s)]
    else:
        args = ["--writer", str(src), str(out), str(history_rows), str(live_s), str(ready), str(every_s)]
    wp = subprocess.Popen([sys.executable, __file__, *args], cwd=REPO)
    while not ready.exists():
        if wp.poll() is not None:
            raise SystemExit("the writer process failed")
        time.sleep(0.2)
    history = int(ready.read_text())
    # fresh processes attaching while the writer commits (each about 1.5 s of the live time)
    attached = [attach(out) for _ in range(attaches)]

    async def watch() -> TopApp:
        app = TopApp(out)
        async with app.run_test(size=(160, 48)) as pilot:
            t0 = time.monotonic()
            while time.monotonic() - t0 < live_s - 1:
                await pilot.pause(0.5)
        return app

    app = asyncio.run(watch())
    stop.touch()  # the history writer (`writer_on`) commits until now; the row writer ends by its own clock
    wp.wait()
    def dist(xs: list[float]) -> dict[str, float]:
        s = sorted(xs[1:])  # the first is the attach
        return {"attach": xs[0], "p50": statistics.median(s), "p90": s[int(0.9 * len(s))],
                "p99": s[min(len(s) - 1, int(0.99 * len(s)))], "max": s[-1], "over_50ms": sum(x > 50 for x in s),
                "of": len(s)}

    if history_trace is not None:
        shutil.rmtree(out, ignore_errors=True)  # links only: the history stays
    return {"history_probe_rows": history, "copy_every_s": every_s, "attach_live": attached,
            "ticks": len(app.tick_ms),
            "ticks_per_s": len(app.tick_ms) / (live_s - 1), "paint_wall_ms": dist(app.tick_ms),
            "paint_cpu_ms": dist(app.tick_cpu_ms), "fold_ms": dist(app.fold_ms), "age_ms": dist(app.age_ms),
            "rows_read": app.state.rows_seen,
            "probe_rows_held": app.state._probes.num_rows if app.state._probes is not None else 0}


def attach(trace: Path) -> dict:
    """A fresh process attaches `TopApp` (headless, 160x48) to `trace`: the time to its first
    screen (the process's imports excluded) and the process's peak RSS."""
    code = """
import asyncio, json, resource, sys, time
from viewer.tui.top_app import TopApp

async def main():
    t0 = time.monotonic()
    app = TopApp(sys.argv[1])
    async with app.run_test(size=(160, 48)) as pilot:
        while not app.age_ms and time.monotonic() - t0 < 60:
            await pilot.pause(0.01)
        first = time.monotonic() - t0
        await pilot.pause(1)
    print(json.dumps({"first_screen_s": first, "fold_ms": app.fold_ms[0], "paint_ms": app.tick_ms[0],
                      "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}))

asyncio.run(main())
"""
    p = subprocess.run([sys.executable, "-c", code, str(trace)], cwd=REPO, capture_output=True, text=True, check=True)
    r = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"{trace}: first screen {r['first_screen_s']:.3f} s (read and fold {r['fold_ms']:.0f} ms, paint "
          f"{r['paint_ms']:.0f} ms), peak RSS {r['peak_rss_gb']:.2f} GB", flush=True)
    return r


def _top_process(trace: Path) -> subprocess.Popen:
    code = ("import sys; from viewer.tui.top_app import TopApp; TopApp(sys.argv[1]).run(headless=True)")
    return subprocess.Popen([sys.executable, "-c", code, str(trace)], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def one_run(out: Path, requests: int, watched: bool) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    top = _top_process(out) if watched else None
    top_cpu = None
    try:
        t0 = time.monotonic()
        _tiny_run(out, requests)
        wall = time.monotonic() - t0
    finally:
        if top is not None:
            top_cpu = cpu_s(top.pid) if top.poll() is None else None
            top.terminate()
            top.wait()
    from tracing.reader import read_table

    meta = json.loads((out / "meta.json").read_text())

    tokens = int(sum(read_table(out, "requests", ["output_len"])["output_len"].to_pylist()))
    cpu = meta["run"]["cpu"]
    return {"cpu_ns": cpu["total_ns"], "tokens": tokens, "per_token_us": cpu["total_ns"] / tokens / 1e3,
            "main_thread_per_token_us": cpu["threads_ns"]["MainThread"] / tokens / 1e3, "wall_s": wall,
            "top_cpu_s": top_cpu}


def _stat_ci(xs: list[float], stat, n: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval of `stat` over `xs` (fixed seed)."""
    import random

    rng = random.Random(0)
    vals = sorted(stat(rng.choices(xs, k=len(xs))) for _ in range(n))
    return vals[int(0.025 * n)], vals[int(0.975 * n)]


def _median_ci(xs: list[float]) -> tuple[float, float]:
    """A 95% bootstrap interval of the median (fixed seed: the same pairs give the same interval)."""
    return _stat_ci(xs, statistics.median)


def cost(requests: int, pairs: int) -> dict:
    ratios, main_ratios, a_runs, b_runs = [], [], [], []
    for i in range(pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        got = {w: one_run(OUT / f"cost-{'b' if w else 'a'}-{i}", requests, w) for w in order}
        a_runs.append(got[False])
        b_runs.append(got[True])
        ratios.append(got[True]["per_token_us"] / got[False]["per_token_us"])
        main_ratios.append(got[True]["main_thread_per_token_us"] / got[False]["main_thread_per_token_us"])
        print(f"pair {i}: without top {got[False]['per_token_us']:.1f} us/token, with top "
              f"{got[True]['per_token_us']:.1f} us/token, B/A {ratios[-1]:.3f} (scheduling thread "
              f"{main_ratios[-1]:.3f}); top used {got[True]['top_cpu_s']} s CPU over {got[True]['wall_s']:.1f} s",
              flush=True)
    return {"pairs": ratios, "median_b_over_a": statistics.median(ratios), "ci95": _median_ci(ratios),
            "main_thread_pairs": main_ratios, "main_thread_median": statistics.median(main_ratios),
            "main_thread_ci95": _median_ci(main_ratios),
            "top_cpu_share_of_a_core": [r["top_cpu_s"] / r["wall_s"] for r in b_runs if r["top_cpu_s"] is not None],
            "a": a_runs, "b": b_runs}


def _tree(pid: int) -> list[int]:
    """A process and its descendants (the run's device process is a child)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def _tree_cpu_s(pid: int) -> float:
    total = 0.0
    for p in _tree(pid):
        try:
            total += cpu_s(p)
        except OSError:  # gone meanwhile
            pass
    return total


def steady_workload(path: Path, rate: float, duration_s: float) -> None:
    """Identical requests (64-token prompt, 128 tokens out) arriving every 1/rate s. Above the
    engine's capacity (about 88/s for tiny here) the running set stays full, so every window
    holds the same work per round and its CPU per token moves only with the machine (the
    synthetic workload's mix of lengths moved it 85-160 us/token between windows)."""
    n = int(rate * duration_s)
    with path.open("w") as f:
        for i in range(n):
            ids = [(7 * i + j) % 200 + 3 for j in range(64)]
            f.write(json.dumps({"id": f"s{i}", "input_ids": ids, "max_new_tokens": 128, "ignore_eos": True,
                                "arrival_s": round(i / rate, 6)}) + "\n")


def interleaved(rate: float, duration_s: float, window_s: float) -> dict:
    """One long run of a saturating steady workload (the batch stays full, so a round's work
    does not depend on how fast rounds go); a headless `top` on its trace runs in one window of
    each pair and is stopped (SIGSTOP) in the other, the order drawn at random per pair so
    that nothing periodic in the run (flushes, compaction) lines up with it. Each window's CPU
    time (from /proc: the run's processes, and its scheduling thread alone) per output token
    (the steps table) gives one log ratio per pair, top running over stopped; adjacent windows
    share the machine's slow drift. One run, so the run-to-run spread is out."""
    import math
    import random
    import signal

    from tracing.reader import read_table

    out = OUT / "interleaved"
    shutil.rmtree(out, ignore_errors=True)
    wl = OUT / "steady.jsonl"
    steady_workload(wl, rate, duration_s)
    run = subprocess.Popen([sys.executable, "-m", "viewer.cli", "run", "--model", "tiny", "--workload", str(wl),
                            "--out", str(out), "-q"], cwd=REPO, stdout=subprocess.DEVNULL)
    top = _top_process(out)
    time.sleep(8.0)  # start-up: model load, then the running set filling to its steady size
    rng = random.Random(1)
    marks: list[tuple[int, float, float, bool]] = []  # (monotonic ns, run CPU s, its main thread's, top on next)
    top_cpu_s, top_before, order = 0.0, 0.0, []
    while run.poll() is None:
        if not order:
            order = rng.choice(([True, False], [False, True]))
        on = order.pop(0)
        os.kill(top.pid, signal.SIGCONT if on else signal.SIGSTOP)
        try:
            top_now = cpu_s(top.pid)
            if marks and marks[-1][3]:
                top_cpu_s += top_now - top_before
            top_before = top_now
            marks.append((time.monotonic_ns(), _tree_cpu_s(run.pid), cpu_s(run.pid, run.pid), on))
        except OSError:  # the run ended between the poll and the read
            break
        time.sleep(window_s)
    top.send_signal(signal.SIGCONT)
    top.terminate()
    top.wait()
    steps = read_table(out, "steps", ["ts_ns", "num_decode_tokens"])
    ts = steps["ts_ns"].to_numpy()
    tok = steps["num_decode_tokens"].to_numpy()
    windows = []  # (top on, run us/token, scheduling thread us/token, tokens per round)
    for (t0, c0, m0, w), (t1, c1, m1, _) in zip(marks, marks[1:], strict=False):
        sel = (ts >= t0) & (ts < t1)
        n = int(tok[sel].sum())
        windows.append((w, (c1 - c0) / n * 1e6, (m1 - m0) / n * 1e6, n / int(sel.sum())) if n else None)
    # whole pairs only, and not the last one (the drain, a shrinking batch, and the exit)
    pairs = [(windows[i], windows[i + 1]) for i in range(0, len(windows) - 3, 2)
             if windows[i] and windows[i + 1]]
    on_time = sum(1 for m in marks[:-1] if m[3]) * window_s
    res: dict = {"rate": rate, "duration_s": duration_s, "window_s": window_s, "pairs": len(pairs),
                 "top_cpu_share_of_a_core": top_cpu_s / on_time if on_time else None,
                 "top_on": [[x[0] for x in p] for p in pairs]}
    for k, name in ((1, "run"), (2, "thread"), (3, "batch")):
        logs = [math.log((p[0][k] if p[0][0] else p[1][k]) / (p[1][k] if p[0][0] else p[0][k])) for p in pairs]
        null = [math.log(p[0][k] / p[1][k]) for p in pairs]  # first window over second, whatever ran
        res[f"{name}_windows"] = [[round(x[k], 3) for x in p] for p in pairs]
        for label, xs in (("on_over_off", logs), ("first_over_second", null)):
            lo, hi = _stat_ci(xs, statistics.fmean)
            res[f"{name}_{label}"] = {"mean": math.exp(statistics.fmean(xs)), "ci95": [math.exp(lo), math.exp(hi)],
                                      "median": math.exp(statistics.median(xs)),
                                      "sd_log": statistics.stdev(xs)}
    return res


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--writer":
        src, out, rows, live, ready, every = sys.argv[2:8]
        writer(Path(src), Path(out), int(rows), float(live), Path(ready), float(every))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--writer-on":
        src, out, live, ready, every = sys.argv[2:7]
        writer_on(Path(src), Path(out), float(live), Path(ready), float(every))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--history-rows", type=int, default=1_000_000)
    ap.add_argument("--history-trace", type=Path,
                    help="refresh: this trace (say a bench/gen_big_trace.py one) as the run's history, "
                         "instead of --history-rows written row by row")
    ap.add_argument("--attaches", type=int, default=0,
                    help="refresh: fresh processes attaching while the writer commits")
    ap.add_argument("--live-s", type=float, default=20.0)
    ap.add_argument("--copy-every-s", type=float, default=0.5)
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--part", choices=("both", "refresh", "cost", "interleaved", "attach"), default="both")
    ap.add_argument("--trace", type=Path, help="attach: the trace to attach to (say a bench/gen_big_trace.py one)")
    ap.add_argument("--repeats", type=int, default=3, help="attach: fresh processes, one after another")
    ap.add_argument("--window-s", type=float, default=1.0)
    ap.add_argument("--rate", type=float, default=100.0, help="interleaved: arrivals per second (over capacity)")
    ap.add_argument("--duration-s", type=float, default=300.0, help="interleaved: seconds of arrivals")
    a = ap.parse_args()
    sys.path.insert(0, str(REPO))
    OUT.mkdir(parents=True, exist_ok=True)
    res: dict = {"load_before": os.getloadavg()}
    if a.part in ("both", "refresh"):
        src = OUT / "src"
        _tiny_run(src, 64, ["--snapshot-every", "16"])
        res["refresh"] = refresh(src, a.history_rows, a.live_s, a.copy_every_s, a.history_trace, a.attaches)
        print(json.dumps(res["refresh"], indent=2), flush=True)
    if a.part in ("both", "cost"):
        res["cost"] = cost(a.requests, a.pairs)
        c = res["cost"]
        print(f"run CPU per output token with top attached / without: median {c['median_b_over_a']:.3f} "
              f"[95% CI {c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}]; scheduling thread {c['main_thread_median']:.3f} "
              f"[{c['main_thread_ci95'][0]:.3f}, {c['main_thread_ci95'][1]:.3f}]")
    if a.part == "attach":
        if a.trace is None:
            ap.error("--part attach needs --trace")
        res["attach"] = [attach(a.trace) for _ in range(a.repeats)]
    if a.part == "interleaved":
        res["interleaved"] = r = interleaved(a.rate, a.duration_s, a.window_s)
        for name in ("run", "thread", "batch"):
            x, z = r[name + "_on_over_off"], r[name + "_first_over_second"]
            print(f"{name}: top running / stopped, geometric mean of {r['pairs']} pairs {x['mean']:.4f} "
                  f"[95% CI {x['ci95'][0]:.4f}, {x['ci95'][1]:.4f}], median {x['median']:.4f}; "
                  f"first / second window (the null) {z['mean']:.4f} [{z['ci95'][0]:.4f}, {z['ci95'][1]:.4f}]")
        print(f"top used {r['top_cpu_share_of_a_core']:.1%} of a core while running")
    res["load_after"] = os.getloadavg()
    (OUT / "result.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
