"""Fault injection (--inject NAME) and the truth harness's delays (--debug-delay-ms),
as one hooks object the engine is given at construction.

Each fault reproduces a known scheduler failure (a hang, a leak, a starved prefill) on purpose,
so the tooling can be shown to catch it. `RoundHooks`, the default, does nothing: the
engine calls it at fixed points of the round (a method call each) and never tests a
fault or debug flag itself. `hooks_for(cfg)` returns it unless something is switched on.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from probes.boundaries import KV_FENCE
from probes.waits import timed_wait
from scheduler.core.request import FinishReason, Request, SamplingParams
from scheduler.harness import debug_delay as dd

if TYPE_CHECKING:
    from probes.waits import WaitRegistry
    from scheduler.config import EngineConfig
    from scheduler.core.batch import ScheduleBatch
    from scheduler.core.memory_manager import MemoryManager
    from scheduler.core.request_manager import RequestManager
    from scheduler.device.device_process import DeviceProcess
    from scheduler.device.work import Stream
    from scheduler.model.config import ModelConfig

FAULTS: dict[str, str] = {
    "deadlock": "overlap mode with split streams: the main stream waits for blocks the prefill stream "
                "would free while the prefill stream waits for an event from the main stream",
    "leak": "the first request to finish dies on an exception path that skips freeing its blocks",
    "slow-sender": "the output path takes 50 ms per round to deliver tokens (a slow client)",
    "starve": "long decodes (four or more, each within the model's context) are submitted first; their "
              "prompts take ~90% of the KV pool and they grow past it",
    "stall-rank": "with --tp/--pp > 1, the last rank stops joining collectives at step 3 (it hangs "
                  "before its next all-reduce, or before its forward without TP) until the run is ended",
}

SLOW_SENDER_S = 0.05
STALL_RANK_STEP = 3


def parse_faults(names: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    for n in names:
        if n not in FAULTS:
            raise ValueError(f"unknown fault {n!r}; choose from {', '.join(FAULTS)}")
    return tuple(names)


class FaultTarget(Protocol):
    """What of the engine (scheduler/engine.py) a fault may touch, and nothing else: the
    queues and the pool it breaks, the streams it deadlocks, `submit` for the requests it
    adds. The engine passes itself; its class is not imported here (it imports this)."""

    @property
    def model_config(self) -> ModelConfig: ...
    @property
    def rm(self) -> RequestManager: ...
    @property
    def mm(self) -> MemoryManager: ...
    @property
    def registry(self) -> WaitRegistry: ...
    @property
    def streams(self) -> dict[str, Stream]: ...
    @property
    def device_proc(self) -> DeviceProcess | None: ...

    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               request_id: str | None = None) -> str: ...


class RoundHooks:
    """No faults, no delays: every hook is a no-op."""

    __slots__ = ()

    def at_start(self, engine: FaultTarget) -> None:
        """After construction, before the first round."""

    def before_launch(self, engine: FaultTarget, batch: ScheduleBatch, step: int) -> None:
        """Inside batch_prepare, after scheduling, before the batch's launches."""

    def cross_stream_waits(self, waits: list[Any]) -> list[Any]:
        """The events a launch waits for on other streams."""
        return waits

    def finish(self, engine: FaultTarget, req: Request) -> bool:
        """A request is about to finish; True: the hook finished it instead."""
        return False

    def end_of_bookkeeping(self) -> None:
        """The last thing inside the round's closing bookkeeping."""

    def after_send(self) -> None:
        """Inside response_send, after the tokens are handed to the sender."""

    def between_rounds(self) -> None:
        """After the round's last probe, before the next round."""

    def before_deliver(self) -> None:
        """On the sender thread, before it delivers a round's output."""

    def device_held(self, held: tuple[int, int] | None) -> None:
        """At close: (count, held_ns) of the device's holds (the backend timed them)."""

    def meta(self) -> dict[str, Any]:
        """What meta.json records about the hooks."""
        return {}


NO_HOOKS = RoundHooks()


class InjectedHooks(RoundHooks):
    """The configured faults and known delays. Only runs that asked for them pay for the
    checks here."""

    __slots__ = ("faults", "delays", "held", "split", "wait_timeout_s", "skip_stream_waits",
                 "_leaked", "_deadlocked")

    def __init__(self, cfg: EngineConfig) -> None:
        self.faults = frozenset(cfg.inject)
        self.delays = {p: dd.delay_ns(cfg.debug_delay_ms, p) for p in dd.PLACES}
        self.held = dd.Held()
        self.split = cfg.split_on
        self.wait_timeout_s = cfg.hard_wait_timeout_s
        self.skip_stream_waits = cfg.debug_skip_stream_waits
        self._leaked = self._deadlocked = False

    def _hold(self, place: str) -> None:
        if self.delays[place]:
            self.held.hold(place, self.delays[place])

    def at_start(self, engine: FaultTarget) -> None:
        if "starve" in self.faults:
            _starve(engine)

    def before_launch(self, engine: FaultTarget, batch: ScheduleBatch, step: int) -> None:
        self._hold(dd.BATCH_PREPARE)  # before the launch: the device has nothing to run meanwhile
        if ("deadlock" in self.faults and not self._deadlocked and batch.decodes and batch.prefills
                and self.split):
            self._deadlocked = True
            _deadlock(engine, batch, step, self.wait_timeout_s)

    def cross_stream_waits(self, waits: list[Any]) -> list[Any]:
        # the negative control of the KV ordering check: without these waits it must fire
        return [] if self.skip_stream_waits else waits

    def finish(self, engine: FaultTarget, req: Request) -> bool:
        if "leak" not in self.faults or self._leaked:
            return False
        # The request dies on an exception path that skips the free: its blocks stay
        # held by a request that no longer runs.
        self._leaked = True
        engine.rm.mark(req, "fault_injected", len(req.block_table))
        req.drop_placeholders()
        engine.rm.finish(req, FinishReason.ABORTED, "injected fault: died without freeing its blocks")
        return True

    def end_of_bookkeeping(self) -> None:
        self._hold(dd.BOOKKEEPING)

    def after_send(self) -> None:
        self._hold(dd.RESPONSE_SEND)

    def between_rounds(self) -> None:
        self._hold(dd.BETWEEN_ROUNDS)

    def before_deliver(self) -> None:
        if "slow-sender" in self.faults:
            time.sleep(SLOW_SENDER_S)

    def device_held(self, held: tuple[int, int] | None) -> None:
        if held is not None and self.delays[dd.DEVICE_COMPUTE]:
            self.held.add(dd.DEVICE_COMPUTE, *held)

    def meta(self) -> dict[str, Any]:
        return {"debug_delays": self.held.to_dict()} if any(self.delays.values()) else {}


def hooks_for(cfg: EngineConfig) -> RoundHooks:
    on = cfg.inject or any(ms for _, ms in cfg.debug_delay_ms) or cfg.debug_skip_stream_waits
    return InjectedHooks(cfg) if on else NO_HOOKS


STARVE_POOL_SHARE = 0.9  # of the KV pool the pins' prompts take


def _starve(engine: FaultTarget) -> None:
    """Long decodes, submitted first, whose prompts take ~90% of the pool and which then
    grow past it, whatever the pool's size: at least four, each within the model's context
    (a longer one would be rejected). The workload behind them waits for blocks until a
    prefill evicts decodes. Says what it added."""
    pool_tokens = engine.mm.num_blocks * engine.mm.block_size
    context = engine.model_config.max_position_embeddings
    share = int(STARVE_POOL_SHARE * pool_tokens)
    pins = max(4, -(-share // int(0.8 * context)))
    prompt = max(1, share // pins)
    new = max(1, min(context - prompt, prompt // 4))
    vocab = engine.model_config.vocab_size
    for i in range(pins):
        ids = [(7919 * (i * prompt + j)) % (vocab - 10) + 5 for j in range(prompt)]
        engine.submit(ids, SamplingParams(new, ignore_eos=True), f"starve-pin-{i}")
    print(f"--inject starve: added {pins} requests starve-pin-0..{pins - 1} of {prompt} prompt + {new} new "
          f"tokens: their prompts take {STARVE_POOL_SHARE:.0%} of the {engine.mm.num_blocks}-block KV pool",
          file=sys.stderr, flush=True)


def _deadlock(engine: FaultTarget, batch: ScheduleBatch, step: int, timeout_s: float) -> None:
    """A cross-stream deadlock: main waits for blocks the prefill stream would free,
    while the prefill stream waits for an event recorded on main after that."""
    from scheduler.device.work import MAIN, PREFILL

    victim = batch.prefills[0].req
    if engine.device_proc is not None:
        # The same cycle from device-side events: main waits for an event the prefill
        # stream records only after its own wait for main.
        main_p, prefill_p = engine.device_proc.streams[MAIN], engine.device_proc.streams[PREFILL]
        freed = prefill_p.reserve()
        main_p.wait_event(freed, what=f"blocks held by req {victim.request_id}",
                          label=f"injected: wait for free blocks#{step}")
        prefill_p.wait_event(main_p.record())
        prefill_p.record(freed)
        return
    blocks_freed = threading.Event()  # the prefill stream would set it; it never gets to
    main = engine.streams[MAIN]
    # host work on the stream (a GPU's host function): the stream, not the scheduling thread, waits
    main.submit_host(lambda: timed_wait(
        blocks_freed.wait, registry=engine.registry, waiter="main-stream",
        what=f"blocks held by req {victim.request_id}", signaller="prefill-stream", boundary=KV_FENCE,
        timeout_s=timeout_s, step=step), f"injected: wait for free blocks#{step}", step, KV_FENCE)
    engine.streams[PREFILL].wait_event(main.record())
