"""Memory Manager: unit tests and a property-based state machine over random
admit / grow / share / finish / abort sequences."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from scheduler.core.memory_manager import BlockState, MemoryManager, OutOfBlocks


def test_blocks_needed_is_ceil():
    mm = MemoryManager(8, 16)
    assert [mm.blocks_needed(n) for n in (1, 15, 16, 17, 32, 33)] == [1, 1, 1, 2, 2, 3]


def test_block_size_zero_rejected():
    with pytest.raises(ValueError, match="block size"):
        MemoryManager(8, 0)


def test_shared_prefix_is_referenced_and_freed_by_last_holder():
    mm = MemoryManager(16, 4)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    a = mm.allocate("a", len(prompt))
    mm.register_full_blocks(prompt, a, num_computed=10)
    m = mm.match_prefix(prompt + [99])
    assert m.block_ids == a[:2]
    b = mm.allocate("b", 11, m)
    assert b[:2] == a[:2] and b[2] != a[2]
    assert mm.blocks[a[0]].state is BlockState.REFERENCED and mm.blocks[a[0]].ref_count == 2
    mm.free("a", a)
    assert mm.blocks[a[0]].state is BlockState.ALLOCATED
    mm.free("b", b)
    assert mm.num_free == 16
    mm.check_invariants([])


def test_hash_hit_confirmed_by_tokens(monkeypatch):
    import scheduler.core.memory_manager as m

    monkeypatch.setattr(m, "chain_hash", lambda prev, toks: 7)  # every block collides
    mm = MemoryManager(8, 2)
    a = mm.allocate("a", 4)
    mm.register_full_blocks([1, 2, 3, 4], a, 4)
    assert mm.match_prefix([5, 6, 7]).num_blocks == 0


def test_freed_prefix_revives_until_reused():
    mm = MemoryManager(4, 2)
    t = mm.allocate("a", 4)
    mm.register_full_blocks([1, 2, 3, 4], t, 4)
    mm.free("a", t)
    m = mm.match_prefix([1, 2, 3, 4, 5])
    assert m.block_ids == t and m.num_from_free == 2
    b = mm.allocate("b", 5, m)
    assert b[:2] == t
    mm.free("b", b)
    # exhaust the pool: the cached blocks get reused and lose their hash
    c = mm.allocate("c", 8)
    assert mm.match_prefix([1, 2, 3, 4, 5]).num_blocks == 0
    mm.free("c", c)
    mm.check_invariants([])


def test_last_prompt_token_never_shared():
    mm = MemoryManager(8, 2)
    t = mm.allocate("a", 4)
    mm.register_full_blocks([1, 2, 3, 4], t, 4)
    assert mm.match_prefix([1, 2, 3, 4]).num_blocks == 1


def test_double_free_detected():
    mm = MemoryManager(4, 2)
    t = mm.allocate("a", 2)
    mm.free("a", t)
    with pytest.raises(RuntimeError, match="double free"):
        mm.free("a", t)


def test_out_of_blocks():
    mm = MemoryManager(2, 2)
    mm.allocate("a", 4)
    with pytest.raises(OutOfBlocks):
        mm.allocate("b", 1)


def test_allocate_counts_matched_blocks_freed_since_the_match():
    """Regression: a prefix matched while another request held it, then that request
    was evicted. Its blocks are free now, and allocating must take them from the free
    list too, not trust the match's stale count (which emptied the list mid-allocate)."""
    mm = MemoryManager(5, 4)
    prompt = list(range(8))  # 2 full blocks
    a = mm.allocate("a", 9)
    mm.register_full_blocks(prompt + [50], a, num_computed=9)
    mm.allocate("c", 8)  # the pool's last 2 blocks
    m = mm.match_prefix(prompt + [99])
    assert m.block_ids == a[:2] and m.num_from_free == 0
    mm.free("a", a)  # the eviction between the match and the allocate: 3 free
    with pytest.raises(OutOfBlocks):
        mm.allocate("b", 13, m)  # 2 revived + 2 fresh: 4 from a free list of 3
    mm.check_invariants([mm.tables["c"]])
    b = mm.allocate("b", 9, m)  # 2 revived + 1 fresh = 3 free blocks: fits exactly
    assert b[:2] == a[:2] and mm.num_free == 0
    mm.check_invariants([mm.tables["c"], b])


class PoolMachine(RuleBasedStateMachine):
    """Random admit / grow / share / finish / abort; the pool must never
    double-free, leak, or lose a block."""

    def __init__(self) -> None:
        super().__init__()
        self.mm = MemoryManager(24, 4)
        self.live: dict[str, tuple[list[int], list[int], int]] = {}  # id -> (tokens, table, computed)
        self.n = 0
        self.events: list[tuple[str, int, str, int]] = []
        self.mm._on_event = lambda *e: self.events.append(e)

    # a tiny alphabet and a few fixed prefixes make sharing frequent
    prompts = st.tuples(st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9]]),
                        st.lists(st.integers(0, 3), min_size=1, max_size=9))

    @rule(p=prompts)
    def admit(self, p):
        tokens = p[0] + p[1]
        m = self.mm.match_prefix(tokens)
        need = self.mm.blocks_needed(len(tokens)) - m.num_blocks + m.num_from_free
        if need > self.mm.num_free:
            with pytest.raises(OutOfBlocks):
                self.mm.allocate("x", len(tokens), m)
            return
        rid = f"r{self.n}"
        self.n += 1
        table = self.mm.allocate(rid, len(tokens), m)
        assert len(table) == self.mm.blocks_needed(len(tokens))
        self.live[rid] = (tokens, table, m.num_blocks * self.mm.block_size)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def compute_and_grow(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        tokens, table, _ = self.live[rid]
        self.mm.register_full_blocks(tokens, table, len(tokens))
        tokens = tokens + [data.draw(st.integers(0, 3))]
        if len(tokens) > len(table) * self.mm.block_size:
            if self.mm.num_free == 0:
                return
            self.mm.append_block(rid, table)
        self.live[rid] = (tokens, table, len(tokens) - 1)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), abort=st.booleans())
    def finish(self, data, abort):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        tokens, table, computed = self.live.pop(rid)
        if not abort:
            self.mm.register_full_blocks(tokens, table, computed)
        self.mm.free(rid, table)

    @invariant()
    def conserved(self):
        tables = [t for _, t, _ in self.live.values()]
        self.mm.check_invariants(tables)
        held = {b for t in tables for b in t}
        assert self.mm.num_free + len(held) == self.mm.num_blocks
        for t in tables:
            assert len(set(t)) == len(t)  # a request never holds a block twice

    @invariant()
    def shared_blocks_hold_equal_tokens(self):
        bs = self.mm.block_size
        owner: dict[int, tuple[int, ...]] = {}
        for tokens, table, computed in self.live.values():
            for i, b in enumerate(table[: computed // bs]):
                chunk = tuple(tokens[i * bs : (i + 1) * bs])
                if b in owner:
                    assert owner[b] == chunk
                owner[b] = chunk

    def teardown(self):
        for rid, (_, table, _) in self.live.items():
            self.mm.free(rid, table)
        assert self.mm.num_free == self.mm.num_blocks
        # every alloc/ref is matched by exactly one unref/free
        up = sum(1 for k, *_ in self.events if k in ("alloc", "ref"))
        down = sum(1 for k, *_ in self.events if k in ("free", "unref"))
        assert up == down


TestPool = PoolMachine.TestCase
TestPool.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
