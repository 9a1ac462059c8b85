"""SpecExec's draft tree (Svirschevski et al. 2024, arXiv 2406.02532) for a slow target.

When the target's weights do not fit the GPU and stream from RAM on every forward, a verify of a
thousand tokens costs about what one token's does: the best tree is then simply the `budget` most
probable continuations, however they are shaped, hundreds to thousands of nodes. SpecExec grows
it best-first by cumulative draft log-probability:

  score(node) = sum of log p_draft along its path (as EAGLE-2's, core/spec/tree.py);
  repeat: feed the head the `batch` best nodes not yet expanded among the pool's best `budget`
          (one head step: a batch of rows), and add each one's `width` most likely children;
  until none of the pool's best `budget` is left unexpanded, or `steps` head steps ran.

Why it is exact: log p <= 0, so a child never outscores its parent; the pool's budget-th score
only rises as nodes join, so a node that falls out of the pool's best `budget` never gets back in
and is never expanded. Once every node of the pool's best `budget` is expanded, they are the best
`budget` nodes of the whole tree in which each node has its `width` most likely children (ties go
to the older node, as tree.rerank breaks them). The tree is the pool's best `budget`, closed under
ancestors: tree.rerank.

Dimensions: M pool nodes, b nodes expanded in a step (b <= batch), V the draft vocabulary, H the
head's hidden size, F nodes fed to the head so far this round.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

BRANCH = 16   # children per expanded node (SpecExec's max_branch_width is 32; our heads rarely put mass past rank 16)


@dataclass(frozen=True)
class Pool:
    """Every drafted node so far, parents before children (appended as they are expanded)."""
    scores: Tensor    # (M,) float: cumulative draft log-prob of the path root..node
    parents: Tensor   # (M,) int64: pool index of the parent, -1 for a child of the root
    tokens: Tensor    # (M,) int64: draft-vocabulary ids
    depth: Tensor     # (M,) int64 >= 1: the root is depth 0
    expanded: Tensor  # (M,) bool: fed to the head, its children added

    @property
    def size(self) -> int:
        return self.scores.shape[0]


Expand = Callable[[Pool, Tensor], Tensor]   # (pool, nodes (b,)) -> the nodes' children's log-probs (b, V)


def root_pool(root_logp: Tensor, width: int) -> Pool:
    """root_logp (V,) -> a pool of the root's `width` most likely children, best first."""
    logp, tokens = root_logp.topk(width)                                   # (w,)
    device = root_logp.device
    return Pool(logp.float(), torch.full((width,), -1, device=device), tokens, torch.ones(width, dtype=torch.long,
                device=device), torch.zeros(width, dtype=torch.bool, device=device))


def best_nodes(pool: Pool, budget: int) -> Tensor:
    """(min(M, budget),) pool indices of the best `budget` by score, best first; the stable sort
    breaks ties by pool index, parents first, as tree.rerank does."""
    return torch.sort(pool.scores, descending=True, stable=True).indices[:budget]


def to_expand(pool: Pool, budget: int, batch: int) -> Tensor:
    """(b,) the best `batch` nodes not yet expanded among the pool's best `budget`, best first;
    empty when all of those are expanded (the tree is final)."""
    best = best_nodes(pool, budget)
    return best[~pool.expanded[best]][:batch]


def add_children(pool: Pool, nodes: Tensor, child_logp: Tensor, width: int, budget: int) -> Pool:
    """Mark `nodes` (b,) expanded and append each one's `width` most likely children (child_logp
    (b, V)) that can still reach the pool's best `budget`: a child scoring no more than the current
    budget-th score never can (that score only rises; ties go to the older node)."""
    logp, tokens = child_logp.topk(width, dim=-1)                          # (b, w)
    scores = (pool.scores[nodes][:, None] + logp.float()).flatten()        # (b*w,)
    parents = nodes.repeat_interleave(width)
    depth = (pool.depth[nodes] + 1).repeat_interleave(width)
    if pool.size >= budget:
        floor = pool.scores[best_nodes(pool, budget)[-1]]
        keep = scores > floor
        scores, parents, depth, tokens = scores[keep], parents[keep], depth[keep], tokens.flatten()[keep]
    expanded = pool.expanded.clone()
    expanded[nodes] = True
    return Pool(torch.cat([pool.scores, scores]), torch.cat([pool.parents, parents]),
                torch.cat([pool.tokens, tokens.flatten()]), torch.cat([pool.depth, depth]),
                torch.cat([expanded, torch.zeros(scores.shape[0], dtype=torch.bool, device=scores.device)]))


def grow_best_first(root_logp: Tensor, expand: Expand, budget: int, batch: int, width: int, steps: int) -> Pool:
    """SpecExec's growth from the root's draft log-probs (V,): at most `steps` calls of `expand`
    (one head step each, `batch` nodes at most). -> the pool; its best `budget` make the tree."""
    width = min(width, budget, root_logp.shape[-1])
    if width < 1:
        return root_pool(root_logp, 0)
    pool = root_pool(root_logp, width)
    for _ in range(steps):
        nodes = to_expand(pool, budget, batch)
        if nodes.numel() == 0:
            break
        pool = add_children(pool, nodes, expand(pool, nodes), width, budget)
    return pool


class HeadFeed:
    """The EAGLE head's side of a best-first growth: an `Expand` that feeds a batch of pool nodes to
    the head step (core/runtime/head_step.py) and returns their children's draft log-probs.

    The j-th node fed this round sits at head cache row past + j; it is the pair (its parent's head
    output, its token) at position past + depth - 1, and it sees the committed pairs, its fed
    ancestors (all of them: a node joins the pool only once its parent was expanded) and itself."""

    def __init__(self, step, past: int, root_out: Tensor, to_target_ids: Callable[[Tensor], Tensor]):
        self.step, self.past, self.to_target_ids = step, past, to_target_ids
        self.outs = [root_out[None]]                  # head outputs: the root's (1, H), then each batch's (b, H)
        self.out_row: dict[int, int] = {}             # pool index -> its row in cat(outs) (the root's is 0)
        device = root_out.device
        # (room, room) [j, i]: the i-th node fed is the j-th's ancestor, or the j-th itself
        self.lines = torch.zeros(step.room, step.room, dtype=torch.bool, device=device)
        self.fed = 0

    def __call__(self, pool: Pool, nodes: Tensor) -> Tensor:
        b, fed, device = nodes.shape[0], self.fed, nodes.device
        assert fed + b <= self.step.room, f"{fed + b} nodes fed to a head step with room for {self.step.room}"
        rows = [self.out_row.get(p, 0) for p in pool.parents[nodes].tolist()]   # the root's children read row 0
        outs = torch.cat(self.outs) if len(self.outs) > 1 else self.outs[0]
        parent_rows = torch.tensor(rows, device=device)                          # (b,) rows of cat(outs)
        lines = self.lines[(parent_rows - 1).clamp(min=0), :fed + b] & (parent_rows > 0)[:, None]  # (b, F + b)
        lines[torch.arange(b, device=device), fed + torch.arange(b, device=device)] = True
        self.lines[fed:fed + b, :fed + b] = lines
        positions = self.past + pool.depth[nodes] - 1
        tokens = self.to_target_ids(pool.tokens[nodes])                          # (b,) target ids
        out, logp = self.step.feed(outs[parent_rows], tokens, positions, lines, self.past)   # (b, H), (b, V)
        self.out_row.update({m: 1 + fed + i for i, m in enumerate(nodes.tolist())})
        self.outs.append(out)
        self.fed += b
        return logp                                                               # (b, V)
