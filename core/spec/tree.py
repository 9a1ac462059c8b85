"""Draft trees: the shape one target forward verifies, as tensors.

A tree holds N nodes in topological order (every parent before its children). Node 0 is the root:
the newest token, already chosen but not yet in the target's KV cache. Every other node is a
drafted token whose context is the committed prefix plus its ancestors. This module builds trees
(by hand, as a chain, from EAGLE-1's static shape, or with EAGLE-2's expand and rerank steps) and
derives what the verify forward needs: the 4D attention mask and the position ids.

It knows nothing about models, heads or caches: it sees token ids, parent pointers and
log-probabilities. Trees live on the CPU (they are small); `DraftTree.to` moves one.

Dimensions: N tree nodes, P root-to-leaf paths, D max depth, V vocabulary, k frontier width,
M drafted candidates in the rerank pool.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from functools import cache
from typing import NamedTuple

import torch
from torch import Tensor


@dataclass(frozen=True)
class DraftTree:
    tokens: Tensor         # (N,) int64 token ids; tokens[0] is the root
    parents: Tensor        # (N,) int64; parents[0] == -1, parents[i] < i
    depth: Tensor          # (N,) int64; depth[0] == 0
    ancestor_mask: Tensor  # (N, N) bool; [i, j] iff j == i or j is an ancestor of i
    paths: Tensor          # (P, D+1) int64; one row per leaf: node indices root..leaf, padded with -1

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_depth(self) -> int:
        return self.paths.shape[1] - 1

    def to(self, device: torch.device | str) -> "DraftTree":
        return DraftTree(*(getattr(self, f.name).to(device) for f in fields(self)))


@dataclass(frozen=True)
class SideRows:
    """Rows a drafter adds to a verify beside its tree (Lookahead's Jacobi window, M rows): the
    target computes them in the same forward, never accepts them and never keeps their KV. Each
    sees the committed prefix, the root and the side rows `visible` marks; no tree node sees them.
    The drafter reads the target's argmax after the rows in `read` (Verified.side_next)."""
    tokens: Tensor    # (M,) int64
    depth: Tensor     # (M,) int64 >= 1: row m sits at position L + depth[m], the root at L
    visible: Tensor   # (M, M) bool: [m, j] iff side row m sees side row j (itself included)
    read: Tensor      # (R,) int64 side rows whose next-token argmax the drafter reads

    @property
    def size(self) -> int:
        return self.tokens.shape[0]


@dataclass(frozen=True)
class Draft:
    """What a drafter proposes for a round: the tree to verify and, for the tuner's acceptance
    model, the root's best candidates as target ids, best first, tree or not; None where the
    drafter ranks none (verify.path_offers); and any side rows to ride in the same forward."""
    tree: DraftTree
    ranking: tuple[int, ...] | None = None
    side: SideRows | None = None
    copied: bool = False   # copied from the context, not the drafter's model: teaches its acceptance model and draft clock nothing
    grafted: tuple[int, ...] = ()   # tree nodes copied from the context into a drafted tree (EagleDrafter.graft_chain)

    @property
    def rows(self) -> int:
        """Tokens the target verifies: the tree's and the side rows'."""
        return self.tree.size + (self.side.size if self.side is not None else 0)


@dataclass(frozen=True)
class VerifyRows:
    """One verify's input: tree nodes first (N), then side rows (M)."""
    tokens: Tensor    # (N+M,) int64
    depth: Tensor     # (N+M,) int64 positions after the root
    visible: Tensor   # (N+M, N+M) bool
    outputs: Tensor | None  # (N+R,) rows whose outputs are read, tree first; None: all N (no side rows)


def verify_rows(draft: Draft) -> VerifyRows:
    """The rows one target forward computes for `draft`: its tree's nodes, each seeing only its
    ancestors, then its side rows, each seeing the root and the side rows it marks."""
    tree, side = draft.tree, draft.side
    if side is None:
        return VerifyRows(tree.tokens, tree.depth, tree.ancestor_mask, None)
    n, m = tree.size, side.size
    visible = torch.zeros(n + m, n + m, dtype=torch.bool)
    visible[:n, :n] = tree.ancestor_mask
    visible[n:, 0] = True                                        # every side row sees the root
    visible[n:, n:] = side.visible
    outputs = torch.cat([torch.arange(n), n + side.read])
    return VerifyRows(torch.cat([tree.tokens, side.tokens]), torch.cat([tree.depth, side.depth]), visible, outputs)


def make_tree(tokens: Tensor | Sequence[int], parents: Tensor | Sequence[int]) -> DraftTree:
    """Validate (tokens, parents) and derive depth, ancestor mask and root-to-leaf paths. The
    derivation walks Python lists: a tree has at most a few dozen nodes, where each tensor op costs
    more in dispatch than in arithmetic (a 4-node tree took 69 us as ~40 tensor ops, 2-core EPYC)."""
    tokens = torch.as_tensor(tokens, dtype=torch.long, device="cpu")
    parents = torch.as_tensor(parents, dtype=torch.long, device="cpu")
    if tokens.ndim != 1 or tokens.numel() == 0:
        raise ValueError(f"tokens must be a non-empty 1-D sequence, got shape {tuple(tokens.shape)}")
    if parents.shape != tokens.shape:
        raise ValueError(f"parents shape {tuple(parents.shape)} != tokens shape {tuple(tokens.shape)}")
    lineage = _lineages(parents.tolist())   # lineage[i]: root .. i
    n = len(lineage)
    rows = [i for i, line in enumerate(lineage) for _ in line]
    ancestor_mask = torch.zeros(n, n, dtype=torch.bool)
    ancestor_mask[rows, [j for line in lineage for j in line]] = True
    depth = torch.tensor([len(line) - 1 for line in lineage])
    is_parent = set(parents.tolist()[1:])
    leaves = [lineage[i] for i in range(n) if i not in is_parent]
    width = max(len(line) for line in leaves)
    paths = torch.tensor([line + [-1] * (width - len(line)) for line in leaves])
    return DraftTree(tokens, parents, depth, ancestor_mask, paths)


def _lineages(parents: list[int]) -> list[list[int]]:
    """parents (N,) -> for each node its path from the root, itself last; raises unless every
    parent comes before its child."""
    if parents[0] != -1:
        raise ValueError(f"node 0 is the root and must have parent -1, got {parents[0]}")
    lineage = [[0]]
    for i, parent in enumerate(parents[1:], start=1):
        if not 0 <= parent < i:
            raise ValueError(f"parents must satisfy 0 <= parents[i] < i; node {i} has parent {parent}")
        lineage.append(lineage[parent] + [i])
    return lineage


def root_only(root_token: int) -> DraftTree:
    """N = 1: verify the root alone, i.e. plain decoding."""
    return chain_tree(root_token, [])


def chain_tree(root_token: int, draft_tokens: Sequence[int]) -> DraftTree:
    """A single path root -> draft_tokens[0] -> draft_tokens[1] -> ..."""
    return replace(_chain_shape(len(draft_tokens) + 1), tokens=torch.tensor([root_token, *draft_tokens], dtype=torch.long))


@cache
def _chain_shape(n: int) -> DraftTree:
    """A chain of n nodes, placeholder tokens: its parents, depths, mask and path depend on n alone.
    Plain decoding and one-token drafts build one every round; make_tree took 0.09 ms of a 7-9 ms
    round (2-core EPYC). Shared between trees: nothing writes into a tree's tensors. Made outside
    inference mode, whichever caller comes first: an inference tensor cannot enter autograd."""
    with torch.inference_mode(False):
        return make_tree([0] * n, [-1, *range(n - 1)])


def first_nodes(tree: DraftTree, n: int) -> DraftTree:
    """The tree's first n >= 1 nodes: still a tree, since parents come first. What a verify holds
    when the cache has room for no more (near the end of the context)."""
    return tree if tree.size <= n else make_tree(tree.tokens[:n], tree.parents[:n])


def children(tree: DraftTree) -> list[list[int]]:
    """children(tree)[i] = the child node indices of node i, in index order."""
    kids: list[list[int]] = [[] for _ in range(tree.size)]
    for i, parent in enumerate(tree.parents.tolist()[1:], start=1):
        kids[parent].append(i)
    return kids


# ---------------------------------------------------------------------------------------------
# EAGLE-2 dynamic tree. The drafter runs the loop (it calls the head); these are its two steps.
#   score(node) = sum of log p_draft along its path = log of the product of draft confidences.
#   Expand: each of the k frontier nodes proposes its top_k children; all k*top_k join the pool,
#   and the best top_k by score become the next frontier.
#   Rerank: of the whole pool keep the best total_tokens - 1 by score; the root makes total_tokens.


class Expansion(NamedTuple):
    scores: Tensor       # (k*top_k,) cumulative log-prob of every candidate child, parent-major
    tokens: Tensor       # (k*top_k,) their token ids
    parent_slot: Tensor  # (k*top_k,) which frontier node (0..k-1) each candidate extends
    frontier: Tensor     # (top_k,) indices into the candidates: the best top_k, best first


def expand_frontier(frontier_scores: Tensor, child_logp: Tensor, top_k: int) -> Expansion:
    """frontier_scores (k,), child_logp (k, V) draft log-probs -> every candidate and the next frontier.

    All k*top_k candidates belong in the rerank pool (EAGLE-2 `topK_genrate` appends them all,
    expanded or not); only `frontier` is fed to the head for the next level. For the root, pass
    frontier_scores = zeros(1).
    """
    k, vocab = child_logp.shape
    assert frontier_scores.shape == (k,), f"frontier_scores {tuple(frontier_scores.shape)} vs k={k}"
    assert 0 < top_k <= vocab, f"top_k={top_k} must be in [1, V={vocab}]"
    logp, tokens = child_logp.topk(top_k, dim=-1)                  # (k, top_k)
    scores = (frontier_scores[:, None] + logp).flatten()          # (k*top_k,)
    parent_slot = torch.arange(k, device=scores.device).repeat_interleave(top_k)
    frontier = scores.topk(top_k).indices                          # (top_k,)
    return Expansion(scores, tokens.flatten(), parent_slot, frontier)


GRAFT_STEP = 1e-6   # score a grafted chain loses per level below its parent (Pool.graft)


class Pool:
    """EAGLE-2's candidate pool, grown one expansion a level: every child's score, parent (pool index,
    -1 for the root's) and target token id, and the frontier (pool indices) to expand next."""

    def __init__(self, root_logp: Tensor, top_k: int, to_target):
        """root_logp (Vd,): the root's children, in draft columns; to_target maps columns to token ids."""
        device = root_logp.device
        first = expand_frontier(torch.zeros(1, device=device), root_logp[None], top_k)
        self.scores, self.parents = [first.scores], [torch.full((top_k,), -1, device=device)]
        self.tokens, self.frontier = [to_target(first.tokens)], first.frontier        # frontier (k,)
        self.top_k, self.to_target = top_k, to_target

    def frontier_tokens(self) -> Tensor:
        return torch.cat(self.tokens)[self.frontier]                                  # (k,) target ids

    def expand(self, child_logp: Tensor) -> Tensor:
        """child_logp (k, Vd) of the frontier's nodes -> the new frontier's parents as frontier slots (k,)."""
        expansion = expand_frontier(torch.cat(self.scores)[self.frontier], child_logp, self.top_k)
        base = sum(len(s) for s in self.scores)
        self.scores.append(expansion.scores)
        self.parents.append(self.frontier[expansion.parent_slot])
        self.tokens.append(self.to_target(expansion.tokens))
        self.frontier = base + expansion.frontier
        return expansion.parent_slot[expansion.frontier]

    def graft(self, chain: Sequence[int]) -> list[bool]:
        """Put a copied chain (target ids, prompt lookup's: core/spec/eagle.py) in the pool ahead of
        every drafted candidate, so the rerank keeps it whatever the head scored it: where it runs
        through candidates, their scores are raised; from where it leaves them, it is appended.
        A chain node scores max(its own score, its parent's - GRAFT_STEP): never above its parent,
        and above any candidate a head is less than ~1 - 1e-5 sure of. -> whether each chain token
        was appended (no candidate of the head's)."""
        if not chain:
            return []
        scores, parents, tokens = (torch.cat(x).cpu() for x in (self.scores, self.parents, self.tokens))
        scores, parents, tokens = scores.tolist(), parents.tolist(), tokens.tolist()
        parent, parent_score, appended = -1, 0.0, []
        for token in chain:
            match = next((m for m, (p, t) in enumerate(zip(parents, tokens)) if p == parent and t == token), None)
            appended.append(match is None)
            if match is None:
                match = len(scores)
                scores.append(-math.inf)
                parents.append(parent)
                tokens.append(token)
            scores[match] = max(scores[match], parent_score - GRAFT_STEP)
            parent, parent_score = match, scores[match]
        self.scores, self.parents, self.tokens = [torch.tensor(scores)], [torch.tensor(parents)], [torch.tensor(tokens)]
        return appended

    def rerank(self, root_token: int, total_tokens: int) -> DraftTree:
        return rerank(torch.cat(self.scores), torch.cat(self.parents), torch.cat(self.tokens), root_token, total_tokens)


def chain_nodes(tree: DraftTree, chain: Sequence[int]) -> list[int]:
    """The tree's nodes along `chain` from the root, as far as the tree holds it."""
    kids, tokens, nodes, node = children(tree), tree.tokens.tolist(), [], 0
    for token in chain:
        node = next((c for c in kids[node] if tokens[c] == token), None)
        if node is None:
            break
        nodes.append(node)
    return nodes


def rerank(
    pool_scores: Tensor, pool_parents: Tensor, pool_tokens: Tensor, root_token: int, total_tokens: int
) -> DraftTree:
    """Keep the best total_tokens - 1 drafted candidates by score and return them as a tree.

    pool_scores, pool_parents, pool_tokens: (M,). pool_parents[m] is the pool index of m's
    parent (< m, the drafter appends level by level), or -1 for a child of the root.
    """
    assert total_tokens >= 1, f"total_tokens={total_tokens} counts the root, so must be >= 1"
    pool_scores, pool_parents, pool_tokens = (t.cpu() for t in (pool_scores, pool_parents, pool_tokens))
    n = min(total_tokens - 1, len(pool_scores))
    # log p <= 0, so a child never outscores its parent; the stable sort breaks ties by pool index,
    # parents first, so the kept set is closed under ancestors. Ascending pool order is topological.
    best = torch.sort(pool_scores, descending=True, stable=True).indices[:n]
    kept = best.sort().values                                      # (n,) pool indices
    parent_pool = pool_parents[kept]                               # (n,)
    parent_node = torch.searchsorted(kept, parent_pool.clamp(min=0)) + 1  # kept[j] is node j+1
    parent_node = torch.where(parent_pool < 0, 0, parent_node)
    found = kept[(parent_node - 1).clamp(0, max(n - 1, 0))] == parent_pool
    closed = bool(((parent_pool < 0) | found).all())
    assert closed, "rerank kept a node without its parent: a score rose along a path"
    tokens = torch.cat([torch.tensor([root_token]), pool_tokens[kept].long()])
    parents = torch.cat([torch.tensor([-1]), parent_node])
    return make_tree(tokens, parents)


# ---------------------------------------------------------------------------------------------
# EAGLE-1 static tree, as data. Each tuple is a path of top-k ranks from the root: (0, 1) is the
# second most likely child of the most likely child. E@v1 `eagle/model/choices.py`; 25 nodes plus
# the root, 4/8/8/3/2 nodes at depths 1..5.

MC_SIM_7B_63: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1),
)


def static_shape(choices: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor]:
    """choices -> (parents (N,), rank (N,)), N = 1 + len(choices), node 0 the root (rank -1).

    Node i is the rank[i]-th most likely child of node parents[i]. Nodes are ordered by depth,
    then lexicographically (as E@v1 sorts them), so parents come first.
    """
    ordered = sorted((tuple(c) for c in choices), key=lambda c: (len(c), c))
    node_of: dict[tuple[int, ...], int] = {(): 0}
    parents, rank = [-1], [-1]
    for path in ordered:
        if not path or path in node_of or min(path) < 0:
            raise ValueError(f"bad or repeated choice {path}")
        if path[:-1] not in node_of:
            raise ValueError(f"choice {path} has no parent {path[:-1]} in the list")
        node_of[path] = len(parents)
        parents.append(node_of[path[:-1]])
        rank.append(path[-1])
    return torch.tensor(parents), torch.tensor(rank)
