"""What the user asked an engine to be: target, quantization, device, drafter, pins."""

from dataclasses import dataclass
from pathlib import Path

from core.config import DRAFTERS, TreeConfig
from core.errors import UnsupportedModelError
from core.tune.shapes import Pins
from models.target import LoadSpec

STRATEGIES = ("auto", *DRAFTERS)


@dataclass(frozen=True)
class EngineSpec:
    model: str | None = None          # Hub id, folder, or None for the embedded default
    quant: str | None = None
    device: str | None = None
    cache_dir: Path = LoadSpec.cache_dir
    head: str | None = None           # Hub id, folder, "random" (a random EAGLE-1 head), or None
    allow_pickle: bool = False        # allow a head's pytorch_model.bin (pickle) when no safetensors
    medusa: str | None = None         # Medusa heads: Hub id or folder (FasterDecoding's layout or Aerie's), or None
    strategy: str = "auto"            # auto = eagle with a head, prompt lookup without
    tree: TreeConfig | None = None    # the EAGLE tree before the tuner's first plan; None = the device's default
    pins: Pins = Pins()               # what the user fixed; the tuner chooses the rest
    vram_reserve_gb: float = 0.5      # GPU memory left to other programs
    compile: bool = True              # compile the target's forward per tree bucket; False = eager (--no-compile)
    # A CPU int4/int8 target's attention: one of models/quants.py ATTENTIONS (auto: `rows_alone`, core/tune/kernels.py).
    attention: str = "auto"
    kernel_mix: bool = False          # trees may run on another 4-bit kernel than one token (--kernel-mix)
    verify_delay_ms: float = 0.0      # a simulated slow target (bench --verify-delay-ms): SpecExec's regime on a CPU
    draft_rows: str = "auto"          # an EAGLE-1 head's draft vocabulary: narrow, wide, auto = narrow on a CPU (DRAFT_ROWS)


def resolved_strategy(spec: EngineSpec) -> str:
    if spec.strategy not in STRATEGIES:
        raise UnsupportedModelError(f"Unknown strategy '{spec.strategy}': choose one of {', '.join(STRATEGIES)}.")
    return spec.strategy if spec.strategy != "auto" else ("eagle" if spec.head else "prompt_lookup")
