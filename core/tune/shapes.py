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
import itertools
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from core.config import TreeConfig
from core.spec.eagle import RANKED
from core.tune.latency import LatencyProfile

MAX_DEPTH = 7                       # expansion steps searched (longest draft = depth + 1)
TOP_KS = (1, 2, 3, 4, 6, 8, 10)
RANKS = RANKED                      # sibling ranks whose acceptance is learned (the root ranks them all)
RANK_DECAY = 0.3                    # prior: rank r+1 is accepted 0.3x as often as rank r
PRIOR_STRENGTH = 8.0                # the prior counts as this many observed offers per (depth, rank)
TIE = 1e-9                          # shapes this close in speed tie: the first found (shallower, narrower) stays


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


class PositionalAcceptance:
    """Online counts of offers and acceptances per (depth, rank) on top of a prior (D, R)."""

    def __init__(self, prior: torch.Tensor):
        self.prior = prior
        self._hits, self._trials = torch.zeros_like(prior), torch.zeros_like(prior)
        # Rounds' offers (depth, children offered, accepted rank) not counted yet: counted in one go
        # when the counts are read (a plan, the monitor, keeping them). Counted per round, a round's
        # few in-place ops on the tables cost ~60 us, 1% of a one-token round on the 2-core EPYC.
        self._pending: list[tuple[int, int, int]] = []

    def observe(self, offers: Sequence[tuple[int, int]]) -> None:
        self._pending += [(depth, min(children, RANKS), rank) for depth, (children, rank) in enumerate(offers[: len(self.prior)])]

    def _count(self) -> None:
        if not self._pending:
            return
        hits, trials = torch.zeros_like(self.prior).tolist(), torch.zeros_like(self.prior).tolist()
        for depth, children, rank in self._pending:
            for r in range(children):
                trials[depth][r] += 1
            if 0 <= rank < RANKS:
                hits[depth][rank] += 1
        self._hits += torch.tensor(hits, dtype=self.prior.dtype)
        self._trials += torch.tensor(trials, dtype=self.prior.dtype)
        self._pending = []

    @property
    def hits(self) -> torch.Tensor:
        self._count()
        return self._hits

    @property
    def trials(self) -> torch.Tensor:
        self._count()
        return self._trials

    def restore(self, hits: torch.Tensor, trials: torch.Tensor) -> None:
        """Counts kept by an earlier session (core/tune/remembered.py) in place of these."""
        self._hits, self._trials, self._pending = hits, trials, []

    def q(self) -> torch.Tensor:
        return (self.hits + PRIOR_STRENGTH * self.prior) / (self.trials + PRIOR_STRENGTH)


def node_pools(q: list[list[float]], top_k: int) -> Iterator[list[float]]:
    """For depth 0, 1, 2, ... at this top_k: P(accepted) of every node EAGLE-2 drafts, best first;
    q (D, R) as lists. Each depth adds the children of the last level's top_k best nodes (EAGLE-2's
    frontier), so every depth's pool is one step from the one before. Python floats: with tensors,
    the per-op dispatch made best_shape's 56 pools ~3 ms of a plan's 10 on the 2-core Zen 4."""
    frontier, pool = [1.0], []
    for level in itertools.count():
        accept = q[min(level, len(q) - 1)][:top_k]
        candidates = sorted((f * a for f in frontier for a in accept), reverse=True)
        pool = sorted(pool + candidates, reverse=True)
        frontier = candidates[:top_k]
        yield pool


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

    def draft_ms(self, depth: int, top_k: int, caught_up: float, context: float) -> float:
        # Medusa's heads read the last feature alone, prompt lookup the token ids: no context slope.
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
    rows = q.tolist()
    pools = {k: node_pools(rows, k) for k in widths}
    best, to_beat = None, 0.0
    for depth in range(max(depths) + 1):
        for k in widths:
            values = next(pools[k])
            if depth not in depths:
                continue
            gained = list(itertools.accumulate(values, initial=0.0))  # gained[j]: the best j nodes
            sizes = [pins.total_tokens] if pins.total_tokens else range(2, min(len(gained), max_size) + 1)
            for n in sizes:
                tokens = 1 + gained[min(n - 1, len(gained) - 1)]
                if tokens <= to_beat * verify_ms(n):
                    continue  # drafts cost time too: this size cannot beat the best, so its draft is not costed
                ms = verify_ms(n) + draft_scale * draft(depth, k, tokens, context)
                if tokens / ms > to_beat:
                    best = Shape(TreeConfig(depth=depth, top_k=k, total_tokens=n), tokens, ms)
                    to_beat = tokens / ms * (1 + TIE)
    return best


def shape_text(t: TreeConfig) -> str:
    """A tree shape in the plan's words."""
    if t.best_first:
        return f"best-first (SpecExec) {t.total_tokens} tokens, {t.top_k} nodes per head step, {t.depth} steps"
    return f"depth {t.depth}, top-k {t.top_k}, {t.total_tokens} tokens"
