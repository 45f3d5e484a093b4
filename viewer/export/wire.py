"""Protobuf wire format for many messages of one shape at once, with numpy.

The Perfetto export writes two TracePackets per probe row: 20 M for a 10 M-row trace.
Built one at a time with the protobuf classes, that is 66 s on this machine's core
(3.3 us a packet, measured); here every packet of a batch is encoded column by column,
a few passes over arrays. The bytes are the same wire format the classes write
(tests/test_perfetto.py parses them back with them and compares).

A message is a list of pieces: constant bytes (a field's tag, a fixed value) or an
array of unsigned integers, one per message, each written as a varint.
"""

from __future__ import annotations

import numpy as np


class Raw:
    """Bytes of a different length per message, back to back in `data` (a string, a
    submessage built earlier, a run of repeated fields)."""

    __slots__ = ("data", "lengths", "starts")

    def __init__(self, lengths: np.ndarray, data: np.ndarray) -> None:
        self.lengths = lengths.astype(np.int64)
        self.data = data.astype(np.uint8, copy=False)
        self.starts = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(self.lengths[:-1], out=self.starts[1:])


Piece = bytes | np.ndarray | Raw


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
    for p in pieces:
        out += len(p) if isinstance(p, bytes) else p.lengths if isinstance(p, Raw) else varint_len(p)
    return out


def encode(pieces: list[Piece], n: int) -> tuple[np.ndarray, np.ndarray]:
    """n messages: (their bytes back to back as uint8, each one's start offset)."""
    sizes = lengths(pieces, n)
    start = np.zeros(n, dtype=np.int64)
    np.cumsum(sizes[:-1], out=start[1:])
    buf = np.zeros(int(sizes.sum()), dtype=np.uint8)
    at = start.copy()
    for p in pieces:
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
    return buf, start


def gather(buf: np.ndarray, start: np.ndarray, size: np.ndarray, order: np.ndarray) -> bytes:
    """The messages of `buf` in `order`, back to back."""
    s, ln = start[order], size[order]
    total = int(ln.sum())
    if not total:
        return b""
    out_start = np.zeros(len(order), dtype=np.int64)
    np.cumsum(ln[:-1], out=out_start[1:])
    idx = np.repeat(s - out_start, ln) + np.arange(total, dtype=np.int64)
    return buf[idx].tobytes()
