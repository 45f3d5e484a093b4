"""End to end: `mstrace run` as a user runs it, then the trace read back."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.checkpoints import build_llama, build_qwen2
from tests.support.cli import mstrace
from tests.support.oracle import teacher_forced_mismatches
from tracing.reader import read_meta, read_table


def test_run_tiny_writes_a_readable_trace(tmp_path):
    out = tmp_path / "t"
    p = mstrace("run", "--model", "tiny", "--requests", "12", "--prompt-len", "8-80", "--output-len", "4-24",
                "--prefill-chunk", "64", "--shared-prefix", "0.5", "--out", str(out), "-q")
    assert p.returncode == 0, p.stderr
    assert "sync-cost table" in p.stdout and "throughput and latency" in p.stdout
    meta = read_meta(out)
    assert meta["config"]["mode"] == "serial" and meta["workload"]["requests"] == 12
    assert len(meta["workload"]["digest"]) == 64 and meta["run"]["steps"] > 0
    req = read_table(out, "requests").to_pydict()
    assert len(req["request_id"]) == 12
    assert all(r == "length" for r in req["finish_reason"])
    for i in range(12):
        assert 4 <= req["output_len"][i] == len(req["output_ids"][i]) <= 24
        assert req["arrival_ns"][i] <= req["queued_ns"][i] <= req["admitted_ns"][i] \
            <= req["first_token_ns"][i] <= req["finish_ns"][i]
    assert sum(req["cached_prefix_len"]) > 0  # the shared system prompt was reused
    assert any(n > 1 for n in req["num_prefill_chunks"])  # some prompt ran in several chunks
    tl = read_table(out, "timeline").to_pydict()
    assert {"arrived", "tokenized", "queued", "got_blocks", "first_scheduled", "prefill_chunk",
            "first_token", "finished"} <= set(tl["stage"])
    steps = read_table(out, "steps").to_pydict()
    assert len(steps["step"]) == meta["run"]["steps"]
    assert all(d >= 0 for d in steps["dur_host_ns"])
    mem = read_table(out, "memory").to_pydict()
    allocs = sum(1 for k in mem["kind"] if k in ("alloc", "ref"))
    frees = sum(1 for k in mem["kind"] if k in ("free", "unref"))
    assert allocs == frees > 0  # everything allocated was released


@pytest.mark.parametrize("builder,mode", [
    (build_llama, "serial"), (build_qwen2, "serial"), (build_llama, "overlap"), (build_qwen2, "timeslice"),
], ids=["llama-gqa-tied", "qwen2-bias", "llama-overlap", "qwen2-timeslice"])
def test_run_matches_transformers_greedy(tmp_path, builder, mode):
    model_dir = builder(tmp_path / "ckpt")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    system = torch.randint(10, vocab, (24,), generator=g).tolist()
    lines = []
    for i, n in enumerate([3, 17, 40, 70, 33, 33]):
        body = torch.randint(10, vocab, (n,), generator=g).tolist()
        if i >= 4:
            body = system + body  # two requests share a prefix: exercises block sharing
        lines.append({"id": f"r{i}", "input_ids": body, "max_new_tokens": 12 + i, "ignore_eos": True})
    wl = tmp_path / "w.jsonl"
    wl.write_text("\n".join(json.dumps(x) for x in lines))
    out = tmp_path / "trace"
    # Small blocks and chunks so prompts span several blocks and several rounds.
    # float32: compared with transformers in float32 (auto may pick bfloat16 where the CPU computes it natively)
    p = mstrace("run", "--model", str(model_dir), "--workload", str(wl), "--out", str(out), "--mode", mode,
                "--dtype", "float32", "--block-size", "4", "--prefill-chunk", "16", "--timeslice-chunk", "16", "--kv-blocks", "200", "-q")
    assert p.returncode == 0, p.stderr
    req = read_table(out, "requests").to_pydict()
    assert sorted(req["request_id"]) == [f"r{i}" for i in range(6)]
    cached = dict(zip(req["request_id"], req["cached_prefix_len"], strict=True))
    assert cached["r5"] == 24  # the shared system prompt's 6 blocks came from r4, not recomputed
    checked = 0
    for i, rid in enumerate(req["request_id"]):
        prompt, output = req["input_ids"][i], req["output_ids"][i]
        assert len(output) == lines[int(rid[1:])]["max_new_tokens"]
        bad, ties = teacher_forced_mismatches(model_dir, prompt, output)
        assert bad == 0, f"{rid}: {bad} greedy tokens differ from transformers"
        checked += len(output) - ties
    assert checked >= 0.95 * sum(len(o) for o in req["output_ids"])
