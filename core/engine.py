"""The engine: the one stateful object. It owns the target, the drafter, the KV cache and the RNG.

It sees token ids only and knows nothing about text, chat templates or the UI. `generate` is a
generator of `StepResult`s; each round reads draft -> verify -> accept -> commit, whatever the
drafter (plain decoding is the drafter that proposes nothing: a tree of just the root).

Cache invariant between rounds: the runner's cache holds the KV of every committed token except
the newest one, the root, which the next round feeds first. `runner.ids` mirrors it on the host so
a new turn that shares a prefix with the last one (a chat's history) skips re-encoding it.
"""

import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Iterator, Protocol, Sequence

import torch

from core.config import SamplingConfig
from core.errors import ContextOverflowError, OutOfMemoryError
from core.spec.sampling import sample, target_probs
from core.spec.drafters import PlainDrafter
from core.runtime.runner import RunnerConfig, TargetRunner, Verified
from core.spec.tree import Draft, DraftTree, first_nodes, root_only, verify_rows
from core.spec.verify import Acceptance, accept_greedy, accept_sampled, path_offers, top2_margins
from models.target import Target


REFERENCE_ROUNDS = (2, 3)   # the rounds of each `reference_every` that run plainly


@dataclass(frozen=True)
class StepResult:
    new_ids: tuple[int, ...]    # tokens committed this round (accepted drafts + the bonus token)
    accepted: int               # draft tokens accepted this round
    drafted: int                # the most draft tokens this round could accept: the tree's depth
    tree_size: int              # tokens the target verified this round (root included)
    draft_s: float
    verify_s: float             # the target forward over the tree
    commit_s: float             # acceptance and the KV commit
    finish: str | None = None   # "eos" | "length" | None
    offers: tuple[tuple[int, int], ...] = ()  # (children, accepted rank) along the path: verify.path_offers
    near_ties: tuple[int, ...] = ()  # greedy: offsets into new_ids chosen by a top-2 margin < runner.tie_margin
    reference: bool = False     # a plain round among drafted ones, timed as plain decoding's cost (`reference_round`)
    copied: bool = False        # a copy round (TreeConfig.copy): drafted by prompt lookup, no head step


class Drafter(Protocol):
    """Proposes a tree whose root is `context[-1]`. Implementations live in core/spec/drafters.py."""

    name: str
    feature_layers: tuple[int, ...] | None  # indices into the target's hidden_states, or None

    def rewind(self, common: int) -> int:
        """A new prompt shares its first `common` tokens with the last context: drop the rest of
        the drafter's state and return how many leading tokens the target may keep (<= common)."""
        ...

    def memory_bytes(self, borrowed: set[int]) -> int:
        """Bytes the drafter holds beyond the storages in `borrowed` (the target's), for the monitor."""
        ...

    def prime(self, context: list[int], fresh: Verified) -> Verified:
        """Right after the prefill (`context` ends with its token): take in the prompt, as far as that
        is prefill work; -> what the first draft is still to read of `fresh`."""
        ...

    def draft(self, context: list[int], fresh: Verified) -> Draft:
        """`fresh` holds the target's outputs for the last T committed positions before the root
        (the prefill's new tokens, or the root and accepted path of the last round)."""
        ...


class Engine:
    def __init__(self, target: Target, drafter: Drafter | None = None, runner: TargetRunner | None = None):
        self.target = target
        self.drafter = drafter or PlainDrafter()
        # Without a runner: the eager one (the tests' reference), giving the drafter the features it reads.
        self.runner = runner or TargetRunner(target, RunnerConfig(compile=False), self.drafter.feature_layers)
        self._check_features(self.drafter)

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def context_len(self) -> int:
        return self.runner.context_len

    @property
    def cached_ids(self) -> list[int]:
        return self.runner.ids

    def set_drafter(self, drafter: Drafter) -> None:
        """Switch drafters between turns. The incoming one forgets what it held: the chat may have
        moved on while it was idle, so the next prompt is encoded afresh for it."""
        if drafter is not self.drafter:
            self._check_features(drafter)
            self.drafter = drafter
            drafter.rewind(0)

    def _check_features(self, drafter: Drafter) -> None:
        if drafter.feature_layers is not None and drafter.feature_layers != self.runner.feature_layers:
            raise ValueError(f"the {drafter.name} drafter reads target layers {drafter.feature_layers}; "
                             f"the runner captures {self.runner.feature_layers}")

    def reset(self) -> None:
        self.runner.reset()
        self.drafter.rewind(0)

    def generate(self, prompt_ids: list[int], sampling: SamplingConfig, cancel: threading.Event | None = None,
                 reference_every: int = 0) -> Iterator[StepResult]:
        """The answer's steps: the prefill's, then one per round. With `reference_every`, rounds
        `reference_round` picks run plainly, so an answer measures plain decoding's cost itself."""
        if not prompt_ids:
            raise ValueError("generate needs at least one prompt token")
        if len(prompt_ids) >= self.context_len:
            raise ContextOverflowError(
                f"The prompt has {len(prompt_ids)} tokens; the model's context holds {self.context_len}.")
        seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(4), "little")
        rng = torch.Generator(device=self.device).manual_seed(seed)
        try:
            yield from self._generate(list(prompt_ids), sampling, rng, cancel, reference_every)
        except torch.OutOfMemoryError as e:
            self.reset()
            raise OutOfMemoryError("Out of memory while generating; try a shorter chat or fewer new tokens.") from e

    def _generate(self, prompt: list[int], sampling: SamplingConfig, rng: torch.Generator,
                  cancel: threading.Event | None, reference_every: int) -> Iterator[StepResult]:
        t0 = time.perf_counter()
        verified = self.prefill(prompt)
        first = self.choose(verified.logits[-1], sampling, rng)
        context, produced = prompt + [first], 1
        finish, t1 = self.finish(first, produced, len(context), sampling), time.perf_counter()
        # The drafter's share of the prompt's work, in the prefill's step rather than the first round's
        # (where the meter took it for a slow draft): the first token waits for it (EAGLE: ~1% of a prefill).
        if finish is None:
            verified = self.drafter.prime(context, verified)
        yield StepResult(new_ids=(first,), accepted=0, drafted=0, tree_size=len(prompt),
                         draft_s=time.perf_counter() - t1, verify_s=t1 - t0, commit_s=0.0, finish=finish,
                         near_ties=self.near_ties(top2_margins(verified.logits[-1:]).tolist(), sampling))
        rounds = 0
        while self.finish(context[-1], produced, len(context), sampling) is None:
            if cancel is not None and cancel.is_set():
                return
            step = self.step(context, verified, sampling, rng, reference_round(rounds, reference_every))
            rounds += 1
            verified = step.verified
            new = step.result.new_ids
            # Stop at EOS or the token budget even when the round accepted past it.
            cut = next((i + 1 for i, t in enumerate(new) if t in self.target.eos_ids), len(new))
            cut = min(cut, sampling.max_new_tokens - produced, self.context_len - len(context))
            new = new[:cut]
            context += new
            produced += len(new)
            finish = self.finish(context[-1], produced, len(context), sampling)
            yield replace(step.result, new_ids=tuple(new), accepted=min(step.result.accepted, len(new) - 1),
                          near_ties=tuple(i for i in step.result.near_ties if i < len(new)),
                          finish=finish)

    def finish(self, last: int, produced: int, length: int, sampling: SamplingConfig) -> str | None:
        if last in self.target.eos_ids:
            return "eos"
        if produced >= sampling.max_new_tokens or length >= self.context_len:
            return "length"
        return None

    @torch.inference_mode()  # per call, not around the generator: Gradio may resume it on another thread
    def prefill(self, prompt: list[int]) -> Verified:
        """Encode the prompt, reusing the longest prefix already in the cache."""
        reuse = self.drafter.rewind(common_prefix(self.runner.ids, prompt[:-1]))  # feed >= 1 token
        return self.runner.prefill(prompt[reuse:], reuse)

    @torch.inference_mode()
    def step(self, context: list[int], verified: Verified, sampling: SamplingConfig,
             rng: torch.Generator, reference: bool = False) -> "Round":
        """One speculative round: draft -> verify -> accept -> commit. On a GPU it waits for the
        device three times: the drafted tree comes to the host (rerank), verify's end (timed on its
        own), and accept's one transfer of each row's top two logits; path offers and near-ties
        read what those brought over. A `reference` round drafts nothing (plain decoding's round)
        and hands the drafter's next round the rows it did not see (`joined`)."""
        t0 = time.perf_counter()
        draft = Draft(root_only(context[-1])) if reference else self.drafter.draft(context, verified)
        if draft.side is None and draft.rows > self.runner.rows_left:  # a big tree near the context's end
            draft = replace(draft, tree=first_nodes(draft.tree, self.runner.rows_left))
        tree = draft.tree
        t1 = time.perf_counter()
        fresh = self.verify(draft)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # attribute GPU time to verify; accept syncs anyway
        t2 = time.perf_counter()
        acceptance = self.accept(tree, fresh.logits, sampling, rng)
        self.commit(acceptance, tree)
        t3 = time.perf_counter()
        result = StepResult(new_ids=tuple(acceptance.new_tokens), accepted=acceptance.accepted, drafted=tree.max_depth,
                            tree_size=draft.rows, draft_s=t1 - t0, verify_s=t2 - t1, commit_s=t3 - t2,
                            offers=() if draft.copied else path_offers(tree, acceptance, draft.ranking, draft.grafted),
                            near_ties=self.near_ties(acceptance.margins, sampling),
                            reference=reference, copied=draft.copied)
        new = kept(fresh, acceptance.nodes)
        return Round(result, joined(verified, new) if reference else new)

    def verify(self, draft: Draft | DraftTree) -> Verified:
        """One target forward over a tree and any side rows -> the tree's rows (N, V) and the
        target's argmax after each side row the drafter reads."""
        draft = draft if isinstance(draft, Draft) else Draft(draft)
        rows = verify_rows(draft)
        verified = self.runner.verify(rows.tokens, rows.depth, rows.visible, rows.outputs)
        if draft.side is None:
            return verified
        n = draft.tree.size
        return Verified(verified.logits[:n], None if verified.features is None else verified.features[:n],
                        verified.logits[n:].argmax(-1))

    def accept(self, tree: DraftTree, logits: torch.Tensor, sampling: SamplingConfig,
               rng: torch.Generator) -> Acceptance:
        if sampling.greedy:
            return accept_greedy(tree, logits)
        return accept_sampled(tree, target_probs(logits, sampling), rng)

    def commit(self, acceptance: Acceptance, tree: DraftTree) -> None:
        """Keep the KV of the root and the accepted path; drop the rest of the tree."""
        self.runner.commit(acceptance.nodes, [int(tree.tokens[0]), *acceptance.new_tokens[:-1]])

    def near_ties(self, margins: Sequence[float] | None, sampling: SamplingConfig) -> tuple[int, ...]:
        """margins (k,): the top-2 logit margin that chose each new token. Offsets of
        greedy choices below the runner's numeric tolerance: such a choice could flip between a
        tree's verify and one token's, so speculative and plain output may differ there, and only there."""
        if not sampling.greedy or margins is None:
            return ()
        return tuple(i for i, margin in enumerate(margins) if margin < self.runner.tie_margin)

    def choose(self, logits: torch.Tensor, sampling: SamplingConfig, rng: torch.Generator) -> int:
        """logits (V,) -> the next token, exactly as a one-node tree would accept it."""
        if sampling.greedy:
            return int(logits.argmax())
        return int(sample(target_probs(logits, sampling), rng))

@dataclass(frozen=True)
class Round:
    result: StepResult
    verified: Verified    # what the next draft catches up on: the kept nodes in path order (`joined` after a reference round)


def kept(verified: Verified, nodes: torch.Tensor) -> Verified:
    """What the next draft reads of the root and the accepted path, in path order: their features
    and the side rows' argmax, not their logits (no drafter reads a round's logits, and copying
    two rows of 49,152 took ~20-30 us a round on a 2-core EPYC). index_select, not features[nodes]:
    the same rows, a fraction of the time."""
    features = verified.features
    return Verified(None, None if features is None else features.index_select(0, nodes.to(features.device)),
                    verified.side_next)


def joined(unseen: Verified, new: Verified) -> Verified:
    """The rows a drafter has not seen yet and a reference round's, in order: its next draft
    catches up on both (a plain round has no side rows)."""
    return Verified(None, None if new.features is None else torch.cat([unseen.features, new.features]))


def reference_round(index: int, every: int) -> bool:
    """Whether round `index` (0 = the first after the prefill) of an answer runs plainly: rounds 2
    and 3 of every `every` (0: none), so even a short answer times plain decoding, the second of
    each pair right after a plain round, as plain decoding runs (core/tune/meter.py)."""
    return every > 0 and index % every in REFERENCE_ROUNDS


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
