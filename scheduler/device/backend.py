"""Where the model runs, chosen once per engine: in this process (CPU stream threads,
or CUDA streams), in a CPU device process of its own, or sharded over TP/PP ranks.

Opening is two-phase because the KV pool's size in blocks depends on the bytes one
block takes on this rank, which depends on the backend: `kv_bytes_per_block` first,
then `open(num_blocks, ...)` builds the pool (or has the device process or the
ranks build theirs) and the streams.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from probes.recorder import Probes
from probes.waits import WaitRegistry
from scheduler.device.device_process import DeviceProcess, RemoteDevice
from scheduler.device.device_server import DeviceSpec
from scheduler.device.local_device import LocalDevice
from scheduler.device.streams import make_streams
from scheduler.device.work import FUTURE_SLOTS, Stream
from scheduler.model.config import ModelConfig
from scheduler.model.dtypes import name_of
from scheduler.model.kv_cache import PagedKVCache
from scheduler.model.loader import load_model

if TYPE_CHECKING:
    from scheduler.parallel.coordinator import Coordinator

class Backend:
    """`kind`: cpu-thread, cpu-process, cuda, or parallel. After `open`: `streams`, and `ops`,
    what the executor launches on (the model and KV pool live there)."""

    def __init__(self, kind: str, model_dir: Path, device: torch.device, dtype: torch.dtype,
                 timeout_s: float, device_threads: int, device_delay_ns: int,
                 parallel: Coordinator | None) -> None:
        self.kind, self.model_dir, self.device, self.dtype = kind, model_dir, device, dtype
        self._timeout_s, self._threads, self._delay_ns = timeout_s, device_threads, device_delay_ns
        self.parallel = parallel
        self.model: Any = None  # loaded here for a local device (before the pool's size is known)
        self.device_proc: DeviceProcess | None = None
        self.ops: LocalDevice | RemoteDevice  # what the executor launches on, after open()
        self.streams: dict[str, Stream] = {}
        if kind in ("cpu-thread", "cuda"):
            self.model, self.model_config = load_model(model_dir, device, dtype)
        else:  # the weights load in the device process or on the ranks
            self.model_config = ModelConfig.from_file(model_dir / "config.json")

    @classmethod
    def choose(cls, cfg: Any, model_dir: Path, dtype: torch.dtype | None, device_delay_ns: int,
               parallel: Coordinator | None) -> Backend:
        device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto"
                              else cfg.device)
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        if parallel is not None:
            kind = "parallel"
        elif device.type == "cuda":
            kind = "cuda"
        else:
            kind = "cpu-process" if cfg.resolved_cpu_device() == "process" else "cpu-thread"
        return cls(kind, model_dir, device, dtype, cfg.hard_wait_timeout_s, cfg.resolved_device_threads(),
                   device_delay_ns, parallel)

    def kv_bytes_per_block(self, block_size: int) -> int:
        """KV bytes of one block on this process (a rank holds its shard's heads and layers)."""
        if self.parallel is not None:
            return self.parallel.kv_bytes_per_block(self.model_config, block_size, self.dtype)
        return PagedKVCache.bytes_per_block(self.model_config, block_size, self.dtype)

    def open(self, num_blocks: int, block_size: int, probes: Probes, registry: WaitRegistry) -> None:
        mc = self.model_config
        if self.kind == "cpu-process":
            self.device_proc = DeviceProcess(DeviceSpec(
                str(self.model_dir), name_of(self.dtype), num_blocks, block_size, self._threads,
                self._timeout_s, FUTURE_SLOTS, self._delay_ns), probes, registry)
            self.streams = dict(self.device_proc.streams)
            self.ops = RemoteDevice()
            return
        if self.parallel is not None:
            # Every rank gets the same block count (the block tables are rank 0's); the engine's
            # registry, so the watchdog sees rank 0's collective waits.
            sharded = self.parallel.start_ranks(self.model_dir, num_blocks, self.dtype, probes, registry)
            self.model = sharded.model
            kv = sharded.make_kv_cache(num_blocks, block_size)
        else:
            kv = PagedKVCache(mc.num_hidden_layers, num_blocks, block_size, mc.num_key_value_heads,
                                   mc.head_dim, self.dtype, self.device)
        self.ops = LocalDevice(self.model, kv, self.device, block_size, self.parallel, self._delay_ns)
        self.streams = make_streams(self.device, probes, registry, self._timeout_s)

    def close(self) -> None:
        for s in self.streams.values():
            s.close()
        if self.device_proc is not None:
            self.device_proc.close()
