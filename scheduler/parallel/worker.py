"""A rank other than 0 of ``mstrace run --tp N --pp M``: ``python -m scheduler.parallel.worker``.

Spawned by rank 0 (``scheduler.parallel.launch.spawn_workers``) or started by torchrun on every
node.  Under torchrun the same command line starts every rank: rank 0 runs the ``mstrace``
command line given after the module name (``torchrun ... -m scheduler.parallel.worker run --tp 2
...``) and owns the scheduler; every other rank runs :func:`worker_main`:

    join the groups, answer the clock handshake, receive the RunSpec, load this rank's shard,
    then per round: receive the batch, build the same ForwardBatch, run ShardedModel.step,
    sample and send the tokens back to rank 0 (the logits rank under PP only), log collectives,
    until rank 0 broadcasts STOP.

Its trace rows (probes, collectives, stalls) go into rank 0's trace directory as its own parts
(``part-r<rank>-*.parquet``), with timestamps on rank 0's clock.  It dies with its parent, and
turns SIGTERM (rank 0 ending a failed run) into a trace flush and exit.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from functools import partial
from multiprocessing.connection import Connection
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from probes.boundaries import DEVICE_COMPUTE, PP_BUBBLE
from probes.clock import now_ns
from probes.recorder import Probes
from probes.waits import WaitRegistry, timed_wait
from probes.watchdog import StallReport, Watchdog
from scheduler.model.dtypes import DTYPES
from scheduler.model.forward_batch import build_forward_batch
from scheduler.model.forward_step import SamplingArgs, forward_step
from scheduler.seeds import Seed, fork_seeds
from tracing.writer import TraceWriter

from .batch_wire import STOP, BatchChannel, WireBatch
from .comm import p2p_ready
from .group import destroy, init_distributed
from .launch import (
    CollectiveLog,
    ForkedRank,
    RunSpec,
    answer_offsets,
    argv_option,
    backend_for,
    control_group,
    die_with_parent,
    recv_spec,
)
from .runner import ShardedModel


def _sigterm(signum: int, frame: FrameType | None) -> None:
    # Unwinds the main thread through worker_main's finally: the in-flight collectives and the
    # trace buffers get written. It runs within ~0.1 s of the signal in a sliced wait; in a
    # point-to-point one (PP's hidden states; gloo cannot slice it) once that wait returns,
    # within the hard wait timeout, which rank 0 allows before it kills (stop_workers).
    raise SystemExit(128 + signum)


def _sizes_in(conf: str) -> dict[str, object]:
    """tp, pp and device from rank 0's --config file. Rank 0 checks the whole file (its run
    options too, which the engine's config does not name: read as it, they were refused here)."""
    import tomllib

    with open(conf, "rb") as fh:
        data = tomllib.load(fh)
    return {k: data[k] for k in ("tp", "pp", "device") if k in data}


def worker_main(argv: list[str]) -> int:
    die_with_parent()
    signal.signal(signal.SIGTERM, _sigterm)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # under torchrun: rank 0's command line, whose --config file may set them too (a flag wins)
    conf = argv_option(argv, "--config", "")
    toml = _sizes_in(conf) if conf and "MSTRACE_TP" not in os.environ else {}
    tp = int(os.environ.get("MSTRACE_TP") or argv_option(argv, "--tp", str(toml.get("tp", 1))))
    pp = int(os.environ.get("MSTRACE_PP") or argv_option(argv, "--pp", str(toml.get("pp", 1))))
    device = os.environ.get("MSTRACE_DEVICE") or argv_option(argv, "--device", str(toml.get("device", "auto")))
    state = init_distributed(backend_for(device), rank, world, "env://", tp_size=tp, pp_size=pp)
    control = control_group(world)
    offset = answer_offsets(control)
    spec = recv_spec(control)
    torch.set_num_threads(max(1, spec.device_threads))
    writer = TraceWriter(spec.trace_dir, rank=rank, clock_offset_ns=offset)
    probes = Probes(writer.buffer if spec.probes else None, rank=rank)
    buf = probes.buffer()
    registry = WaitRegistry()
    step = -1
    stall_buf = writer.buffer("stalls")

    def on_stall(rep: StallReport) -> None:
        stall_buf.append(rep.to_row())
        w = rep.wait
        print(f"STALL rank {rank} step {rep.step}: {w.waiter} has waited {rep.waited_ns / 1e9:.2f} s "
              f"for {w.what} (to be signalled by {w.signaller})", file=sys.stderr, flush=True)

    watchdog = Watchdog(registry, spec.watchdog_s, on_stall=on_stall, rank=rank, step=lambda: step)
    watchdog.start()
    log = CollectiveLog(None, None, rank, f"tp{state.pp_rank}")
    clean = False
    try:
        sm = ShardedModel.load(
            spec.model_dir, state, dtype=DTYPES[spec.dtype], overlap=spec.comm_overlap,
            probe_buf=buf, registry=registry, timeout_s=spec.comm_timeout_s, microbatches=spec.pp_microbatches,
            pack=spec.pack_weights,
        )
        kv = sm.make_kv_cache(spec.num_blocks, spec.block_size)
        comm = sm.tp.comm if sm.tp is not None else None
        log = CollectiveLog(comm, probes.table_buffer("collectives"), rank, f"tp{state.pp_rank}")
        stall = _stall_rank(spec, rank, world)
        if comm is not None and stall is not None:
            comm.before_issue = lambda seq: stall(comm.step)
        channel = BatchChannel(control, rank, registry=registry, timeout_s=spec.comm_timeout_s,
                               buf=buf)
        while True:
            wb = channel.recv()
            if wb.code == STOP:
                break
            step = wb.step
            if stall is not None and comm is None:
                stall(step)  # no collectives (tp == 1): stop before the forward instead
            t0 = now_ns()
            fb = build_forward_batch(wb.seqs, spec.block_size, state.device)
            out = forward_step(partial(sm.step, step=step), fb, kv, _sampling(wb))
            if out is not None and fb.num_sampled:  # the logits rank of a PP run
                _send_tokens(out.tokens.tolist(), control, registry, rank, spec.comm_timeout_s, step)
            if buf is not None:
                buf.append((t0, now_ns() - t0, DEVICE_COMPUTE, "main", rank, step))
            log.drain()
        clean = True
    finally:
        log.drain(final=True)
        watchdog.stop()
        writer.close()
        if clean:
            destroy()  # a failed run's peers may be gone: leave the groups to process exit
    return 0


def _stall_rank(spec: RunSpec, rank: int, world: int) -> Callable[[int], None] | None:
    """--inject stall-rank: the last rank stops joining collectives from ``spec.stall_step`` on;
    it sleeps until rank 0 ends the run (SIGTERM), like a rank hung in a kernel or a host call."""
    if spec.stall_step < 0 or rank != world - 1:
        return None

    def stall(step: int) -> None:
        if step >= spec.stall_step:
            while True:
                time.sleep(0.1)

    return stall


def _sampling(wb: WireBatch) -> SamplingArgs:
    """The tokens only: a PP run refuses logprobs and penalties (their logits are here)."""
    return SamplingArgs(wb.temperatures, wb.top_ps,
                        [s if t > 0 else None for t, s in zip(wb.temperatures, wb.seeds, strict=True)])


def _send_tokens(toks: list[int], group: dist.ProcessGroup, registry: WaitRegistry, rank: int,
                 timeout_s: float, step: int) -> None:
    t = torch.tensor(toks, dtype=torch.int64)
    work = dist.isend(t, dst=0, group=group)
    assert work is not None
    timed_wait(p2p_ready(work, timeout_s), registry=registry, waiter=f"rank{rank}",
               what=f"send of the sampled tokens of step {step}", signaller="rank 0",
               boundary=PP_BUBBLE, timeout_s=timeout_s, rank=rank, step=step)


class RankSeed:
    """A rank other than 0 forked before rank 0 ran a torch op (scheduler/seeds.py says why),
    waiting for its environment; `spawn_workers` starts it instead of a fresh interpreter."""

    def __init__(self, seed: Seed) -> None:
        self._seed = seed

    @classmethod
    def fork(cls, n: int) -> list[RankSeed]:
        """`n` seeds; none where a fork is not safe here."""
        # Ctrl-C as a fresh interpreter would take it: ignored where the host ignores it (a
        # shell's `&` without job control), else KeyboardInterrupt
        sigint = signal.SIG_IGN if signal.getsignal(signal.SIGINT) == signal.SIG_IGN else signal.default_int_handler
        seeds = fork_seeds(n, partial(_seed_main, sigint=sigint), ("torch", __name__), "mstrace-rank")
        return [cls(s) for s in seeds or ()]

    def start(self, env: dict[str, str]) -> ForkedRank:
        conn, proc = self._seed
        conn.send(env)
        conn.close()
        return ForkedRank(proc)


def _seed_main(conn: Connection, env: dict[str, str], sigint: signal.Handlers | Callable[..., Any]) -> None:
    """As `python -m scheduler.parallel.worker` with `env` (spawn_workers' Popen) runs it."""
    conn.close()
    signal.signal(signal.SIGINT, sigint)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.update(env)
    sys.exit(worker_main([]))


if __name__ == "__main__":  # spawned by rank 0 (launch.py); under torchrun: viewer/commands/torchrun.py
    sys.exit(worker_main(sys.argv[1:]))
