"""The Memory Manager: a pool of fixed-size KV blocks with reference counts,
a free list and prefix sharing.

Block states: FREE (ref 0, on the free list), ALLOCATED (ref 1)
and REFERENCED (ref > 1, shared by several requests through a common prefix).

Prefix sharing: every *full* block whose KV has been computed is registered
under a chain hash (hash of the previous block's hash and this block's tokens).
A new request walks its prompt block by block; a hash hit is confirmed by
comparing tokens, because a hash alone can collide. When a block's last
reference goes it returns to the tail of the free list but keeps its hash, so a
later request with the same prefix can revive it until the block is reused
(LRU order, as vLLM's free queue does). Only full blocks are ever shared, so a
request always appends into a block it owns alone: no copy-on-write is needed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from probes.clock import now_ns

if TYPE_CHECKING:
    from scheduler.core.request import Request

NO_HASH = -1


class BlockState(StrEnum):
    FREE = "free"
    ALLOCATED = "allocated"
    REFERENCED = "referenced"


class OutOfBlocks(RuntimeError):
    """The pool cannot satisfy an allocation; the scheduler must wait or preempt."""


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int = NO_HASH
    token_ids: tuple[int, ...] = ()

    @property
    def state(self) -> BlockState:
        if self.ref_count == 0:
            return BlockState.FREE
        return BlockState.ALLOCATED if self.ref_count == 1 else BlockState.REFERENCED


# (kind, block_id, request_id, ref_count_after); the engine turns these into the
# trace's memory table. A plain callable keeps this module free of tracing.
MemoryEventSink = Callable[[str, int, str, int], None]


@dataclass(slots=True)
class PrefixMatch:
    block_ids: list[int] = field(default_factory=list)
    # How many of the matched blocks currently sit on the free list: reviving
    # them consumes free blocks just like a fresh allocation does.
    num_from_free: int = 0
    last_hash: int = NO_HASH

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


def chain_hash(prev: int, tokens: Sequence[int]) -> int:
    # Int tuples hash deterministically (no PYTHONHASHSEED salt), so hashes are
    # stable across runs and ranks.
    return hash((prev, tuple(tokens)))


class MemoryManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        on_event: MemoryEventSink | None = None,
        enable_prefix_sharing: bool = True,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block size must be >= 1, got {block_size}")
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least 1 block, got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # OrderedDict as an O(1)-removal LRU queue: popitem(last=False) takes the
        # least recently freed block; revived prefix blocks are removed by key.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[int, int] = {}
        # request id -> its block table (the same list object the request holds),
        # so the GC can reconcile holders against live requests.
        self.tables: dict[str, list[int]] = {}
        self._on_event = on_event
        self.enable_prefix_sharing = enable_prefix_sharing

    # ---- queries -------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- the contiguous layout (--kv-layout contiguous) -----------------
    # The pool as one contiguous array: a request owns one run of
    # consecutive blocks, so free space can be plentiful yet too scattered.
    def free_runs(self) -> list[tuple[int, int]]:
        """(start, length) of every run of consecutive free block ids, in id order."""
        runs: list[tuple[int, int]] = []
        start = prev = -2
        for b in sorted(self._free):
            if b != prev + 1:
                if prev >= 0:
                    runs.append((start, prev - start + 1))
                start = b
            prev = b
        if prev >= 0:
            runs.append((start, prev - start + 1))
        return runs

    def largest_free_run(self) -> int:
        return max((n for _, n in self.free_runs()), default=0)

    def allocate_run(self, request_id: str, num_blocks: int) -> list[int] | None:
        """First fit: the lowest run of num_blocks free consecutive blocks, or None."""
        start = next((s for s, n in self.free_runs() if n >= num_blocks), None)
        if start is None:
            return None
        table = []
        for bid in range(start, start + num_blocks):
            del self._free[bid]
            blk = self.blocks[bid]
            if blk.hash != NO_HASH:
                self._unpublish(blk)
            blk.ref_count = 1
            self._emit("alloc", bid, request_id, 1)
            table.append(bid)
        self.tables[request_id] = table
        return table

    def move(self, request_id: str, table: list[int], dst_start: int) -> list[tuple[int, int]]:
        """Defragmentation: give a request the run starting at dst_start (blocks
        that are free or its own). Returns the (src, dst) block moves whose KV
        the caller must copy; the table is updated in place."""
        dst = list(range(dst_start, dst_start + len(table)))
        own, dst_set = set(table), set(dst)
        if any(b not in self._free and b not in own for b in dst):
            raise RuntimeError(f"defrag: target run at {dst_start} is not free for {request_id}")
        moves = [(s, d) for s, d in zip(table, dst, strict=True) if s != d]
        # Ownership moves as ordinary alloc/free events, so a replay of the
        # memory table needs no special case; a block in both sets stays held.
        for d in dst:
            if d not in own:
                del self._free[d]
                self.blocks[d].ref_count = 1
                self._emit("alloc", d, request_id, 1)
        for s_ in table:
            if s_ not in dst_set:
                self.blocks[s_].ref_count = 0
                self._free[s_] = None
                self._emit("free", s_, request_id, 0)
        table[:] = dst
        return moves

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest run of already-computed full blocks equal to the prompt's start.

        The last prompt token is never covered, because the step that computes
        it produces the logits the first output token is sampled from.
        """
        match = PrefixMatch()
        if not self.enable_prefix_sharing:
            return match
        bs = self.block_size
        h = NO_HASH
        for i in range((len(token_ids) - 1) // bs):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            h = chain_hash(h, chunk)
            bid = self._by_hash.get(h)
            if bid is None or self.blocks[bid].token_ids != chunk:
                break
            match.block_ids.append(bid)
            match.last_hash = h
            if self.blocks[bid].ref_count == 0:
                match.num_from_free += 1
        return match

    # ---- allocation ----------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int, prefix: PrefixMatch | None = None) -> list[int]:
        """Blocks for the first num_tokens tokens of a request, reusing a matched prefix."""
        shared = prefix.block_ids if prefix else []
        fresh = self.blocks_needed(num_tokens) - len(shared)
        # Counted now, not taken from the match: a free between match and allocate
        # (an eviction) can drop a matched block's last reference.
        from_free = fresh + sum(1 for b in shared if self.blocks[b].ref_count == 0)
        if from_free > len(self._free):
            raise OutOfBlocks(f"need {from_free} free blocks, have {len(self._free)}")
        table: list[int] = []
        for bid in shared:
            self._ref(bid, request_id)
            table.append(bid)
        for _ in range(fresh):
            table.append(self._take_free(request_id))
        self.tables[request_id] = table
        return table

    def append_block(self, request_id: str, table: list[int]) -> int:
        """Grow a request by one block (decode crossed a block boundary)."""
        if not self._free:
            raise OutOfBlocks("no free block to grow into")
        bid = self._take_free(request_id)
        table.append(bid)
        return bid

    def free(self, request_id: str, table: Sequence[int], kind: str = "free") -> None:
        """Drop one reference to each block; a block with no references left is free again.

        kind="reclaim" marks blocks the GC took back from a dead holder.
        """
        if self.tables.get(request_id) is table:
            del self.tables[request_id]
        # Reverse order puts a request's tail blocks at the LRU front, so its
        # (more widely shared) prefix blocks survive longest for revival.
        for bid in reversed(table):
            blk = self.blocks[bid]
            if blk.ref_count <= 0:
                raise RuntimeError(f"double free of block {bid} by {request_id}")
            blk.ref_count -= 1
            if blk.ref_count == 0:
                self._free[bid] = None
                self._emit(kind, bid, request_id, 0)
            else:
                self._emit("unref" if kind == "free" else kind, bid, request_id, blk.ref_count)

    def detach(self, request_id: str, table: list[int]) -> None:
        """Stop tracking a table whose free is deferred (behind the KV fence): the
        engine owns it until then, so the GC must not mistake it for a leak, and a
        re-admitted request of the same id gets its own entry."""
        if self.tables.get(request_id) is table:
            del self.tables[request_id]

    def register_full_blocks(
        self,
        token_ids: Sequence[int],
        table: Sequence[int],
        num_computed: int,
        num_hashed: int = 0,
        prev_hash: int = NO_HASH,
    ) -> tuple[int, int]:
        """Publish blocks whose KV is now fully computed so later prompts can share them.

        Incremental: the caller passes how many leading blocks it already
        hashed and the last chain hash, and gets the new pair back, so a decode
        step hashes at most the one block it just filled.
        """
        if not self.enable_prefix_sharing:
            return num_hashed, prev_hash
        bs = self.block_size
        h = prev_hash
        upto = min(num_computed // bs, len(table))
        for i in range(num_hashed, upto):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            h = chain_hash(h, chunk)
            blk = self.blocks[table[i]]
            if blk.hash == h:
                continue
            if h in self._by_hash and self._by_hash[h] != blk.block_id:
                # Another block already holds this content (computed twice
                # before either was published); keep the first, this one stays private.
                continue
            if blk.hash != NO_HASH:
                self._unpublish(blk)
            blk.hash, blk.token_ids = h, chunk
            self._by_hash[h] = blk.block_id
        return max(num_hashed, upto), h

    # ---- invariants (used by tests and the leak checker) --------------
    def check_invariants(self, tables: Sequence[Sequence[int]]) -> None:
        counts = [0] * self.num_blocks
        for t in tables:
            for bid in t:
                counts[bid] += 1
        for blk, want in zip(self.blocks, counts, strict=True):
            if blk.ref_count != want:
                raise AssertionError(f"block {blk.block_id}: ref_count {blk.ref_count} != {want} holders")
            if (blk.ref_count == 0) != (blk.block_id in self._free):
                raise AssertionError(f"block {blk.block_id}: free-list membership disagrees with ref_count")
        for h, bid in self._by_hash.items():
            if self.blocks[bid].hash != h:
                raise AssertionError(f"hash index points at block {bid} with another hash")

    # ---- internals -----------------------------------------------------
    def _take_free(self, request_id: str) -> int:
        bid, _ = self._free.popitem(last=False)
        blk = self.blocks[bid]
        if blk.hash != NO_HASH:
            self._unpublish(blk)
        blk.ref_count = 1
        self._emit("alloc", bid, request_id, 1)
        return bid

    def _ref(self, bid: int, request_id: str) -> None:
        blk = self.blocks[bid]
        if blk.ref_count == 0:
            del self._free[bid]
        blk.ref_count += 1
        self._emit("ref", bid, request_id, blk.ref_count)

    def _unpublish(self, blk: Block) -> None:
        if self._by_hash.get(blk.hash) == blk.block_id:
            del self._by_hash[blk.hash]
        blk.hash, blk.token_ids = NO_HASH, ()

    def _emit(self, kind: str, bid: int, request_id: str, ref_after: int) -> None:
        if self._on_event is not None:
            self._on_event(kind, bid, request_id, ref_after)


def append_snapshot(buf: list[Any], step: int, mm: MemoryManager, running: Iterable[Request]) -> None:
    """A full block-table snapshot into the memory table (`--snapshot-every N` rounds): one
    row per (block, holder), after a marker row, so an empty pool still shows up as a
    snapshot; the marker's ref_count carries the free count."""
    ts = now_ns()
    blocks = mm.blocks
    rows = [(ts, step, "snapshot_begin", -1, "", mm.num_free)]
    rows += [(ts, step, "snapshot", bid, req.request_id, blocks[bid].ref_count)
             for req in running for bid in req.block_table]
    # one extend (atomic under the GIL): a flush takes the whole listing or none of it. Row by
    # row, a flush could commit the marker and part of the list, and `top`, restarting its
    # holders at the marker, lost the rest (weighted as a snapshot it had already taken)
    buf.extend(rows)


def plan_moves(running: Iterable[Request], mm: MemoryManager,
               mark: Callable[[Request, str, int], object]) -> list[tuple[int, int]]:
    """Defragmentation's plan (--kv-layout contiguous): every live run moves to the low end
    of the pool, in pool order, so the free blocks become one run. Moves the block tables
    here; returns the (src, dst) block copies the device must make (the engine pauses
    scheduling and waits for the streams first). `mark` records a `defrag_moved` stage on
    each moved request."""
    holders = sorted((r for r in running if r.block_table), key=lambda r: r.block_table[0])
    moves: list[tuple[int, int]] = []
    at = 0
    for req in holders:
        m = mm.move(req.request_id, req.block_table, at)
        at += len(req.block_table)
        if m:
            moves += m
            mark(req, "defrag_moved", len(m))
    return moves
