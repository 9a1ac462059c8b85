"""An exact 4-bit kernel on AMX whose cost is nearly flat in the rows (models/csrc/q41_amx.cpp).

torch's int4 CPU kernel computes each block of 4 rows with fp32 FMAs over weights it dequantizes
again for every block, so a tree of 16 tokens costs ~6x one token in its linears. A 4-bit weight
is d (c - 8) + z with an integer code c in 0..15 and bf16 d and z per group of 32 inputs (torch's
int4 layout, Int4Linear's values), so per group x . w = d (x . c - 8 sum(x)) + z sum(x). Codes are exact
in bf16, so AMX's bf16 tile product gives x . c with exact products and fp32 sums: the same weight
values, only the order of the sums differs from the int4 kernel's, and each row is computed alone,
in one order whatever the number of rows. On a 2-core Xeon with AMX (hot, 1 / 4 / 16 rows): a
576x1536 linear 0.024 / 0.027 / 0.041 ms against int4's 0.025 / 0.045 / 0.172; the 576x49152 LM
head 0.71 / 0.79 / 1.38 against 0.74 / 1.31 / 5.42. Outputs are fp32 (int4's are bf16).

The kernel is C++ compiled once per machine and torch version into the cache folder (g++, which
the compiled graphs need anyway) and loaded as the op `torch.ops.aerie_amx.q41_mm`.
"""

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from models.native import Kernel, NativeUnavailable, build

NAME = "q41_amx"
FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512bw")
COMPILER_FLAGS = ("-mamx-tile", "-mamx-bf16", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-mavx512vl")
KERNEL = Kernel(NAME, COMPILER_FLAGS)   # the same build on every CPU that has FLAGS


class AmxUnavailable(NativeUnavailable):
    """This machine cannot run the AMX kernel; the message says why."""


def source_digest() -> str:
    """What the compiled kernel depends on: its source, torch's version, its flags."""
    return KERNEL.source_digest()


def lacking(cpu_flags: Iterable[str]) -> list[str]:
    """The FLAGS this CPU lacks."""
    have = set(cpu_flags)
    return [f for f in FLAGS if f not in have]


def kernel(cpu_flags: Iterable[str]) -> Kernel | None:
    """The kernel as this CPU builds it (models/native.py `build_all`); None where it lacks AMX."""
    return None if lacking(cpu_flags) else KERNEL


def load(cache_dir: Path, cpu_flags: Iterable[str]) -> None:
    """Make `torch.ops.aerie_amx.q41_mm` available: compile the kernel once into `cache_dir`
    (models/native.py), then load it. `cpu_flags`: the CPU's, as /proc/cpuinfo lists them. Raises
    AmxUnavailable with the reason where the CPU lacks AMX, the platform is not Linux, or
    compiling fails."""
    missing = lacking(cpu_flags)
    if missing:
        raise AmxUnavailable(f"this CPU lacks {', '.join(missing)}")
    try:
        first = build(KERNEL, cache_dir)
    except NativeUnavailable as e:
        raise AmxUnavailable(str(e)) from e
    if first:  # the op's shape rule, for compiled graphs
        torch.library.register_fake("aerie_amx::q41_mm", _fake)


def _fake(x, codes, d, z, n):
    return x.new_empty(x.shape[0], n, dtype=torch.float32)


@dataclass(frozen=True)
class Q41:
    """A 4-bit weight as the kernel reads it: codes (N/16 * K/32 * 256,) uint8, d and z (K/32, N) bf16."""
    codes: torch.Tensor
    d: torch.Tensor
    z: torch.Tensor


def pack(codes: torch.Tensor, d: torch.Tensor, z: torch.Tensor) -> Q41:
    """codes (N, K) integers 0..15 (K a multiple of 64, N of 16), d and z (K/32, N) bf16 -> the kernel's layout. For each block of
    16 outputs and each group of 32 inputs, 256 bytes: tile row kp (a pair of inputs 2kp, 2kp+1)
    holds 32 codes in AMX's VNNI order (output j's two codes side by side); chunk q of 64 bytes
    holds rows 4q and 4q+1 in its low nibbles and rows 4q+2 and 4q+3 in its high ones."""
    n, k = codes.shape
    groups = k // 32
    pairs = codes.to(torch.uint8).view(n // 16, 16, groups, 16, 2)          # block, j, group, kp, e
    rows = pairs.permute(0, 2, 3, 1, 4).reshape(n // 16, groups, 4, 4, 32)   # block, group, q, row in q, word
    low = torch.cat([rows[:, :, :, 0], rows[:, :, :, 1]], -1)
    high = torch.cat([rows[:, :, :, 2], rows[:, :, :, 3]], -1)
    return Q41((low | (high << 4)).reshape(-1).contiguous(), d.bfloat16().contiguous(), z.bfloat16().contiguous())

