"""The serve app's own cost of a request on the event loop, two revisions alternated.

    python bench/bench_serve_app.py --a REV [--b REV] [--repeats 9] [--requests 2000]
    python bench/bench_serve_app.py --a REV --streams 16 [--tokens 32] [--batches 24]

Under a burst of arrivals each request waits on the event loop behind the others' parse,
routing and validation (BENCHMARKS.md, the hop), so the app's time per request is what a
burst multiplies. This times, in the event loop thread's own CPU time, a streamed
`POST /v1/completions` (the body bench-serve sends: 128 token ids, 32 tokens) through the app
`mstrace serve` builds (`scheduler.serving.app.make_app`: its middleware, routing,
validation, the route's checks and the call's build), called as uvicorn calls it, with a
responder that answers at once with one chunk: no engine, no socket. Each revision runs in
its own process from its own git worktree (bench/out/ab/, as bench_ab.py), the order
alternating; each reports the median us per request over batches of `--requests`.

`--streams S` times the whole stream instead: S requests at once, each answered by the real
responder (scheduler/serving/responses.py) with `--tokens` tokens that a sender thread posts
through the real `ResponseStreams`, one token to every open request per round, as the
engine's sender does. The figure is still the event loop thread's CPU per request (the
sender's own work is on its thread and not counted); uvicorn's socket writes are not in it.
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

# what both children share: the app `mstrace serve` builds around a responder, and a streamed
# completion request for it (the body bench-serve sends: 128 token ids), called as uvicorn
# calls it (ASGI 2.3), its chunks counted; no socket
PRELUDE = r'''
import asyncio, json, sys, threading, time
from types import SimpleNamespace
import uvloop
from scheduler.serving.app import ServerState, make_app
from scheduler.serving.engine_loop import Health


def served(responder, tokens):
    state = ServerState(loop=SimpleNamespace(health=lambda: Health(True, "running", "")), metrics=None,
                        responder=responder, chat=None, model="m", max_model_len=4096, api_key=None, started=0)
    app = make_app(state, 1 << 20)
    body = json.dumps({"model": "m", "prompt": list(range(3, 131)), "max_tokens": tokens, "stream": True,
                       "temperature": 0, "stream_options": {"include_usage": True}}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
             "headers": [(b"host", b"bench"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}

    async def one():
        msgs = [{"type": "http.request", "body": body, "more_body": False}]
        chunks = 0

        async def receive():
            if msgs:
                return msgs.pop()
            await asyncio.sleep(3600)

        async def send(m):
            nonlocal chunks
            chunks += m["type"] == "http.response.body"

        await app({**scope, "state": {}, "extensions": {}}, receive, send)
        return chunks

    return one
'''

CHILD = PRELUDE + r'''
n = int(sys.argv[1])


class Responder:
    async def answer(self, call, disconnected):
        async def body():
            yield b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'
        return body()


one = served(Responder(), 32)


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


STREAM_CHILD = PRELUDE + r'''
from scheduler.serving.responses import Responder
from scheduler.serving.streams import ResponseStreams

batches, width, tokens = map(int, sys.argv[1:4])


class Sender:
    """The engine's side: each round (2 ms apart) posts one token to every open request."""

    def __init__(self):
        self.new, self.lock = [], threading.Lock()

    def submit(self, prompt, params, rid, special):
        with self.lock:
            self.new.append(rid)

    def run(self, streams):
        live = {}
        while True:
            with self.lock:
                new, self.new = self.new, []
            live.update((rid, 0) for rid in new)
            for rid in list(live):
                streams.on_text(rid, "x")
                live[rid] += 1
                if live[rid] == tokens:
                    del live[rid]
                    streams.on_finish(SimpleNamespace(request_id=rid, finish_reason="length", finish_detail="",
                                                      input_ids=[0] * 128, output_ids=[0] * tokens), "")
            getattr(streams, "on_round_end", lambda: None)()  # (a revision before it posted each event)
            time.sleep(0.002)


sender = Sender()
streams = ResponseStreams(lambda rid, why: None, lambda t: (str(t), False))
probes, timeline = [], []
one = served(Responder(streams, sender.submit, lambda rid, why: None, probes, lambda: 0, None, timeline), tokens)
threading.Thread(target=sender.run, args=(streams,), daemon=True).start()


async def main():
    per = []
    for i in range(batches + 2):  # two to warm up
        t0 = time.thread_time_ns()
        got = await asyncio.gather(*(one() for _ in range(width)))
        if i >= 2:
            per.append((time.thread_time_ns() - t0) / width)
        assert min(got) >= tokens, got
        probes.clear()
        timeline.clear()
    per.sort()
    print(json.dumps({"median_ns": per[len(per) // 2]}))


uvloop.run(main())
'''


def child(src: Path, code: str, *args: int) -> float:
    p = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=src, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{src}: {p.stderr.strip()[-600:]}")
    return float(json.loads(p.stdout.strip().splitlines()[-1])["median_ns"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, help="baseline revision")
    ap.add_argument("--b", default=None, help="revision to compare (default: the working tree)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--streams", type=int, default=0, help="time whole streams, this many at once (0: the app alone)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per stream (with --streams)")
    ap.add_argument("--batches", type=int, default=24, help="batches of --streams requests timed (with --streams)")
    a = ap.parse_args()
    if a.streams:
        def measure(src: Path) -> float:
            return child(src, STREAM_CHILD, a.batches, a.streams, a.tokens) / 1e3
        what = f"{a.streams} streams of {a.tokens} tokens at once"
    else:
        def measure(src: Path) -> float:
            return child(src, CHILD, a.requests) / 1e3
        what = "a response of one chunk"
    median = alternated(measure, a.a, a.b, a.repeats, "us per request")
    print(f"median B/A over {a.repeats} repeats: {median:.3f} (the app's event-loop CPU per streamed completion "
          f"request, {what}; A = {a.a}, B = {a.b or 'working tree'})")


if __name__ == "__main__":
    main()
