"""Building an engine from what the user asked for: target, quantization, device (and later the
drafter). launch.py calls this at start and whenever the UI switches models."""

from pathlib import Path

import torch

from core.engine import Engine
from models.target import LoadSpec, load_target


def load_engine(model: str | None, quant: str | None, device: str | None, cache_dir: Path) -> Engine:
    target = load_target(LoadSpec(model=model, quant=quant, device=device, cache_dir=cache_dir))
    return Engine(target)


def release(engine: Engine) -> None:
    """Drop the engine's cache and, on CUDA, hand the freed blocks back to the driver."""
    engine.reset()
    if engine.device.type == "cuda":
        torch.cuda.empty_cache()
