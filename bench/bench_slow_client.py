"""Does a client that reads 1 byte per second slow anyone else down?

    python bench/bench_slow_client.py [--pairs 3] [--clients 8] [--requests 48]

Each pair runs the same load twice, each on a fresh `mstrace serve --model tiny`, in
alternating order. Both runs have the normal clients and one more client asking for the
same long stream (1500 tokens): in A it reads the stream as fast as it comes, in B one
byte per second. So the engine does the same work in both, and B/A is what a slow
reader costs the others (not what one more request in the batch costs). The figure is each run's ITL
p50 over the normal clients (measured at the client, bench-serve's definition), B/A
per pair, and the median of the pairs. B's trace must show the slow client's
`response_deliver` rows on stream `http`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import load  # noqa: E402

from tests.support.serve_proc import Served  # noqa: E402
from viewer.bench_serve.http_client import Endpoint  # noqa: E402


def normal_load(port: int, clients: int, requests: int) -> float:
    ep = Endpoint(f"http://127.0.0.1:{port}", "/v1/completions", None, math.inf)
    gate = asyncio.Semaphore(clients)

    async def run() -> list[list[int]]:
        async with ep.session(clients) as session:
            async def one(i: int) -> list[int]:
                async with gate:
                    r = await ep.stream(session, {"model": "tiny", "prompt": f"def task_{i}(x):", "max_tokens": 64,
                                                  "temperature": 0, "ignore_eos": True, "stream": True}, chat=False)
                assert r.ok, r.error
                return [b - a for a, b in zip(r.chunk_ns, r.chunk_ns[1:], strict=False)]

            return await asyncio.gather(*(one(i) for i in range(requests)))

    gaps = [g for gs in asyncio.run(run()) for g in gs]
    return statistics.median(gaps) / 1e6


def extra_reader(port: int, stop: threading.Event, slow: bool) -> None:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    body = json.dumps({"model": "tiny", "prompt": "while True:", "max_tokens": 1500, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    if slow:
        while not stop.wait(1.0):
            s.recv(1)
    else:
        while s.recv(65536) and not stop.is_set():
            pass
    s.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=48)
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="slow-"))
    print(f"load before: {load()}", flush=True)
    ratios = []
    for k in range(a.pairs):
        out = {}
        for label in (("A", "B") if k % 2 == 0 else ("B", "A")):
            srv = Served(root / f"{k}{label}", "--send-buffer-bytes", "16384")
            stop = threading.Event()
            extra = threading.Thread(target=extra_reader, args=(srv.port, stop, label == "B"), daemon=True)
            extra.start()
            time.sleep(2.0)  # B: its socket fills first
            out[label] = normal_load(srv.port, a.clients, a.requests)
            stop.set()
            extra.join()
            rc, _, err = srv.stop()
            assert rc == 0, err
            if label == "B":
                import pyarrow.parquet as pq

                rows = [p for p in pq.read_table(srv.out / "probes", columns=["dur_ns", "boundary", "stream"])
                        .to_pylist() if p["boundary"] == "response_deliver" and p["stream"] == "http"]
                longest = max(p["dur_ns"] for p in rows) / 1e9
                print(f"pair {k} B: {len(rows)} response_deliver rows on http, longest {longest:.1f} s", flush=True)
        ratios.append(out["B"] / out["A"])
        print(f"pair {k}: ITL p50 A {out['A']:.3f} ms, B {out['B']:.3f} ms, B/A {ratios[-1]:.3f}", flush=True)
    print(f"median B/A {statistics.median(ratios):.3f} over {a.pairs} pairs; load after: {load()}")


if __name__ == "__main__":
    main()
