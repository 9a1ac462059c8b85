"""A tree shape's expected speed, from a positional acceptance model and the latency profile.

A shape's expected speed is E[tokens per round] / E[round time] (DESIGN.md section 6):
  - E[tokens per round] = 1 + sum over drafted nodes of P(node accepted), with
    P(node accepted) = product along its path of q[d, r], Sequoia's positional acceptance per depth:
    q[d, r] = P(the target's next token is the drafter's rank-r child | the path to depth d was
    accepted). q is learned online from every EAGLE round's `path_offers`, starting from a prior
    (the head's held-out chain acceptance when its train.json has it). EAGLE-2's tree is simulated
    with these values in place of the head's confidence: expand the top_k best nodes of each level,
    `depth` times, then keep the best total_tokens - 1 of the pool.
  - E[round time] = profile.round(total_tokens, context) + one head step per level at width top_k
    + the catch-up step over the tokens the last round committed + the rerank (core/tune/latency.py).
Plain decoding costs profile.plain_ms(context) per token, so predicted speedup = speed x plain_ms.
"""

import functools
from dataclasses import dataclass, field
from typing import Sequence

import torch

from core.config import TreeConfig
from core.spec.eagle import RANKED
from core.tune.latency import LatencyProfile

MAX_DEPTH = 7                       # expansion steps searched (longest draft = depth + 1)
TOP_KS = (1, 2, 3, 4, 6, 8, 10)
RANKS = RANKED                      # sibling ranks whose acceptance is learned (the root ranks them all)
RANK_DECAY = 0.3                    # prior: rank r+1 is accepted 0.3x as often as rank r
PRIOR_STRENGTH = 8.0                # the prior counts as this many observed offers per (depth, rank)


@dataclass(frozen=True)
class Pins:
    """What the user fixed on the command line; None leaves it to the tuner."""
    strategy: str | None = None       # a drafter's name (core.config.DRAFTERS)
    depth: int | None = None
    top_k: int | None = None
    total_tokens: int | None = None
    static: TreeConfig | None = None  # EAGLE-1's fixed tree


def prior_table(alphas: Sequence[float] | None) -> torch.Tensor:
    """(MAX_DEPTH + 1, RANKS) prior q: the head's chain acceptance per depth (the last one carried
    on, 0.5 without any), shared across ranks by RANK_DECAY."""
    chain = list(alphas or [0.5])
    chain += [chain[-1]] * (MAX_DEPTH + 1 - len(chain))
    return torch.tensor(chain[: MAX_DEPTH + 1])[:, None] * RANK_DECAY ** torch.arange(RANKS)[None]


@dataclass
class PositionalAcceptance:
    """Online counts of offers and acceptances per (depth, rank) on top of a prior."""
    prior: torch.Tensor                                    # (D, R)
    hits: torch.Tensor = field(init=False)
    trials: torch.Tensor = field(init=False)

    def __post_init__(self):
        self.hits, self.trials = torch.zeros_like(self.prior), torch.zeros_like(self.prior)

    def observe(self, offers: Sequence[tuple[int, int]]) -> None:
        for depth, (children, rank) in enumerate(offers[: len(self.prior)]):
            self.trials[depth, : min(children, RANKS)] += 1
            if 0 <= rank < RANKS:
                self.hits[depth, rank] += 1

    def q(self) -> torch.Tensor:
        return (self.hits + PRIOR_STRENGTH * self.prior) / (self.trials + PRIOR_STRENGTH)


def node_values(q: torch.Tensor, depth: int, top_k: int) -> torch.Tensor:
    """P(accepted) of every node EAGLE-2 would draft with this shape, best first: (M,)."""
    frontier, pool = torch.ones(1), []
    for level in range(depth + 1):
        candidates = (frontier[:, None] * q[min(level, len(q) - 1), :top_k][None]).flatten()  # (f * k,)
        pool.append(candidates)
        frontier = candidates.topk(min(top_k, len(candidates))).values
    return torch.cat(pool).sort(descending=True).values


@dataclass
class TreeRival:
    """A drafter of trees besides EAGLE (Medusa; prompt lookup's chains): its shape is planned as
    EAGLE's is, from its own positional acceptance (learned from its rounds, starting from a prior:
    Medusa's heads' held-out chain) and its draft cost, fixed_ms + level_ms for each depth drafted
    (one head each), plus a rerank for a tree. `chain`: it drafts chains only."""
    acceptance: PositionalAcceptance
    max_depth: int       # expansion steps it reaches: Medusa's heads - 1
    fixed_ms: float
    level_ms: float
    rerank_ms: float = 0.0
    chain: bool = False

    def draft_ms(self, depth: int, top_k: int, caught_up: float) -> float:
        return self.fixed_ms + self.level_ms * (depth + 1) + (self.rerank_ms if top_k > 1 else 0.0)


@dataclass(frozen=True)
class Shape:
    tree: TreeConfig
    tokens: float        # expected tokens per round
    round_ms: float


def best_shape(q: torch.Tensor, profile: LatencyProfile, context: float, max_size: int, pins: Pins,
               chain: bool, draft_scale: float = 1.0, rival: TreeRival | None = None) -> Shape:
    """The shape with the most expected tokens per second, within the pins and `max_size`; drafts
    cost `draft_scale` times what the profile says (DraftClock), or a tree rival's own draft cost."""
    draft = rival.draft_ms if rival is not None else profile.draft
    deepest = rival.max_depth if rival is not None else MAX_DEPTH
    depths = [pins.depth] if pins.depth is not None else range(deepest + 1)
    widths = [1] if chain else ([pins.top_k] if pins.top_k else TOP_KS)
    verify_ms = functools.cache(lambda n: profile.round(n, context))  # a size's verify is the same for every shape
    best = None
    for depth in depths:
        for k in widths:
            gained = torch.cat([torch.zeros(1), node_values(q, depth, k).cumsum(0)]).tolist()  # gained[j]: best j nodes
            sizes = [pins.total_tokens] if pins.total_tokens else range(2, min(len(gained), max_size) + 1)
            for n in sizes:
                tokens = 1 + gained[min(n - 1, len(gained) - 1)]
                ms = verify_ms(n) + draft_scale * draft(depth, k, tokens)
                if best is None or tokens / ms > best.tokens / best.round_ms:
                    best = Shape(TreeConfig(depth=depth, top_k=k, total_tokens=n), tokens, ms)
    return best


def shape_text(t: TreeConfig) -> str:
    """A tree shape in the plan's words."""
    if t.best_first:
        return f"best-first (SpecExec) {t.total_tokens} tokens, {t.top_k} nodes per head step, {t.depth} steps"
    return f"depth {t.depth}, top-k {t.top_k}, {t.total_tokens} tokens"
