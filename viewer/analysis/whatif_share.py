"""Host and device slowing each other while both work (docs/whatif.md, "What it assumes").

On a GPU neither notices the other. The CPU emulation shares the machine's cores and, with a
device thread, the GIL; the engine measures at start-up how much (scheduler/device/contention.py)
as two pairs of rates, the share of its own speed each side keeps while the other works:
beside the host's batch_prepare (tensor building, which lets go of the GIL at every torch call,
so both sides slow down) and beside its other work (pure Python, which holds it).

An overlap run's batch i runs beside the host's work of that round: the collect of batch i-1
(W, Q, G) and the prepare of batch i+1 (P). `shared` starts both together, each side at its
rates until the first ends, the other alone after; `unshared` undoes it for an overlap trace,
from the host work the trace shows inside each device span (`H`). A serial run's host never
works beside its device, so a serial trace is taken as it ran.
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
    i-1, the bookkeeping of i+1) and its batch_prepare of i+1 (round 0 collects nothing; the
    draining round launches nothing)."""
    py = np.concatenate([[b.head_Q], (b.W + b.Q + b.G)[:-1]]) + np.append(b.P_book[1:], b.tail_P)
    return py, np.append(b.P_prep[1:], 0.0)


def _host_scaled(b: Batches, f_py: np.ndarray, f_prep: np.ndarray) -> Batches:
    """The host's components beside batch i (`host_beside`) times f_py[i], its batch_prepare
    times f_prep[i]."""
    # round j's prepare is beside batch j-1, its collect (W, Q, G of batch j) beside batch j+1
    for_prep, for_collect = np.append(1.0, f_py[:-1]), np.append(f_py[1:], 1.0)
    return replace(b, P_book=b.P_book * for_prep, P_prep=b.P_prep * np.append(1.0, f_prep[:-1]),
                   W=b.W * for_collect, Q_book=b.Q_book * for_collect, Q_send=b.Q_send * for_collect,
                   Q_defrag=b.Q_defrag * for_collect, G=b.G * for_collect,
                   head_Q=b.head_Q * float(f_py[0]), tail_P=b.tail_P * float(f_py[-1]))


def _ratio(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """x / y, 0 where y is 0 (an element not taken may overflow: inf, left unused)."""
    with np.errstate(over="ignore"):
        out: np.ndarray = np.where(y > 0, x / np.where(y > 0, y, 1.0), 0.0)
    return out


def _host(r: Rates) -> float:
    return max(r.host, MIN_RATE)


def shared(b: Batches, s: Sharing) -> Batches:
    """An overlap run's batches as host and device slow each other (the module's docstring).
    What each side lost lengthens its own components. The two kinds of host work are taken as
    mixed evenly over the host's time, so the device's progress beside them is even too."""
    if s.free:
        return b
    d = b.D + b.A
    py, prep = host_beside(b)
    rp, rt = s.python, s.prepare
    t_py, t_prep = py / _host(rp), prep / _host(rt)
    t_host = t_py + t_prep  # the host's time for its work, beside a busy device throughout
    done = t_py * rp.device + t_prep * rt.device  # the device's work meanwhile
    # u: the share of the host's time it shares with the device; below 1 where the device ends first
    u = np.where(done >= d, _ratio(d, done), 1.0)
    d2 = np.where(u < 1, u * t_host, t_host + d - done)
    return _host_scaled(replace(b, D=d2 - b.A), u / _host(rp) + 1 - u, u / _host(rt) + 1 - u)


def unshared(b: Batches, s: Sharing) -> Batches:
    """`shared` undone, exactly: each side's work alone, from an overlap trace."""
    if s.free:
        return b
    span = b.D + b.A
    py2, prep2 = host_beside(b)
    rp, rt = s.python, s.prepare
    inside = np.minimum(span, py2 + prep2)  # the host's time beside the device: all of it, or the span
    # the share u of each kind's work done beside the device solves
    # u * (py2 / (u + r_py (1 - u)) + prep2 / (u + r_prep (1 - u))) = inside (increasing in u)

    def beside(u: np.ndarray) -> np.ndarray:
        out: np.ndarray = u * (_ratio(py2, u + _host(rp) * (1 - u)) + _ratio(prep2, u + _host(rt) * (1 - u)))
        return out

    lo, hi = np.zeros_like(span), np.ones_like(span)
    for _ in range(50):
        mid = (lo + hi) / 2
        low = beside(mid) < inside
        lo, hi = np.where(low, mid, lo), np.where(low, hi, mid)
    u = (lo + hi) / 2
    f_py, f_prep = 1 / (u / _host(rp) + 1 - u), 1 / (u / _host(rt) + 1 - u)
    py, prep = py2 * f_py, prep2 * f_prep
    done = u * (py / _host(rp) * rp.device + prep / _host(rt) * rt.device)
    return _host_scaled(replace(b, D=np.maximum(span - inside + done - b.A, 0)), f_py, f_prep)
