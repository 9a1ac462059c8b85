"""The EAGLE drafter: an EAGLE-1/2/3 head grows an EAGLE-2 dynamic tree from the target's features.

The head reads pairs (target feature at position t, token at t+1) and predicts the feature at
t+1, hence the distribution of the token at t+2. Its KV cache holds only pairs built from real
target features of committed tokens; tree nodes are written after those while drafting and
forgotten at the end of the round, where the next round writes over them (EAGLE's `stable_kv`).
The head's forward runs through core/runtime/head_step.py: a preallocated cache and, when compiling, one
graph per step size.

One round of drafting (eagle.md 4.1), with H the head's hidden size and Vd its vocabulary:
  1. catch up: feed the K pairs the last round committed; the last output scores the root's children;
  2. expand `depth` times: feed the top_k frontier nodes together, each paired with its parent's
     head output, each seeing only its own ancestors; every node proposes top_k children;
  3. rerank the whole pool by cumulative log-probability and keep total_tokens - 1 nodes.
With `best_first` (a slow target), steps 2-3 are SpecExec's instead: up to `depth` head steps, each
feeding the top_k best unexpanded nodes of the pool's best total_tokens - 1 (core/spec/specexec.py).

A copy round (TreeConfig.copy) replaces all three where the context's last 2-3 tokens appeared
earlier in it: the chain of what followed them then (prompt lookup), with no head step. A 135M
model's answers quote their prompt and repeat themselves, and there a copied chain of 3 is accepted
~1.6 tokens a round against the head's one-token draft's ~0.56. The head catches up on the skipped
pairs in the next round's one step.

It knows nothing about text; it sees token ids, target features and the head.
"""

import copy
from dataclasses import replace

import torch

from core.config import PLANNED_CONTEXT
from core.config import TreeConfig
from core.runtime.head_step import HeadStep
from core.runtime.memory import storage, tensor_bytes
from core.spec.drafters import LookupConfig, PromptLookupDrafter
from core.spec.specexec import BRANCH, HeadFeed, grow_best_first
from core.spec.tree import Draft, DraftTree, Pool, chain_nodes, chain_tree, make_tree, rerank, static_shape
from models.cpu_quant import quantized
from models.errors import UnsupportedModelError
from models.heads import vocab_rows

RANKED = 10  # root drafts ranked for the tuner's acceptance model (core/tune/shapes.py RANKS)
GRAFT_TOKENS = 8   # a copied chain grafted into a big tree (`graft_chain`): prompt lookup's own draft length


class EagleDrafter:
    name = "eagle"

    def __init__(self, head, num_target_layers: int, tree: TreeConfig, draft_vocab: torch.Tensor | None = None,
                 context: int = PLANNED_CONTEXT):
        self.head = head
        # An EAGLE-1 head scores the whole target vocabulary through the target's LM head: on a small
        # model that matrix is a large share of all weights (SmolLM2-135M: 28M of 135M). With a draft
        # vocabulary (ids (Vd,)) only its rows are read: drafts are restricted to it, and the target
        # still verifies every token, so output is unchanged.
        self.vocab_ids, self.vocab_head = None, None
        if draft_vocab is not None:
            assert head.config.kind == "eagle1", "an EAGLE-3 head carries its own draft vocabulary"
            self.vocab_ids = draft_vocab.to(head.target.lm_head.weight.device)
            self.vocab_head = vocab_rows(head.target.lm_head, self.vocab_ids)   # (Vd, H)
        self.feature_layers = head.feature_layers(num_target_layers)
        self.step = HeadStep(head, self.log_probs, context)  # eager until graphs are adopted
        self.head_len = 0   # pairs (feature t, token t+1) for t < head_len are in the head cache
        self.unseen: torch.Tensor | None = None   # (K, F) features of committed tokens a copy round skipped
        self.lookup = PromptLookupDrafter(LookupConfig(branches=1))
        self.reshape(tree)

    def shrink(self, quant: str) -> None:
        """Small weights for drafting on a CPU: the head's (models/heads.py `shrink`) and the draft
        vocabulary's rows, read once per head step. Drafts only: the target still verifies."""
        self.head.shrink(quant)
        if self.vocab_head is not None:
            self.vocab_head = quantized(self.vocab_head, quant)

    def reshape(self, tree: TreeConfig) -> None:
        """Draft trees of another shape from the next round on (the tuner re-plans between turns)."""
        fed = len(tree.choices) if tree.choices is not None else tree.depth * tree.top_k
        if fed > self.step.room:
            raise UnsupportedModelError(f"A tree of depth {tree.depth} and top-k {tree.top_k} feeds the head {fed} "
                                        f"nodes a round; it has room for {self.step.room}. Lower --depth or --top-k.")
        self.tree = tree
        self.static = None if tree.choices is None else static_tree_shape(tree.choices)

    def sibling(self, tree: TreeConfig) -> "EagleDrafter":
        """A drafter of another shape on this one's head, draft vocabulary and step (its cache and
        compiled graphs), for engines that take turns on one runner, as the bench's do: each starts
        its chat afresh, so the shared cache holds only the running one's pairs."""
        twin = copy.copy(self)
        twin.lookup = PromptLookupDrafter(twin.lookup.cfg)   # its own index of its own chat
        twin.reshape(tree)
        twin.rewind(0)
        return twin

    def rewind(self, common: int) -> int:
        # Pair t needs tokens 0..t+1 unchanged, so pairs t < common - 1 survive. The target must
        # re-encode from there on: the head needs its features for the pairs it lost.
        self.head_len = min(self.head_len, max(common - 1, 0))
        self.unseen = None   # the target re-encodes from head_len on: its features come fresh
        self.lookup.rewind(common)
        return self.head_len

    @property
    def feature_widths(self) -> tuple[int, ...]:
        """The widths of the features the head step is fed: the target's, and its own outputs'."""
        c = self.head.config
        return tuple(dict.fromkeys((len(self.feature_layers) * c.target_width, c.hidden_size)))

    def warm_up(self, report=None) -> None:
        """Compile the head's step for every bucket and feature width here (core/runtime/head_step.py), then start over."""
        self.step.warm_up(self.feature_widths, report)
        self.rewind(0)

    def graph_jobs(self):
        """What a CPU precompiles of this drafter (core/runtime/graphs.py)."""
        return self.step.graph_jobs(self.feature_widths)

    @torch.inference_mode()
    def prime(self, context: list[int], fresh):
        """Take in the prompt's pairs in the prefill's step, all but the last (the first draft
        feeds it and grows its tree from its output): a prompt's pairs are prefill work. Left to
        the first round, they read as a draft ten times the profile's to the tuner's draft clock
        and as a burst of other work to the meter, which then overstated plain decoding's time by
        ~18% (a long prompt's EAGLE answers shown 1.2x for 0.86x). No draft reads these pairs'
        outputs, so only their keys and values are written (`remember`)."""
        k = fresh.features.shape[0]
        assert self.unseen is None and self.head_len == len(context) - 1 - k, (self.head_len, len(context), k)
        if k > 1:
            self.remember(fresh.features[:-1], context[-k:-1])
        self.lookup.prime(context, fresh)   # copy rounds' index of the prompt
        return replace(fresh, features=fresh.features[-1:])

    @torch.inference_mode()
    def draft(self, context: list[int], fresh) -> Draft:
        features = fresh.features if self.unseen is None else torch.cat([self.unseen, fresh.features])  # (K, F)
        k = features.shape[0]
        assert self.head_len == len(context) - 1 - k, (self.head_len, len(context), k)
        copied = self.copy_round(context, features)
        if copied is not None:
            return copied
        self.unseen = None
        last, last_logp = self.catch_up(features, context[-k:])   # (H,), (Vd,)
        if self.static is None:  # drafted nodes stay past head_len: the next round writes over them
            # The root's best RANKED drafts, tree or not: the tuner learns how often the target picks
            # each rank, including ranks this round's tree left out (path_offers).
            ranking = self.to_target_ids(last_logp.topk(min(RANKED, last_logp.shape[-1])).indices)  # (R,)
            tree, grafted = self.grow(context, last, last_logp)
            return Draft(tree, tuple(ranking.tolist()), grafted=grafted)  # after the rerank brought the tree over: no extra wait
        return Draft(self.grow_static(context[-1], last, last_logp))

    def copy_round(self, context: list[int], features: torch.Tensor) -> Draft | None:
        """A copy round's draft, its chain copied from the context, or None: copying is off, nothing
        matches, or the pairs the head would catch up on next round (these K, and the round's
        accepted tokens and bonus) could outgrow its step's largest bucket (two reference rounds
        between can still add two: that catch-up then runs eagerly). features (K, F): the committed
        rows the head has not seen, kept for that catch-up."""
        # Only in place of a tree no bigger than the copied chain (a CPU's one- to three-token drafts):
        # where verifying more tokens costs little (a GPU, an offloaded target's SpecExec trees), the
        # round's tree accepts more than a copy. Never for EAGLE-1's static tree, asked for as such.
        t = self.tree
        if not t.copy_sized or self.static is not None or features.shape[0] + t.copy + 1 > max(self.step.buckets):
            return None
        found = self.lookup.continuations(context)
        if not found:
            return None
        self.unseen = features
        return Draft(chain_tree(context[-1], found[0][: t.copy]), copied=True)

    def remember(self, features: torch.Tensor, next_tokens: list[int]) -> None:
        """Put committed pairs (features (K, F), tokens (K,)) in the head's cache, computing only
        their keys and values: at 2,400 prompt pairs 0.23 -> ~0.03 s on the 2-core EPYC."""
        K, device = features.shape[0], features.device
        positions = torch.arange(self.head_len, self.head_len + K, device=device)           # (K,)
        self.step.remember(features, torch.tensor(next_tokens, device=device), positions, self.head_len)
        self.head_len += K

    def catch_up(self, features: torch.Tensor, next_tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the committed pairs (features (K, F), tokens (K,)); -> the last output (H,) and its
        draft log-probs (Vd,)."""
        K, device = features.shape[0], features.device
        positions = torch.arange(self.head_len, self.head_len + K, device=device)           # (K,)
        causal = torch.ones(K, K, dtype=torch.bool, device=device).tril()
        out, logp = self.step.feed(features, torch.tensor(next_tokens, device=device), positions, causal, self.head_len,
                                   last_only=True)
        self.head_len += K
        return out[-1], logp[0]

    def graft_chain(self, context: list[int]) -> list[int]:
        """What the context's last 2-3 tokens were followed by earlier in it (prompt lookup), to graft
        into an EAGLE-2 tree too big for a copy round (`copy_round`): where an answer quotes its
        prompt or repeats itself, the copy runs on past the head's depth. Up to GRAFT_TOKENS, at most
        half the tree's drafted nodes; none where copying is off."""
        t = self.tree
        if not t.copy or t.copy_sized:
            return []
        found = self.lookup.continuations(context)
        return found[0][: min(GRAFT_TOKENS, (t.total_tokens - 1) // 2)] if found else []

    def grow(self, context: list[int], root_out: torch.Tensor,
             root_logp: torch.Tensor) -> tuple[DraftTree, tuple[int, ...]]:
        """EAGLE-2's dynamic tree from the root's (context[-1]'s) head output and its log-probs (a chain
        for top_k 1), or SpecExec's best-first tree (`best_first`: a slow target's big trees); -> the
        tree and the nodes a chain copied from the context added (EAGLE-2 trees only: `graft_chain`)."""
        root = context[-1]
        if self.tree.best_first:
            return self.grow_best_first(root, root_out, root_logp), ()
        if self.tree.top_k == 1:
            return self.grow_chain(root, root_out, root_logp), ()
        return self.grow_tree(root, root_out, root_logp, self.graft_chain(context))

    def grow_tree(self, root: int, root_out: torch.Tensor, root_logp: torch.Tensor,
                  chain: list[int]) -> tuple[DraftTree, tuple[int, ...]]:
        """EAGLE-2's expand-then-rerank, a copied `chain` grafted in before the rerank (Pool.graft);
        -> the tree and the nodes the chain added, not the head's."""
        top_k, device = self.tree.top_k, root_out.device
        pool = Pool(root_logp, top_k, self.to_target_ids)
        parent_out = root_out[None].expand(top_k, -1)                           # (k, H)
        ancestors = torch.eye(top_k, dtype=torch.bool, device=device)           # (k, fed) tree block
        for level in range(self.tree.depth):
            out, logp = self.feed_frontier(pool.frontier_tokens(), parent_out, ancestors, level)  # (k, H), (k, Vd)
            chosen_parent = pool.expand(logp)                                   # (k,) slots 0..k-1
            parent_out = out[chosen_parent]
            ancestors = torch.cat([ancestors[chosen_parent], torch.eye(top_k, dtype=torch.bool, device=device)], 1)
        appended = pool.graft(chain)
        tree = pool.rerank(root, self.tree.total_tokens)
        return tree, tuple(node for node, new in zip(chain_nodes(tree, chain), appended) if new)

    def grow_best_first(self, root: int, root_out: torch.Tensor, root_logp: torch.Tensor) -> DraftTree:
        """SpecExec's tree (core/spec/specexec.py): the best total_tokens - 1 nodes by cumulative
        log-prob, grown in at most `depth` head steps of `top_k` nodes each (reshape keeps
        depth x top_k within the head cache's draft rows, `step.room`)."""
        t = self.tree
        feed = HeadFeed(self.step, self.head_len, root_out, self.to_target_ids)
        pool = grow_best_first(root_logp, feed, t.total_tokens - 1, t.top_k, BRANCH, t.depth)
        return rerank(pool.scores, pool.parents, self.to_target_ids(pool.tokens), root, t.total_tokens)

    def grow_chain(self, root: int, out: torch.Tensor, logp: torch.Tensor) -> DraftTree:
        """EAGLE-2 with top_k 1: each level's best child. Scores only fall along a chain, so the
        rerank would keep its first total_tokens - 1 nodes in order: feed no more levels than those,
        and skip the rerank (0.3 ms of a 2.7 ms chain draft on a 2-core CPU)."""
        length = min(self.tree.depth + 1, self.tree.total_tokens - 1)
        tokens = []
        for level in range(length):
            tokens.append(self.to_target_ids(logp.argmax(-1, keepdim=True)))                 # (1,) target id
            if level + 1 < length:
                ancestors = torch.ones(1, level + 1, dtype=torch.bool, device=out.device)    # its whole path
                outs, logps = self.feed_frontier(tokens[-1], out[None], ancestors, level)   # (1, H), (1, Vd)
                out, logp = outs[0], logps[0]
        return chain_tree(root, torch.cat(tokens).tolist())

    def grow_static(self, root: int, root_out: torch.Tensor, root_logp: torch.Tensor) -> DraftTree:
        """EAGLE-1's fixed tree: node i is the rank[i]-th most likely child of its parent. The head
        is fed one depth at a time, like a frontier that holds the whole level."""
        shape, rank = self.static
        device = root_out.device
        tokens = torch.full((shape.size,), root, dtype=torch.long, device=device)
        prev_nodes, prev_out, prev_logp, fed = [0], root_out[None], root_logp[None], []  # last fed level
        for d in range(1, shape.max_depth + 1):
            level = (shape.depth == d).nonzero().squeeze(1)          # (n,) nodes at depth d
            slot = torch.tensor([prev_nodes.index(p) for p in shape.parents[level].tolist()], device=device)
            ranked = prev_logp.topk(int(rank[level].max()) + 1, dim=-1).indices  # (n_prev, r)
            tokens[level.to(device)] = self.to_target_ids(ranked[slot, rank[level].to(device)])
            if d == shape.max_depth:
                break
            fed += level.tolist()
            ancestors = shape.ancestor_mask[level][:, fed].to(device)  # (n, fed)
            prev_out, prev_logp = self.feed_frontier(tokens[level.to(device)], prev_out[slot], ancestors, d - 1)
            prev_nodes = level.tolist()
        return make_tree(tokens.cpu(), shape.parents)

    def feed_frontier(self, tokens: torch.Tensor, parent_out: torch.Tensor, ancestors: torch.Tensor,
                      level: int) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens (k,) at depth level+1, parent_out (k, H), ancestors (k, fed) -> outputs (k, H)
        and their draft log-probs (k, Vd). Siblings share a position."""
        positions = torch.full((ancestors.shape[0],), self.head_len + level, device=tokens.device)
        return self.step.feed(parent_out, tokens, positions, ancestors, self.head_len)

    def frontier_steps(self, features: torch.Tensor, next_tokens: list[int], widths: tuple[int, ...]) -> list:
        """After catching up on the pairs (features (K, F), next_tokens (K,)): for each width a
        repeatable head step of that many frontier nodes and its top-k, as a round's first
        expansion runs it (each call writes the same rows). What the latency profile times."""
        out, _ = self.catch_up(features, next_tokens)

        def step(width: int):
            tokens = torch.tensor(next_tokens[:width], device=out.device)
            parent_out = out[None].expand(width, -1)
            ancestors = torch.eye(width, dtype=torch.bool, device=out.device)
            return lambda: self.feed_frontier(tokens, parent_out, ancestors, 0)[1].topk(width, dim=-1)
        return [step(w) for w in widths]

    @property
    def compiled_sizes(self) -> tuple[int, ...]:
        """The head step's row counts that run as graphs (for every feature width); () while it runs eagerly."""
        return tuple(rows for rows in self.step.buckets if all(self.step.has_graph(rows, w) for w in self.feature_widths))

    @property
    def draft_rows(self) -> int:
        """Vd: the draft vocabulary's size, the LM-head rows each head step reads."""
        return self.head.config.draft_vocab_size if self.vocab_ids is None else len(self.vocab_ids)

    def cache_bytes(self) -> int:
        return self.step.nbytes()

    def memory_bytes(self, borrowed: set[int]) -> int:
        """Bytes this drafter holds: the head's own weights (it borrows the target's embedding and
        LM head, whose storages are in `borrowed`), the draft vocabulary's rows and the head's cache."""
        tensors = list(self.head.parameters()) + list(self.head.buffers())
        if self.vocab_head is not None:
            tensors += list(self.vocab_head.parameters()) + list(self.vocab_head.buffers())
        return tensor_bytes([t for t in tensors if storage(t)[0] not in borrowed]) + self.cache_bytes()

    def log_probs(self, out: torch.Tensor) -> torch.Tensor:
        """out (k, H) -> (k, Vd) draft log-probabilities, normalised over the draft vocabulary."""
        if self.vocab_head is None:
            logits = self.head.draft_logits(out)
        else:
            logits = self.vocab_head(out)
        return torch.log_softmax(logits.float(), dim=-1)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.head.to_target_ids(draft_ids) if self.vocab_ids is None else self.vocab_ids[draft_ids]


def static_tree_shape(choices) -> tuple[DraftTree, torch.Tensor]:
    """EAGLE-1 choices -> (the tree's shape with placeholder tokens, rank (N,) of each node)."""
    parents, rank = static_shape(choices)
    return make_tree(torch.zeros_like(parents), parents), rank
