"""Each row's argmax and top-1 minus top-2 logit in one pass on a CPU (models/csrc/top2.cpp):
greedy acceptance's read of a verify's rows (core/spec/verify.py `best_two`).

torch's `topk(2)` selects in scalar code: ~85 us for a row of 49,152 logits on a 2-core Zen 4,
where reading them once a vector at a time takes a few; with the ops that turned topk's values
and indices into the argmax and the margin, greedy acceptance cost ~0.25 ms of a 4.9 ms plain round.
The argmax is the first maximal index (torch.argmax's rule); a NaN ranks above every number.
"""

from collections.abc import Iterable
from pathlib import Path

import torch

from models import native

NAME = "top2"


def kernel(cpu_flags: Iterable[str]) -> native.Kernel:
    """Built for the widest vectors: comparisons and selects, no rounding to choose."""
    return native.Kernel(NAME, native.widest_vectors(cpu_flags))


def load(cache_dir: Path, cpu_flags: Iterable[str]) -> None:
    """Make `torch.ops.aerie_top2.best_two` available (built once into `cache_dir`, models/native.py);
    raises NativeUnavailable with the reason where it cannot be built."""
    native.build(kernel(cpu_flags), cache_dir)


def loaded() -> bool:
    """Whether this process has the kernel (`load`)."""
    return native.loaded(NAME)


def best_two(logits: torch.Tensor) -> torch.Tensor:
    """logits (N, V) fp32 on the CPU -> (N, 2) float64: each row's argmax and its top-1 minus top-2
    logit (a repeated maximum: 0)."""
    return torch.ops.aerie_top2.best_two(logits)
