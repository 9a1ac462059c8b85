"""One answer's rounds, collected once for everyone who reads them: the running `ReplyStats` the
page and the API show, what the tuner learns (each round's offers, the turn's measured speedup),
and the totals the bench reports. The chat service and the bench both run a turn as

    log = TurnLog.planned(engine, tuner, prompt_len)   # the tuner's plan for it, set on the engine
    for step in engine.generate(..., reference_every=log.reference_every):
        log.add(step, elapsed_s)                       # -> the ReplyStats so far
    log.end()                                          # the tuner's turn, if it was one
"""

from dataclasses import dataclass, replace

from core.config import ReplyStats
from core.tune.meter import REFERENCE_EVERY, Meter
from core.tune.tuner import Plan, Tuner


@dataclass
class TurnLog:
    stats: ReplyStats
    tuner: Tuner | None = None
    counted: bool = True          # the tuner's own turn; an A/B override teaches acceptance, but is not one
    meter: Meter | None = None
    draft_s: float = 0.0          # the rounds after the prefill: drafting, verifying, committing
    verify_s: float = 0.0
    commit_s: float = 0.0
    plan: Plan | None = None      # the tuner's plan, when it planned the turn

    @classmethod
    def start(cls, stats: ReplyStats, tuner: Tuner | None, counted: bool = True) -> "TurnLog":
        """A turn the engine is already set up for (`stats` names its drafter and why)."""
        meter = tuner.meter(stats.strategy, stats.prompt_tokens) if tuner is not None else None
        return cls(stats, tuner, counted, meter)

    @classmethod
    def planned(cls, engine, tuner: Tuner | None, prompt_len: int) -> "TurnLog":
        """The tuner's plan for the next turn, set on the engine; without a tuner, its drafter as is."""
        plan = tuner.prepare(engine, prompt_len) if tuner is not None else None
        stats = ReplyStats(strategy=engine.drafter.name, prompt_tokens=prompt_len, tuning=plan.reason if plan else "")
        return replace(cls.start(stats, tuner), plan=plan)

    @classmethod
    def asked(cls, engine, tuner: Tuner | None, prompt_len: int, reason: str) -> "TurnLog":
        """A turn of the drafter set on the engine as asked (a race, an A/B, an API request), not the
        tuner's: a tree rival drafts the shape its acceptance picks; the tuner learns, not counting it."""
        if tuner is not None:
            tuner.ready(engine.drafter.name, prompt_len)
        return cls.start(ReplyStats(strategy=engine.drafter.name, prompt_tokens=prompt_len, tuning=reason), tuner,
                         counted=False)

    def add(self, step, elapsed_s: float) -> ReplyStats:
        """One engine step (step 0 is the prefill; the rounds after it are what the speedup gauge
        compares with plain decoding); -> the stats so far."""
        s = self.stats
        s = replace(s, new_tokens=s.new_tokens + len(step.new_ids), elapsed_s=elapsed_s, target_steps=s.target_steps + 1,
                    drafted=s.drafted + step.drafted, accepted=s.accepted + step.accepted,
                    reference_rounds=s.reference_rounds + step.reference,
                    prefill_s=elapsed_s if s.target_steps == 0 else s.prefill_s)
        if s.target_steps > 1 and not step.reference:   # the drafted rounds' phases
            self.draft_s, self.verify_s, self.commit_s = (self.draft_s + step.draft_s, self.verify_s + step.verify_s,
                                                          self.commit_s + step.commit_s)
            if self.meter is not None:
                self.tuner.observe_round(s.strategy, step.offers)
        if s.target_steps > 1 and self.meter is not None:   # every round's time counts for the speedup
            self.meter.add(step)
            s = replace(s, round_tokens=self.meter.tokens, round_s=self.meter.engine_s, plain_ms=self.meter.plain_ms)
        self.stats = s
        return s

    @property
    def reference_every(self) -> int:
        """Engine.generate's `reference_every`: the tuner's EAGLE answers time plain decoding
        themselves (pairs of plain rounds, ~2% of their tokens). Not other drafters, which keep
        state between rounds, nor an answer as asked (A/B and races time plain decoding whole;
        a fixed tree's accepted length stays its own)."""
        return REFERENCE_EVERY if self.meter is not None and self.counted and self.stats.strategy == "eagle" else 0

    def end(self) -> None:
        """Hand the finished turn to the tuner (it may step the ladder)."""
        if self.meter is not None and self.counted:
            self.tuner.end_turn(self.meter.turn())
        elif self.meter is not None:
            self.tuner.record(self.meter.turn())
