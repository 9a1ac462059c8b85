"""core/spec/verify.py: greedy acceptance on hand-built cases; sampled acceptance is lossless."""

import pytest
import torch

from core.spec.tree import DraftTree, chain_tree, make_tree, root_only
from core.spec.verify import Acceptance, accept_greedy, accept_sampled, top2_margins


def _logits_with_argmax(target_next: list[int], vocab: int = 6) -> torch.Tensor:
    """(N, V) logits whose row i has its maximum at target_next[i]."""
    logits = torch.randn(len(target_next), vocab, generator=torch.Generator().manual_seed(1))
    logits[torch.arange(len(target_next)), torch.tensor(target_next)] = 10.0
    return logits


# --- greedy ----------------------------------------------------------------------------------

#        0:r
#       /   \
#     1:1   2:2
#     /  \
#   3:3  4:1
#    |
#   5:2
TREE = make_tree([0, 1, 2, 3, 1, 2], [-1, 0, 0, 1, 1, 3])


@pytest.mark.parametrize(
    "target_next, nodes, new_tokens",
    [
        ([1, 3, 0, 2, 0, 4], [0, 1, 3, 5], [1, 3, 2, 4]),  # whole deepest path, then the bonus
        ([1, 3, 0, 5, 0, 4], [0, 1, 3], [1, 3, 5]),        # stops at the first wrong draft
        ([1, 1, 0, 2, 0, 4], [0, 1, 4], [1, 1, 0]),        # the other branch
        ([2, 3, 5, 2, 0, 4], [0, 2], [2, 5]),              # leaf accepted: bonus from the leaf row
        ([4, 3, 0, 2, 0, 4], [0], [4]),                    # nothing matches: only the bonus
    ],
)
def test_greedy_longest_matching_path(target_next, nodes, new_tokens):
    acc = accept_greedy(TREE, _logits_with_argmax(target_next))
    assert acc.nodes.tolist() == nodes and acc.new_tokens == new_tokens
    assert acc.accepted == len(nodes) - 1 and acc.nodes.dtype == torch.long


def test_greedy_full_chain_accepts_its_depth():
    chain = chain_tree(0, [1, 2, 3, 4])
    acc = accept_greedy(chain, _logits_with_argmax([1, 2, 3, 4, 5]))
    assert acc.accepted == chain.max_depth == 4 and acc.new_tokens == [1, 2, 3, 4, 5]
    assert accept_greedy(root_only(0), _logits_with_argmax([3])).new_tokens == [3]


def test_greedy_duplicate_siblings_take_the_longer_path():
    # root children 1 and 2 both hold token 1; only node 2 has a matching child
    tree = make_tree([0, 1, 1, 2], [-1, 0, 0, 2])
    acc = accept_greedy(tree, _logits_with_argmax([1, 5, 2, 3]))
    assert acc.nodes.tolist() == [0, 2, 3] and acc.new_tokens == [1, 2, 3]
    # equal lengths: the lowest node index wins
    acc = accept_greedy(tree, _logits_with_argmax([1, 5, 4, 3]))
    assert acc.nodes.tolist() == [0, 1] and acc.new_tokens == [1, 5]


def test_greedy_argmax_ties_follow_torch_argmax():
    logits = torch.zeros(3, 6)
    logits[0, [1, 3]] = 5.0  # tie between tokens 1 and 3: torch.argmax (and plain greedy) pick 1
    tree = make_tree([0, 3, 1], [-1, 0, 0])
    assert accept_greedy(tree, logits).nodes.tolist() == [0, 2]


# --- sampled: exactness checks ---------------------------------------------------------------


def _tree_hitting_argmax(gen: torch.Generator, n: int, best: list[int], vocab: int) -> DraftTree:
    """n random nodes with distinct sibling tokens; a child is best[parent] (the target's argmax
    after its parent) 70% of the time, so paths of several accepted drafts are common."""
    parents, tokens = [-1], [0]
    for i in range(1, n):
        parent = int(torch.randint(i, (1,), generator=gen))
        taken = {tokens[c] for c in range(1, i) if parents[c] == parent}
        free = [t for t in range(vocab) if t not in taken]
        pick = free[int(torch.randint(len(free), (1,), generator=gen))]
        if torch.rand(1, generator=gen) < 0.7 and best[parent] in free:
            pick = best[parent]
        parents.append(parent)
        tokens.append(pick)
    return make_tree(tokens, parents)


def test_one_hot_sampling_agrees_with_greedy():
    gen, vocab = torch.Generator().manual_seed(0), 8
    depths = []
    for trial in range(200):
        n = 1 + trial % 15
        logits = torch.randn(n, vocab, generator=gen)
        tree = _tree_hitting_argmax(gen, n, logits.argmax(-1).tolist(), vocab)
        greedy = accept_greedy(tree, logits)
        sampled = accept_sampled(tree, torch.nn.functional.one_hot(logits.argmax(-1), vocab).float(), gen)
        assert sampled.nodes.tolist() == greedy.nodes.tolist() and sampled.new_tokens == greedy.new_tokens
        depths.append(greedy.accepted)
    assert max(depths) >= 3  # the comparison covered long accepted paths


def test_zero_probability_drafts_are_never_accepted():
    probs = torch.tensor([[0.6, 0.4, 0.0, 0.0]]).repeat(4, 1)  # (N, V): tokens 2 and 3 impossible
    tree = make_tree([0, 2, 3, 2], [-1, 0, 0, 0])  # every root child has p = 0 under row 0
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        acc = accept_sampled(tree, probs, gen)
        assert acc.accepted == 0 and acc.new_tokens[0] in (0, 1)


def test_certain_drafts_are_always_accepted_and_seeds_repeat():
    probs = torch.eye(4)[[1, 2, 3, 0]]  # row i: the next token after node i is certain
    tree = chain_tree(0, [1, 2, 3])     # each draft is that certain token
    acc = accept_sampled(tree, probs, torch.Generator().manual_seed(3))
    assert acc.nodes.tolist() == [0, 1, 2, 3] and acc.new_tokens == [1, 2, 3, 0]
    probs = torch.softmax(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)), -1)
    runs = [accept_sampled(tree, probs, torch.Generator().manual_seed(7)) for _ in range(2)]
    assert runs[0].nodes.tolist() == runs[1].nodes.tolist() and runs[0].new_tokens == runs[1].new_tokens


# --- sampled: the distribution of emitted tokens ---------------------------------------------

# A toy target over V = 4 tokens: the next token depends on the previous one, P[prev, next].
TARGET = torch.tensor(
    [
        [0.50, 0.25, 0.15, 0.10],
        [0.10, 0.60, 0.20, 0.10],
        [0.25, 0.25, 0.25, 0.25],
        [0.05, 0.15, 0.30, 0.50],
    ]
)
ROOT = 0
TRIALS = 6000
P_THRESHOLD = 1e-4


def _by_rank(prev: int) -> list[int]:
    return TARGET[prev].argsort(descending=True, stable=True).tolist()


def _shape(name: str, root: int) -> tuple[list[int], list[int]]:
    """(tokens, parents) of a toy draft tree rooted at `root`; drafts follow the target's ranks."""
    r = _by_rank(root)
    if name == "chain_likely":
        t1 = r[0]
        t2 = _by_rank(t1)[0]
        return [root, t1, t2, _by_rank(t2)[0]], [-1, 0, 1, 2]
    if name == "wide":  # all four tokens, each with its two most likely children
        kids = [k for t in r for k in _by_rank(t)[:2]]
        return [root, *r, *kids], [-1, 0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    if name == "duplicates":  # repeated siblings at both levels
        a, b = r[0], r[1]
        return [root, a, a, b, a, _by_rank(a)[0], _by_rank(a)[0], _by_rank(a)[1]], [-1, 0, 0, 0, 0, 1, 1, 2]
    if name == "unlikely":  # the least likely drafts
        lo1, lo2 = r[-1], r[-2]
        return [root, lo1, lo2, _by_rank(lo1)[-1], _by_rank(lo2)[-1]], [-1, 0, 0, 1, 2]
    gen = torch.Generator().manual_seed(100 + root)  # "random": 10 nodes, random tokens and parents
    parents = [-1] + [int(torch.randint(i, (1,), generator=gen)) for i in range(1, 10)]
    return [root, *torch.randint(4, (9,), generator=gen).tolist()], parents


def _drafter(name: str) -> dict[int, tuple[DraftTree, torch.Tensor]]:
    """context token -> (tree, target rows): row i of the target is P[tokens[i]]."""
    out = {}
    for root in range(4):
        tree = make_tree(*_shape(name, root))
        out[root] = tree, TARGET[tree.tokens]
    return out


def _first_two_counts(accept, drafter, gen: torch.Generator) -> torch.Tensor:
    """Run rounds until two tokens are emitted after ROOT, TRIALS times: (V, V) counts of (t1, t2)."""
    counts = torch.zeros(4, 4)
    for _ in range(TRIALS):
        context, emitted = ROOT, []
        while len(emitted) < 2:
            tree, probs = drafter[context]
            emitted += accept(tree, probs, gen).new_tokens
            context = emitted[-1]
        counts[emitted[0], emitted[1]] += 1
    return counts


def _chi_square_p(counts: torch.Tensor) -> float:
    """Pearson chi-square against P(t1, t2) = P[ROOT, t1] P[t1, t2]; 15 degrees of freedom."""
    expected = counts.sum() * TARGET[ROOT][:, None] * TARGET  # (V, V), every cell >= 6000 * 0.005 = 30
    stat = ((counts - expected) ** 2 / expected).sum().double()
    dof = torch.tensor(counts.numel() - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))  # P(chi2_dof >= stat)


@pytest.mark.parametrize("shape", ["chain_likely", "wide", "duplicates", "unlikely", "random"])
def test_sampled_acceptance_keeps_the_target_distribution(shape):
    """Lossless sampling (DESIGN invariant 3) on a 4-token toy target, first two emitted tokens.

    Statistic: Pearson chi-square of the 16 (t1, t2) counts over 6000 seeded trials against the
    exact P[ROOT, t1] * P[t1, t2]; 15 degrees of freedom. Fails if the p-value < 1e-4, so a correct
    verifier fails one shape about 1 run in 10,000 (the 5 shapes together: about 1 in 2,000). The
    seed is fixed, so the outcome is deterministic. The next test shows the same harness rejects a
    verifier with a subtle bug (bonus drawn from p instead of the residual): p-value ~1e-200.
    """
    counts = _first_two_counts(accept_sampled, _drafter(shape), torch.Generator().manual_seed(1234))
    assert _chi_square_p(counts) > P_THRESHOLD, counts


def test_chi_square_harness_catches_a_subtly_wrong_verifier():
    def bonus_from_full_row(tree, probs, gen) -> Acceptance:  # forgets to zero the rejected drafts
        acc = accept_sampled(tree, probs, gen)
        bonus = int(torch.multinomial(probs[int(acc.nodes[-1])], 1, generator=gen))
        return Acceptance(acc.nodes, [*acc.new_tokens[:-1], bonus])

    counts = _first_two_counts(bonus_from_full_row, _drafter("wide"), torch.Generator().manual_seed(1))
    assert _chi_square_p(counts) < P_THRESHOLD


def test_greedy_acceptance_brings_every_rows_top2_margin_to_the_host():
    """accept's one transfer carries each row's margin too: near-ties need no second sync. The
    margins are those of the rows that chose the new tokens (the path's), as host floats."""
    tree = make_tree([5, 6, 7, 8], [-1, 0, 1, 0])
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(0))
    logits[0, 6], logits[1, 7] = 9.0, 9.0                     # the chain 5 -> 6 -> 7 is accepted
    acc = accept_greedy(tree, logits)
    top = logits.topk(2, dim=-1).values
    assert acc.path == (0, 1, 2) and acc.nodes.tolist() == [0, 1, 2] and len(acc.margins) == len(acc.new_tokens)
    assert all(isinstance(m, float) for m in acc.margins)
    assert torch.allclose(torch.tensor(acc.margins, dtype=torch.float64), (top[:3, 0] - top[:3, 1]).double())
    assert acc.margins == tuple(top2_margins(logits)[:3].tolist())
