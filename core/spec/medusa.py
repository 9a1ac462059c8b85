"""The Medusa drafter: K heads on the target's last feature guess the next K tokens at once.

The feature that chose the root (the last row of `fresh`: the target's output at the position
before it) gives head k's log-probs for the token at depth k + 1 of the tree. The heads never see
the path, so every node at depth d draws its children from the same head's top-k:
  - a static tree (Medusa's sparse `choices`: paths of ranks) takes node (r_0, .., r_d) = head d's r_d-th guess;
  - a dynamic one is EAGLE-2's expand and rerank over those guesses: best-first by the sum of the
    heads' log-probs along a path, the best total_tokens - 1 kept (closed under ancestors).
Verification is the engine's own (greedy: exactly plain decoding's tokens; sampling: exact
rejection), never Medusa's "typical acceptance", which changes the output distribution.

It holds no cache of its own: a round costs D small MLPs on one row (D the tree's depth) and, for
heads that share the target's LM head, one projection of those D rows onto the draft vocabulary.
Dimensions: K heads, D <= K levels drafted, H the target's width, Vd the draft vocabulary (or the
target's), k top-k.
"""

import torch

from core.config import TreeConfig
from core.runtime.memory import storage, tensor_bytes
from core.spec.eagle import RANKED   # the first head's best guesses ranked for the tuner's acceptance model
from core.spec.tree import Draft, DraftTree, Pool, make_tree, static_shape
from models.cpu_quant import quantize_cpu, quantized
from models.errors import UnsupportedModelError
from models.heads import vocab_rows
from models.medusa import MedusaHeads

class MedusaDrafter:
    name = "medusa"

    def __init__(self, heads: MedusaHeads, feature_layers: tuple[int, ...], last_layer: int, tree: TreeConfig,
                 draft_vocab: torch.Tensor | None = None, lm_head: torch.nn.Module | None = None):
        """`lm_head`: the target's, whose draft-vocabulary rows are the projection of heads that share it."""
        if last_layer not in feature_layers:
            raise UnsupportedModelError(f"Medusa heads read the target's last layer ({last_layer}); this engine "
                                        f"captures layers {list(feature_layers)} for its EAGLE head.")
        self.heads = heads
        self.feature_layers = feature_layers  # the runner's: Medusa reads its last-layer slice
        H = heads.config.hidden_size
        start = feature_layers.index(last_layer) * H
        self.columns = slice(start, start + H)
        weight = next(heads.parameters())   # before `shrink`: the heads' own device and dtype
        self.dtype, self.vocab_ids = weight.dtype, None if draft_vocab is None else draft_vocab.to(weight.device)
        if heads.config.shared and lm_head is None:
            raise UnsupportedModelError("These Medusa heads share the target's LM head; pass it to the drafter.")
        self.projection = vocab_rows(lm_head, self.vocab_ids) if heads.config.shared else None   # (Vd, H)
        self.reshape(tree)

    def reshape(self, tree: TreeConfig) -> None:
        deepest = max(map(len, tree.choices)) if tree.choices else tree.depth + 1
        if deepest > self.heads.config.num_heads:
            raise UnsupportedModelError(f"A tree {deepest} tokens deep needs {deepest} Medusa heads; these have "
                                        f"{self.heads.config.num_heads}.")
        self.tree = tree
        self.static = None if tree.choices is None else static_shape(tree.choices)
        self.levels = max(1, deepest if tree.choices else min(deepest, tree.total_tokens - 1))  # heads a draft runs

    def shrink(self, quant: str) -> None:
        """Small weights for drafting on a CPU (models/cpu_quant.py); drafts only, the target checks them."""
        quantize_cpu(self.heads, quant)
        if self.projection is not None:
            self.projection = quantized(self.projection, quant)

    def rewind(self, common: int) -> int:
        return common  # nothing cached: the next draft reads the target's newest feature

    def memory_bytes(self, borrowed: set[int]) -> int:
        tensors = list(self.heads.parameters()) + list(self.heads.buffers())
        if self.projection is not None:
            tensors += list(self.projection.parameters()) + list(self.projection.buffers())
        return tensor_bytes([t for t in tensors if storage(t)[0] not in borrowed])

    def prime(self, context: list[int], fresh):
        return fresh

    @torch.inference_mode()
    def draft(self, context: list[int], fresh) -> Draft:
        feature = fresh.features[-1:, self.columns].to(self.dtype)                  # (1, H)
        out = self.heads(feature, self.levels)[:, 0]                                # (D, Vd), or (D, H) shared
        logits = out if self.projection is None else self.projection(out)          # (D, Vd)
        logp = torch.log_softmax(logits.float(), dim=-1)
        ranking = tuple(self.to_target_ids(logp[0].topk(min(RANKED, logp.shape[-1])).indices).tolist())
        if self.static is not None:
            return Draft(static_medusa_tree(context[-1], logp, *self.static, self.to_target_ids), ranking)
        tree = medusa_tree(context[-1], logp, self.tree.top_k, self.tree.total_tokens, self.to_target_ids)
        return Draft(tree, ranking)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.vocab_ids is None else self.vocab_ids[draft_ids]


def medusa_tree(root: int, logp: torch.Tensor, top_k: int, total_tokens: int, to_target) -> DraftTree:
    """logp (D, Vd): head d's log-probs for depth d + 1 -> the best total_tokens - 1 paths' nodes. Each
    frontier node's children are head d's top_k, scored by the path's sum of log-probs (EAGLE-2's
    expand, with the same child distribution for every parent), then reranked."""
    pool = Pool(logp[0], top_k, to_target)
    for level_logp in logp[1:]:
        pool.expand(level_logp.expand(len(pool.frontier), -1))
    return pool.rerank(root, total_tokens)


def static_medusa_tree(root: int, logp: torch.Tensor, parents: torch.Tensor, rank: torch.Tensor, to_target) -> DraftTree:
    """Medusa's sparse tree: node i at depth d >= 1 is head d-1's rank[i]-th guess."""
    depth = torch.zeros_like(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    ranked = logp.topk(int(rank.max()) + 1, dim=-1).indices.cpu()                   # (K, r)
    drafted = to_target(ranked[depth[1:] - 1, rank[1:]].to(logp.device)).cpu()       # (N-1,)
    return make_tree(torch.cat([torch.tensor([root]), drafted]), parents)
