"""The EAGLE draft head's KV cache: preallocated slabs behind transformers' public `Cache` API
(the target's lives in core/runner.py).

Each layer keeps keys/values in a buffer `(B, Hkv, C, Dh)` with capacity C and a used length L.
A forward writes its T new entries at [L, L+T) in place and attends to the view [0, L+T), so a
step costs O(T) writes plus the attention itself, never a copy of the whole cache (a
`DynamicCache` concatenates, copying all L entries every step). The capacity doubles when full.

`keep(start, rows)` is the speculative commit: after a verify wrote a tree of N entries at
[start, start+N), the accepted rows are moved to [start, start+a) and the rest dropped. Only the
a accepted entries are copied, whatever the chat length.
"""

import torch
from transformers.cache_utils import Cache, DynamicLayer

MIN_CAPACITY = 256


class SlabLayer(DynamicLayer):
    """One layer's preallocated K/V. Subclasses DynamicLayer for the mask contract only:
    `get_mask_sizes` = (L + T, 0), i.e. a 4D mask of shape (B, 1, T, L + T)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.length = 0
        self._k = key_states.new_empty(*key_states.shape[:2], MIN_CAPACITY, key_states.shape[3])
        self._v = value_states.new_empty(*value_states.shape[:2], MIN_CAPACITY, value_states.shape[3])
        self.is_initialized = True
        self._sync_views()

    def _sync_views(self) -> None:
        self.keys = self._k[:, :, : self.length]
        self.values = self._v[:, :, : self.length]

    def _grow(self, needed: int) -> None:
        capacity = self._k.shape[2]
        while capacity < needed:
            capacity *= 2
        if capacity == self._k.shape[2]:
            return
        k = self._k.new_empty(*self._k.shape[:2], capacity, self._k.shape[3])
        v = self._v.new_empty(*self._v.shape[:2], capacity, self._v.shape[3])
        k[:, :, : self.length] = self._k[:, :, : self.length]
        v[:, :, : self.length] = self._v[:, :, : self.length]
        self._k, self._v = k, v

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        T = key_states.shape[2]
        self._grow(self.length + T)
        self._k[:, :, self.length : self.length + T] = key_states
        self._v[:, :, self.length : self.length + T] = value_states
        self.length += T
        self._sync_views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count (tokens to remove)")
        if self.is_initialized:
            self.length = max(0, self.length + tokens_to_remove)
            self._sync_views()

    def truncate(self, length: int) -> None:
        if self.is_initialized:
            self.length = min(self.length, length)
            self._sync_views()

    def keep(self, start: int, rows: torch.Tensor) -> None:
        """Move entries start+rows to [start, start+len(rows)) and drop everything after."""
        if not self.is_initialized:
            return
        src = rows.to(self.device) + start
        self._k[:, :, start : start + len(rows)] = self._k.index_select(2, src)  # index_select copies: no aliasing
        self._v[:, :, start : start + len(rows)] = self._v.index_select(2, src)
        self.length = start + len(rows)
        self._sync_views()

    def reset(self) -> None:
        self.length = 0
        if self.is_initialized:
            self._sync_views()

    def nbytes(self) -> int:
        return 0 if not self.is_initialized else self._k.nbytes + self._v.nbytes


class SlabCache(Cache):
    """A transformers `Cache` of `SlabLayer`s, created lazily one per attention layer."""

    def __init__(self):
        super().__init__(layer_class_to_replicate=SlabLayer)

    def truncate(self, length: int) -> None:
        """Forget everything at positions >= length (e.g. a new turn diverging from the old one)."""
        for layer in self.layers:
            layer.truncate(length)

    def keep(self, start: int, rows: torch.Tensor) -> None:
        for layer in self.layers:
            layer.keep(start, rows)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)
