"""Processes forked before the host runs a torch op or starts a thread, each waiting on its
pipe for what to become: the CPU device process (`DeviceSeed`,
scheduler/device/device_process.py) and a TP/PP run's other ranks (`RankSeed`,
scheduler/parallel/worker.py).

Why: a spawned child is a fresh interpreter that imports torch (and, as spawn does, the
host's `__main__`): about 3 s of CPU and of start-up wall here, more than a short run's
rounds. A fork shares the host's import. It is safe only from that early point: a fork
copies another thread's locks mid-state, and a child of a process whose OpenMP team exists
hangs in its first parallel region (torch's libgomp: a two-thread matmul in the parent,
then one in a forked child, never returned here; a preset's first build runs such ops, so
the seeds come before the model is resolved). Where the host already has a Python thread,
or on a platform without a plain fork, `fork_seeds` returns None and the caller starts its
children as it would without seeds.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerContext, SpawnContext

Seed = tuple[Connection, BaseProcess]  # the host's end of the pipe, the forked process


def fork_seeds(n: int, then: Callable[[Connection, Any], None], imports: Sequence[str],
               name: str) -> list[Seed] | None:
    """`n` children forked now, each running `then(conn, message)` on the first message the
    host sends; None where a fork is not safe here. `imports` are imported first, once for
    host and children. One call per command: a child closes the host's ends of this call's
    pipes, not of another call's."""
    if sys.platform != "linux" or threading.active_count() > 1:
        return None
    for module in imports:
        importlib.import_module(module)
    ctx = mp.get_context("fork")
    sys.stdout.flush()  # or a child's exit would write the host's buffered output again
    sys.stderr.flush()
    seeds: list[Seed] = []
    # Ctrl-C reaches the whole process group: a seed ignores it from its first instruction
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        for _ in range(n):
            conn, child = ctx.Pipe(duplex=True)
            # a fork inherits every fd: the host's ends, closed there, so that the host's exit
            # (even by SIGKILL) is each seed's end of file
            host_ends = [conn, *(c for c, _ in seeds)]
            proc = ctx.Process(target=_seed_main, args=(child, host_ends, then), name=name, daemon=True)
            proc.start()
            child.close()
            seeds.append((conn, proc))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return seeds


def late_context(imports: Sequence[str]) -> ForkServerContext | SpawnContext:
    """How to start such children where no seed was forked, in a process that may have
    threads and an OpenMP team (so not a plain fork): multiprocessing's forkserver, a fresh
    interpreter started on first use that imports `imports` once and forks a child per
    start, so a process that starts several pays the imports once; spawn where there is
    none. The preload list is the process-wide forkserver's: it takes effect only if that
    server is not yet running."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(imports))
    return ctx


def _seed_main(conn: Connection, host_ends: list[Connection], then: Callable[[Connection, Any], None]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    for c in host_ends:
        c.close()
    try:
        message = conn.recv()
    except (EOFError, OSError):
        return  # the host ended, or closed an unused seed
    then(conn, message)
