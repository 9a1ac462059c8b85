"""The batched generator's KV cache and attention: B rows x C slots, each row at its own length.

`RowCache` is a transformers `Cache` of `RowLayer`s that writes each fed token at its row's own
slot, in place. `row_groups_attention` (registered with transformers' AttentionInterface as
ROW_GROUPS) runs one-token decode steps band by band, each band of rows reading only up to its own
longest row. Shapes: B cache rows, b rows fed, T tokens per row, C slots, L attended slots,
H kv heads, D head dim.
"""

from dataclasses import dataclass

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

ROW_GROUPS = "aerie_row_groups"  # the attention implementation below, registered with transformers

@dataclass
class FeedPlan:
    """Where the next forward writes: shared by the cache's layers."""
    rows: torch.Tensor | None = None        # (b,) cache rows fed
    positions: torch.Tensor | None = None   # (b, T) slot of each fed token
    length: int = 0                         # L = max position + 1: slots returned to attention
    leading: int | None = None              # b when rows are 0..b-1 (decode): a view, no copy


class RowLayer(DynamicLayer):
    """One layer's K/V, (B, H, C, D), written in place at each row's own positions."""

    def __init__(self, plan: FeedPlan, rows: int, capacity: int):
        super().__init__()
        self.plan, self.rows, self.capacity = plan, rows, capacity
        self.prefix_keys = self.prefix_values = None  # (H, P, D)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        shape = (self.rows, key_states.shape[1], self.capacity, key_states.shape[3])  # (B, H, C, D)
        self.keys, self.values = key_states.new_zeros(shape), value_states.new_zeros(shape)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):  # (b, H, T, D) each
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        p = self.plan
        rows = p.rows[:, None]  # (b, 1) against positions (b, T): advanced indices come first
        self.keys[rows, :, p.positions] = key_states.transpose(1, 2)  # (b, T, H, D)
        self.values[rows, :, p.positions] = value_states.transpose(1, 2)
        if p.leading is not None:
            return self.keys[: p.leading, :, : p.length], self.values[: p.leading, :, : p.length]
        return self.keys[p.rows, :, : p.length], self.values[p.rows, :, : p.length]  # (b, H, L, D) copies

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.keys[dst, :, :length] = self.keys[src, :, :length]
        self.values[dst, :, :length] = self.values[src, :, :length]

    def save_prefix(self, row: int, length: int) -> None:
        self.prefix_keys = self.keys[row, :, :length].clone()
        self.prefix_values = self.values[row, :, :length].clone()

    def load_prefix(self, rows: torch.Tensor) -> None:
        if self.prefix_keys is not None:
            self.keys[rows, :, : self.prefix_keys.shape[1]] = self.prefix_keys  # broadcast over rows
            self.values[rows, :, : self.prefix_values.shape[1]] = self.prefix_values


class RowCache(Cache):
    """A transformers `Cache` of `RowLayer`s: B rows x C slots, one length per row (kept by the caller)."""

    def __init__(self, num_layers: int, rows: int, capacity: int):
        self.plan = FeedPlan()
        super().__init__(layers=[RowLayer(self.plan, rows, capacity) for _ in range(num_layers)])

    def plan_feed(self, rows: torch.Tensor, positions: torch.Tensor, leading: int | None) -> None:
        self.plan.rows, self.plan.positions, self.plan.leading = rows, positions, leading
        self.plan.length = int(positions.max()) + 1

    def move_row(self, src: int, dst: int, length: int) -> None:
        for layer in self.layers:
            layer.move_row(src, dst, length)

    def save_prefix(self, row: int, length: int) -> None:
        for layer in self.layers:
            layer.save_prefix(row, length)

    def load_prefix(self, rows: torch.Tensor) -> None:
        for layer in self.layers:
            layer.load_prefix(rows)


def row_groups_attention(module, query, key, value, attention_mask, row_groups=None, **kwargs):
    """SDPA per band of rows (lo, hi, L), each over slots [0, L) only, so a band of short rows
    skips the padding that the batch's longest row would force on one call. Registered with
    transformers' AttentionInterface; without `row_groups` it is plain SDPA."""
    if row_groups is None or query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
    out = [decode_attention(query[lo:hi], key[lo:hi, :, :L], value[lo:hi, :, :L], attention_mask[lo:hi, :, :, :L],
                            scaling) for lo, hi, L in row_groups]
    return torch.cat(out), None


def decode_attention(query, key, value, mask, scaling: float) -> torch.Tensor:
    """One new token per row, GQA folded into the query rows; 15% faster than CPU SDPA at this size.
    query (b, Hq, 1, D), key/value (b, H, L, D), mask (b, 1, 1, L) -> (b, 1, Hq, D)."""
    b, hq, _, d = query.shape
    q = query.view(b, key.shape[1], hq // key.shape[1], d)  # (b, H, R, D): q head i reads kv head i // R
    scores = torch.matmul(q, key.transpose(-1, -2)).mul_(scaling).add_(mask)  # (b, H, R, L)
    out = torch.matmul(scores.softmax(-1), value)  # (b, H, R, D)
    return out.reshape(b, hq, 1, d).transpose(1, 2)


def bands(n: int, count: int) -> list[tuple[int, int]]:
    """[lo, hi) of `count` near-equal contiguous bands of rows 0..n-1, empty ones left out."""
    edges = [round(g * n / count) for g in range(count + 1)]
    return [(lo, hi) for lo, hi in zip(edges, edges[1:]) if hi > lo]


def feed_mask(positions: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """(b, 1, T, L) additive mask: the token at positions[r, t] sees its row's slots 0..positions[r, t]."""
    slots = torch.arange(length, device=positions.device)
    visible = slots[None, None, :] <= positions[:, :, None]  # (b, T, L)
    mask = torch.zeros(visible.shape, dtype=dtype, device=positions.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)[:, None]


def use_row_group_attention(model) -> None:
    """Switch `model` to ROW_GROUPS attention, in place (pass a model you own). Registering the
    function with transformers' public interfaces is idempotent; it happens here, not at import."""
    AttentionInterface.register(ROW_GROUPS, row_groups_attention)
    AttentionMaskInterface.register(ROW_GROUPS, sdpa_mask)
    model.set_attn_implementation(ROW_GROUPS)
