"""The engine: the one stateful object. It owns the target, the drafter, the KV cache and the RNG.

It sees token ids only and knows nothing about text, chat templates or the UI. `generate` is a
generator of `StepResult`s; each round reads draft -> verify -> accept -> commit, whatever the
drafter (plain decoding is the drafter that proposes nothing: a tree of just the root).

Cache invariant between rounds: the cache holds the KV of every committed token except the
newest one, the root, which the next round feeds first. `cached_ids` mirrors it on the host so a
new turn that shares a prefix with the last one (a chat's history) skips re-encoding it.
"""

import os
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch

from core.config import SamplingConfig
from core.errors import ContextOverflowError, OutOfMemoryError
from core.kv import SlabCache
from core.sampling import sample, target_probs
from core.tree import DraftTree, root_only, tree_attention_mask, tree_position_ids
from core.verify import Acceptance, accept_greedy, accept_sampled
from models.target import Target


@dataclass(frozen=True)
class StepResult:
    new_ids: tuple[int, ...]    # tokens committed this round (accepted drafts + the bonus token)
    accepted: int               # draft tokens accepted this round
    drafted: int                # draft tokens on the longest path offered (0 for plain decoding)
    tree_size: int              # tokens the target verified this round (root included)
    draft_s: float
    verify_s: float
    finish: str | None = None   # "eos" | "length" | None


@dataclass(frozen=True)
class Verified:
    logits: torch.Tensor        # (N, V) target logits after each tree node
    hidden: tuple[torch.Tensor, ...] | None  # the target's hidden states, when the drafter wants features


class Drafter(Protocol):
    """Proposes a tree of continuations of `context` whose root is `context[-1]`."""

    name: str
    needs_hidden: bool

    def draft(self, context: list[int], verified: Verified | None) -> DraftTree: ...

    def commit(self, acceptance: Acceptance, verified: Verified) -> None: ...

    def reset(self) -> None: ...


class PlainDrafter:
    """Plain decoding as a drafter: proposes nothing, so each round verifies the root alone."""

    name = "plain"
    needs_hidden = False

    def draft(self, context: list[int], verified: Verified | None) -> DraftTree:
        return root_only(context[-1])

    def commit(self, acceptance: Acceptance, verified: Verified) -> None:
        pass

    def reset(self) -> None:
        pass


class Engine:
    def __init__(self, target: Target, drafter: Drafter | None = None):
        self.target = target
        self.drafter = drafter or PlainDrafter()
        self.cache = SlabCache()
        self.cached_ids: list[int] = []

    @property
    def device(self) -> torch.device:
        return self.target.device

    def reset(self) -> None:
        self.cache = SlabCache()
        self.cached_ids = []
        self.drafter.reset()

    def generate(self, prompt_ids: list[int], sampling: SamplingConfig,
                 cancel: threading.Event | None = None) -> Iterator[StepResult]:
        if not prompt_ids:
            raise ValueError("generate needs at least one prompt token")
        if len(prompt_ids) >= self.target.context_len:
            raise ContextOverflowError(
                f"The prompt has {len(prompt_ids)} tokens; the model's context holds {self.target.context_len}.")
        seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(4), "little")
        rng = torch.Generator(device=self.device).manual_seed(seed)
        try:
            yield from self._generate(list(prompt_ids), sampling, rng, cancel)
        except torch.OutOfMemoryError as e:
            self.reset()
            raise OutOfMemoryError("Out of memory while generating; try a shorter chat or fewer new tokens.") from e

    def _generate(self, prompt: list[int], sampling: SamplingConfig, rng: torch.Generator,
                  cancel: threading.Event | None) -> Iterator[StepResult]:
        t0 = time.perf_counter()
        verified = self.prefill(prompt)
        first = self.choose(verified.logits[-1], sampling, rng)
        context, produced = prompt + [first], 1
        yield StepResult((first,), 0, 0, len(prompt), 0.0, time.perf_counter() - t0, self.finish(first, produced, len(context), sampling))
        while self.finish(context[-1], produced, len(context), sampling) is None:
            if cancel is not None and cancel.is_set():
                return
            step = self.step(context, verified, sampling, rng)
            verified = step.verified
            new = step.result.new_ids
            # Stop at EOS or the token budget even when the round accepted past it.
            cut = next((i + 1 for i, t in enumerate(new) if t in self.target.eos_ids), len(new))
            cut = min(cut, sampling.max_new_tokens - produced, self.target.context_len - len(context))
            new = new[:cut]
            context += new
            produced += len(new)
            finish = self.finish(context[-1], produced, len(context), sampling)
            yield StepResult(tuple(new), min(step.result.accepted, len(new) - 1), step.result.drafted,
                             step.result.tree_size, step.result.draft_s, step.result.verify_s, finish)

    def finish(self, last: int, produced: int, length: int, sampling: SamplingConfig) -> str | None:
        if last in self.target.eos_ids:
            return "eos"
        if produced >= sampling.max_new_tokens or length >= self.target.context_len:
            return "length"
        return None

    @torch.inference_mode()  # per call, not around the generator: Gradio may resume it on another thread
    def prefill(self, prompt: list[int]) -> Verified:
        """Encode the prompt, reusing the longest prefix already in the cache."""
        reuse = common_prefix(self.cached_ids, prompt[:-1])  # feed at least the last prompt token
        self.cache.truncate(reuse)
        self.cached_ids = self.cached_ids[:reuse]
        self.drafter.reset()
        ids = torch.tensor([prompt[reuse:]], device=self.device)  # (1, T)
        positions = torch.arange(reuse, len(prompt), device=self.device)[None]  # (1, T)
        verified = self.forward(ids, positions, None)
        self.cached_ids = list(prompt)
        return verified

    @torch.inference_mode()
    def step(self, context: list[int], verified: Verified, sampling: SamplingConfig,
             rng: torch.Generator) -> "Round":
        """One speculative round: draft -> verify -> accept -> commit."""
        t0 = time.perf_counter()
        tree = self.drafter.draft(context, verified)
        t1 = time.perf_counter()
        verified = self.verify(tree)
        acceptance = self.accept(tree, verified.logits, sampling, rng)
        self.commit(acceptance, tree, verified)
        t2 = time.perf_counter()
        result = StepResult(tuple(acceptance.new_tokens), acceptance.accepted, tree.max_depth, tree.size, t1 - t0, t2 - t1)
        return Round(result, Verified(verified.logits[acceptance.nodes], kept_hidden(verified.hidden, acceptance.nodes)))

    def verify(self, tree: DraftTree) -> Verified:
        past = len(self.cached_ids)
        ids = tree.tokens.to(self.device)[None]  # (1, N)
        positions = tree_position_ids(tree, past).to(self.device)  # (1, N)
        # A lone root sees the whole past: the model's own causal mask is exact and cheaper.
        mask = None if tree.size == 1 else tree_attention_mask(tree, past, self.target.dtype).to(self.device)
        return self.forward(ids, positions, mask)

    def accept(self, tree: DraftTree, logits: torch.Tensor, sampling: SamplingConfig,
               rng: torch.Generator) -> Acceptance:
        if sampling.greedy:
            return accept_greedy(tree, logits)
        return accept_sampled(tree, target_probs(logits, sampling), rng)

    def commit(self, acceptance: Acceptance, tree: DraftTree, verified: Verified) -> None:
        """Keep the KV of the root and the accepted path; drop the rest of the tree."""
        past = len(self.cached_ids)
        if tree.size > 1:
            self.cache.keep(past, acceptance.nodes)
        self.cached_ids += tree.tokens[acceptance.nodes].tolist()
        self.drafter.commit(acceptance, verified)

    def choose(self, logits: torch.Tensor, sampling: SamplingConfig, rng: torch.Generator) -> int:
        """logits (V,) -> the next token, exactly as a one-node tree would accept it."""
        if sampling.greedy:
            return int(logits.argmax())
        return int(sample(target_probs(logits, sampling), rng))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None) -> Verified:
        out = self.target.model(input_ids=ids, position_ids=positions, attention_mask=mask, cache=self.cache,
                                use_cache=True, output_hidden_states=self.drafter.needs_hidden)
        hidden = out.hidden_states if self.drafter.needs_hidden else None
        return Verified(out.logits[0].float(), None if hidden is None else tuple(h[0] for h in hidden))


@dataclass(frozen=True)
class Round:
    result: StepResult
    verified: Verified    # logits/hidden of the kept nodes only, in path order


def kept_hidden(hidden: tuple[torch.Tensor, ...] | None, nodes: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    return None if hidden is None else tuple(h[nodes] for h in hidden)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
