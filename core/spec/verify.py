"""Accepting drafts: which part of a verified tree the target agrees with.

One target forward over a `DraftTree` gives, for every node i, the target's next-token
distribution after node i given the committed prefix and i's ancestors: row i of an (N, V)
tensor. From those rows this module picks the accepted path and the one token the target adds
after it (the bonus: a correction, or a free extra token when the whole path is accepted).

It knows nothing about models, heads or caches: it sees a tree and the target's rows. The caller
keeps `Acceptance.nodes` in the KV cache and emits `Acceptance.new_tokens`.

Dimensions: N tree nodes, V vocabulary, a accepted draft tokens.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from core.spec.sampling import sample
from core.spec.tree import DraftTree, children
from models import top2


@dataclass(frozen=True)
class Acceptance:
    nodes: Tensor          # (a+1,) int64 tree nodes to keep in the KV: the root, then the accepted path
    new_tokens: list[int]  # the a accepted draft tokens, then the bonus token; len a+1
    # Greedy: the top-1 minus top-2 logit of the row that chose each new token. Host numbers, as
    # the few a round reads: tensor ops on them cost ~0.1 ms a round right after a verify.
    margins: tuple[float, ...] | None = None
    path: tuple[int, ...] | None = None   # `nodes` on the host (read from them where not given)

    def __post_init__(self):
        if self.path is None:
            object.__setattr__(self, "path", tuple(self.nodes.tolist()))

    @property
    def accepted(self) -> int:
        return len(self.new_tokens) - 1


def best_two(logits: Tensor) -> Tensor:
    """logits (N, V) -> (N, 2) float64 on the host: each row's argmax and its top-1 minus top-2
    logit, in one transfer (on a GPU accept's one wait). On a CPU with Aerie's one-pass kernel
    built (models/top2.py, ~12 us for two rows of 49,152 logits), that; elsewhere torch's topk (~85
    us on a CPU). Both pick the first maximal index (torch.argmax's rule) and give a repeated maximum
    a margin of 0; plain decoding and speculation read the same one."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and top2.loaded():
        return top2.best_two(logits)
    top = logits.topk(2, dim=-1)
    first = logits.argmax(-1, keepdim=True).double()   # topk leaves the order of equal values open
    return torch.cat([first, (top.values[:, :1] - top.values[:, 1:]).double()], 1).cpu()


def top2_margins(logits: Tensor) -> Tensor:
    """logits (k, V) -> (k,) float64 on the host: each row's top-1 minus top-2 logit."""
    return best_two(logits)[:, 1]


def accept_greedy(tree: DraftTree, target_logits: Tensor) -> Acceptance:
    """target_logits (N, V) -> the longest path on which every draft is the target's argmax."""
    # Node i is right iff tokens[i] == argmax(target row of parents[i]). A node is accepted iff it
    # and all its ancestors are right; keep the deepest accepted node (the lowest index on ties) and
    # emit its path plus argmax(row of that node), exactly what plain greedy decoding would emit.
    # The top two of each row in one transfer, the one host sync: the argmax decides, the margin
    # between them tells a near-tie (Engine.near_ties) without a second trip to the device.
    host = best_two(target_logits).tolist()                                          # (N, 2) ids < 2^53: exact
    target_next = [int(row[0]) for row in host]
    # The rest on host lists (parents come before children): a few dozen nodes cost less in Python
    # than as tensor ops.
    tokens, parents, depth = tree.tokens.tolist(), tree.parents.tolist(), tree.depth.tolist()
    right, last = [True] * len(tokens), 0
    for i in range(1, len(tokens)):
        right[i] = right[parents[i]] and tokens[i] == target_next[parents[i]]
        if right[i] and depth[i] > depth[last]:
            last = i
    path = [last]
    while path[-1] > 0:
        path.append(parents[path[-1]])
    root_first = path[::-1]
    return _along_path(tree, tokens, root_first, target_next[last], tuple(host[i][1] for i in root_first))


def accept_sampled(tree: DraftTree, target_probs: Tensor, generator: torch.Generator | None) -> Acceptance:
    """target_probs (N, V) -> a path and bonus distributed exactly as sampling from the target.

    target_probs must be the distribution plain decoding samples from (`core.spec.sampling.target_probs`).
    Siblings are tried in index order. `generator` (None, or on target_probs' device) supplies every
    random draw, so a seed replays a round exactly.
    """
    # Drafts are top-k picks, so each candidate's draft probability is q(x) = 1 and the
    # speculative test min(1, p(x)/q(x)) accepts x with probability p(x). On rejection the
    # residual norm(max(0, p - q)) is p with p(x) set to 0, and the next sibling is tested against
    # it (a repeated x now has p(x) = 0: rejected surely). If every child is rejected, or at a
    # leaf, the bonus is drawn from the residual. Each emitted token is therefore ~ p exactly.
    device = generator.device if generator is not None else target_probs.device
    draws = torch.rand(tree.size, generator=generator, device=device).tolist()  # node i's test uses draws[i]
    parents, tokens = tree.parents.clamp(min=0).to(target_probs.device), tree.tokens.to(target_probs.device)
    p_node = target_probs[parents, tokens].tolist()          # (N,) p(tokens[i]) in the row of parents[i]
    row_mass = target_probs.sum(-1).tolist()                 # (N,) 1 up to rounding
    kids, token_of = children(tree), tree.tokens.tolist()
    node, path = 0, [0]
    while True:
        rejected, mass, chosen = set(), row_mass[node], None
        for child in kids[node]:
            x = token_of[child]
            p_x = 0.0 if x in rejected else p_node[child]
            if draws[child] * mass < p_x:                     # u < p_residual(x) / mass
                chosen = child
                break
            rejected.add(x)
            mass -= p_x                                       # the residual's total
        if chosen is None:
            break
        node = chosen
        path.append(node)
    row = target_probs[node]                                  # (V,)
    residual = row.clone()
    residual[list(rejected)] = 0.0
    # Rounding can reject a token that held all the remaining mass (a probability-0 event in exact
    # arithmetic); then draw from the row rather than fail on an all-zero residual.
    residual = torch.where(residual.sum() > 0, residual, row)
    return _along_path(tree, token_of, path, int(sample(residual, generator)))


def _along_path(tree: DraftTree, tokens: list[int], path: list[int], bonus: int,
                margins: tuple[float, ...] | None = None) -> Acceptance:
    """The root-first `path` of nodes and its tokens (`tokens`: the tree's, on the host), then the bonus token."""
    nodes = torch.tensor(path, dtype=torch.long, device=tree.tokens.device)
    return Acceptance(nodes=nodes, path=tuple(path), new_tokens=[*(tokens[i] for i in path[1:]), bonus], margins=margins)


def path_offers(tree: DraftTree, acceptance: Acceptance, root_ranking: tuple[int, ...] | None = None,
                grafted: tuple[int, ...] = ()) -> tuple[tuple[int, int], ...]:
    """What the drafter offered along the accepted path, for learning acceptance by rank (Sequoia).

    One (children, rank) pair per path node that had children, root first: how many children the
    node had and the sibling rank (0 = the drafter's most likely) of the one accepted, or -1 when
    none was. EAGLE's trees list siblings best first, so a child's index among its siblings is its
    draft rank. The i-th pair is about depth i + 1. With `root_ranking` (R,), the drafter's best R
    root drafts whether the tree kept them or not, the first pair covers all R: the target's next
    token after the root is known, so every rank's acceptance is observed there, not only the kept.
    The pairs stop before a `grafted` node on the path (copied, no rank of the drafter's).
    """
    kids, path = children(tree), acceptance.path
    if root_ranking is not None and kids[0]:
        taken = acceptance.new_tokens[0]
        first = (len(root_ranking), root_ranking.index(taken) if taken in root_ranking else -1)
        return (first, *path_offers(tree, acceptance, grafted=grafted)[1:])
    offers = []
    for depth, node in enumerate(path):
        nxt = path[depth + 1] if depth + 1 < len(path) else None
        if not kids[node] or nxt in grafted:
            break
        offers.append((len(kids[node]), kids[node].index(nxt) if nxt is not None else -1))
    return tuple(offers)
