"""What the machine has right now: memory per GPU through NVML, our own share through the torch
allocator, RAM and CPU through psutil.

No GPU, no NVIDIA driver and no NVML library are normal readings, not errors: the reading then has
no GPUs and a one-line note saying why. NVML is passed in (tests inject fake 6-24 GB cards); the
real one is the `pynvml` module of the nvidia-ml-py package. All sizes are bytes.
"""

import importlib
import time
from dataclasses import dataclass
from types import ModuleType

import psutil
import torch


@dataclass(frozen=True)
class GpuReading:
    index: int
    name: str
    total: int
    used: int            # by every process on the card, ours included (NVML)
    free: int
    ours: int | None     # reserved by this process's torch allocator; None if torch never used the card

    @property
    def others(self) -> int:
        """Used by other processes, plus our CUDA context (NVML cannot tell the two apart)."""
        return max(self.used - (self.ours or 0), 0)


@dataclass(frozen=True)
class HostReading:
    ram_total: int
    ram_available: int
    process_rss: int     # this process's resident memory
    cpu_percent: float   # whole machine, since the previous reading
    cpu_count: int


@dataclass(frozen=True)
class Reading:
    gpus: tuple[GpuReading, ...]
    host: HostReading
    gpu_note: str | None = None  # why there are no GPU figures, when there are none


def load_nvml() -> ModuleType | None:
    """The real NVML bindings, or None when nvidia-ml-py is not installed."""
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        return None


class Probe:
    """Reads the machine. `nvml` is a pynvml-like module (None: no NVML); `allocator(index)` gives
    our reserved bytes on a card, or None. NVML is initialised once, on the first reading."""

    def __init__(self, nvml: ModuleType | None, allocator=None):
        self.nvml = nvml
        self.allocator = allocator or torch_reserved
        self.nvml_note: str | None = None if nvml is not None else "no NVML library (pip package nvidia-ml-py)"
        self.nvml_ready = False
        self.cpu = CpuLoad()

    def read(self) -> Reading:
        return Reading(self.read_gpus(), read_host(self.cpu.percent()), self.nvml_note)

    def read_gpus(self) -> tuple[GpuReading, ...]:
        if self.nvml is None or (not self.nvml_ready and not self._init()):
            return ()
        nvml = self.nvml
        try:
            out = []
            for i in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                mem = nvml.nvmlDeviceGetMemoryInfo(handle)
                name = nvml.nvmlDeviceGetName(handle)
                name = name.decode() if isinstance(name, bytes) else str(name)
                out.append(GpuReading(i, name, int(mem.total), int(mem.used), int(mem.free), self.allocator(i)))
            return tuple(out)
        except nvml.NVMLError as e:  # a card that fell off the bus: report it, keep the app running
            self.nvml_note = f"NVML error: {e}"
            return ()

    def _init(self) -> bool:
        try:
            self.nvml.nvmlInit()
        except self.nvml.NVMLError as e:  # no driver: the normal case on a machine without a GPU
            self.nvml_note = f"no NVIDIA driver ({e})"
            return False
        self.nvml_ready, self.nvml_note = True, None
        return True


class CpuLoad:
    """Machine-wide CPU use over the time since this probe's previous reading. psutil's own
    `cpu_percent()` measures since the previous call anywhere in the process, so two callers (two
    open pages, a load event beside a timer tick) would read ~0% on a busy machine. Readings less
    than MIN_WINDOW_S apart repeat the last value rather than divide a sliver of time."""

    MIN_WINDOW_S = 0.5

    def __init__(self):
        self.last_times, self.last_at, self.value = psutil.cpu_times(), time.monotonic(), 0.0

    def percent(self) -> float:
        now = time.monotonic()
        if now - self.last_at < self.MIN_WINDOW_S:
            return self.value
        times = psutil.cpu_times()
        total = sum(times) - sum(self.last_times)
        idle = (times.idle + getattr(times, "iowait", 0.0)) - (self.last_times.idle + getattr(self.last_times, "iowait", 0.0))
        if total > 0:
            self.value = max(0.0, min(100.0, 100.0 * (1 - idle / total)))
        self.last_times, self.last_at = times, now
        return self.value


def read_host(cpu_percent: float) -> HostReading:
    vm = psutil.virtual_memory()
    return HostReading(int(vm.total), int(vm.available), int(psutil.Process().memory_info().rss),
                       cpu_percent, psutil.cpu_count() or 1)


def torch_reserved(index: int) -> int | None:
    """Bytes our torch allocator holds on card `index` (NVML's numbering is CUDA's unless
    CUDA_VISIBLE_DEVICES reorders them; Aerie reports what torch sees)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized() or index >= torch.cuda.device_count():
        return None
    return int(torch.cuda.memory_reserved(index))
