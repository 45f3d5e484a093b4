"""Where the model runs, chosen once per engine by `choose_backend`: in this process (CPU
stream threads, or CUDA streams), in a CPU device process of its own, or sharded over
TP/PP ranks. Each is a `Backend`; the engine never asks which.

Opening is two-phase because the KV pool's size in blocks depends on the bytes one
block takes on this rank, which depends on the backend: `kv_bytes_per_block` first,
then `open(num_blocks, ...)` builds the pool (or has the device process or the
ranks build theirs) and the streams.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from probes.recorder import Probes
from probes.waits import WaitRegistry
from scheduler.device.device_process import DeviceProcess, DeviceSeed, RemoteDevice
from scheduler.device.device_server import DeviceSpec
from scheduler.device.local_device import LocalDevice
from scheduler.device.streams import make_streams
from scheduler.device.work import FUTURE_SLOTS, DeviceOps, Stream
from scheduler.model.auto_dtype import DtypeChoice, choose_dtype
from scheduler.model.config import ModelConfig
from scheduler.model.dtypes import name_of
from scheduler.model.kv_cache import PagedKVCache
from scheduler.model.loader import load_model
from scheduler.model.packed_gemm import (
    PackChoice,
    choose_pack,
    primitive_cache_asked,
    size_primitive_cache,
)

if TYPE_CHECKING:
    from scheduler.parallel.coordinator import Coordinator


class Backend(Protocol):
    """After `open`: `streams`, and `ops`, what the executor launches on (the model and
    the KV pool live there)."""

    name: str  # cpu-thread, cuda, cpu-process, parallel
    device: torch.device
    dtype: torch.dtype
    dtype_why: str  # how --dtype chose it
    pack: PackChoice  # whether the CPU's GEMMs run on reordered weights, and why
    pages: str | None  # after `open`: what the host's KV pool and weights got (CausalLM.pages); None on a GPU
    primitive_cache: str | None  # the oneDNN primitive cache asked for (packed_gemm); None on a GPU
    model_config: ModelConfig
    streams: dict[str, Stream]
    ops: DeviceOps
    device_proc: DeviceProcess | None  # the device process, whose threads a stall report lists

    def kv_bytes_per_block(self, block_size: int) -> int: ...

    def open(self, num_blocks: int, block_size: int, probes: Probes, registry: WaitRegistry) -> None: ...

    def close(self) -> None: ...

    def device_held(self) -> tuple[int, int] | None:
        """After `close`: (count, held_ns) of the truth harness's holds inside the forward,
        None where there were none or the host could not time them (a GPU's)."""


def device_of(cfg: Any) -> torch.device:
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)


def runs_device_process(cfg: Any) -> bool:
    """Whether an engine of `cfg` puts its model in a CPU device process (ProcessBackend)."""
    return cfg.world_size == 1 and device_of(cfg).type == "cpu" and cfg.resolved_cpu_device() == "process"


def choose_backend(cfg: Any, model_dir: Path, dtype: torch.dtype | None, device_delay_ns: int,
                   parallel: Coordinator | None, seed: DeviceSeed | None = None) -> Backend:
    """`seed`: the device process forked early for this engine, if any (DeviceSeed)."""
    device = device_of(cfg)
    size_primitive_cache()  # before the probes' GEMMs; device processes and ranks set it in load_model
    numerics = choose_dtype(device, dtype)
    args = (model_dir, device, numerics, choose_pack(device, numerics.dtype, cfg.weight_pack), cfg.hard_wait_timeout_s,
            device_delay_ns)
    if parallel is not None:
        return ParallelBackend(*args, parallel)
    if runs_device_process(cfg):
        return ProcessBackend(*args, cfg.resolved_device_threads(), seed)
    return LocalBackend(*args)


class _Common:
    def __init__(self, model_dir: Path, device: torch.device, dtype: DtypeChoice, pack: PackChoice,
                 timeout_s: float, delay_ns: int) -> None:
        self.model_dir, self.device = model_dir, device
        self.dtype, self.dtype_why, self.pack = dtype.dtype, dtype.why, pack
        self._timeout_s, self._delay_ns = timeout_s, delay_ns
        self.streams: dict[str, Stream] = {}
        self.ops: DeviceOps
        self.device_proc: DeviceProcess | None = None
        self.pages: str | None = None
        # the device process and the ranks ask the same (load_model): they inherit this
        # process's environment, or fork before it and ask the default themselves
        self.primitive_cache = primitive_cache_asked() if device.type == "cpu" else None
        self._local: LocalDevice | None = None  # where the forward runs in this process
        # where the weights load elsewhere (a device process, the ranks), the config is all this process reads
        self.model_config = ModelConfig.from_file(model_dir / "config.json")

    def kv_bytes_per_block(self, block_size: int) -> int:
        return PagedKVCache.bytes_per_block(self.model_config, block_size, self.dtype)

    def close(self) -> None:
        for s in self.streams.values():
            s.close()

    def device_held(self) -> tuple[int, int] | None:
        held = self._local.held if self._local is not None else None
        return held.tally() if held is not None else None


class LocalBackend(_Common):
    """The model in this process: stream threads on the CPU, CUDA streams on a GPU. The
    weights load here, before the pool's size is known."""

    def __init__(self, model_dir: Path, device: torch.device, dtype: DtypeChoice, pack: PackChoice,
                 timeout_s: float, delay_ns: int) -> None:
        super().__init__(model_dir, device, dtype, pack, timeout_s, delay_ns)
        self.name = "cuda" if device.type == "cuda" else "cpu-thread"
        self.model, self.model_config = load_model(model_dir, device, self.dtype, pack=pack.packed)

    def open(self, num_blocks: int, block_size: int, probes: Probes, registry: WaitRegistry) -> None:
        mc = self.model_config
        kv = PagedKVCache(mc.num_hidden_layers, num_blocks, block_size, mc.num_key_value_heads, mc.head_dim,
                          self.dtype, self.device)
        self.ops = self._local = LocalDevice(self.model, kv, self.device, block_size, None, self._delay_ns)
        self.pages = self.model.pages(kv)
        self.streams = make_streams(self.device, probes, registry, self._timeout_s)


class ProcessBackend(_Common):
    """The model in a CPU device process of its own, which loads the weights."""

    name = "cpu-process"

    def __init__(self, model_dir: Path, device: torch.device, dtype: DtypeChoice, pack: PackChoice,
                 timeout_s: float, delay_ns: int, threads: int, seed: DeviceSeed | None) -> None:
        super().__init__(model_dir, device, dtype, pack, timeout_s, delay_ns)
        self._threads, self._seed = threads, seed

    def open(self, num_blocks: int, block_size: int, probes: Probes, registry: WaitRegistry) -> None:
        self.device_proc = DeviceProcess(DeviceSpec(
            str(self.model_dir), name_of(self.dtype), num_blocks, block_size, self._threads,
            self._timeout_s, FUTURE_SLOTS, self._delay_ns, self.pack.packed), probes, registry, self._seed)
        self.streams = dict(self.device_proc.streams)
        self.pages = self.device_proc.pages
        self.ops = RemoteDevice()

    def close(self) -> None:
        super().close()
        if self.device_proc is not None:
            self.device_proc.close()

    def device_held(self) -> tuple[int, int] | None:
        return self.device_proc.device_held if self.device_proc is not None else None


class ParallelBackend(_Common):
    """Rank 0's shard of a TP/PP run; the ranks load their own weights."""

    name = "parallel"

    def __init__(self, model_dir: Path, device: torch.device, dtype: DtypeChoice, pack: PackChoice,
                 timeout_s: float, delay_ns: int, parallel: Coordinator) -> None:
        super().__init__(model_dir, device, dtype, pack, timeout_s, delay_ns)
        self.parallel = parallel

    def kv_bytes_per_block(self, block_size: int) -> int:
        """A rank holds its shard's heads and layers."""
        return self.parallel.kv_bytes_per_block(self.model_config, block_size, self.dtype)

    def open(self, num_blocks: int, block_size: int, probes: Probes, registry: WaitRegistry) -> None:
        # Every rank gets the same block count (the block tables are rank 0's); the engine's
        # registry, so the watchdog sees rank 0's collective waits.
        sharded = self.parallel.start_ranks(self.model_dir, num_blocks, self.dtype, self.pack.packed, probes,
                                            registry)
        kv = sharded.make_kv_cache(num_blocks, block_size)
        self.ops = self._local = LocalDevice(sharded.model, kv, self.device, block_size, self.parallel,
                                             self._delay_ns)
        self.pages = sharded.model.pages(kv)  # rank 0's
        self.streams = make_streams(self.device, probes, registry, self._timeout_s)
