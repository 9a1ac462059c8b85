"""What an answer measured: its speedup over plain decoding, timed in the answer itself where it
ran reference rounds (core/engine.py `reference_round`), else at the machine's load then, and the
drafts' real cost against the profile's."""

import bisect
import statistics
from dataclasses import dataclass, field

from core.config import TreeConfig
from core.tune.latency import LatencyProfile

MIN_DRAFTS = 16                     # drafts measured before their time replaces the profile's estimate
BURST = 1.5                         # a round over this many times the median of its kind was slowed by other work
REFERENCE_EVERY = 16                # an EAGLE answer's rounds per pair of plain reference rounds (Engine.generate)


@dataclass(frozen=True)
class Turn:
    strategy: str
    tokens: int          # tokens committed by the rounds after the prefill
    engine_s: float      # those rounds' draft + verify + commit time
    plain_ms: float      # plain decoding's time per token then (Meter.plain_ms)
    drafts: int = 0                 # EAGLE rounds of a dynamic tree, and their drafting time:
    draft_s: float = 0.0            # measured
    draft_profiled_s: float = 0.0   # what the profile says the same drafts cost, at the turn's load

    @property
    def speedup(self) -> float | None:
        """Measured speedup over plain decoding (None if the turn made no rounds)."""
        return self.tokens / self.engine_s * self.plain_ms / 1000 if self.tokens and self.engine_s > 0 else None


@dataclass
class Meter:
    """One answer's rounds after the prefill, for the measured speedup. Where the answer ran
    reference rounds, plain decoding's time per token is the mean of the second of each pair (a
    plain round right after a plain round, as plain decoding runs) left unslowed by a burst of
    load (a page's redraw, another program), times the share such bursts added to this answer's
    drafted rounds (`burst_share`): the drafted rounds' time is a sum, so bursts count on their side
    in proportion, and must on plain's. Their plain mean, bursts and all, was right on average but
    wrong for most answers: 4-5 reference rounds mostly miss a burst and now and then catch one (12
    page answers: below the A/B plain run's own rounds on 10, by ~8%, far above on 2), so the page
    showed 0.86-0.89x its A/Bs for the median answer. Their median alone (bursts left out of
    plain's side only) read low on average: 0.88x the page's A/Bs over 80 MT-bench answers, and the
    tuner left EAGLE for 33 of them (2-core Zen 4). Without them it is the
    profile's at the answer's mean context, rescaled by how this answer's verifies compare with
    the profile's for the same tree sizes (a machine busier or quieter than when it was profiled
    slows plain decoding alike); that assumes the profile's tree-to-one-token ratios still hold,
    which on a noisy 2-core host they did not (a 2-token round profiled at 1.25x one token, 1.11x
    in the same bench's rounds: the page showed 1.11x for a measured 1.22x)."""
    profile: LatencyProfile
    strategy: str
    prompt_len: int
    tokens: int = 0
    engine_s: float = 0.0
    verify_s: float = 0.0      # measured verify + accept + commit, what the profile times
    profiled_s: float = 0.0    # the profile's time for the same rounds
    tree: TreeConfig | None = None   # the EAGLE tree drafted this turn (None: no dynamic tree)
    drafts: int = 0
    draft_s: float = 0.0
    draft_profiled_s: float = 0.0
    reference_ms: list[float] = field(default_factory=list)   # each timed reference round (one token)
    drafted_ms: list[float] = field(default_factory=list)     # each drafted round's, ascending (`burst_share`)
    after_reference: bool = False
    uncaught: int = 1   # rows the head's next catch-up feeds: after the prefill (which primed it), its last

    def add(self, step) -> None:
        context = self.prompt_len + self.tokens   # what the round drafted and verified after
        self.profiled_s += self.profile.round(step.tree_size, context) / 1000
        round_s = step.draft_s + step.verify_s + step.commit_s
        self.tokens += len(step.new_ids)
        self.engine_s += round_s
        self.verify_s += step.verify_s + step.commit_s
        if step.reference and self.after_reference:
            self.reference_ms.append(1000 * round_s)
        elif not step.reference:
            bisect.insort(self.drafted_ms, 1000 * round_s)
        self.after_reference = step.reference
        if self.tree is None:
            return
        if step.reference or step.copied:   # no head step: the next one catches up on these rows too
            self.uncaught += len(step.new_ids)
            return
        caught_up, self.uncaught = self.uncaught, len(step.new_ids)
        self.drafts += 1
        self.draft_s += step.draft_s
        self.draft_profiled_s += self.profile.draft(self.tree.depth, self.tree.top_k, caught_up, context,
                                                    self.tree.best_first) / 1000

    @property
    def load(self) -> float:
        """How much slower than profiled the verifies ran: the machine's load now."""
        return self.verify_s / self.profiled_s if self.profiled_s > 0 else 1.0

    @property
    def plain_ms(self) -> float:
        if self.reference_ms:
            return statistics.fmean(unslowed(self.reference_ms)) * burst_share(self.drafted_ms)
        return self.profile.plain_ms(self.prompt_len + self.tokens / 2) * self.load

    def turn(self) -> Turn:
        # Drafts profiled at this turn's load: a busier machine slows drafts and verifies alike,
        # and that must not read as drafts the profile got wrong.
        return Turn(self.strategy, self.tokens, self.engine_s, self.plain_ms, self.drafts, self.draft_s,
                    self.draft_profiled_s * self.load)


def burst_limit(times_ms: list[float]) -> float:
    """A round slower than this was slowed by a burst of other work: BURST times the median."""
    return BURST * statistics.median(times_ms)


def unslowed(times_ms: list[float]) -> list[float]:
    """`times_ms` less the rounds a burst of other work slowed (`burst_limit`)."""
    limit = burst_limit(times_ms)
    return [t for t in times_ms if t <= limit]


def burst_share(sorted_ms: list[float]) -> float:
    """How much bursts of other work slowed these rounds on average: their mean over the mean of
    those they left alone (1.0 without rounds). `sorted_ms` ascending, as the meter keeps them: it
    reads this at every round, and filtering a long answer's thousands of rounds each time cost
    ~0.2 ms a round at 2,400 rounds; the slowed ones are the tail past `burst_limit`."""
    if not sorted_ms:
        return 1.0
    kept, total = bisect.bisect_right(sorted_ms, burst_limit(sorted_ms)), sum(sorted_ms)
    return total / len(sorted_ms) / ((total - sum(sorted_ms[kept:])) / kept)


@dataclass
class DraftClock:
    """Drafting time measured in chats against the profile's estimate for the same drafts, over all
    turns. The profile times the head's steps on their own; a chat's drafts may cost more (on an
    H200, 72 ms per draft of a depth-2, top-10 tree where the profile predicted ~5 ms), so once
    MIN_DRAFTS drafts back it, best_shape scales draft costs by the ratio."""
    measured_s: float = 0.0
    profiled_s: float = 0.0
    drafts: int = 0

    def add(self, turn: Turn) -> None:
        self.measured_s += turn.draft_s
        self.profiled_s += turn.draft_profiled_s
        self.drafts += turn.drafts

    @property
    def scale(self) -> float:
        return self.measured_s / self.profiled_s if self.drafts >= MIN_DRAFTS and self.profiled_s > 0 else 1.0
