"""Protobuf wire format for many messages of one shape at once.

The Perfetto export writes two TracePackets per probe row: 20 M for a 10 M-row trace.
Built one at a time with the protobuf classes, that is 66 s on this machine's core
(3.3 us a packet, measured); here every packet of a batch is encoded at once, from
columns. The bytes are the same wire format the classes write (tests/test_export.py
parses them back with them and compares).

A message is a list of pieces: constant bytes (a field's tag, a fixed value), an
array of unsigned integers, one per message, each written as a varint, bytes of a
different length per message (`Raw`), or a submessage (`Sub`, whose size is worked
out once, when it is made). Where the install built `_wire.c`, the sizes, the writing
and the gather run there, a message at a time; without a C compiler numpy does the
same column by column (tests/test_export.py checks that the two write the same bytes).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from viewer.analysis.native import open_library


class Raw:
    """Bytes of a different length per message, back to back in `data` (a string, a
    submessage built earlier, a run of repeated fields)."""

    __slots__ = ("data", "lengths", "starts")

    def __init__(self, lengths: np.ndarray, data: np.ndarray) -> None:
        self.lengths = lengths.astype(np.int64)
        self.data = data.astype(np.uint8, copy=False)
        self.starts = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(self.lengths[:-1], out=self.starts[1:])


class Sub:
    """A length-delimited submessage of every message: its tag, its length, its pieces."""

    __slots__ = ("pieces", "sizes", "tag")

    def __init__(self, tag: bytes, pieces: list[Piece], n: int) -> None:
        self.tag, self.pieces = tag, pieces
        self.sizes = lengths(pieces, n).astype(np.uint64)  # each message's, once: outer messages reuse them


Piece = bytes | np.ndarray | Raw | Sub


class _Piece(ctypes.Structure):
    """`piece` in _wire.c."""
    _fields_ = [("kind", ctypes.c_int64), ("nbytes", ctypes.c_int64), ("bytes", ctypes.c_void_p),
                ("values", ctypes.c_void_p), ("lengths", ctypes.c_void_p)]


def _load() -> ctypes.CDLL | None:
    lib = open_library(Path(__file__).parent, "_wire")
    if lib is not None:
        v, n = ctypes.c_void_p, ctypes.c_int64
        lib.wire_sizes.argtypes = [n, n, v, v]
        lib.wire_write.argtypes = [n, n, v, v, v]
        lib.wire_gather.argtypes = [v, v, v, v, n, v]
        lib.wire_sizes.restype = lib.wire_write.restype = lib.wire_gather.restype = None
    return lib


_LIB = _load()
AVAILABLE = _LIB is not None


def _flat(pieces: list[Piece]) -> list[bytes | np.ndarray | Raw]:
    """Submessages spelled out: tag, size, pieces (what is written)."""
    out: list[bytes | np.ndarray | Raw] = []
    for p in pieces:
        if isinstance(p, Sub):
            out += [p.tag, p.sizes, *_flat(p.pieces)]
        else:
            out.append(p)
    return out


def _c_pieces(pieces: Sequence[Piece], n: int) -> tuple[ctypes.Array[_Piece], list[np.ndarray]]:
    """The pieces as _wire.c reads them, and the arrays that must outlive the call. A
    submessage is one piece of known size (kind 3) here: `_flat` spells it out to write it.
    C reads n values of each array without looking: a short one is an error here, not a
    read past its end there."""
    keep: list[np.ndarray] = []
    arr = (_Piece * max(len(pieces), 1))()
    for q, p in zip(arr, pieces, strict=False):
        if isinstance(p, bytes):
            b = np.frombuffer(p, dtype=np.uint8)
            q.kind, q.nbytes, q.bytes = 0, len(p), b.ctypes.data
            keep.append(b)
        elif isinstance(p, Raw):
            ln = np.ascontiguousarray(p.lengths[:n], dtype=np.int64)
            data = np.ascontiguousarray(p.data)
            if len(ln) < n or int(ln.sum()) > len(data) or (len(ln) and int(ln.min()) < 0):
                raise ValueError(f"a Raw piece holds {len(ln)} lengths and {len(data)} bytes for {n} messages")
            q.kind, q.bytes, q.lengths = 2, data.ctypes.data, ln.ctypes.data
            keep += [ln, data]
        else:
            v = np.ascontiguousarray((p.sizes if isinstance(p, Sub) else p)[:n], dtype=np.uint64)
            if len(v) < n:
                raise ValueError(f"a piece holds {len(v)} values for {n} messages")
            q.kind, q.nbytes, q.values = (3, len(p.tag), v.ctypes.data) if isinstance(p, Sub) else (1, 0, v.ctypes.data)
            keep.append(v)
    return arr, keep


def fixed64s(tag: bytes, counts: np.ndarray, values: np.ndarray) -> Raw:
    """A repeated fixed64 field: `counts[i]` of `values` (grouped by message) per message."""
    per = len(tag) + 8
    rows = np.empty((len(values), per), dtype=np.uint8)
    rows[:, :len(tag)] = np.frombuffer(tag, dtype=np.uint8)
    rows[:, len(tag):] = values.astype("<u8").view(np.uint8).reshape(-1, 8)
    return Raw(counts * per, rows.reshape(-1))


def varint_len(v: np.ndarray) -> np.ndarray:
    n = np.ones(len(v), dtype=np.int64)
    x = v.astype(np.uint64) >> np.uint64(7)
    while x.any():
        n += x > 0
        x >>= np.uint64(7)
    return n


def lengths(pieces: list[Piece], n: int) -> np.ndarray:
    """Each message's encoded length."""
    out = np.zeros(n, dtype=np.int64)
    if _LIB is not None and n:
        arr, _keep = _c_pieces(pieces, n)
        _LIB.wire_sizes(n, len(pieces), ctypes.addressof(arr), out.ctypes.data)
        return out
    for p in pieces:
        if isinstance(p, Sub):
            out += len(p.tag) + varint_len(p.sizes) + p.sizes.astype(np.int64)
        else:
            out += len(p) if isinstance(p, bytes) else p.lengths if isinstance(p, Raw) else varint_len(p)
    return out


def encode(pieces: list[Piece], n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n messages: (their bytes back to back as uint8, each one's start offset, each one's size)."""
    sizes = lengths(pieces, n)
    start = np.zeros(n, dtype=np.int64)
    np.cumsum(sizes[:-1], out=start[1:])
    flat = _flat(pieces)
    if _LIB is not None and n:
        buf = np.empty(int(sizes.sum()), dtype=np.uint8)
        arr, _keep = _c_pieces(flat, n)
        _LIB.wire_write(n, len(flat), ctypes.addressof(arr), start.ctypes.data, buf.ctypes.data)
        return buf, start, sizes
    buf = np.zeros(int(sizes.sum()), dtype=np.uint8)
    at = start.copy()
    for p in flat:
        if isinstance(p, bytes):
            for k, b in enumerate(p):
                buf[at + k] = b
            at += len(p)
            continue
        if isinstance(p, Raw):
            total = int(p.lengths.sum())
            if total:
                buf[np.repeat(at - p.starts, p.lengths) + np.arange(total, dtype=np.int64)] = p.data[:total]
            at += p.lengths
            continue
        ln = varint_len(p)
        x = p.astype(np.uint64)
        for k in range(int(ln.max()) if n else 0):
            more = ln > k
            byte = (x & np.uint64(0x7F)).astype(np.uint8)
            byte[ln > k + 1] |= 0x80  # continuation bit: more bytes follow
            buf[at[more] + k] = byte[more]
            x >>= np.uint64(7)
        at += ln
    return buf, start, sizes


def gather(buf: np.ndarray, start: np.ndarray, size: np.ndarray, order: np.ndarray) -> bytes:
    """The messages of `buf` in `order`, back to back."""
    s, ln = start[order], size[order]
    total = int(ln.sum())
    if not total:
        return b""
    if _LIB is not None:
        out = np.empty(total, dtype=np.uint8)
        st, sz, od = (np.ascontiguousarray(a, dtype=np.int64) for a in (start, size, order))
        _LIB.wire_gather(buf.ctypes.data, st.ctypes.data, sz.ctypes.data, od.ctypes.data, len(od), out.ctypes.data)
        return out.tobytes()
    out_start = np.zeros(len(order), dtype=np.int64)
    np.cumsum(ln[:-1], out=out_start[1:])
    idx = np.repeat(s - out_start, ln) + np.arange(total, dtype=np.int64)
    return buf[idx].tobytes()
