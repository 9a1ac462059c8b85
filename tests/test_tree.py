"""core/spec/tree.py: tree structure, the verify mask and positions, EAGLE-2 expand/rerank, EAGLE-1 shape."""

import math
from dataclasses import fields

import pytest
import torch

from core.runtime.kv import additive_mask
from core.spec.tree import (
    MC_SIM_7B_63,
    DraftTree,
    Pool,
    chain_nodes,
    chain_tree,
    children,
    expand_frontier,
    make_tree,
    rerank,
    root_only,
    static_shape,
)

#         0
#        / \
#       1   2
#      / \   \
#     3   4   5
#     |
#     6
PARENTS = [-1, 0, 0, 1, 1, 2, 3]
TOKENS = [10, 11, 12, 13, 14, 15, 16]
ANCESTORS = [{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 1, 4}, {0, 2, 5}, {0, 1, 3, 6}]


def test_hand_built_tree_structure():
    tree = make_tree(TOKENS, PARENTS)
    assert tree.size == 7 and tree.max_depth == 3
    assert tree.tokens.tolist() == TOKENS and tree.parents.tolist() == PARENTS
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    for i, expected in enumerate(ANCESTORS):
        assert set(tree.ancestor_mask[i].nonzero().flatten().tolist()) == expected
    assert tree.paths.tolist() == [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]]  # leaves 4, 5, 6
    assert children(tree) == [[1, 2], [3, 4], [5], [6], [], [], []]
    for t in (tree.tokens, tree.parents, tree.depth, tree.paths):
        assert t.dtype == torch.long


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("past_len", [0, 5])
@pytest.mark.parametrize("pad", [0, 9])
def test_attention_mask_and_depths(dtype, past_len, pad):
    tree = make_tree(TOKENS, PARENTS)
    mask = additive_mask(tree.ancestor_mask, past_len, dtype, width=past_len + 7 + pad if pad else None)
    assert mask.shape == (1, 1, 7, past_len + 7 + pad) and mask.dtype == dtype
    assert (mask[0, 0, :, :past_len] == 0).all()  # the committed prefix is visible to every node
    low = torch.finfo(dtype).min
    for i in range(7):
        for j in range(7):
            assert mask[0, 0, i, past_len + j].item() == (0 if j in ANCESTORS[i] else low)
    assert (mask[0, 0, :, past_len + 7:] == low).all()  # columns past the tree: blocked
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]  # node i sits at position past_len + depth[i]


def test_root_only_and_chain():
    root = root_only(42)
    assert root.size == 1 and root.max_depth == 0 and root.paths.tolist() == [[0]]
    assert additive_mask(root.ancestor_mask, 3, torch.float32).tolist() == [[[[0.0] * 4]]]
    chain = chain_tree(1, [2, 3, 4])
    assert chain.tokens.tolist() == [1, 2, 3, 4] and chain.parents.tolist() == [-1, 0, 1, 2]
    assert chain.paths.tolist() == [[0, 1, 2, 3]] and chain.ancestor_mask.equal(torch.ones(4, 4).tril().bool())


def test_to_moves_every_field():
    tree = make_tree(TOKENS, PARENTS)
    assert tree.paths.tolist() == [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]]
    moved = tree.to("meta")  # a device the tree is not on: a field left behind would stay on the CPU
    assert isinstance(moved, DraftTree)
    assert all(getattr(moved, f.name).device.type == "meta" for f in fields(DraftTree))
    assert all(getattr(moved, f.name).shape == getattr(tree, f.name).shape for f in fields(DraftTree))


@pytest.mark.parametrize(
    "tokens, parents",
    [
        ([1, 2], [0, 0]),          # root must have parent -1
        ([1, 2], [-1, 1]),         # self-parent
        ([1, 2, 3], [-1, 2, 0]),   # parent after child
        ([1, 2], [-1, -1]),        # second root
        ([1, 2], [-1]),            # length mismatch
        ([], []),                  # empty
        ([[1]], [[-1]]),           # not 1-D
    ],
)
def test_make_tree_rejects_bad_parents(tokens, parents):
    with pytest.raises(ValueError):
        make_tree(tokens, parents)


def test_random_trees_mask_matches_parent_walk():
    gen = torch.Generator().manual_seed(0)
    for n in [1, 2, 9, 64, 128]:
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        tree = make_tree(torch.randint(0, 100, (n,), generator=gen), parents)
        for i in range(n):
            walk, j = set(), i
            while j >= 0:
                walk.add(j)
                j = parents[j]
            assert set(tree.ancestor_mask[i].nonzero().flatten().tolist()) == walk
            assert tree.depth[i] == len(walk) - 1
        leaves = sorted(set(range(n)) - set(parents[1:]))
        assert tree.paths.shape == (len(leaves), int(tree.depth.max()) + 1)
        for row, leaf in zip(tree.paths.tolist(), leaves):
            path = [k for k in row if k >= 0]
            assert path[0] == 0 and path[-1] == leaf and len(path) == tree.depth[leaf] + 1
            assert all(parents[b] == a for a, b in zip(path, path[1:]))  # consecutive = parent, child


# --- EAGLE-2 expand / rerank -----------------------------------------------------------------


def _draft(child_logp_of, top_k: int, depth: int, root_token: int, total_tokens: int):
    """The EAGLE-2 loop as a drafter runs it (core/spec/tree.py Pool); child_logp_of(pool index, -1 = root)
    stands in for the head."""
    pool = Pool(child_logp_of(-1), top_k, lambda tokens: tokens)
    for _ in range(depth):
        pool.expand(torch.stack([child_logp_of(int(i)) for i in pool.frontier]))
    return (torch.cat(pool.scores), torch.cat(pool.parents), torch.cat(pool.tokens)), pool.rerank(root_token, total_tokens)


# Hand-computed: V = 4, top_k = 2, depth = 2 (three levels). Pool index -> draft distribution.
HAND_PROBS = {
    -1: [0.50, 0.30, 0.15, 0.05],  # root: keeps tok0 (p .5, pool 0), tok1 (.3, pool 1)
    0: [0.10, 0.20, 0.58, 0.12],   # tok2 .29 (pool 2), tok1 .10 (pool 3)
    1: [0.70, 0.05, 0.10, 0.15],   # tok0 .21 (pool 4), tok3 .045 (pool 5); frontier = pools 2, 4
    2: [0.90, 0.05, 0.03, 0.02],   # tok0 .261 (pool 6), tok1 .0145 (pool 7)
    4: [0.45, 0.35, 0.10, 0.10],   # tok0 .0945 (pool 8), tok1 .0735 (pool 9)
}


def _hand_logp(i: int) -> torch.Tensor:
    return torch.tensor(HAND_PROBS[i]).log()


def test_expand_frontier_scores_and_frontier():
    step = expand_frontier(torch.tensor([0.5, 0.3]).log(), torch.stack([_hand_logp(0), _hand_logp(1)]), 2)
    assert step.tokens.tolist() == [2, 1, 0, 3]
    assert step.parent_slot.tolist() == [0, 0, 1, 1]
    assert torch.allclose(step.scores.exp(), torch.tensor([0.29, 0.10, 0.21, 0.045]))
    assert step.frontier.tolist() == [0, 2]  # the best two of all four, best first


@pytest.mark.parametrize(
    "total_tokens, tokens, parents",
    [
        # by score: pool 0 .5, 1 .3, 2 .29, 6 .261, 4 .21 | 3 .10, 8 .0945, 9 .0735, 5 .045, 7 .0145
        (6, [7, 0, 1, 2, 0, 0], [-1, 0, 0, 1, 2, 3]),
        (8, [7, 0, 1, 2, 1, 0, 0, 0], [-1, 0, 0, 1, 1, 2, 3, 5]),
        (1, [7], [-1]),
        (100, None, None),  # more than the pool: keep all 10
    ],
)
def test_hand_computed_rerank(total_tokens, tokens, parents):
    (scores, pool_parents, _), tree = _draft(_hand_logp, top_k=2, depth=2, root_token=7, total_tokens=total_tokens)
    assert pool_parents.tolist() == [-1, -1, 0, 0, 1, 1, 2, 2, 4, 4]
    if tokens is None:
        assert tree.size == 11 and tree.depth.tolist() == [0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    else:
        assert tree.tokens.tolist() == tokens and tree.parents.tolist() == parents


def test_rerank_ties_go_to_parents_and_shallower_nodes():
    # log p = 0: child 1 ties its parent 0; node 2 (a root child) ties them both.
    scores, parents, tokens = torch.tensor([-1.0, -1.0, -1.0]), torch.tensor([-1, 0, -1]), torch.tensor([5, 6, 7])
    assert rerank(scores, parents, tokens, 9, 2).tokens.tolist() == [9, 5]
    assert rerank(scores, parents, tokens, 9, 3).tokens.tolist() == [9, 5, 6]
    assert rerank(scores, parents, tokens, 9, 3).parents.tolist() == [-1, 0, 1]


@pytest.mark.parametrize("seed", range(6))
def test_rerank_random_pools_are_ancestor_closed_and_best(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab, top_k, depth = 12, 3 + seed % 3, 2 + seed % 4
    rows: dict[int, torch.Tensor] = {}

    def logp_of(i: int) -> torch.Tensor:
        if i not in rows:  # some rows nearly one-hot, so log p rounds to 0 and scores tie exactly
            sharp = 60.0 if torch.rand(1, generator=gen) < 0.3 else 1.5
            rows[i] = torch.log_softmax(sharp * torch.randn(vocab, generator=gen), -1)
        return rows[i]

    for total in [1, 2, 8, 25, 60]:
        (scores, pool_parents, pool_tokens), tree = _draft(logp_of, top_k, depth, 3, total)
        assert tree.size == min(total, len(scores) + 1)
        # recover each kept node's pool index by walking from the root: tokens are distinct among siblings
        pool_index, kids = {0: -1}, children(tree)
        for node in range(tree.size):
            for kid in kids[node]:
                match = ((pool_parents == pool_index[node]) & (pool_tokens == tree.tokens[kid])).nonzero().flatten()
                assert len(match) == 1
                pool_index[kid] = int(match[0])
        kept = torch.tensor(sorted(pool_index.values())[1:], dtype=torch.long)
        dropped = torch.ones(len(scores), dtype=torch.bool)
        dropped[kept] = False
        if len(kept) and dropped.any():
            assert scores[kept].min() >= scores[dropped].max()  # the best total-1 by score
        assert (tree.parents[1:] < torch.arange(1, tree.size)).all()  # make_tree also checks this


# --- EAGLE-1 static shape --------------------------------------------------------------------


def test_static_shape_mc_sim_7b_63():
    parents, rank = static_shape(MC_SIM_7B_63)
    assert len(MC_SIM_7B_63) == 25 and parents.shape == rank.shape == (26,)
    depth = make_tree(torch.zeros(26, dtype=torch.long), parents).depth
    assert torch.bincount(depth).tolist() == [1, 4, 8, 8, 3, 2]
    assert rank[:5].tolist() == [-1, 0, 1, 2, 3] and parents[:5].tolist() == [-1, 0, 0, 0, 0]
    # every node's path of ranks, read back through the parents, is its choice
    paths = []
    for i in range(1, 26):
        path, j = [], i
        while j > 0:
            path.append(int(rank[j]))
            j = int(parents[j])
        paths.append(tuple(reversed(path)))
    assert sorted(paths) == sorted(MC_SIM_7B_63)


def test_static_shape_rejects_orphans_and_repeats():
    assert static_shape([(1,), (0,), (0, 0)])[0].tolist() == [-1, 0, 0, 1]  # sorted: (0,), (1,), (0, 0)
    for bad in ([(0, 0)], [(0,), (0,)], [()]):
        with pytest.raises(ValueError):
            static_shape(bad)


def test_log_probs_are_nonpositive_so_scores_never_rise():
    # the premise of rerank's ancestor closure, in float32 log_softmax
    logp = torch.log_softmax(torch.randn(1000, 50) * 30, -1)
    assert (logp <= 0).all() and math.isclose(float(logp.exp().sum(-1).mean()), 1.0, rel_tol=1e-5)


def test_graft_keeps_a_copied_chain_through_the_rerank():
    """Pool.graft: a chain that starts on the head's best child and leaves its candidates after it
    survives a rerank that keeps only a few nodes; the head's candidate on the path is reused, the
    rest appended, and the kept set is still a tree (parents first)."""
    root_logp = torch.log_softmax(torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0]), -1)
    pool = Pool(root_logp, 3, lambda ids: ids + 100)              # draft column c is token 100 + c
    pool.expand(torch.log_softmax(torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0]] * 3), -1))  # children 100-102
    appended = pool.graft([100, 105, 104])                        # 105 scored low under 100: not a candidate
    assert appended == [False, True, True]
    tree = pool.rerank(7, 5)                                      # the root and 4 nodes
    nodes = chain_nodes(tree, [100, 105, 104])
    assert len(nodes) == 3 and tree.tokens[nodes].tolist() == [100, 105, 104]
    assert tree.parents[nodes].tolist() == [0, nodes[0], nodes[1]]
