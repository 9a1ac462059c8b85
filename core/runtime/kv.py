"""Preallocated KV caches behind transformers' public `Cache` API: the target's (core/runtime/runner.py)
and the EAGLE head's (core/runtime/head_step.py).

Each layer is a `StaticLayer`: keys/values in one buffer `(1, Hkv, C, Dh)` allocated once, and a
length counter L kept as a device tensor (a CPU target on the row attention kernel keeps its keys
in blocks of 16 rows, each transposed, as that kernel reads them: `BlockedKVLayer`,
models/attention.py). A forward writes its T new rows at [L, L+T) in place and returns the whole
buffer; the caller's additive mask decides which rows each query sees, and its width Lk <= C how
many rows attention reads. Nothing is ever reallocated or copied whole, so a compiled graph (a CUDA
graph included) can keep the buffers' addresses.

`keep_rows` is the speculative commit: after a verify wrote a tree of N rows at [start, start+N),
the accepted rows move to [start, start+a). Only those a rows are copied, whatever the chat length.
"""

from dataclasses import dataclass, replace

import torch
from transformers.cache_utils import Cache, StaticLayer

from models.attention import KEY_BLOCK

CPU_KV_BLOCK = 64  # on a CPU attention reads the rows in use rounded up to this many


class KVLayer(StaticLayer):
    """A StaticLayer whose buffers may be wider than the model's activations: new K/V rows are cast
    to the buffer's dtype as they are written."""

    def update(self, key_states, value_states, *args, **kwargs):
        return super().update(key_states.to(self.keys.dtype), value_states.to(self.values.dtype), *args, **kwargs)

    def row_move(self, source: torch.Tensor, start: int) -> "RowMove":
        """The indices that move rows `source` (ascending, all >= start) to [start, start + len(source))."""
        target = torch.arange(start, start + len(source), device=source.device)
        return RowMove(source, target, source, target)

    def move_rows(self, move: "RowMove") -> None:
        # index_select copies first: a source row the move overwrites is read before it is.
        self.keys.index_copy_(2, move.key_target, self.keys.index_select(2, move.key_source))
        self.values.index_copy_(2, move.target, self.values.index_select(2, move.source))


@dataclass(frozen=True)
class RowMove:
    """One commit's move as index tensors, computed once for all of a cache's layers (one layout):
    building them per layer was ~20 small ops a layer, 1.7 ms a commit that moved a row on the
    2-core EPYC (a third of a plain token) against 0.55 now."""
    source: torch.Tensor       # (a,) the rows kept
    target: torch.Tensor       # (a,) where they go: start, start + 1, ...
    key_source: torch.Tensor   # where their keys' elements lie along the keys' dim 2 (a layout's own)
    key_target: torch.Tensor   # ... and where they go


class BlockedKVLayer(KVLayer):
    """Keys in blocks of KEY_BLOCK rows, each transposed (models/attention.py `blocked`), kept flat per
    head: keys (1, Hkv, C/16 * Dh * 16), element d of row p at (p // 16) * Dh * 16 + d * 16 + p % 16.
    Flat, a forward's rows go in with one index_copy_, which a compiled graph does in place (written
    through an indexed 5-D view, inductor copied the whole cache at each forward: 16 ms a token);
    `key_blocks` is the kernel's view. Values (1, Hkv, C, Dh) as a StaticLayer's, in `value_dtype`
    (default the keys'): bf16 where V is the 4-bit or 8-bit kernels' bias-free output, which they
    round to bf16, so the same bits in half the bytes (models/cpu_quant.py `bf16_outputs`). At long
    contexts a token streams the whole cache: at 2,752 rows, 30 layers' one-token calls 4.16 ->
    3.24 ms on the 2-core Zen 4. Keys stay fp32: RoPE's rotation leaves them fp32 values."""

    def __init__(self, max_cache_len: int, value_dtype: torch.dtype | None = None):
        super().__init__(max_cache_len)
        self.value_dtype = value_dtype

    def lazy_initialization(self, key_states, value_states):
        # StaticLayer's own with a head size of 0 (its device, heads, counter, flags; no buffers of
        # its own, which this layout's would replace at once), then this layout's buffers.
        super().lazy_initialization(key_states[..., :0], value_states[..., :0])
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        blocks = -(-self.max_cache_len // KEY_BLOCK)
        self.keys = torch.zeros((self.batch_size, self.num_heads, blocks * self.k_head_dim * KEY_BLOCK),
                                dtype=key_states.dtype, device=self.device)
        self.values = torch.zeros((self.batch_size, self.num_heads, self.max_cache_len, self.v_head_dim),
                                  dtype=self.value_dtype or value_states.dtype, device=self.device)
        torch._dynamo.mark_static_address(self.keys)
        torch._dynamo.mark_static_address(self.values)

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        """positions (T,) -> where their keys' elements lie in a head's flat keys (T * Dh,), row by row."""
        dims = torch.arange(self.k_head_dim, device=positions.device) * KEY_BLOCK
        return ((positions // KEY_BLOCK * self.k_head_dim * KEY_BLOCK + positions % KEY_BLOCK)[:, None] + dims).reshape(-1)

    def update(self, key_states, value_states, *args, **kwargs):
        rows = key_states.shape[-2]
        positions = torch.arange(rows, device=self.device) + self.cumulative_length   # (T,)
        self.cumulative_length.add_(rows)
        flat = key_states.to(self.keys.dtype).reshape(self.batch_size, self.num_heads, rows * self.k_head_dim)
        self.keys.index_copy_(2, self.slots(positions), flat)
        self.values.index_copy_(2, positions, value_states.to(self.values.dtype))
        return self.keys, self.values

    def row_move(self, source: torch.Tensor, start: int) -> RowMove:
        move = super().row_move(source, start)
        return replace(move, key_source=self.slots(move.source), key_target=self.slots(move.target))


def key_blocks(keys: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A BlockedKVLayer's keys (B, Hkv, C/16 * Dh * 16) as blocks (B, Hkv, C/16, Dh, 16): a view."""
    return keys.view(*keys.shape[:2], -1, head_dim, KEY_BLOCK)


def static_cache(layers: int, capacity: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, blocked_keys: bool = False, value_dtype: torch.dtype | None = None) -> Cache:
    """`layers` KV layers of `capacity` rows each, allocated now (so their addresses never change);
    blocked_keys: the keys as the row attention kernel reads them, the values in `value_dtype`
    (BlockedKVLayer)."""
    make = (lambda: BlockedKVLayer(capacity, value_dtype)) if blocked_keys else (lambda: KVLayer(capacity))
    cache = Cache(layers=[make() for _ in range(layers)])
    cache.early_initialization(1, kv_heads, head_dim, dtype, device)
    return cache


def set_length(cache: Cache, length: int) -> None:
    """The next forward writes at row `length`; rows past it are forgotten (masks block them)."""
    for layer in cache.layers:
        layer.cumulative_length.fill_(length)


def keep_rows(cache: Cache, start: int, rows: torch.Tensor, written: int | None = None) -> None:
    """Move rows start+rows (ascending) to [start, start+len(rows)) and forget everything after.
    written: how many rows the last forward wrote from `start`, where the length counters stand;
    when it kept them all in place (plain decoding, a whole chain) the counters are right already
    (a layer's counter each: 30 `fill_`s, ~40 us a round after a verify on the 2-core EPYC)."""
    in_place = rows.tolist() == list(range(len(rows)))   # kept rows already in place (plain, a chain): no copy
    if not in_place:
        move = cache.layers[0].row_move(rows.to(cache.layers[0].keys.device) + start, start)  # every layer's
        for layer in cache.layers:
            layer.move_rows(move)
    if not (in_place and written == len(rows)):
        set_length(cache, start + len(rows))


def attended_rows(used: int, capacity: int, device: torch.device) -> int:
    """Lk, the cache rows attention reads when `used` are in use: on a CPU `used` rounded up to a
    block, so attention costs what the chat's length costs and a compiled graph sees few widths;
    on a GPU the whole capacity, the one shape a CUDA graph can replay."""
    if device.type == "cuda":
        return capacity
    return min(capacity, -(-used // CPU_KV_BLOCK) * CPU_KV_BLOCK)


def additive_mask(visible: torch.Tensor, past_len: int, dtype: torch.dtype, width: int | None = None) -> torch.Tensor:
    """visible (T, n) bool -> (1, 1, T, width) additive mask, width >= past_len+n (default equal):
    every row sees the whole committed prefix, and among the n new columns only those marked
    visible (0 attends; finfo.min blocks, a -inf that stays finite in sums); columns past
    past_len+n are blocked. A tree passes its ancestor mask, a causal run its lower triangle."""
    T, n = visible.shape
    mask = torch.full((1, 1, T, width or past_len + n), torch.finfo(dtype).min, dtype=dtype, device=visible.device)
    mask[0, 0, :, :past_len] = 0
    mask[0, 0, :, past_len: past_len + n].masked_fill_(visible, 0)
    return mask


def cache_bytes(cache: Cache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
