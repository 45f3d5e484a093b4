"""Request Manager transitions and the policy's admission and chunking,
without a model: the round's steps 1-3 are pure bookkeeping."""

from __future__ import annotations

import zlib

from probes.clock import now_ns
from scheduler.config import EngineConfig
from scheduler.core.collect import collect, launched
from scheduler.core.memory_manager import MemoryManager
from scheduler.core.policy import Policy
from scheduler.core.request import FinishReason, ReqSample, RequestStatus, SamplingParams
from scheduler.core.request_manager import RequestManager
from scheduler.hops.sender import StepOutput


def make(num_blocks=16, block_size=4, chunk=8, **kw):
    events = []
    rm = RequestManager(lambda *e: events.append(e))
    mm = MemoryManager(num_blocks, block_size)
    # The two wait limits read the clock (token times, queue times): a loaded machine that
    # stalls between rounds for 0.5 s or 2 s would change what these policy tests schedule.
    cfg = EngineConfig(block_size=block_size, prefill_chunk=chunk, watermark_frac=0,
                       **{"decode_max_wait_ms": 1e9, "prefill_max_wait_ms": 1e9, **kw})
    return rm, mm, Policy(cfg, rm, mm), events


def add(rm, rid, n, max_new=4, ts=1):
    # crc32, not hash(): str hashes change per process, and two ids equal mod 50 would make two
    # prompts identical (and share blocks) in one run in fifty
    ids = [(zlib.crc32(rid.encode()) + i) % 50 + 1 for i in range(n)]
    return rm.enqueue(ReqSample(rid, ids, n, SamplingParams(max_new), ts, ts + 1))


def run_round(rm, mm, policy, step, token=7):
    """A round without a device: the engine's own launch and collect steps
    (scheduler/core/collect.py), every sampled row drawing `token`."""
    b = policy.schedule(step)
    sampled = [c for c in b.chunks if c.sample]
    slots = list(range(len(sampled)))
    launched(b.chunks, sampled, slots)

    def finish(req, reason):
        mm.free(req.request_id, req.block_table)
        req.block_table = []
        req.drop_placeholders()
        rm.finish(req, reason)

    collect([(c, s, token, None) for c, s in zip(sampled, slots, strict=True)], b.chunks, step, now_ns(), mm, rm,
            frozenset(), finish, StepOutput(step))
    return b


def test_transitions_are_timestamped_in_order():
    rm, mm, policy, events = make()
    r = add(rm, "a", 5, max_new=2)
    assert r.status is RequestStatus.WAITING and r.queued_ns > 0
    run_round(rm, mm, policy, 1)
    assert r.status is RequestStatus.RUNNING and r.admitted_ns >= r.queued_ns
    run_round(rm, mm, policy, 2)
    assert r.status is RequestStatus.FINISHED and r.finish_reason is FinishReason.LENGTH
    stages = [e[2] for e in events if e[1] == "a"]
    # (the real collect step marks the first token, which the old copy of it did not)
    assert stages == ["arrived", "tokenized", "queued", "got_blocks", "first_token", "finished"]
    ts = [e[0] for e in events if e[1] == "a"]
    assert ts == sorted(ts)
    assert rm.drain_finished() == [r] and rm.drain_finished() == []


def test_fcfs_scan_stops_at_first_request_that_does_not_fit():
    rm, mm, policy, _ = make(num_blocks=6, block_size=4, chunk=1000)
    add(rm, "a", 12)  # 3 blocks
    add(rm, "b", 16)  # 4 blocks: does not fit after a
    add(rm, "c", 4)  # 1 block: would fit, but FCFS stops at b
    b = policy.schedule(1)
    assert [c.req.request_id for c in b.prefills] == ["a"]
    assert [r.request_id for r in rm.waiting] == ["b", "c"]
    assert mm.num_free == 3


def test_prefill_blocks_are_ceil_of_prompt():
    rm, mm, policy, _ = make(num_blocks=16, block_size=4, chunk=1000)
    r = add(rm, "a", 9)
    policy.schedule(1)
    assert len(r.block_table) == 3


def test_chunked_prefill_splits_long_prompt_and_decodes_run_between_chunks():
    rm, mm, policy, _ = make(num_blocks=32, block_size=4, chunk=8)
    add(rm, "short", 3, max_new=10)
    b1 = run_round(rm, mm, policy, 1)
    assert [(c.req.request_id, c.num_tokens, c.sample) for c in b1.prefills] == [("short", 3, True)]
    long = add(rm, "long", 20, max_new=2)
    seen = []
    for step in range(2, 6):
        b = run_round(rm, mm, policy, step)
        seen.append(([c.req.request_id for c in b.decodes], [(c.start, c.num_tokens, c.sample) for c in b.prefills]))
    # the short request decodes every round while the long prompt goes in 8-token chunks
    assert seen[0] == (["short"], [(0, 8, False)])
    assert seen[1] == (["short"], [(8, 8, False)])
    assert seen[2] == (["short"], [(16, 4, True)])
    assert seen[3][0] == ["short", "long"]
    assert long.num_computed == 21


def test_prefill_budget_is_shared_across_requests():
    rm, mm, policy, _ = make(num_blocks=32, block_size=4, chunk=10)
    add(rm, "a", 6)
    add(rm, "b", 6)
    b = policy.schedule(1)
    assert [(c.req.request_id, c.num_tokens) for c in b.prefills] == [("a", 6), ("b", 4)]
    assert b.num_prefill_tokens == 10


def test_prompt_that_never_fits_is_rejected_and_run_continues():
    rm, mm, policy, _ = make(num_blocks=4, block_size=4)
    big = add(rm, "big", 30)
    add(rm, "ok", 3)
    b = policy.schedule(1)
    assert big.finish_reason is FinishReason.REJECTED and "KV pool has 4" in big.finish_detail
    assert [c.req.request_id for c in b.prefills] == ["ok"]


def test_a_request_that_fits_only_with_the_reserve_is_rejected_not_waited_for():
    """The watermark reserve is never handed out at admission: a request whose prompt and
    max_new_tokens need more than the pool less its reserve (10 blocks, 1 kept back) could run
    only by growing into it, and once preempted never be admitted again. It is rejected,
    saying why, and the requests behind it run (a prompt needing the whole pool used to hold
    the queue, evicting every decode)."""
    for contiguous in (False, True):
        for prompt, max_new in ((38, 2), (30, 10), (20, 17)):  # 10 blocks at admission, or by growth
            rm = RequestManager(lambda *e: None)
            mm = MemoryManager(10, 4)
            cfg = EngineConfig(block_size=4, prefill_chunk=100, watermark_frac=0.1, decode_max_wait_ms=1e9,
                               prefill_max_wait_ms=0, kv_layout="contiguous" if contiguous else "paged")
            policy = Policy(cfg, rm, mm)
            assert policy.capacity == 9
            small = add(rm, "small", 3)
            run_round(rm, mm, policy, 1)
            big = add(rm, "big", prompt, max_new=max_new)
            add(rm, "after", 3)
            b = policy.schedule(2)
            assert big.finish_reason is FinishReason.REJECTED, (contiguous, prompt)
            assert "the KV pool has 10 less the 1 kept back at admission" in big.finish_detail, big.finish_detail
            assert small.status is RequestStatus.RUNNING and small.num_preemptions == 0
            assert [c.req.request_id for c in b.prefills] == ["after"]


def test_overlap_publishes_a_block_only_once_the_round_that_wrote_its_last_slot_is_collected():
    """Overlap: round 2 (a's decode, writing K/V at position 7, the last of block 1) is
    launched before round 1 is collected. Collecting round 1 makes token 7's id known, but its
    K/V is still being written: block 1 is published only at round 2's collect (a prompt
    matching it could be prefilled on the prefill stream meanwhile and read the stale slot)."""
    rm, mm, policy, _ = make(num_blocks=16, block_size=4, chunk=100)
    a = add(rm, "a", 7, max_new=8)

    def launch(step):
        b = policy.schedule(step)
        sampled = [c for c in b.chunks if c.sample]
        launched(b.chunks, sampled, list(range(len(sampled))))
        return b, sampled

    def collect_round(step, b, sampled, token):
        collect([(c, s, token, None) for s, c in enumerate(sampled)], b.chunks, step, now_ns(), mm, rm,
                frozenset(), lambda req, why: None, StepOutput(step))

    b1 = launch(1)  # a's prompt, positions 0-6; samples token 7
    b2 = launch(2)  # overlap: a's decode of token 7 (position 7, block 1's last slot) before round 1's collect
    collect_round(1, *b1, token=9)
    tokens = a.token_ids()[:8]
    assert len(tokens) == 8 and tokens[7] == 9  # token 7's id is known now ...
    assert mm.match_prefix(tokens + [1]).num_blocks == 1  # ... but not its K/V: block 1 waits
    collect_round(2, *b2, token=9)
    assert mm.match_prefix(tokens + [1]).num_blocks == 2


def test_decode_growth_preempts_latest_when_pool_is_full():
    rm, mm, policy, events = make(num_blocks=4, block_size=4, chunk=100)
    a = add(rm, "a", 8, max_new=8)
    b = add(rm, "b", 8, max_new=8)
    run_round(rm, mm, policy, 1)  # both admitted: 4 blocks used, each has 9 tokens
    assert mm.num_free == 0
    bt = run_round(rm, mm, policy, 2)  # both need a 3rd block: b (admitted last) is preempted
    assert [c.req.request_id for c in bt.decodes] == ["a"]
    assert b.status is RequestStatus.WAITING and b.num_preemptions == 1 and b.block_table == []
    assert rm.waiting[0] is b
    assert any(e[1] == "b" and e[2] == "preempted" for e in events)
    mm.check_invariants([a.block_table])


def test_decodes_wait_for_fenced_blocks_instead_of_preempting_everyone():
    """Regression (CI hang): with split streams a victim's blocks come back only after
    the KV fence, so evicting more in the same round frees nothing. Every decode of a
    full pool used to evict the next, the whole batch was preempted, re-admitted to
    the same full pool, and preempted again, forever."""
    rm, mm, _, events = make(num_blocks=6, block_size=4, chunk=100)
    fenced: list[tuple[str, list[int]]] = []

    def release(req):  # the engine's fenced release: detached now, free next round
        mm.detach(req.request_id, req.block_table)
        fenced.append((req.request_id, req.block_table))
        req.block_table = []

    policy = Policy(EngineConfig(block_size=4, prefill_chunk=100, watermark_frac=0), rm, mm, release,
                    lambda: sum(len(t) for _, t in fenced))
    reqs = [add(rm, r, 8, max_new=8) for r in "abc"]
    run_round(rm, mm, policy, 1)  # all three admitted: 6 blocks, each holds 9 tokens
    assert mm.num_free == 0
    b2 = run_round(rm, mm, policy, 2)  # a needs a 3rd block: c is evicted, a and b wait for the fence
    assert reqs[2].status is RequestStatus.WAITING and reqs[2].num_preemptions == 1
    assert [r.num_preemptions for r in reqs[:2]] == [0, 0] and b2.decodes == []
    assert sum(e[2] == "fence_wait" for e in events) == 2
    for rid, table in fenced:  # the fence passes
        mm.free(rid, table)
    fenced.clear()
    b3 = run_round(rm, mm, policy, 3)
    assert [c.req.request_id for c in b3.decodes] == ["a", "b"]
    assert all(r.num_preemptions == 0 for r in reqs[:2])


def test_prefix_hit_skips_computed_tokens():
    rm, mm, policy, _ = make(num_blocks=16, block_size=4, chunk=100)
    a = add(rm, "a", 10, max_new=3)
    run_round(rm, mm, policy, 1)
    mm.register_full_blocks(a.token_ids(), a.block_table, a.num_computed)
    b = rm.enqueue(ReqSample("b", a.sample.input_ids[:8] + [42, 43], 10, SamplingParams(2), 1, 1))
    batch = policy.schedule(2)
    pf = [c for c in batch.prefills if c.req is b][0]
    assert b.num_cached_prefix == 8 and pf.start == 8 and pf.num_tokens == 2
    assert b.block_table[:2] == a.block_table[:2]


def test_max_running_caps_admission():
    rm, mm, policy, _ = make(num_blocks=64, chunk=1000, max_running=2)
    for i in range(4):
        add(rm, f"r{i}", 4)
    policy.schedule(1)
    assert len(rm.running) == 2 and len(rm.waiting) == 2
