"""mstrace's public probes API (docs/api.md): `import mstrace`, then `mstrace.Tracer(...)`.

Version 1. What is exported here is the stable surface; everything else in the package
tree is the reference engine's and may change without notice.
"""

from mstrace.api import API_VERSION, Round, Tracer
from probes.boundaries import (
    BATCH_PREPARE,
    BOOKKEEPING,
    DEVICE_COMPUTE,
    IDLE,
    KV_FENCE,
    RESPONSE_SEND,
    SCHEDULER_BARRIER,
    STREAM_WAIT,
)
from probes.clock import now_ns
from probes.waits import WaitTimeout

__all__ = ["API_VERSION", "BATCH_PREPARE", "BOOKKEEPING", "DEVICE_COMPUTE", "IDLE", "KV_FENCE", "RESPONSE_SEND",
           "SCHEDULER_BARRIER", "STREAM_WAIT", "Round", "Tracer", "WaitTimeout", "now_ns"]
