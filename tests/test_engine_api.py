"""The Engine as a library user drives it: submit, step, abort, EOS."""

from __future__ import annotations

import shutil
import time

from scheduler.config import EngineConfig
from scheduler.core.request import FinishReason, SamplingParams
from scheduler.engine import Engine
from tests.support.checkpoints import build_llama, set_eos
from tests.support.engines import drive
from tests.support.exact import F32


def test_eos_finishes_a_request(tmp_path):
    ckpt = build_llama(tmp_path / "ckpt")
    prompt = [11, 42, 7, 99, 5]
    # alone, then batched with another: F32, or a near-tie may round either way
    eng = Engine(EngineConfig(cpu_device="thread", model=str(ckpt), block_size=4, kv_blocks=64, **F32))
    try:
        eng.submit(prompt, SamplingParams(12, ignore_eos=True), "ref")
        drive(eng)
        ref = eng.rm.finished[0].output_ids
    finally:
        eng.close()
    eos = ref[3]
    first = ref.index(eos)
    eos_dir = tmp_path / "eos"
    shutil.copytree(ckpt, eos_dir)
    set_eos(eos_dir, [eos])
    eng = Engine(EngineConfig(cpu_device="thread", model=str(eos_dir), block_size=4, kv_blocks=64, **F32))
    try:
        eng.submit(prompt, SamplingParams(12), "a")
        eng.submit(prompt, SamplingParams(12, ignore_eos=True), "b")
        drive(eng)
        got = {r.request_id: r for r in eng.rm.finished}
        assert got["a"].finish_reason is FinishReason.EOS and got["a"].output_ids == ref[: first + 1]
        assert got["b"].finish_reason is FinishReason.LENGTH and got["b"].output_ids == ref
        assert eng.mm.num_free == eng.mm.num_blocks
    finally:
        eng.close()


def test_abort_releases_blocks_and_is_recorded():
    eng = Engine(EngineConfig(cpu_device="thread", model="tiny", kv_blocks=64))
    try:
        eng.submit(list(range(5, 60)), SamplingParams(200, ignore_eos=True), "long")
        # until it holds blocks (the tokenizer pool's thread hands it over in its own time)
        deadline = time.monotonic() + 60
        while eng.mm.num_free == eng.mm.num_blocks and time.monotonic() < deadline:
            if eng.step() is None:
                eng.wait_for_arrivals(0.05)
        assert eng.mm.num_free < eng.mm.num_blocks
        assert eng.abort("long") and not eng.abort("nope")
        drive(eng)
        r = eng.rm.finished[0]
        assert r.finish_reason is FinishReason.ABORTED and eng.mm.num_free == eng.mm.num_blocks
    finally:
        eng.close()


def test_seeded_sampling_is_reproducible():
    outs = []
    for _ in range(2):
        eng = Engine(EngineConfig(cpu_device="thread", model="tiny"))
        try:
            eng.submit([5, 6, 7, 8], SamplingParams(16, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True), "s")
            drive(eng)
            outs.append(eng.rm.finished[0].output_ids)
        finally:
            eng.close()
    assert outs[0] == outs[1] and len(outs[0]) == 16


def test_close_restores_the_process_wide_settings():
    """An Engine sets torch's thread count and freezes the GC for the whole process;
    closing it gives both back (a test or notebook that builds engines keeps its own)."""
    import gc

    import torch

    from scheduler.harness.faults import NO_HOOKS

    threads = torch.get_num_threads()
    frozen = gc.get_freeze_count()
    eng = Engine(EngineConfig(cpu_device="thread", model="tiny", device_threads=threads + 1))
    try:
        assert torch.get_num_threads() == threads + 1
        assert gc.get_freeze_count() > frozen
        assert eng.hooks is NO_HOOKS  # no fault, no delay: the round's hooks do nothing
    finally:
        eng.close()
    assert torch.get_num_threads() == threads
    assert gc.get_freeze_count() == frozen or frozen > 0


def test_a_failing_arrivals_thread_stops_the_run(tmp_path):
    """A prompt for a model folder without a tokenizer: the arrivals thread fails. The run
    used to wait forever for the request it had counted; now it stops and says why."""
    import pytest

    from scheduler.core.request import SamplingParams as SP
    from scheduler.harness.runner import RunFailed, run_workload
    from scheduler.harness.workload import WorkloadItem

    ckpt = build_llama(tmp_path / "ckpt")  # config and weights, no tokenizer
    eng = Engine(EngineConfig(cpu_device="thread", model=str(ckpt), block_size=4, kv_blocks=64))
    items = [WorkloadItem("ids", None, (5, 6, 7), SP(2)), WorkloadItem("text", "hello", None, SP(2))]
    try:
        with pytest.raises(RunFailed, match="arrivals thread failed: .*no tokenizer"):
            run_workload(eng, items)
    finally:
        eng.close()
    assert eng.submitted == 1  # the refused request is not counted as submitted


def test_a_request_rejected_as_it_arrives_still_reaches_the_output():
    """Rejected inside wait_for_arrivals, as the last work of a run: has_work() must still
    say so, or the run ends before its record reaches the sender (and the trace)."""
    got = []

    class Sink:
        def on_text(self, rid, text):
            pass

        def on_finish(self, rec, text):
            got.append((rec.request_id, rec.finish_reason))

    eng = Engine(EngineConfig(cpu_device="thread", model="tiny", kv_blocks=64), sinks=[Sink()])
    try:
        eng.submit([5, 6, 7], SamplingParams(10**9), "huge")  # longer than the model's context
        for _ in range(200):
            if eng.rm.has_undrained():
                break
            eng.wait_for_arrivals(0.05)  # arrives here and is rejected at once
        assert eng.rm.has_undrained() and len(eng.rm) == 0
        assert eng.has_work()
        drive(eng)
    finally:
        eng.close()
    assert got == [("huge", "rejected")]


def test_sinks_get_one_text_per_token_and_the_whole_text_at_the_end():
    """Sampled text on a byte-level tokenizer splits characters across tokens and can end
    inside one: each token still gets exactly one on_text (a streamed chunk each), and
    their texts join to the finished text, the detokenizer's held-back bytes included."""
    texts: dict[str, list[str]] = {}
    whole: dict[str, tuple[int, str]] = {}

    class Sink:
        def on_text(self, rid, text):
            texts.setdefault(rid, []).append(text)

        def on_finish(self, rec, text):
            whole[rec.request_id] = (len(rec.output_ids), text)

    eng = Engine(EngineConfig(cpu_device="thread", model="tiny", kv_blocks=256), sinks=[Sink()])
    try:
        for i in range(16):
            eng.submit([5 + i, 6, 7, 8], SamplingParams(40, temperature=1.5, seed=i, ignore_eos=True), f"r{i}")
        drive(eng)
    finally:
        eng.close()
    assert len(whole) == 16
    for rid, (n, text) in whole.items():
        assert len(texts[rid]) == n, rid
        assert "".join(texts[rid]) == text, rid
