"""The serve app's own cost of a request on the event loop, two revisions alternated.

    python bench/bench_serve_app.py --a REV [--b REV] [--repeats 9] [--requests 2000]

Under a burst of arrivals each request waits on the event loop behind the others' parse,
routing and validation (BENCHMARKS.md, the hop), so the app's time per request is what a
burst multiplies. This times, in the event loop thread's own CPU time, a streamed
`POST /v1/completions` (the body bench-serve sends: 128 token ids, 32 tokens) through the app
`mstrace serve` builds (`scheduler.serving.app.make_app`: its middleware, routing,
validation, the route's checks and the call's build), called as uvicorn calls it, with a
responder that answers at once with one chunk: no engine, no socket. Each revision runs in
its own process from its own git worktree (bench/out/ab/, as bench_ab.py), the order
alternating; each reports the median us per request over batches of `--requests`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_ab import alternated  # noqa: E402

CHILD = r'''
import asyncio, json, sys, time
from types import SimpleNamespace
import uvloop
from scheduler.serving.app import ServerState, make_app
from scheduler.serving.engine_loop import Health

n = int(sys.argv[1])


class Responder:
    async def answer(self, call, disconnected):
        async def body():
            yield b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'
        return body()


state = ServerState(loop=SimpleNamespace(health=lambda: Health(True, "running", "")), metrics=None,
                    responder=Responder(), chat=None, model="m", max_model_len=4096, api_key=None, started=0)
app = make_app(state, 1 << 20)
body = json.dumps({"model": "m", "prompt": list(range(3, 131)), "max_tokens": 32, "stream": True,
                   "temperature": 0, "stream_options": {"include_usage": True}}).encode()
scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
         "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
         "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
         "headers": [(b"host", b"bench"), (b"content-type", b"application/json"),
                     (b"content-length", str(len(body)).encode())]}


async def one():
    msgs = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if msgs:
            return msgs.pop()
        await asyncio.sleep(3600)

    async def send(m):
        pass

    await app({**scope, "state": {}, "extensions": {}}, receive, send)


async def main():
    for _ in range(n // 4):
        await one()
    per = []
    for _ in range(7):
        t0 = time.thread_time_ns()
        for _ in range(n):
            await one()
        per.append((time.thread_time_ns() - t0) / n)
    per.sort()
    print(json.dumps({"median_ns": per[len(per) // 2]}))


uvloop.run(main())
'''


def one(src: Path, requests: int) -> float:
    p = subprocess.run([sys.executable, "-c", CHILD, str(requests)], cwd=src, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{src}: {p.stderr.strip()[-600:]}")
    return float(json.loads(p.stdout.strip().splitlines()[-1])["median_ns"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, help="baseline revision")
    ap.add_argument("--b", default=None, help="revision to compare (default: the working tree)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--requests", type=int, default=2000)
    a = ap.parse_args()
    median = alternated(lambda src: one(src, a.requests) / 1e3, a.a, a.b, a.repeats, "us per request")
    print(f"median B/A over {a.repeats} repeats: {median:.3f} (the app's event-loop CPU per streamed completion "
          f"request; A = {a.a}, B = {a.b or 'working tree'})")


if __name__ == "__main__":
    main()
