"""Switching models from the page: fetch what is not on disk yet (with progress, cancellable),
free the old model, load the new one, and measure what that freed and what the new one holds.

Memory is measured, not estimated: on a GPU the torch allocator's bytes in use, on a CPU the
process's resident memory. The old model is freed before the new one loads (a consumer GPU seldom
holds two); if the new one fails, the old one is loaded again so the chat stays usable.
"""

import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil
import torch

from core.config import ModelChoice
from models.download import HEAD_PATTERNS, MODEL_PATTERNS, Download, Progress, snapshot
from models.errors import ModelLoadError
from models.head_checkpoint import HUB_ID
from models.target import LoadSpec, resolve


@dataclass(frozen=True)
class SwitchReport:
    label: str
    device: str
    freed: int                   # bytes the old model gave back
    used: int                    # bytes the new model took


def is_hub_id(source: str | None) -> bool:
    return bool(source) and not Path(source).expanduser().exists() and bool(HUB_ID.match(source))


def fetch(choice: ModelChoice, cache_dir: Path, report: Callable[[str, Progress], None],
          cancelled: Callable[[], bool], worker: Callable = snapshot) -> None:
    """Download the model and head of `choice` that are Hub ids into cache_dir/hub; `report(what,
    progress)` is called about twice a second. Raises ModelLoadError if cancelled or failed."""
    for source, patterns in ((choice.model, MODEL_PATTERNS), (choice.head, HEAD_PATTERNS)):
        if is_hub_id(source):
            Download(source, cache_dir, patterns, worker).run(lambda p, s=source: report(s, p), cancelled)


def process_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return psutil.Process().memory_info().rss


def release(device: torch.device) -> int:
    """Collect what nothing references any more and hand cached GPU blocks back; -> bytes in use.
    Compiled graphs hold their model's weights and cache: one model is loaded at a time, so all go."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return process_bytes(device)


def preflight(spec: LoadSpec, head: str | None) -> None:
    """Cheap checks before the current model is freed: the target resolves (its folder, config and
    architecture; a Hub model was fetched already) and a head given as a folder exists."""
    resolve(spec)
    if head and head != "random" and not is_hub_id(head) and not Path(head).expanduser().is_dir():
        raise ModelLoadError(f"The head folder {head} does not exist: pass a folder with the head's config.json "
                             "and weights, a Hugging Face id, 'default' or 'none'.")
