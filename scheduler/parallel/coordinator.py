"""Rank 0 of ``mstrace run --tp N --pp M``: the scheduler's side of a tensor x pipeline parallel run.

Rank 0 owns everything of the engine (policy, memory manager, sender, trace writer) and also
holds a model shard: TP rank 0 of pipeline stage 0.  Per round, on its main stream's thread
(:meth:`Coordinator.shard_step` as the model of ``scheduler/model/forward_step.py``, called by
:meth:`scheduler.device.local_device.LocalDevice.run_model`):

1. broadcast the batch description to every rank (``batch_wire``; ``batch_broadcast``);
2. run its own shard (``ShardedModel.step``: all-reduces with its TP peers, hidden states to the
   next stage);
3. sample, when it is the logits rank (``pp == 1``), exactly as one process would; otherwise
   receive the tokens the logits rank (TP rank 0 of the last stage) sampled, waited on as
   ``pp_bubble`` (stage 0 idles while the later stages run).  Each random row's draw seed
   (``token_seed``: the request's seed and the token's position) travels with the batch, so
   every layout draws the same tokens as a single process.

Rounds are serial: with tp * pp > 1 the engine runs with overlap scheduling and split streams
off (``EngineConfig.validate``), because a placeholder token lives in rank 0's future ring
only, and the other ranks would need that ring too.  Pipeline micro-batching across rounds is
not done either, so a stage idles while the others compute (the ``pp_bubble`` rows show it).
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from probes.boundaries import PP_BUBBLE
from probes.recorder import ProbeRow, Probes
from probes.waits import WaitRegistry, timed_wait
from scheduler.config import EngineConfig
from scheduler.model.config import ModelConfig
from scheduler.model.dtypes import name_of
from scheduler.model.kv_cache import PagedKVCache, block_bytes

from .batch_wire import RUN, STOP, BatchChannel, WireBatch
from .comm import COMM_STREAM, p2p_ready
from .group import ParallelState, destroy, init_distributed
from .launch import (
    ClockOffset,
    CollectiveLog,
    RunSpec,
    backend_for,
    control_group,
    free_port,
    measure_offsets,
    send_spec,
    spawn_workers,
    stop_workers,
)
from .pp import stage_layers
from .runner import ShardedModel
from .tp import tp_config

if TYPE_CHECKING:
    from collections.abc import Sequence

    from scheduler.device.prepared import PreparedBatch

    from .launch import RankProcess
    from .worker import RankSeed



class Coordinator:
    def __init__(
        self,
        cfg: EngineConfig,
        trace_dir: Path,
        state: ParallelState,
        control: dist.ProcessGroup,
        procs: list[RankProcess],
        offsets: dict[int, ClockOffset],
        backend: str,
    ) -> None:
        self.cfg = cfg
        self.trace_dir = trace_dir
        self.state = state
        self.control = control
        self.procs = procs  # empty under torchrun: its agent owns the other ranks
        self.offsets = offsets
        self.backend = backend
        self.sm: ShardedModel | None = None
        self.channel: BatchChannel | None = None
        self.log = CollectiveLog(None, None, 0, "tp0")
        self.registry = WaitRegistry()
        self._buf: list[ProbeRow] | None = None  # the main stream thread's probe rows (comm waits)
        self.exit_codes: list[int | None] = []

    @classmethod
    def start(cls, cfg: EngineConfig, trace_dir: Path, seeds: Sequence[RankSeed] = ()) -> Coordinator:
        """Start the other ranks (unless torchrun did; from `seeds` where given), join the
        process groups, sync clocks."""
        world = cfg.tp * cfg.pp
        backend = backend_for(cfg.device)
        procs: list[RankProcess] = []
        env_world = int(os.environ.get("WORLD_SIZE", "1"))
        if env_world > 1:  # under torchrun: the other ranks exist already
            if env_world != world or os.environ.get("RANK", "0") != "0":
                raise ValueError(f"torchrun started {env_world} ranks (this is rank "
                                 f"{os.environ.get('RANK')}), but --tp x --pp is {world}")
            init_method = "env://"
        else:
            port = free_port()
            procs = spawn_workers(world, port, {
                "MSTRACE_TP": str(cfg.tp), "MSTRACE_PP": str(cfg.pp), "MSTRACE_DEVICE": cfg.device,
            }, seeds)
            init_method = f"tcp://127.0.0.1:{port}"
        try:
            state = init_distributed(backend, 0, world, init_method, tp_size=cfg.tp, pp_size=cfg.pp)
            control = control_group(world)
            offsets = measure_offsets(control, world)
        except BaseException:
            stop_workers(procs, graceful=False)
            raise
        return cls(cfg, trace_dir, state, control, procs, offsets, backend)

    def kv_bytes_per_block(self, full: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """KV bytes one block costs on rank 0 (its stage's layers, its KV heads): what
        --kv-bytes budgets.  Other stages may hold a different number of layers."""
        local = tp_config(full, self.cfg.tp)
        layers = len(stage_layers(full.num_hidden_layers, self.cfg.pp, 0))
        return block_bytes(layers, local.num_key_value_heads, local.head_dim, block_size, dtype)

    def start_ranks(
        self, model_dir: Path, num_blocks: int, dtype: torch.dtype, pack: bool, probes: Probes,
        registry: WaitRegistry,
    ) -> ShardedModel:
        """Tell every rank what to run, then load rank 0's own shard (the others load theirs
        meanwhile).  ``registry`` is the engine's, so the stall watchdog sees rank 0's
        collective waits."""
        cfg = self.cfg
        from scheduler.harness.faults import STALL_RANK_STEP

        send_spec(self.control, RunSpec(
            model_dir=str(model_dir), trace_dir=str(self.trace_dir), tp=cfg.tp, pp=cfg.pp,
            dtype=name_of(dtype), device_threads=cfg.resolved_device_threads(),
            block_size=cfg.block_size, num_blocks=num_blocks, comm_overlap=cfg.comm_overlap,
            comm_timeout_s=cfg.hard_wait_timeout_s, watchdog_s=cfg.wait_timeout_s,
            probes=cfg.probes, stall_step=STALL_RANK_STEP if "stall-rank" in cfg.inject else -1,
            pp_microbatches=cfg.pp_microbatches, pack_weights=pack,
        ))
        self.registry = registry
        self._buf = probes.buffer()
        self.sm = ShardedModel.load(
            model_dir, self.state, dtype=dtype, overlap=cfg.comm_overlap, probe_buf=self._buf,
            registry=registry, timeout_s=cfg.hard_wait_timeout_s, microbatches=cfg.pp_microbatches, pack=pack,
        )
        self.channel = BatchChannel(self.control, 0, registry=registry,
                                    timeout_s=cfg.hard_wait_timeout_s, buf=self._buf)
        comm = self.sm.tp.comm if self.sm.tp is not None else None
        self.log = CollectiveLog(comm, probes.table_buffer("collectives"), 0, "tp0")
        return self.sm

    def shard_step(self, prepared: PreparedBatch, kv: PagedKVCache, step: int) -> torch.Tensor | None:
        """Rank 0's model in `forward_step` (the main stream's thread): broadcast the batch,
        run this shard. Logits where rank 0 computes them (pp == 1; logprobs only then, the
        engine refuses them otherwise), else None and the tokens come from `tokens`."""
        sm, ch = self.sm, self.channel
        assert sm is not None and ch is not None, "start_ranks() first"
        s = prepared.sampling
        ch.send(WireBatch(RUN, step, prepared.seqs, list(s.temperatures), list(s.top_ps),
                          [0 if x is None else x for x in s.seeds]))
        assert prepared.forward is not None, "TP/PP runs use the in-process device"
        logits = sm.step(prepared.forward, kv, step)
        self.log.drain()
        return logits

    def tokens(self, prepared: PreparedBatch, step: int) -> torch.Tensor:
        """The tokens the last pipeline stage sampled for this round."""
        if not prepared.sampled:
            return torch.zeros(0, dtype=torch.int64)
        return self._recv_tokens(len(prepared.sampled), step)

    def _recv_tokens(self, n: int, step: int) -> torch.Tensor:
        src = self.state.logits_rank
        toks = torch.empty(n, dtype=torch.int64)
        work = dist.irecv(toks, src=src, group=self.control)
        assert work is not None
        timed_wait(
            p2p_ready(work, self.cfg.hard_wait_timeout_s), registry=self.registry, waiter="rank0",
            what=f"sampled tokens of step {step}", signaller=f"rank {src} (last pp stage)",
            boundary=PP_BUBBLE, timeout_s=self.cfg.hard_wait_timeout_s, buf=self._buf,
            stream=COMM_STREAM, rank=0, step=step,
        )
        return toks

    def meta(self) -> dict[str, Any]:
        """``meta.json``'s ``ranks`` (clock offsets) and ``parallel`` sections."""
        ranks: dict[str, Any] = {"0": {"offset_ns": 0}}
        for r, o in sorted(self.offsets.items()):
            ranks[str(r)] = asdict(o)
        return {
            "ranks": ranks,
            "parallel": {"tp": self.cfg.tp, "pp": self.cfg.pp, "world": self.state.world_size,
                         "backend": self.backend, "comm_overlap": self.cfg.comm_overlap,
                         "pp_microbatches": self.cfg.pp_microbatches,
                         "logits_rank": self.state.logits_rank,
                         "launcher": "mstrace" if self.procs else "torchrun"},
        }

    def close(self, ok: bool) -> str | None:
        """End the run on every rank.  ``ok``: broadcast STOP and let the workers flush and exit;
        otherwise (a stall, an error) terminate them (they flush on SIGTERM), then kill.  Either
        way no child survives this call.  Rank 0's collectives still in flight are written last:
        they are the evidence of a collective that a peer never joined.  Returns what went
        wrong where the run had completed: a worker that did not exit cleanly after STOP (its
        last flush failed, or it was stopped in it) may have left its part of the trace short."""
        told = ok
        try:
            if ok and self.channel is not None:
                self.channel.send(WireBatch(STOP, -1))
        except Exception:  # noqa: BLE001 - a peer already gone: fall back to terminating
            ok = False
        finally:
            # a worker in a point-to-point wait (PP's hidden states) takes SIGTERM only when the
            # wait returns: gloo cannot wait for one in slices (comm.p2p_ready)
            self.exit_codes = stop_workers(self.procs, graceful=ok, wait_s=self.cfg.hard_wait_timeout_s)
            self.log.drain(final=True)
        if ok:
            destroy()
        bad = [f"rank {r} {'was killed by signal ' + str(-c) if c < 0 else 'exited with code ' + str(c)}"
               for r, c in enumerate(self.exit_codes, start=1) if c]
        if told and (bad or not ok):
            return (", ".join(bad) or "a rank was gone at the end") + " after the run: its part of the trace may be short"
        return None
