"""The same `mstrace bench-serve` load against `mstrace serve` and `transformers serve`
(continuous batching on), one after the other, on the same local model folder and the
same intra-op thread budget.

    python bench/bench_serve_peer.py [--model default] [--num-prompts 64] [--max-concurrency 16]
        [--input-len 128] [--output-len 64] [--threads N] [--pairs N]

Both servers get the same greedy requests (random token prompts, seeded), so with the same
weights they generate the same tokens. transformers serve refuses `ignore_eos`, so neither
run sends it. Prints both result blocks and the ratio; with `--pairs N`, N alternated pairs and
their median (a shared machine's speed drifts more between two runs a minute apart than most
changes move either server). Needs the bench extra (`pip install 'mstrace[bench]'`: bench-serve's
aiohttp, `transformers[serving]`, accelerate).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from urllib.request import urlopen

from common import OUT, REPO, load


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[str], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {proc.stderr.read() if proc.stderr else ''}")
        try:
            with urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"{url} never answered")


def bench(base: str, model: str, tokenizer: Path, a: argparse.Namespace, save: Path,
          trace: Path | None = None) -> dict[str, object]:
    cmd = [sys.executable, "-m", "viewer.cli", "bench-serve", "--base-url", base, "--model", model,
           "--tokenizer", str(tokenizer), "--num-prompts", str(a.num_prompts), "--max-concurrency",
           str(a.max_concurrency), "--request-rate", "inf", "--random-input-len", str(a.input_len),
           "--random-output-len", str(a.output_len), "--seed", "0", "--save-result", str(save),
           *(["--trace", str(trace)] if trace else [])]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    print(p.stdout, flush=True)
    if p.returncode != 0:
        raise SystemExit(f"bench-serve failed: {p.stderr.strip()}")
    return json.loads(save.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--dtype", default=None, help="both servers' dtype (default: the folder's config.json)")
    ap.add_argument("--pairs", type=int, default=1,
                    help="runs of each server, alternated (which goes first alternates too); prints the median ratio")
    a = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from scheduler.model.presets import resolve_model

    folder = resolve_model(a.model)
    # one dtype for both: mstrace's own auto measures the CPU and may pick bfloat16 where
    # transformers' auto takes the folder's
    if a.dtype is None:
        cfg = json.loads((folder / "config.json").read_text())
        a.dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    out = OUT / "serve_peer"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    print(f"model folder {folder}; dtype {a.dtype}; {a.threads} intra-op threads each; load before: {load()}",
          flush=True)

    ours_cmd = [sys.executable, "-m", "viewer.cli", "serve", "--model", str(folder), "--device-threads", str(a.threads),
                "--dtype", a.dtype]
    theirs_cmd = [str(Path(sys.executable).parent / "transformers"), "serve", str(folder), "--continuous-batching",
                  "--device", "cpu", "--dtype", a.dtype, "--host", "127.0.0.1"]
    theirs_env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(a.threads)}
    ratios = []
    for i in range(a.pairs):
        tag = "" if i == 0 else f"-{i}"
        trace = out / f"mstrace_trace{tag}"

        def run_ours(tag: str = tag, trace: Path = trace) -> dict[str, object]:
            return serve_and_bench([*ours_cmd, "--out", str(trace)], None, folder, a, out / f"mstrace{tag}.json",
                                   trace)

        def run_theirs(tag: str = tag) -> dict[str, object]:
            return serve_and_bench(theirs_cmd, theirs_env, folder, a, out / f"transformers{tag}.json")

        # alternate which server goes first, so a drift of the machine's speed does not
        # favour one side in every pair
        if i % 2 == 0:
            ours, theirs = run_ours(), run_theirs()
        else:
            theirs, ours = run_theirs(), run_ours()
        theirs_tps = float(theirs["output_throughput"])  # type: ignore[arg-type]
        r = float(ours["output_throughput"]) / theirs_tps if theirs_tps else float("nan")  # type: ignore[arg-type]
        ratios.append(r)
        print(f"output tok/s mstrace / transformers: {r:.2f}x; "
              f"TTFT p99 {ours['ttft_ms']['p99']:.1f} vs {theirs['ttft_ms']['p99']:.1f} ms; "  # type: ignore[index]
              f"load after: {load()}", flush=True)
    if len(ratios) > 1:
        print(f"median of {len(ratios)} pairs: {statistics.median(ratios):.2f}x "
              f"({', '.join(f'{r:.2f}' for r in ratios)})")


def serve_and_bench(cmd: list[str], env: dict[str, str] | None, folder: Path, a: argparse.Namespace, save: Path,
                    trace: Path | None = None) -> dict[str, object]:
    """Start one server (`cmd` plus a free port), run bench-serve against it, stop it."""
    port = free_port()
    proc = subprocess.Popen([*cmd, "--port", str(port)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc)
        return bench(f"http://127.0.0.1:{port}", str(folder), folder, a, save, trace)
    finally:
        proc.terminate()
        proc.communicate(timeout=120)


if __name__ == "__main__":
    main()
