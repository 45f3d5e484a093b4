"""`mstrace serve` under sustained load: many streaming clients for a while, some leaving
mid-stream, /health polled and the server's memory sampled throughout.

    python bench/serve_soak.py [--clients 200] [--seconds 60] [--leave 0.1]

Each client thread streams completions back to back (prompt and max_tokens drawn at
random, ignore_eos) and, with probability --leave, closes its connection after a few
chunks. Pass/fail, printed at the end (exit 1 on a failure): no 5xx and no client error,
every request that was read to the end got all its tokens, /health 200 at every poll,
the server's RSS (its process tree) grows < 10% over the second half, and after SIGTERM
the trace has a row for every request and `mstrace leaks` finds nothing held.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.cli import mstrace  # noqa: E402
from tests.support.serve_proc import Served  # noqa: E402


def rss_bytes(pid: int) -> int:
    """RSS of a process and its children (a cpu-process backend's device process)."""
    total = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(next(x for x in status.splitlines() if x.startswith("VmRSS:")).split()[1]) * 1024
            for t in Path(f"/proc/{p}/task").iterdir():
                kids = (t / "children").read_text().split()
                todo.extend(int(k) for k in kids)
        except (OSError, StopIteration, ValueError):
            continue
    return total


def soak(clients: int, seconds: float, leave: float, out: Path, seed: int = 0) -> dict[str, object]:
    s = Served(out)
    stop_at = time.monotonic() + seconds
    lock = threading.Lock()
    tally = {"completed": 0, "short": 0, "left": 0, "http_5xx": 0, "http_4xx": 0, "client_errors": 0}
    errors: list[str] = []

    def count(k: str, why: str = "") -> None:
        with lock:
            tally[k] += 1
            if why and len(errors) < 10:
                errors.append(why)

    def client(i: int) -> None:
        rng = random.Random(seed * 100_003 + i)
        while time.monotonic() < stop_at:
            n = rng.randint(16, 64)
            body = {"model": "tiny", "prompt": f"# task {rng.random():.6f}\ndef f(", "max_tokens": n,
                    "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
            try:
                conn, resp = s.stream(body)
                if resp.status >= 500:
                    count("http_5xx", f"{resp.status} {resp.read()[:200]!r}")
                    conn.close()
                    continue
                if resp.status >= 400:
                    count("http_4xx", f"{resp.status} {resp.read()[:200]!r}")
                    conn.close()
                    continue
                if rng.random() < leave:
                    for _ in range(2 * rng.randint(1, 4)):
                        resp.readline()
                    resp.close()
                    conn.close()
                    count("left")
                    continue
                usage = None
                for raw in resp:
                    line = raw.strip()
                    if line.startswith(b"data: {") and b'"usage"' in line:
                        usage = json.loads(line[6:]).get("usage")
                conn.close()
                count("completed" if usage and usage["completion_tokens"] == n else "short",
                      "" if usage and usage["completion_tokens"] == n else f"usage {usage} for {n}")
            except (OSError, ValueError) as e:
                count("client_errors", f"{type(e).__name__}: {e}")

    health_bad: list[int] = []
    rss: list[tuple[float, int]] = []
    t0 = time.monotonic()

    def monitor() -> None:
        while time.monotonic() < stop_at:
            try:
                code = s.get("/health")[0]
            except OSError:
                code = -1
            if code != 200:
                health_bad.append(code)
            rss.append((time.monotonic() - t0, rss_bytes(s.proc.pid)))
            time.sleep(1.0)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    mon = threading.Thread(target=monitor, daemon=True)
    mon.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 120)
    mon.join()
    rc, _, err = s.stop()
    half = [b for t, b in rss if t >= seconds / 2]
    growth = (max(half) - half[0]) / half[0] if half else float("nan")
    leaks = mstrace("leaks", str(out))
    rep = mstrace("report", str(out), "--json")
    rows = int(json.loads(rep.stdout)["throughput"]["requests"]) if rep.returncode == 0 else -1
    meta = json.loads((out / "meta.json").read_text())
    res: dict[str, object] = {
        **tally, "errors": errors, "health_polls": len(rss), "health_not_200": len(health_bad),
        "rss_mb_first_last": [round(rss[0][1] / 2**20), round(rss[-1][1] / 2**20)] if rss else None,
        "rss_growth_second_half": round(growth, 4), "server_exit": rc, "server_stderr_tail": err[-300:],
        "submitted": meta["run"]["submitted"], "requests_in_trace": rows,
        "leaks_exit": leaks.returncode, "leaks_says": leaks.stdout.strip().splitlines()[2:3],
    }
    res["ok"] = (tally["http_5xx"] == 0 and tally["client_errors"] == 0 and tally["short"] == 0
                 and not health_bad and growth < 0.10 and rc == 0 and leaks.returncode == 0
                 and "no leaks" in leaks.stdout and rows == meta["run"]["submitted"])
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--leave", type=float, default=0.1)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    out = a.out or Path(tempfile.mkdtemp(prefix="soak-")) / "trace"
    res = soak(a.clients, a.seconds, a.leave, out)
    print(json.dumps(res, indent=2))
    sys.exit(0 if res["ok"] else 1)


if __name__ == "__main__":
    main()
