"""What the monitor panel shows: memory by role on each GPU and in RAM, plus CPU load.

A snapshot joins the probe's machine-wide reading (core/tune/probe.py) with what the engine itself
holds: the target's weights, the KV cache, the draft head (its own weights, draft vocabulary and
cache), and on a GPU the rest of our allocator's share (tree activations and reusable blocks).
"Others" is what NVML sees used that our allocator does not hold: other programs and our CUDA
context. No torch types leave this module: the page formats plain numbers (bytes).
"""

from dataclasses import dataclass

from core.runtime.memory import storage, tensor_bytes
from core.tune.probe import Probe, Reading


@dataclass(frozen=True)
class EngineMemory:
    device: str          # "cpu" or "cuda:N"
    weights: int
    kv: int
    draft: int


@dataclass(frozen=True)
class GpuBars:
    index: int
    name: str
    total: int
    weights: int         # 0 on cards the engine does not use
    kv: int
    draft: int
    activations: int     # our allocator's share beyond the three above
    others: int
    free: int


@dataclass(frozen=True)
class Snapshot:
    gpus: tuple[GpuBars, ...]
    gpu_note: str | None
    ram_total: int
    ram_used: int        # by everything on the machine
    process_rss: int     # this process (on a CPU engine: weights, KV and draft live in here)
    engine: EngineMemory
    cpu_percent: float
    cpu_count: int


def engine_memory(engine) -> EngineMemory:
    model = engine.target.model
    weights = list(model.parameters()) + list(model.buffers())
    target_ptrs = {storage(t)[0] for t in weights}
    draft = engine.drafter.memory_bytes(target_ptrs)
    device = engine.target.device
    name = f"cuda:{device.index or 0}" if device.type == "cuda" else device.type
    return EngineMemory(name, tensor_bytes(weights), engine.runner.cache_bytes(), draft)


def snapshot(probe: Probe, engine) -> Snapshot:
    reading: Reading = probe.read()
    mem = engine_memory(engine)
    bars = tuple(gpu_bars(g, mem) for g in reading.gpus)
    host = reading.host
    return Snapshot(bars, reading.gpu_note, host.ram_total, host.ram_total - host.ram_available, host.process_rss,
                    mem, host.cpu_percent, host.cpu_count)


def gpu_bars(gpu, mem: EngineMemory) -> GpuBars:
    ours = gpu.ours or 0
    if mem.device != f"cuda:{gpu.index}":
        return GpuBars(gpu.index, gpu.name, gpu.total, 0, 0, 0, ours, gpu.others, gpu.free)
    known = mem.weights + mem.kv + mem.draft
    return GpuBars(gpu.index, gpu.name, gpu.total, mem.weights, mem.kv, mem.draft, max(ours - known, 0),
                   gpu.others, gpu.free)
