"""SpecExec's budget: how big a best-first tree pays when the target is slow (offloaded, or slowed
on purpose by `bench --verify-delay-ms`).

A best-first tree of n tokens (core/spec/specexec.py) holds the n - 1 most probable nodes. With
Sequoia's positional acceptance q[d, r] (core/tune/shapes.py) in place of the head's confidence, a
node's value P(accepted) is the product of q along its path, and the tree holds the n - 1 nodes
of highest value:
  E[tokens per round](n) = 1 + sum of the best n - 1 values (the sorted node values, summed);
  head steps(n, b)       = max(ceil(expanded(n) / b), longest path(n) - 1), where expanded(n) counts
                           the drafted nodes with a child among the best n - 1 (each is fed to the
                           head once, b per step; a path deepens by one per step);
  E[round ms](n, b)      = profile.round(n, context) + the draft of steps(n, b) head steps of width b.
The budget is the (n, b) with the most expected tokens per ms. On a target whose verify costs about
the same for 1 or 1,000 tokens (weights streamed over PCIe each forward) that is hundreds of nodes;
where a verify's cost grows with its size (a target in memory) it stays small.
"""

import heapq
import math
from dataclasses import dataclass

import torch

from core.config import TreeConfig
from core.tune.latency import LatencyProfile

BATCHES = (1, 2, 4, 8, 16)   # nodes fed per head step searched (SpecExec feeds up to 128 on a GPU)
WIDTH = 10                   # children per node the value model knows ranks for (shapes.RANKS)


@dataclass(frozen=True)
class Growth:
    """The best-first tree's nodes in the order it takes them (best first), and for each prefix
    of j nodes (j = 1..N) what it costs the head."""
    values: tuple[float, ...]     # (N,) P(accepted) of each node, best first
    expanded: tuple[int, ...]     # (N,) nodes of the best j with a child among them
    longest: tuple[int, ...]      # (N,) the deepest node's depth among the best j


def best_first_growth(q: torch.Tensor, nodes: int, width: int = WIDTH) -> Growth:
    """q (D, R) acceptance per depth and rank (deeper depths reuse the last row) -> the best `nodes`
    nodes of the tree in which each node has its `width` best-ranked children. A heap holds every
    child of every node taken so far; each node taken adds its own children."""
    table = q.tolist()
    width = min(width, len(table[0]))
    heap = [(-table[0][r], 1, -1) for r in range(width)]   # (-value, depth, parent's order in the tree)
    heapq.heapify(heap)
    values, expanded, longest, parents = [], [], [], set()
    while heap and len(values) < nodes:
        value, depth, parent = heapq.heappop(heap)
        if parent >= 0:
            parents.add(parent)
        values.append(-value)
        expanded.append(len(parents))
        longest.append(max(depth, longest[-1] if longest else 0))
        row = table[min(depth, len(table) - 1)]
        me = len(values) - 1
        for r in range(width):
            heapq.heappush(heap, (value * row[r], depth + 1, me))
    return Growth(tuple(values), tuple(expanded), tuple(longest))


def head_steps(growth: Growth, n: int, batch: int) -> int:
    """Head steps to grow a best-first tree of n tokens (n - 1 nodes), `batch` nodes a step."""
    if n < 2:
        return 0
    return max(math.ceil(growth.expanded[n - 2] / batch), growth.longest[n - 2] - 1)


@dataclass(frozen=True)
class Budget:
    tree: TreeConfig     # best_first: total_tokens the budget, top_k the batch, depth the head steps
    tokens: float        # expected tokens per round
    round_ms: float


def best_first_budget(q: torch.Tensor, profile: LatencyProfile, context: float, max_size: int, room: int, pins,
                      draft_scale: float = 1.0) -> Budget:
    """The best-first tree (tokens per round n, batch b) with the most expected tokens per ms, n within
    `max_size` (memory) and steps x b within `room` (the head cache's draft rows); drafts cost
    `draft_scale` times the profile's (meter.DraftClock). `pins` (shapes.Pins) may fix n, b or the steps."""
    growth = best_first_growth(q, max_size - 1)
    gained = [0.0, *torch.tensor(growth.values, dtype=torch.float64).cumsum(0).tolist()]   # gained[j]: best j nodes
    sizes = [pins.total_tokens] if pins.total_tokens else range(2, len(gained) + 1)
    best = None
    for b in [pins.top_k] if pins.top_k else BATCHES:
        for n in sizes:
            needed, most = head_steps(growth, min(n, len(gained)), b), room // b   # needed grows with n
            steps = min(most, needed if pins.depth is None else pins.depth)
            if needed > steps and not pins.total_tokens:
                break   # the head would stop short of n - 1 nodes (a pinned size is planned anyway)
            tokens = 1 + gained[min(n - 1, len(gained) - 1)]
            ms = profile.round(n, context) + draft_scale * profile.draft(steps, b, tokens, context, best_first=True)
            if best is None or tokens / ms > best.tokens / best.round_ms:
                best = Budget(TreeConfig(depth=steps, top_k=b, total_tokens=n, best_first=True), tokens, ms)
    return best
