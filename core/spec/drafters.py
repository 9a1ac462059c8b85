"""Drafters: what proposes the tree each round. The verifier treats them all alike.

- PlainDrafter: proposes nothing (a tree of just the root): plain decoding, the baseline.
- PromptLookupDrafter: n-gram lookup in the prompt and the answer so far; needs no head.
- EagleDrafter (core/spec/eagle.py): an EAGLE head reading the target's features.

Drafters see token ids and target outputs; they know nothing about text or the UI.
"""

from collections import defaultdict
from dataclasses import dataclass, replace

import torch

from core.config import TreeConfig
from core.spec.tree import Draft, DraftTree, make_tree, root_only


class PlainDrafter:
    name = "plain"
    feature_layers = None

    def rewind(self, common: int) -> int:
        return common

    def memory_bytes(self, borrowed: set[int]) -> int:
        return 0

    def prime(self, context: list[int], fresh):
        return fresh

    def draft(self, context: list[int], fresh) -> Draft:
        return Draft(root_only(context[-1]))


@dataclass(frozen=True)
class LookupConfig:
    # Defaults from a grid on MT-bench (8 prompts, 2-core CPU): 1-gram matches are mostly wrong
    # and every extra verified token costs ~1 ms there, so short, confident trees win.
    max_ngram: int = 3        # longest suffix to look up; shorter ones are tried when it misses
    min_ngram: int = 2
    num_tokens: int = 8       # draft length per continuation (the tree's depth)
    branches: int = 2         # distinct earlier continuations merged into one tree


class PromptLookupDrafter:
    """Prompt lookup decoding: if the context's last n tokens appeared before, what followed them
    then is a good guess now. The latest `branches` distinct continuations of the longest
    matching suffix are merged into a trie, so one verify checks them all.

    An index from every n-gram to the positions that follow it is extended incrementally, so a
    round costs O(new tokens), not O(context)."""

    name = "prompt_lookup"
    feature_layers = None

    def __init__(self, cfg: LookupConfig = LookupConfig()):
        self.cfg = cfg
        self.rewind(0)

    def rewind(self, common: int) -> int:
        # A new prompt is indexed from scratch on its first draft: O(prompt) once per turn.
        self.index: dict[tuple[int, ...], list[int]] = defaultdict(list)
        self.indexed = 1        # positions end < indexed are in the index
        return common

    def memory_bytes(self, borrowed: set[int]) -> int:
        return 0  # its index lives in Python objects, a few bytes per token of the chat

    def prime(self, context: list[int], fresh):
        self._extend(context)   # index the prompt now: O(prompt), prefill work
        return fresh

    def _extend(self, context: list[int]) -> None:
        """Index every n-gram that ends just before a position we have not indexed yet; within one
        generation the context only grows, so this touches the new tokens only."""
        for end in range(self.indexed, len(context)):
            for n in range(self.cfg.min_ngram, min(self.cfg.max_ngram, end) + 1):
                self.index[tuple(context[end - n:end])].append(end)  # context[end] followed this n-gram
        self.indexed = max(self.indexed, len(context))

    def continuations(self, context: list[int]) -> list[list[int]]:
        self._extend(context)
        for n in range(min(self.cfg.max_ngram, len(context)), self.cfg.min_ngram - 1, -1):
            found: list[list[int]] = []
            for start in reversed(self.index.get(tuple(context[-n:]), ())):  # most recent first
                cont = context[start:start + self.cfg.num_tokens]
                if cont not in found:
                    found.append(cont)
                if len(found) == self.cfg.branches:
                    break
            if found:
                return found
        return []

    def draft(self, context: list[int], fresh) -> Draft:
        return Draft(trie_tree(context[-1], self.continuations(context)))

    @property
    def tree(self) -> TreeConfig:
        """The largest tree it drafts, as the tuner names shapes: `branches` chains of num_tokens."""
        return TreeConfig(depth=self.cfg.num_tokens - 1, top_k=self.cfg.branches,
                          total_tokens=1 + self.cfg.num_tokens * self.cfg.branches)

    def reshape(self, tree: TreeConfig) -> None:
        """Draft the tuner's chain (core/tune/shapes.py `TreeRival`): one continuation of
        total_tokens - 1 tokens, as long as a verify of that many pays on this machine."""
        if tree.top_k != 1 or tree.total_tokens < 2:
            raise ValueError(f"prompt lookup drafts chains; got {tree}")
        self.cfg = replace(self.cfg, num_tokens=tree.total_tokens - 1, branches=1)


def trie_tree(root: int, sequences: list[list[int]]) -> DraftTree:
    """Merge token sequences that all continue `root` into a tree sharing common prefixes."""
    tokens, parents, child = [root], [-1], {}
    for seq in sequences:
        node = 0
        for tok in seq:
            if (node, tok) not in child:
                child[(node, tok)] = len(tokens)
                tokens.append(tok)
                parents.append(node)
            node = child[(node, tok)]
    return make_tree(torch.tensor(tokens), torch.tensor(parents))
