"""The EAGLE head's step as the drafter runs it: a preallocated KV cache, a few fixed row counts,
and with `compile` one compiled graph per row count (a CUDA graph on a GPU), as core/runtime/runner.py
does for the target's verify (issue 7, point 3).

Why: a head step is ~30 small kernels, and a draft makes depth + 1 of them plus their scoring. On
the H200 an eager d2k10n64 draft took 72 ms against a 10.5 ms verify where the latency profile
had predicted ~5 ms: the host's dispatch per kernel set the cost, not the GPU. A graph replays a
whole step, scoring included, in one launch.

`feed` writes T (feature, token) pairs at head cache rows [past + n - T, past + n): the last T of
the n rows fed since the `past` committed pairs; `visible` (T, n) says which of those n each new
row sees (all rows see the `past` ones). A step runs padded to the next bucket: padding rows see
only themselves and land after the real ones, where the next feed overwrites them and no mask
lets a real row see them. A catch-up longer than the largest bucket (a new prompt) runs eagerly,
unpadded.
"""

import torch

from core.runtime.graphs import Graph, GraphJob, compiled_all, graph_name, row_groups, rows_label
from core.runtime.kv import additive_mask, attended_rows, cache_bytes, set_length, static_cache

STEP_CPU_BUCKETS = (1, 2, 4, 8)      # rows per step: a catch-up (accepted + 1) or a frontier (top_k)
STEP_CUDA_BUCKETS = (1, 4, 8, 16)    # each a CUDA graph compiled at start: few, as the runner's smallest
DRAFT_ROWS = 1024                   # cache rows beyond the context: one draft's fed nodes and padding


class HeadStep:
    def __init__(self, head, score, context: int):
        """head: an EagleHead on its device; score: outputs (T, H) -> draft log-probs (T, Vd).
        Eager until warm_up compiles it."""
        weight = head.fc.weight
        self.head, self.score, self.device = head, score, weight.device
        self.buckets = STEP_CUDA_BUCKETS if self.device.type == "cuda" else STEP_CPU_BUCKETS
        self.capacity = context + DRAFT_ROWS
        self.dtype = weight.dtype  # of the head's activations and its cache
        self.room = DRAFT_ROWS - max(self.buckets)  # drafted nodes a round can feed, padding aside
        c = head.config
        self.cache = static_cache(1, self.capacity, c.num_key_value_heads, c.head_dim, self.dtype, self.device)
        self._graphs: dict[tuple[int, int], object] = {}  # (rows, feature width) -> its graph, once adopted

    @torch.inference_mode()  # as its graphs were compiled: autograd off
    def feed(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor,
             past: int, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """features (T, F), tokens (T,) target ids, positions (T,), visible (T, n) bool ->
        the head's outputs (T, H) and their draft log-probs (T, Vd), or with `last_only` the last
        row's (1, Vd): a catch-up reads no other, and scoring a prompt's every row against the
        draft vocabulary was half of its cost (14 of 29 ms for 200 rows here)."""
        T, n = visible.shape
        start = past + n - T
        bucket = next((b for b in self.buckets if b >= T), T)
        graph = self._graphs.get((bucket, features.shape[1]))
        rows = bucket if graph is not None else T
        if start + rows > self.capacity:
            raise ValueError(f"a {T}-row head step at row {start} overflows the head's {self.capacity}-row cache")
        # One graph per size: not per dtype or stride too (a frontier's parents can be a broadcast view).
        features = features.to(self.dtype).contiguous()
        pad = rows - T
        if pad:
            features = torch.cat([features, features.new_zeros(pad, features.shape[1])])
            tokens = torch.cat([tokens, tokens.new_zeros(pad)])
            positions = torch.cat([positions, positions[-1:].expand(pad)])
            seen = torch.zeros(rows, n + pad, dtype=torch.bool, device=self.device)
            seen[:T, :n] = visible
            seen[T:, n:] = torch.eye(pad, dtype=torch.bool, device=self.device)
            visible = seen
        width = attended_rows(past + n + pad, self.capacity, self.device)
        mask = additive_mask(visible, past, self.dtype, width=width)  # (1, 1, rows, Lk)
        set_length(self.cache, start)
        if graph is None:  # eager, unpadded: score only what the caller reads
            return self.forward(features[None], tokens[None], positions[None], mask,
                                scored=slice(T - 1, T) if last_only else None)
        out, logp = graph(features[None], tokens[None], positions[None], mask)
        return out[:T], logp[T - 1:T] if last_only else logp[:T]

    @torch.inference_mode()
    def remember(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, past: int) -> None:
        """Write T pairs' keys and values at head cache rows [past, past + T), eagerly, without
        their outputs (a prompt's pairs: EagleHead.remember). features (T, F), tokens (T,), positions (T,)."""
        T = features.shape[0]
        if past + T > self.capacity:
            raise ValueError(f"{T} pairs at row {past} overflow the head's {self.capacity}-row cache")
        set_length(self.cache, past)
        self.head.remember(features.to(self.dtype)[None], tokens[None], positions[None], self.cache)

    def forward(self, features, tokens, positions, mask, scored: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(1, T, F), (1, T), (1, T), (1, 1, T, Lk) -> outputs (T, H), log-probs (T, Vd) of all rows
        or of the `scored` ones. What a graph holds (all rows)."""
        out = self.head(features, tokens, positions, mask, self.cache)[0]
        return out, self.score(out if scored is None else out[scored])

    @property
    def compiled(self) -> bool:
        return bool(self._graphs)

    def has_graph(self, rows: int, width: int) -> bool:
        return (rows, width) in self._graphs

    def adopt(self, buckets: tuple[int, ...], width: int, graph) -> None:
        """Use `graph` for these buckets' rows and features of `width` from the next feed on (a
        drafter adopts between rounds)."""
        for rows in buckets:
            self._graphs[(rows, width)] = graph

    def graph_jobs(self, widths: tuple[int, ...]) -> list[GraphJob]:
        """What a CPU precompiles: a step for features of each width, one graph per group of
        buckets (core/runtime/graphs.py `row_groups`), on example inputs of the group's smallest."""
        jobs = []
        for width in widths:
            for rows in row_groups(self.buckets):
                size = rows[0]
                causal = torch.ones(size, size, dtype=torch.bool, device=self.device).tril()
                args = (torch.zeros(1, size, width, dtype=self.dtype, device=self.device),
                        torch.zeros(1, size, dtype=torch.long, device=self.device),
                        torch.arange(size, device=self.device)[None], additive_mask(causal, 0, self.dtype,
                                                                                    width=attended_rows(size, self.capacity, self.device)))
                jobs.append(GraphJob(graph_name("head", rows, f"x{width}"), f"the draft head's {rows_label(rows)}row step",
                                     self.forward, args, lambda g, rows=rows, w=width: self.adopt(rows, w, g), rows))
        return jobs

    @torch.inference_mode()  # as drafting runs: a graph compiled with autograd on would not be reused
    def warm_up(self, widths: tuple[int, ...], report=None) -> None:
        """Compile every bucket's graph for features of each width here and now, as a GPU captures
        its CUDA graphs (a CPU's are precompiled: `graph_jobs`). Writes junk rows from row 0 on: the
        drafter's head must start over afterwards. Where torch cannot compile, say so and stay eager."""
        def every_bucket():
            for width in widths:
                for rows in self.buckets:
                    self.adopt((rows,), width, Graph(self.forward, self.device))
                    causal = torch.ones(rows, rows, dtype=torch.bool, device=self.device).tril()
                    self.feed(torch.zeros(rows, width, dtype=self.dtype, device=self.device),
                              torch.zeros(rows, dtype=torch.long, device=self.device),
                              torch.arange(rows, device=self.device), causal, 0)
        if not compiled_all(every_bucket, report or print):
            self._graphs = {}

    def nbytes(self) -> int:
        return cache_bytes(self.cache)
