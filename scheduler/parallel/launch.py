"""Starting and stopping the ranks of ``mstrace run --tp N --pp M``, and what they share at start-up.

Rank 0 is the ``mstrace run`` process (it owns the scheduler).  Locally it starts ranks
``1 .. N*M-1`` with torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``), each a `RankSeed` forked before rank 0 ran a torch op (scheduler/seeds.py), else
a ``python -m scheduler.parallel.worker`` child, so the same entry point runs under ``torchrun``
on several nodes.  No child may outlive a run: :func:`stop_workers` terminates, then
kills, in the caller's ``finally``; and each worker dies with its parent on its own
(:func:`die_with_parent`), in case rank 0 itself is killed.

Start-up, on every rank in this order (collective calls must match across ranks):

1. :func:`~scheduler.parallel.group.init_distributed` (world, TP and PP groups);
2. :func:`control_group`: a gloo group over all ranks for the batch broadcast, with a timeout
   long enough for an idle engine (gloo applies a group's timeout to every operation);
3. the clock handshake (:func:`measure_offsets` / :func:`answer_offsets`);
4. the run description, :class:`RunSpec`, as JSON bytes in a uint8 tensor (no pickles).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.distributed as dist

from probes.clock import now_ns
from probes.recorder import Row

from .batch_wire import IDLE_TIMEOUT_S
from .comm import AllReduce
from .group import INIT_TIMEOUT_S

if TYPE_CHECKING:
    from .worker import RankSeed

PARENT_PID_ENV = "MSTRACE_PARENT_PID"
HANDSHAKE_ROUNDS = 16
STOP_GRACE_S = 10.0  # a worker's clean exit after STOP: flush its trace, leave the group
KILL_GRACE_S = 3.0  # after SIGTERM (a failed run): the worker's SIGTERM handler flushes its trace


@dataclass(slots=True)
class RunSpec:
    """What rank 0 tells every other rank before the first round."""

    model_dir: str
    trace_dir: str
    tp: int
    pp: int
    dtype: str  # "float32", "bfloat16", "float16"
    device_threads: int
    block_size: int
    num_blocks: int  # rank 0 sizes the pool; every rank allocates the same block count
    comm_overlap: bool
    comm_timeout_s: float  # every collective / p2p wait (the engine's hard wait timeout)
    watchdog_s: float  # the stall watchdog's timeout (--wait-timeout)
    probes: bool
    stall_step: int  # --inject stall-rank: the last rank stops joining at this step; -1 = off
    pp_microbatches: int = 2  # a round's batch in this many pipelined parts (pp > 1)
    pack_weights: bool = False  # scheduler/model/packed_gemm.py (rank 0's choose_pack decided)


def backend_for(device: str) -> str:
    """The process-group backend every rank must agree on: nccl for CUDA devices, else gloo."""
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    return "nccl" if cuda else "gloo"


def free_port() -> int:
    # Racy (another process may take it before rank 0 binds), but only between two local calls.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RankProcess(Protocol):
    """A started rank, as much of `subprocess.Popen` as :func:`stop_workers` uses."""

    @property
    def returncode(self) -> int | None: ...
    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


class ForkedRank:
    """A rank started from a `RankSeed`: a forked process, not a Popen."""

    def __init__(self, proc: BaseProcess) -> None:
        self._proc = proc

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode  # as Popen's: negative for a signal

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self._proc.name or "rank", timeout or 0)
        return self._proc.exitcode

    def terminate(self) -> None:
        self._proc.terminate()

    def kill(self) -> None:
        self._proc.kill()


def spawn_workers(world: int, port: int, extra_env: dict[str, str],
                  seeds: Sequence[RankSeed] = ()) -> list[RankProcess]:
    """Start ranks 1 .. world-1 on this host; rank 0 is the caller. Rank r is `seeds[r-1]`
    where there is one, else a fresh interpreter."""
    procs: list[RankProcess] = []
    try:
        for r in range(1, world):
            env = {
                **os.environ, **extra_env,
                "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                PARENT_PID_ENV: str(os.getpid()),
            }
            if r - 1 < len(seeds):
                procs.append(seeds[r - 1].start(env))
                continue
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "scheduler.parallel.worker"], env=env,
                stdin=subprocess.DEVNULL,
            ))
    except BaseException:
        stop_workers(procs, graceful=False)
        raise
    return procs


def stop_workers(procs: Sequence[RankProcess], graceful: bool, wait_s: float = 0.0) -> list[int | None]:
    """End every child, whatever state it is in; returns the exit codes.

    ``graceful``: they were told STOP and exit on their own within :data:`STOP_GRACE_S`.
    Otherwise (or after that) SIGTERM, which a worker turns into a trace flush and exit, then
    SIGKILL after :data:`KILL_GRACE_S`, or after ``wait_s`` more where a worker's wait cannot
    be cut (``wait_s``: the run's longest such wait, a point-to-point receive).
    """
    if graceful:
        _wait_all(procs, STOP_GRACE_S)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    _wait_all(procs, KILL_GRACE_S + wait_s)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(5)
    return [p.returncode for p in procs]


def _wait_all(procs: Sequence[RankProcess], timeout_s: float) -> None:
    deadline = now_ns() + int(timeout_s * 1e9)
    for p in procs:
        try:
            p.wait(max(0.0, (deadline - now_ns()) / 1e9))
        except subprocess.TimeoutExpired:
            pass


def die_with_parent() -> None:
    """Make this process exit when the process that started it dies, even by SIGKILL.

    Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, done by the kernel.  Elsewhere (and as a
    fallback) a daemon thread polls the parent pid.  ``$MSTRACE_PARENT_PID`` closes the race of a
    parent that died before the prctl: then the parent is already someone else.
    """
    expected = int(os.environ.get(PARENT_PID_ENV) or os.getppid())
    if sys.platform.startswith("linux"):
        try:
            pr_set_pdeathsig = 1
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the polling thread below still covers it
    if os.getppid() != expected:
        os._exit(1)

    def watch() -> None:
        while True:
            threading.Event().wait(0.5)
            if os.getppid() != expected:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def control_group(world: int) -> dist.ProcessGroup:
    """A gloo group over all ranks for the per-round batch broadcast and the sampled tokens.

    gloo even under nccl: it carries host-side integers (vLLM's "cpu group" does the same), and its
    timeout is long because a worker legitimately waits for the next round as long as the engine
    is idle.  Collective: every rank calls it, after ``init_distributed``.
    """
    g = dist.new_group(list(range(world)), timeout=timedelta(seconds=IDLE_TIMEOUT_S),
                       backend="gloo")
    assert g is not None
    return cast(dist.ProcessGroup, g)


# ----------------------------------------------------------------------------- clock handshake


@dataclass(slots=True)
class ClockOffset:
    offset_ns: int  # applied: this rank's timestamps minus offset_ns are on rank 0's clock
    measured_ns: int  # what the handshake measured (error <= rtt_ns / 2)
    rtt_ns: int  # the shortest round trip of the handshake
    same_clock: bool  # same boot as rank 0: one CLOCK_MONOTONIC, nothing to correct


def clock_domain() -> int:
    """Equal on two processes exactly when they read the same CLOCK_MONOTONIC (same Linux boot)."""
    try:
        key = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        key = socket.gethostname()  # not Linux: assume one clock per host
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little", signed=True)


def measure_offsets(control: dist.ProcessGroup, world: int, rounds: int = HANDSHAKE_ROUNDS) -> dict[int, ClockOffset]:
    """Rank 0: each rank's clock offset from rank 0's.

    Ping-pong (NTP's idea): rank 0 sends its time t0, the rank answers with its own time t_r,
    rank 0 reads t1 on the reply; ``offset = t_r - (t0 + t1) / 2``, with an error of at most
    half the round trip.  Of ``rounds`` exchanges the one with the shortest round trip is kept
    (the least queueing).  A rank on rank 0's clock domain (same host and boot: the kernel's
    CLOCK_MONOTONIC is shared) gets offset 0, since there the measurement could only add its
    error; the measured value is still recorded.  Every rank is then told the offset it applies
    (:func:`answer_offsets`).
    """
    out: dict[int, ClockOffset] = {}
    buf = torch.zeros(1, dtype=torch.int64)
    mine = clock_domain()
    for r in range(1, world):
        best: tuple[int, int] | None = None
        for _ in range(rounds):
            t0 = now_ns()
            buf[0] = t0
            _send(buf, r, control)
            _recv(buf, r, control)
            t1 = now_ns()
            rtt, off = t1 - t0, int(buf[0]) - (t0 + t1) // 2
            if best is None or rtt < best[1]:
                best = (off, rtt)
        assert best is not None
        _recv(buf, r, control)
        same = int(buf[0]) == mine
        out[r] = ClockOffset(0 if same else best[0], best[0], best[1], same)
        buf[0] = out[r].offset_ns
        _send(buf, r, control)
    return out


def answer_offsets(control: dist.ProcessGroup, rounds: int = HANDSHAKE_ROUNDS) -> int:
    """Rank r > 0: the other half of :func:`measure_offsets`; returns the offset to apply."""
    buf = torch.zeros(1, dtype=torch.int64)
    for _ in range(rounds):
        _recv(buf, 0, control)
        buf[0] = now_ns()
        _send(buf, 0, control)
    buf[0] = clock_domain()
    _send(buf, 0, control)
    _recv(buf, 0, control)
    return int(buf[0])


# ----------------------------------------------------------------------------- the run spec


def send_spec(control: dist.ProcessGroup, spec: RunSpec) -> None:
    """Rank 0: broadcast ``spec`` (length, then UTF-8 JSON bytes) on the control group."""
    data = torch.tensor(list(json.dumps(asdict(spec)).encode()), dtype=torch.uint8)
    _bcast(torch.tensor([data.numel()], dtype=torch.int64), control)
    _bcast(data, control)


def recv_spec(control: dist.ProcessGroup) -> RunSpec:
    n = torch.zeros(1, dtype=torch.int64)
    _bcast(n, control)
    data = torch.empty(int(n[0]), dtype=torch.uint8)
    _bcast(data, control)
    return RunSpec(**json.loads(bytes(data.tolist()).decode()))


# The start-up's host tensors go over the gloo control group: under nccl the default group
# takes CUDA tensors only. Its own timeout is the idle one (a week), so each op is bounded
# here by the setup's, as it was on the default group.
def _wait_setup(work: dist.Work | None) -> None:
    assert work is not None
    work.wait(timedelta(seconds=INIT_TIMEOUT_S))


def _send(buf: torch.Tensor, dst: int, control: dist.ProcessGroup) -> None:
    _wait_setup(dist.isend(buf, dst=dst, group=control))


def _recv(buf: torch.Tensor, src: int, control: dist.ProcessGroup) -> None:
    _wait_setup(dist.irecv(buf, src=src, group=control))


def _bcast(t: torch.Tensor, control: dist.ProcessGroup) -> None:
    _wait_setup(dist.broadcast(t, src=0, group=control, async_op=True))


# ----------------------------------------------------------------------------- collectives table


class CollectiveLog:
    """Copies a rank's :class:`~scheduler.parallel.comm.CollectiveRecord` history into the
    ``collectives`` table: after each step the completed ones, and at the end (:meth:`drain`
    with ``final``) the ones still in flight, which is what names a collective some peer never
    joined.  Called from one thread at a time (the forward's, then the shutdown path)."""

    __slots__ = ("comm", "buf", "rank", "group", "_next")

    def __init__(self, comm: AllReduce | None, buf: list[Row] | None, rank: int, group: str) -> None:
        self.comm = comm
        self.buf = buf
        self.rank = rank
        self.group = group
        self._next = 0  # the first sequence number not written yet

    def drain(self, final: bool = False) -> None:
        if self.comm is None or self.buf is None:
            return
        for c in list(self.comm.records):
            if c.seq < self._next:
                continue
            if c.wait_ns < 0 and not final:
                break  # in flight: written once it completes, or by the final drain
            # Never waited out: its work may have "completed" only by failing when a peer was
            # killed (gloo then runs the completion callback too), so no completion time.
            end = c.end_ns if c.wait_ns >= 0 else -1
            self.buf.append((self.rank, self.group, c.seq, c.step, c.numel, c.overlapped,
                             c.issue_ns, c.start_ns, end, c.wait_ns))
            self._next = c.seq + 1


def argv_option(argv: Sequence[str], name: str, default: str) -> str:
    """``--name VALUE`` or ``--name=VALUE`` from a command line (torchrun: every rank gets
    rank 0's ``mstrace run`` arguments, and a worker needs the few it must know before rank 0
    can tell it anything: the group sizes and the device)."""
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return default
