"""Host and device slowing each other while both work (docs/whatif.md, "What it assumes").

On a GPU neither notices the other. The CPU emulation shares the machine's cores and, with a
device thread, the GIL; the engine measures at start-up how much (scheduler/device/contention.py)
as two pairs of rates, the share of its own speed each side keeps while the other works:
beside the host's batch_prepare (tensor building, which lets go of the GIL at every torch call,
so both sides slow down) and beside its other work (pure Python, which holds it).

An overlap run's batch i runs beside the host's work of that round: the collect of batch i-1
(W, Q, G) and the prepare of batch i+1 (P). `shared` starts both together, each side at the
rates of the host's part at hand (its pure Python first, then its batch_prepare) until the
first ends, the other alone after; `unshared` undoes it exactly for an overlap trace. A
serial run's host never works beside its device, so a serial trace is taken as it ran.
Where the host's two parts cost the device differently, a shorter first part brings the
costlier second one forward: a faster host can lengthen the device's span (with
`--contention K`, the same rates for both parts and the host unslowed, it never does).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from viewer.analysis.whatif_model import Batches

MIN_RATE = 1e-3  # a side that kept nothing of its speed would never end


@dataclass(slots=True, frozen=True)
class Rates:
    device: float = 1.0  # the share of its own speed the device keeps while the host works
    host: float = 1.0  # ... and the host while the device works


@dataclass(slots=True, frozen=True)
class Sharing:
    prepare: Rates = field(default_factory=Rates)  # beside the host's batch_prepare (P_prep)
    python: Rates = field(default_factory=Rates)  # beside its other work: bookkeeping, the hand-off, the gap

    @classmethod
    def contention(cls, k: float) -> Sharing:
        """`--contention K`: K of the host's work delays the device; the host is not slowed."""
        r = Rates(1 - k, 1.0)
        return cls(r, r)

    @property
    def free(self) -> bool:
        return all(x >= 1 for r in (self.prepare, self.python) for x in (r.device, r.host))


def host_beside(b: Batches) -> tuple[np.ndarray, np.ndarray]:
    """The host's work while the device runs batch i: its pure-Python part (the collect of
    i-1, the bookkeeping of i+1) and its batch_prepare of i+1. A round that collects nothing
    (the first, and the one after a drain) has only its hand-off; a draining round launches
    nothing (the last, and where the running requests all finished with batch i)."""
    drained = b.drains
    collect = np.where(b.fresh, b.head_Q, np.concatenate([[0.0], (b.W + b.Q + b.G)[:-1]]))
    py = collect + np.where(drained, b.tail_P, np.append(b.P_book[1:], 0.0))
    return py, np.where(drained, 0.0, np.append(b.P_prep[1:], 0.0))


def _host_scaled(b: Batches, f_py: np.ndarray, f_prep: np.ndarray) -> Batches:
    """The host's components beside batch i (`host_beside`) times f_py[i], its batch_prepare
    times f_prep[i]."""
    # round j's prepare is beside batch j-1, its collect (W, Q, G of batch j) beside batch j+1;
    # the round after a drain works beside no batch, nor does the draining round's collect
    fresh, drains = b.fresh, b.drains
    for_prep = np.where(fresh, 1.0, np.append(1.0, f_py[:-1]))
    for_collect = np.where(drains, 1.0, np.append(f_py[1:], 1.0))
    return replace(b, P_book=b.P_book * for_prep, P_prep=b.P_prep * np.where(fresh, 1.0, np.append(1.0, f_prep[:-1])),
                   W=b.W * for_collect, Q_book=b.Q_book * for_collect, Q_send=b.Q_send * for_collect,
                   Q_defrag=b.Q_defrag * for_collect, G=b.G * for_collect,
                   head=b.head * np.where(fresh, f_py, 1.0)[:, None],
                   tail_P=b.tail_P * np.where(drains, f_py, 1.0))


def _ratio(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """x / y, 0 where y is 0 (an element not taken may overflow: inf, left unused)."""
    with np.errstate(over="ignore"):
        out: np.ndarray = np.where(y > 0, x / np.where(y > 0, y, 1.0), 0.0)
    return out


def _host(r: Rates) -> float:
    return max(r.host, MIN_RATE)


def _dev(r: Rates) -> float:
    # a device stopped beside the host (a device thread beside pure Python) still ends, and
    # its part is still undone: a speed too small to show (1.7 ps of work in 1.7 ms)
    return max(r.device, 1e-9)


def shared(b: Batches, s: Sharing) -> Batches:
    """An overlap run's batches as host and device slow each other (the module's docstring),
    the host's work in its round's order: the pure-Python part (the collect of the batch
    before, the next round's bookkeeping) first, then its batch_prepare. What each side lost
    lengthens its own components."""
    if s.free:
        return b
    d = b.D + b.A
    py, prep = host_beside(b)
    rp, rt = s.python, s.prepare
    t1, t2 = py / _host(rp), prep / _host(rt)  # each part's time beside a busy device
    left = d - t1 * _dev(rp)  # the device's work left after the first part
    in1 = left <= 0  # the device ends within the host's pure-Python part ...
    in2 = ~in1 & (left <= t2 * _dev(rt))  # ... within its batch_prepare; else after the host
    tau1 = _ratio(d, np.full_like(d, _dev(rp)))  # when it ends in the first part
    tau2 = _ratio(left, np.full_like(d, _dev(rt)))  # ... in the second, from its start
    span = np.where(in1, tau1, np.where(in2, t1 + tau2, t1 + t2 + left - t2 * _dev(rt)))
    # each part's share of its work done beside the device (the rest alone, at full speed)
    u1 = np.where(in1, np.minimum(_ratio(tau1 * _host(rp), py), 1.0), 1.0)
    u2 = np.where(in1, 0.0, np.where(in2, np.minimum(_ratio(tau2 * _host(rt), prep), 1.0), 1.0))
    return _host_scaled(replace(b, D=span - b.A), u1 / _host(rp) + 1 - u1, u2 / _host(rt) + 1 - u2)


def unshared(b: Batches, s: Sharing) -> Batches:
    """`shared` undone, exactly: each side's work alone, from an overlap trace."""
    if s.free:
        return b
    span = b.D + b.A
    py2, prep2 = host_beside(b)  # each part's time as the trace shows it
    rp, rt = s.python, s.prepare
    in1 = span <= py2  # the device ended within the host's pure-Python part
    in2 = ~in1 & (span <= py2 + prep2)  # ... within its batch_prepare; else after the host
    tau2 = span - py2  # the batch_prepare's time beside the device (where the device ended in it)
    py = np.where(in1, py2 - span * (1 - _host(rp)), py2 * _host(rp))
    prep = np.where(in1, prep2, np.where(in2, prep2 - tau2 * (1 - _host(rt)), prep2 * _host(rt)))
    d = np.where(in1, span * _dev(rp), np.where(in2, py2 * _dev(rp) + tau2 * _dev(rt),
                                                 py2 * _dev(rp) + prep2 * _dev(rt) + span - py2 - prep2))
    return _host_scaled(replace(b, D=np.maximum(d - b.A, 0)), _ratio(py, py2) + (py2 <= 0),
                        _ratio(prep, prep2) + (prep2 <= 0))


def as_run(b: Batches, s: Sharing, overlapped: bool) -> Batches:
    """Each side's work alone, as a run in that mode would take it (a serial run's host never
    works beside its device)."""
    return shared(b, s) if overlapped else b


def alone(b: Batches, s: Sharing, overlapped: bool) -> Batches:
    """A trace's batches as each side's work alone: `as_run` undone."""
    return unshared(b, s) if overlapped else b
