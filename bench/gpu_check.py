"""What only a GPU can tell: the checks bench/gpu_check.sh runs, as one short table.

    python bench/gpu_check.py          # on a CUDA machine (about 5 minutes on one GPU)
    python bench/gpu_check.py --cpu    # the same checks on this machine's CPU, smaller

1. greedy parity with transformers, on the device: a preset and a test-built checkpoint;
2. the three modes on the default preset (tiny with --cpu): overlap / serial throughput;
   on a GPU also what a new attention shape costs the launch (torch's SDPA backends against
   the engine's) and a serial run under torch's sync debug mode (no wait in the launch);
3. device rows reach the trace during the run (read 2 s after its first committed round,
   before the run ends);
4. probe overhead: output tok/s with probes against --no-probes (one pair: a sanity
   bound, not a benchmark);
5. a deadlock injection is caught: exit code 3 and `mstrace stalls` names the cycle.

Any failed check, or any error, exits non-zero after printing the table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
OUT = REPO / "bench" / "out" / "gpu_check"


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "viewer.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def must(p: subprocess.CompletedProcess[str], what: str) -> subprocess.CompletedProcess[str]:
    if p.returncode != 0:
        raise RuntimeError(f"{what} exited {p.returncode}: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
    return p


def tok_per_s(trace: Path) -> float:
    rep = json.loads(must(cli("report", str(trace), "--json"), f"report {trace.name}").stdout)
    return float(rep["throughput"]["output_tok_per_s"])


def parity(device: str) -> str:
    """Engine greedy tokens against transformers' argmax, teacher-forced on the engine's own
    sequence; a mismatch counts only where transformers' top two are not a near-tie."""
    import torch
    from transformers import AutoModelForCausalLM

    from scheduler.config import EngineConfig
    from scheduler.core.request import SamplingParams
    from scheduler.engine import Engine
    from scheduler.harness.runner import run_workload
    from scheduler.harness.workload import WorkloadItem
    from scheduler.model.presets import ensure_preset
    from tests.support.checkpoints import build_llama

    results = []
    for name, path in (("tiny preset", ensure_preset("tiny")), ("test-built llama", build_llama(OUT / "ckpt"))):
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (5, 17, 40, 64, 9, 33)]
        items = [WorkloadItem(f"p{i}", None, tuple(p), SamplingParams(16, ignore_eos=True)) for i, p in enumerate(prompts)]
        eng = Engine(EngineConfig(model=str(path), device=device, dtype="float32", cpu_device="thread",
                                  block_size=16, kv_blocks=256))
        try:
            run_workload(eng, items)
        finally:
            eng.close()
        outs = {r.request_id: r.output_ids for r in eng.rm.finished}
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").to(device).eval()
        checked = bad = 0
        for i, p in enumerate(prompts):
            seq = p + outs[f"p{i}"]
            with torch.no_grad():
                logits = hf(torch.tensor([seq], device=device)).logits[0, len(p) - 1:len(seq) - 1].float()
            top2 = logits.topk(2, dim=-1).values
            for j, tok in enumerate(outs[f"p{i}"]):
                checked += 1
                if tok != int(logits[j].argmax()) and float(top2[j, 0] - top2[j, 1]) >= 1e-3:
                    bad += 1
        if bad:
            raise RuntimeError(f"{name}: {bad} of {checked} greedy tokens differ from transformers")
        results.append(f"{name} {checked}/{checked}")
    return ", ".join(results)


def modes(model: str, requests: int, device: str) -> str:
    out = OUT / "modes"
    shutil.rmtree(out, ignore_errors=True)
    must(cli("run", "--model", model, "--device", device, "--requests", str(requests), "--mode", "all", "-q",
             "--out", str(out), timeout=600), "mstrace run --mode all")
    tps = {m: tok_per_s(out / m) for m in ("serial", "timeslice", "overlap")}
    return (f"serial {tps['serial']:.0f}, timeslice {tps['timeslice']:.0f}, overlap {tps['overlap']:.0f} tok/s; "
            f"overlap/serial {tps['overlap'] / tps['serial']:.2f}x")


def live_rows(model: str, requests: int, device: str) -> str:
    from tracing.reader import Trace, TraceError

    def committed_rounds() -> int:
        # the run writes its manifest before its meta.json: until both are there it is no trace yet
        try:
            return Trace.open(out).table("steps", ["step"]).num_rows
        except TraceError:
            return 0

    out = OUT / "live"
    shutil.rmtree(out, ignore_errors=True)
    # Poisson arrivals at 60/s: the run lasts ~5 s however fast the device is
    proc = subprocess.Popen([sys.executable, "-m", "viewer.cli", "run", "--model", model, "--device", device,
                             "--requests", str(requests), "--rate", "60", "--mode", "overlap", "-q",
                             "--out", str(out)],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not committed_rounds():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the run ended or hung before its first committed round")
            time.sleep(0.1)
        time.sleep(2.0)  # rounds are running: 2 s more, then what has the trace got?
        if proc.poll() is not None:
            raise RuntimeError("the run ended within 2 s of its first committed round")
        tr = Trace.open(out)
        probes = tr.table("probes", ["boundary"])
        n = sum(1 for b in probes["boundary"].to_pylist() if b == "device_compute")
        if n == 0:
            raise RuntimeError(f"no device_compute row in the trace 2 s into the run ({probes.num_rows} probe rows)")
    finally:
        rc = proc.wait(timeout=600)
    if rc != 0:
        raise RuntimeError(f"the live run exited {rc}")
    return f"{n} device_compute rows committed 2 s into the run"


def probe_overhead(model: str, requests: int, device: str) -> str:
    runs = {}
    for label, extra in (("probes", ()), ("no-probes", ("--no-probes",))):
        out = OUT / label
        shutil.rmtree(out, ignore_errors=True)
        must(cli("run", "--model", model, "--device", device, "--requests", str(requests), "-q", "--out", str(out),
                 *extra, timeout=600), f"mstrace run ({label})")
        runs[label] = tok_per_s(out)
    ratio = runs["probes"] / runs["no-probes"]
    if ratio < 0.8:
        raise RuntimeError(f"probes cost {100 * (1 - ratio):.0f}% of throughput in one pair")
    return f"with/without probes {ratio:.3f} (one pair; bench/bench_probe_cpu.py measures it properly)"


def attention_shapes() -> str:
    """What a new attention shape costs the launching thread: torch's default SDPA backends
    against the engine's (forward_step's, without cuDNN), eight decode-shaped masked calls of
    shapes not seen before, bfloat16, as the engine's length groups make them every round."""
    import torch
    import torch.nn.functional as F

    from scheduler.model.forward_step import _gpu_attention

    dev, dt = torch.device("cuda"), torch.bfloat16

    def call(rows: int, keys: int) -> tuple[float, float]:
        q = torch.randn(rows, 4, 2, 64, device=dev, dtype=dt)
        k, v = (torch.randn(rows, 4, keys, 64, device=dev, dtype=dt) for _ in range(2))
        mask = torch.zeros(rows, 1, 1, keys + 16, device=dev, dtype=dt)[..., :keys]
        times = []
        for _ in range(2):  # first sight, then the same shape again
            torch.cuda.synchronize()
            t = time.perf_counter()
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            times.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
        return times[0], times[1]

    q0 = torch.randn(8, 4, 2, 64, device=dev, dtype=dt)
    kv0 = torch.randn(8, 4, 160, 64, device=dev, dtype=dt)
    m0 = torch.zeros(8, 1, 1, 160, device=dev, dtype=dt)
    # a prefill chunk with context: [1, heads, rows, hd] against [1, kv heads, keys, hd], GQA, a mask
    qp, kp = torch.randn(1, 8, 100, 64, device=dev, dtype=dt), torch.randn(1, 4, 160, 64, device=dev, dtype=dt)
    mp = torch.zeros(100, 160, device=dev, dtype=dt)

    def choices() -> str:  # 0 math, 1 flash, 2 efficient, 3 cudnn
        return (f"decode {int(torch._fused_sdp_choice(q0, kv0, kv0, attn_mask=m0))}, "
                f"prefill {int(torch._fused_sdp_choice(qp, kp, kp, attn_mask=mp, enable_gqa=True))}")

    choice = choices()
    with _gpu_attention():
        ours = choices()
    default = [call(5 + i, 144 + 16 * i) for i in range(8)]
    with _gpu_attention():
        engine = [call(40 + i, 144 + 16 * i) for i in range(8)]
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return (f"backends {choice} by default, {ours} in the engine (0 math, 2 efficient, 3 cuDNN); "
            f"host ms per decode call, new shape / seen: "
            f"default {med([a for a, _ in default]):.2f} / {med([b for _, b in default]):.2f}, "
            f"engine {med([a for a, _ in engine]):.2f} / {med([b for _, b in engine]):.2f} (medians of 8)")


def no_sync_in_launch(requests: int) -> str:
    """A serial run in this process with torch's sync debug mode on: an operation in the
    launch that makes the host wait for the device warns, and the check fails."""
    import warnings

    import torch

    from scheduler.config import EngineConfig
    from scheduler.engine import Engine
    from scheduler.harness.runner import run_workload
    from scheduler.harness.workload import SyntheticSpec, synthetic_workload

    eng = Engine(EngineConfig(model="default", device="cuda", mode="serial"))
    try:
        mc = eng.model_config
        items = synthetic_workload(SyntheticSpec(requests), mc.vocab_size, set(eng.eos_ids))  # `run`'s lengths
        # every other request samples, with penalties and a bias: those paths copy host values too
        items = [it if i % 2 else replace(it, params=replace(
            it.params, temperature=0.8, top_p=0.9, seed=i, presence_penalty=0.5, frequency_penalty=0.2,
            repetition_penalty=1.1, logit_bias=((5, 1.0),))) for i, it in enumerate(items)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                res = run_workload(eng, items)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        eng.close()
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    if syncs:
        raise RuntimeError(f"{len(syncs)} synchronising operations in {res.steps} rounds, first: "
                           f"{syncs[0].filename}:{syncs[0].lineno}: {str(syncs[0].message)[:80]}")
    return f"{res.steps} rounds, no synchronising operation"


def deadlock(model: str, device: str) -> str:
    out = OUT / "deadlock"
    shutil.rmtree(out, ignore_errors=True)
    p = cli("run", "--model", model, "--device", device, "--requests", "8", "--mode", "overlap", "--inject",
            "deadlock", "--wait-timeout", "2", "-q", "--out", str(out))
    if p.returncode != 3:
        raise RuntimeError(f"--inject deadlock exited {p.returncode}, not 3 (stalled)")
    p = cli("stalls", str(out), "--json")
    if p.returncode != 1:  # 1: stalls found (FINDINGS), as the command documents
        raise RuntimeError(f"mstrace stalls exited {p.returncode}, not 1 (stalls found): {p.stderr.strip()[-200:]}")
    st = json.loads(p.stdout)
    cycles = [s for s in st["stalls"] if s.get("cycle")]
    if not cycles:
        raise RuntimeError(f"mstrace stalls found {st['count']} stalls but no wait cycle")
    return f"exit 3; {st['count']} stall reports, cycle: {cycles[0].get('cycle_name') or cycles[0]['cycle']}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="run the checks on the CPU (smaller)")
    a = ap.parse_args()
    device = "cpu" if a.cpu else "cuda"
    if not a.cpu:
        import torch

        if not torch.cuda.is_available():
            print("error: no CUDA device (use --cpu for the CPU-compatible checks)", file=sys.stderr)
            return 2
    model, requests = ("tiny", 16) if a.cpu else ("default", 128)
    OUT.mkdir(parents=True, exist_ok=True)
    checks: list[tuple[str, Callable[[], str]]] = [
        ("greedy parity vs transformers", lambda: parity(device)),
        *([("attention on a new shape", attention_shapes),
           ("no sync in the launch", lambda: no_sync_in_launch(32))] if device == "cuda" else []),
        ("three modes", lambda: modes(model, requests, device)),
        ("device rows during the run", lambda: live_rows(model, 300, device)),
        ("probe overhead", lambda: probe_overhead(model, requests, device)),
        ("deadlock injection caught", lambda: deadlock(model, device)),
    ]
    rows, failed = [], 0
    for name, fn in checks:
        t = time.monotonic()
        try:
            res, ok = fn(), "ok"
        except Exception as e:  # noqa: BLE001 - every check reports, then the script fails
            res, ok = f"{type(e).__name__}: {e}", "FAIL"
            failed += 1
        rows.append((name, ok, f"{time.monotonic() - t:.0f} s", res))
        print(f"[{ok}] {name}: {res}", file=sys.stderr, flush=True)
    w = max(len(r[0]) for r in rows)
    print(f"\ngpu_check on {device}\n" + "\n".join(f"{n:<{w}}  {ok:<4}  {s:>5}  {res}" for n, ok, s, res in rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
