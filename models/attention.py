"""Exact attention for a tree's few rows on a CPU, in fp32 (models/csrc/row_attention.cpp).

A tree's verify must give each row what one token at a time gives, bit for bit, or greedy texts
part at near-ties. torch's SDPA sums in an order that depends on how many query rows come
together, so Aerie ran it in fp64 over an fp64 cache, whose rounding to fp32 hid the order; that
cost most of a small model's verify (SmolLM2-135M, 2-core Xeon, one layer, Lk 512: fp64 SDPA 134 us
for one token's 3 folded rows per KV head and 385 for eight tokens', fp32 52 and 142). This kernel
computes every row alone in one fixed order (the source says which), in fp32 from an fp32 cache:
exact in the sense that matters (a row's value does not depend on the rows beside it or on the
padding of Lk). Built for the CPU's vector width: AVX-512, AVX2 or plain SSE. One layer's call
for SmolLM2-135M (3 KV heads x 3 query heads each), us, 1 / 8 tokens: 2-core EPYC with AVX2, Lk
128: 15 / 53 against fp64 SDPA's 95 / 176; Lk 512: 34 / 155 against 182 / 444.

It reads the keys in blocks of 16, each transposed, (H, C/16, D, 16) (the runner's cache keeps
them so): 16 columns' scores are then 64 vector multiply-adds, where keys row by row cost a
horizontal sum per row and column. 2-core Zen 4 (AVX-512), 30 layers' calls over distinct K/V (as
a forward reads them: from memory at long contexts), ms, 1 / 2 / 8 tokens: Lk 256 0.78 / 0.85 /
2.60 row by row, 0.39 / 0.52 / 1.24 in blocks; Lk 1024 2.17 / 3.10 / 10.28 against 1.55 / 1.89 /
4.86; Lk 2752 6.05 / 8.26 / 26.64 against 4.93 / 5.60 / 12.81. (Keys wholly transposed, (H, D, C),
computed alike but read 64 strided streams: 8.59 / 9.64 / 16.83 at Lk 2752.) Values are read in
bf16 where the cache keeps them so (kv.BlockedKVLayer: where they are bf16 values already): Lk
2752, 1 / 2 / 8 tokens 4.16 / 5.87 / 13.28 -> 3.24 / 4.85 / 12.66 ms, the same bits.
"""

from collections.abc import Iterable
from pathlib import Path

import torch

from models.native import Kernel, build, widest_vectors

NAME = "row_attention"
MAX_ROWS = 64            # query tokens per call it serves: a verify's; longer prefills keep fp32 SDPA
KEY_BLOCK = 16           # keys per block of the cache's layout (`blocked`)


def supports(head_dim: int) -> bool:
    """Whether the kernel has a build for this head size (a multiple of 16 up to 128)."""
    return head_dim % 16 == 0 and 16 <= head_dim <= 128


def compiler_flags(cpu_flags: Iterable[str]) -> tuple[str, ...]:
    """The widest vectors this CPU has; no contraction by the compiler, which could fuse a multiply
    and an add in one instantiation and not another (a row computed alone or beside others): the
    kernel spells out its fused multiply-adds where the CPU has them."""
    return (*widest_vectors(cpu_flags), "-ffp-contract=off")


def kernel(cpu_flags: Iterable[str]) -> Kernel:
    """The kernel as this CPU builds it (models/native.py `build_all`)."""
    return Kernel(NAME, compiler_flags(cpu_flags))


def source_digest(cpu_flags: Iterable[str]) -> str:
    """What the kernel built for this CPU depends on (models/native.py `digest`)."""
    return kernel(cpu_flags).source_digest()


def load(cache_dir: Path, cpu_flags: Iterable[str]) -> None:
    """Make `torch.ops.aerie_attn.attend` available (built once into `cache_dir`, models/native.py);
    raises NativeUnavailable with the reason where it cannot be built."""
    if build(kernel(cpu_flags), cache_dir):
        torch.library.register_fake("aerie_attn::attend", lambda q, k, v, mask, scale: torch.empty_like(q))


def blocked(keys: torch.Tensor) -> torch.Tensor:
    """keys (..., C, D) -> (..., C/16, D, 16), C rounded up with zero rows: block b, transposed,
    holds keys 16b..16b+15, element d of them side by side."""
    rows, dim = keys.shape[-2:]
    padded = torch.nn.functional.pad(keys, (0, 0, 0, -rows % KEY_BLOCK))
    return padded.reshape(*keys.shape[:-2], -1, KEY_BLOCK, dim).transpose(-1, -2).contiguous()


def unblocked(key_blocks: torch.Tensor, rows: int) -> torch.Tensor:
    """`blocked`'s inverse for the first `rows` keys: (..., C/16, D, 16) -> (..., rows, D), a copy."""
    kept = key_blocks[..., : -(-rows // KEY_BLOCK), :, :].transpose(-1, -2)            # (..., blocks, 16, D)
    return kept.reshape(*key_blocks.shape[:-3], -1, key_blocks.shape[-2])[..., :rows, :]


def attend(query: torch.Tensor, key_blocks: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
           scale: float) -> torch.Tensor:
    """query (Hkv, R, D) fp32, R = r * N folded rows; key_blocks (Hkv, C/16, D, 16) fp32, the cached
    keys `blocked` (core/runtime/kv.py BlockedKVLayer); value (Hkv, C, D) fp32 or bf16; mask (N, Lk) additive
    fp32 -> (Hkv, R, D): softmax(q k^T * scale + mask) v over the first Lk cache rows."""
    return torch.ops.aerie_attn.attend(query.contiguous(), key_blocks, value, mask, scale)
