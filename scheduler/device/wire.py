"""The messages between the host and its CPU device process, one type each (they
cross a multiprocessing pipe: NamedTuples of plain data, pickled by `send` below only;
nothing of them reaches a trace file)."""

from __future__ import annotations

import pickle
from multiprocessing.connection import Connection
from typing import Any, NamedTuple


# Connection.send pickles with multiprocessing's ForkingPickler, which copies its dispatch
# table for every message (78 reducers once torch is imported): right after a forward, with
# the caches cold, a forward's answer took 137 us to pickle on a Zen 3, and 64 us with plain
# pickle (15.7 and 5.7 us in a warm loop; BENCHMARKS.md, "The device pipe's messages"). The
# wire is plain data, so plain pickle carries it; the bytes are what Connection.recv reads.
def send(conn: Connection, msg: Any) -> None:
    conn.send_bytes(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))


def recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


# host -> device: a stream's items, answered in order by one Done each
class Op(NamedTuple):
    stream: str
    kind: str  # forward | copy | sleep (scheduler/device/work.py RemoteOp)
    payload: tuple[Any, ...]


class Record(NamedTuple):
    stream: str
    event: int


class Wait(NamedTuple):
    stream: str
    event: int
    label: str


StreamItem = Op | Record | Wait


class Items(NamedTuple):
    """Several stream items in one message (a launch's: ProcStream.batched), each put on its
    stream's queue in order, as if sent one by one: one write and one wake-up of the device."""

    items: tuple[StreamItem, ...]


# host -> device: to the dispatcher, which answers even while every stream is blocked
class AskStacks(NamedTuple):
    key: int


class Stop(NamedTuple):
    pass


# device -> host
class Ready(NamedTuple):
    pages: str | None = None  # what the host's KV pool and weights got (CausalLM.pages)


class StartFailed(NamedTuple):
    why: str


class Done(NamedTuple):
    stream: str
    start_ns: int
    end_ns: int
    result: Any
    err: str | None


class Dones(NamedTuple):
    """An item's Done and those of the Records queued right behind it (a launch's end
    event), answered together: one write and one wake-up of the host's reader."""

    dones: tuple[Done, ...]


class Stacks(NamedTuple):
    key: int
    stacks: list[tuple[int, str, list[str]]]  # (thread id, name, formatted frames)


class Stopped(NamedTuple):
    """The device process is done; (count, held_ns) of its truth-harness holds, if any."""

    device_held: tuple[int, int] | None = None


class Dead(NamedTuple):
    """Not sent: what the host's reader makes of a pipe that broke."""

    why: str
