"""A 4-bit linear whose rows are each computed alone, in one order (models/csrc/q4_rows.cpp).

torch's int4 CPU kernel takes its rows in blocks of 4 and sums each block in an order of its own,
so a tree's row and the same token verified alone can differ in the last bits: greedy texts then
part at near-ties, and it dequantizes every weight again for each 4 rows, so its cost grows with
the tree. This kernel holds the same weight values (torch's int4 codes, scales and zeros,
w = (c - 8) d + z), computes each group of 32 inputs as d sum((c - 8) x) + z sum(x) without
dequantizing a weight, puts outputs in vector lanes and sums each over its groups and inputs in
order, so a row's output is the same bits alone or in a tree of any size, and it keeps each
converted code in registers for up to 4-6 rows with enough independent sums to keep an FMA unit
busy even at one row. It rounds inputs and outputs to bf16 as int4 does, but takes and gives
fp32, so an eager call needs no casts around it.

One linear, hot, 2-core AMD EPYC with AVX2 alone, when it still dequantized each weight (ms at
1 / 2 / 4 / 8 / 16 rows): 576x1536
0.065 / 0.089 / 0.134 / 0.277 / 0.505 against int4's 0.088 / 0.117 / 0.172 / 0.374 / 0.628; the
576x49152 LM head 2.02 / 2.88 / 4.48 / 9.12 / 16.5 against 2.56 / 3.52 / 5.03 / 9.80 / 21.0.
From a row count the tuner measures (core/tune/kernels.py `choose_tiles_from`) it takes a tiled
path with the same bits: each group's codes converted once into an L1 tile that every row's
FMAs read (hot, 2-core Zen 3 EPYC, both paths still dequantizing, ms registers / tile: 576x1536
at 8 rows 0.147 / 0.125, 16 0.288 / 0.205, 64 1.19 / 0.81; the LM head at 16 rows 10.2 / 7.3).
Not dequantizing then cut the register path's 576x1536 at 1 / 4 / 8 rows from 0.043 / 0.082 /
0.174 to 0.033 / 0.064 / 0.118 ms and the LM head's one row from 1.20 to 0.85 (hot, same EPYC).
Built per machine (models/native.py) for its widest vectors: AVX-512, AVX2 or SSE; with
AVX512-BF16 each multiply-add takes two inputs (vdpbf16ps: each product exact, a bf16 x times an
integer code), which on a 2-core Zen 4 EPYC cut the embedded model's linears at 1 / 4 / 8 / 16
rows from 7.41 / 10.36 / 20.36 / 32.74 ms to 5.81 / 7.50 / 12.77 / 20.89 (int4 9.15 / 12.38 /
19.8 / 33.69 in the same run): from 4 rows on it runs at the bf16 dot product's peak.
"""

from collections.abc import Iterable
from pathlib import Path

import torch

from models.native import Kernel, build

NAME = "q4_rows"
NEVER = 1 << 30   # a `tiles_from` no call reaches (the op's default)


def compiler_flags(cpu_flags: Iterable[str]) -> tuple[str, ...]:
    """The widest vectors and multiply-adds this CPU has: bf16 pair dot products (AVX512-BF16, with
    AVX512BW's 16-bit permutes), else fp32 FMAs. Each output's sum is one chain in any build."""
    flags = set(cpu_flags)
    if "avx512f" not in flags:
        return ("-mavx2", "-mfma") if "avx2" in flags else ()
    bf16 = ("-mavx512bw", "-mavx512bf16") if {"avx512_bf16", "avx512bw"} <= flags else ()
    return ("-mavx512f", "-mavx512vl", "-mfma", *bf16)


def kernel(cpu_flags: Iterable[str]) -> Kernel:
    """The kernel as this CPU builds it (models/native.py `build_all`)."""
    return Kernel(NAME, compiler_flags(cpu_flags))


def source_digest(cpu_flags: Iterable[str]) -> str:
    """What the kernel built for this CPU depends on (models/native.py `digest`)."""
    return kernel(cpu_flags).source_digest()


def load(cache_dir: Path, cpu_flags: Iterable[str]) -> None:
    """Make `torch.ops.aerie_q4` available (built once into `cache_dir`); raises NativeUnavailable
    with the reason where it cannot be built."""
    if build(kernel(cpu_flags), cache_dir):
        torch.library.register_fake("aerie_q4::mm", lambda x, packed, n, tiles_from=NEVER: x.new_empty(x.shape[0], n, dtype=torch.float32))


def fits(in_features: int, out_features: int) -> bool:
    """Whether a linear's shape suits the kernel: whole groups of 32 inputs, whole vectors of outputs."""
    return in_features % 32 == 0 and out_features % torch.ops.aerie_q4.block_outputs() == 0


def pack(codes: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """(N, K) 4-bit codes 0..15 and (K/32, N, 2) bf16 d and z per group (Int4Linear's) -> the
    kernel's weight: one stream per block of outputs, each group's code words then its scales."""
    return torch.ops.aerie_q4.pack(codes.to(torch.uint8).contiguous(), scale_zero.contiguous())


def unpack(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """`pack`'s inverse: -> (N, K) uint8 codes."""
    return torch.ops.aerie_q4.unpack(packed, out_features, in_features)


def matmul(rows: torch.Tensor, packed: torch.Tensor, out_features: int, tiles_from: int = NEVER) -> torch.Tensor:
    """rows (M, K) fp32 or bf16, rounded to bf16 @ W^T -> (M, N) fp32 holding bf16 values (the
    int4 kernel's inputs and outputs, without its casts), W the int4 values `pack` packed. Calls
    of `tiles_from` rows or more convert each group's codes once into an L1 tile that all rows
    then read; fewer keep them in registers for up to 4-6 rows at a time. The same bits either way."""
    return torch.ops.aerie_q4.mm(rows, packed, out_features, tiles_from)
