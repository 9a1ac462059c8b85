"""The tuner: which drafter, and which tree shape, pays most on this machine for this chat.

Each shape's expected speed comes from core/tune/shapes.py (positional acceptance x the latency
profile), each answer's measured speedup from core/tune/meter.py.

The ladder: tree -> chain -> prompt lookup -> plain. Where the EAGLE rungs are predicted slower than
plain, prompt lookup is passed over too while its last `RIVAL_RUNS` answers (races and A/Bs
included) measured slower than plain, and its turns there move no rung. A rung is left when its measured speedup
(tokens per second of engine time in the rounds after the prefill, times plain decoding's time
per token: see `Meter`), averaged over its last answers (at least `DEMOTE_TURNS`, at most
`RIVAL_RUNS`, weighed by their tokens), is below plain decoding's; at once when one answer measures
it clearly slower (below `CLEARLY_SLOWER`, over `CLEAR_TOKENS` or more); or when the model predicts
the EAGLE rung cannot beat plain decoding; but a slow turn whose shape the acceptance it taught
no longer picks first re-plans the rung (`_replan`, once per visit). The user's pins (strategy, depth, top_k, total_tokens, a
static tree) are never overridden.

The rivals (Lookahead, layer skip, Medusa: `RIVALS`): each answer they decode (a race, a pinned
answer, an A/B) records its measured speedup. Once one of them has measured at `DEMOTE_BELOW` or
more over its last `RIVAL_RUNS` answers, and more than the ladder's plan predicts (or, without a
prediction, than plain), the plan is that rival; its own slow answers pull its mean down and the
ladder's plan returns. The ladder itself never moves for a rival's turn. A rival that drafts trees
(Medusa: `TreeRival`) also has an acceptance model of its own: its tree is shaped like EAGLE's from
it and its measured draft cost, and until its answers are measured, a predicted speed above the
ladder's plans it.

Stepping down is not for ever: a busy minute slows every rung, and the load correction cannot
tell all of it apart. After `PROBE_EVERY` measured turns below the top, one turn tries the rung
above again (a probe, over as many turns as it takes to decode `CLEAR_TOKENS`); measured at
`DEMOTE_BELOW` or more over them, the ladder climbs back to it, else it stays and probes again
`PROBE_EVERY` turns later. A probe that loses costs a turn (up to CLEAR_TOKENS / MIN_TURN_TOKENS short
ones) in every PROBE_EVERY + 1 or so; one that wins recovers the speedup for the rest of the chat.
"""

from dataclasses import dataclass, replace
from typing import Callable, Sequence

from core.config import TreeConfig
from core.tune.big_trees import best_first_budget
from core.tune.latency import LatencyProfile
from core.tune.meter import DraftClock, Meter, Turn
from core.tune.shapes import Pins, PositionalAcceptance, Shape, TreeRival, best_shape, shape_text

DEMOTE_BELOW, MIN_TURN_TOKENS = 1.05, 16   # a probe or a rival must measure DEMOTE_BELOW to win
SLOWER_THAN_PLAIN = 1.0             # a rung's mean below this leaves it; prompt lookup's, passed over
# One answer's measured speedup is noisy: the same prompt measured 1.02x, then 1.14x; against the
# wall-clock ratio of a plain and an EAGLE answer to the same prompt, 16 answers' meters differed by
# 0.06 on average on a quiet host and 0.19 beside a bursty load (50 ms busy every 250 ms, as a page's
# updates). Leaving a rung on one or two answers sent a 1.15x EAGLE to plain decoding in served runs,
# so a rung is judged by the mean of its last DEMOTE_TURNS or more answers, and one answer leaves it
# only when far below plain (CLEARLY_SLOWER) over at least CLEAR_TOKENS tokens: a bench run through the
# page (2026-12-06) left the tree for 31 tokens measured at 0.78x, the same prompt at 1.34x through the API.
DEMOTE_TURNS, CLEARLY_SLOWER, CLEAR_TOKENS = 3, 0.85, 64
RIVALS = ("lookahead", "layer_skip", "medusa")  # drafters chosen on their measured speed alone
RIVAL_RUNS = 4                      # the last answers a rival's measured speedup is the mean of
PROBE_EVERY = 8                     # measured turns on a lower rung before one turn tries the rung above
LABELS = {"tree": "EAGLE tree", "chain": "EAGLE chain", "prompt_lookup": "prompt lookup", "lookahead": "lookahead",
          "layer_skip": "layer skip", "medusa": "Medusa heads", "plain": "plain decoding"}


@dataclass(frozen=True)
class Plan:
    rung: str                         # tree, chain, prompt_lookup or plain
    tree: TreeConfig | None           # the shape drafted: an EAGLE rung's, a tree rival's predicted one
    predicted: float | None           # predicted speedup over plain decoding; None if not modelled
    reason: str                       # one line for the page

    @property
    def strategy(self) -> str:
        return "eagle" if self.rung in ("tree", "chain") else self.rung


class Tuner:
    """Plans each turn; learns from its rounds. Built by core/service/factory.py, one per loaded model."""

    def __init__(self, profile: LatencyProfile, acceptance: PositionalAcceptance, pins: Pins, drafters: dict, max_size: int,
                 keep: Callable[[PositionalAcceptance], None] | None = None, best_first: bool = False,
                 tree_rivals: dict[str, TreeRival] | None = None, heard: dict[str, list[float]] | None = None,
                 keep_heard: Callable[[dict[str, list[float]]], None] | None = None):
        """drafters: name -> drafter, "plain" and "prompt_lookup" always, "eagle" with a head; `keep`
        stores the acceptance after each EAGLE turn (core/tune/remembered.py); `best_first`: the
        target is slow (offloaded), so the tree rung plans SpecExec's big trees (`shape`);
        `tree_rivals`: the rivals whose trees it shapes and whose speed it predicts (Medusa); `heard`:
        the measured speedups earlier sessions kept, and `keep_heard` stores them after each answer."""
        self.profile, self.acceptance, self.pins, self.max_size = profile, acceptance, pins, max_size
        self.best_first = best_first
        self.tree_rivals = tree_rivals or {}   # name -> TreeRival: the rivals whose trees the tuner shapes
        self.keep = keep
        self.drafters = drafters
        self.pin(pins.strategy)
        self.turns: list[Turn] = []
        self.draft_clock = DraftClock()
        self.heard: dict[str, list[float]] = dict(heard or {})   # strategy -> measured speedups of its answers, oldest first
        self.keep_heard = keep_heard

    def pin(self, strategy: str | None) -> None:
        """Decode with `strategy` (a drafter's name) from the next answer on, or None: the tuner's
        choice again; the ladder starts from its top. What was learned stays."""
        if strategy is not None and strategy not in self.drafters:
            raise ValueError(f"no {strategy} drafter is loaded; there are {', '.join(self.drafters)}")
        self.pins = replace(self.pins, strategy=strategy)
        rungs = ["tree", "chain", "prompt_lookup", "plain"] if "eagle" in self.drafters else ["prompt_lookup", "plain"]
        if strategy is not None:
            rungs = ["tree"] if strategy == "eagle" else [strategy]
        if self.pins.top_k == 1 and rungs[0] == "tree":
            rungs = ["chain", *rungs[1:]]   # a pinned width of 1 is a chain: the tree rung would repeat it
        self.rungs, self.rung = list(dict.fromkeys(rungs)), 0
        self.runs: list[Turn] = []             # this rung's measured turns since it was reached (RIVAL_RUNS at most)
        self.demoted = ""                      # the ladder's last move and why
        self.since_probe = 0                   # measured turns on this rung since it was reached or last probed
        self.trial: int | None = None          # the rung above that the planned turn probes
        self.probed: list[Turn] = []           # the running probe's turns: it is judged over CLEAR_TOKENS tokens
        self.planned: Plan | None = None       # the last turn's plan, and its context
        self.planned_context = 0.0
        self.replanned = False                 # this rung's one new shape after a slow turn is spent

    def prepare(self, engine, context: float) -> Plan:
        """Plan the next turn and set the engine up for it."""
        plan = self.plan(context)
        index = self.rungs.index(plan.rung) if plan.rung in self.rungs else self.rung
        self.trial = index if index < self.rung else None
        self.planned, self.planned_context = plan, context
        engine.set_drafter(self.drafters[plan.strategy])
        if plan.tree is not None:   # an EAGLE rung's shape, or the one a tree rival was predicted with
            self.drafters[plan.strategy].reshape(plan.tree)
        else:
            self.ready(plan.strategy, context)
        return plan

    def ready(self, strategy: str, context: float) -> None:
        """Before any turn of `strategy` (planned, raced or asked for): a tree rival drafts its best shape."""
        if strategy in self.tree_rivals:
            self.drafters[strategy].reshape(self.rival_shape(strategy, context).tree)

    def rival_shape(self, name: str, context: float) -> Shape:
        rival = self.tree_rivals[name]
        return best_shape(rival.acceptance.q(), self.profile, context, self.max_size, Pins(), rival.chain, rival=rival)

    def plan(self, context: float) -> Plan:
        plan = self._ladder_plan(context)
        if self.pins.strategy:
            return plan
        beaten = plan.predicted if plan.predicted is not None else self.measured(plan.strategy) or 1.0
        rival = self.best_rival()
        if rival is not None and self.measured(rival) > beaten:
            speed = self.measured(rival)
            return Plan(rival, None, speed, f"{LABELS[rival]}: measured {speed:.2f}x plain over its last "
                                            f"{len(self.recent(rival))} answers, ahead of {LABELS[plan.rung]}")
        return self.predicted_rival(context, beaten) or plan

    def predicted_rival(self, context: float, beaten: float) -> Plan | None:
        """A tree rival not yet measured whose model predicts it beats `beaten` (and DEMOTE_BELOW): the
        fastest such, planned with its best shape. Once its answers are measured, `plan` goes by those."""
        plain_ms, best = self.profile.plain_ms(context), None
        for name in self.tree_rivals:
            if name not in RIVALS or self.measured(name) is not None:   # prompt lookup is a rung, shaped only
                continue
            shape = self.rival_shape(name, context)
            predicted = shape.tokens / shape.round_ms * plain_ms
            if predicted >= max(beaten, DEMOTE_BELOW) and (best is None or predicted > best.predicted):
                best = Plan(name, shape.tree, predicted, f"{LABELS[name]} {shape_text(shape.tree)}: {shape.tokens:.2f} tokens "
                                                   f"per {shape.round_ms:.0f} ms round, predicted {predicted:.2f}x plain")
        return best

    def recent(self, strategy: str) -> list[float]:
        """The measured speedups of `strategy`'s last RIVAL_RUNS answers."""
        return self.heard.get(strategy, [])[-RIVAL_RUNS:]

    def measured(self, strategy: str) -> float | None:
        """The mean measured speedup of `strategy`'s last RIVAL_RUNS answers, or None if none."""
        runs = self.recent(strategy)
        return sum(runs) / len(runs) if runs else None

    def best_rival(self) -> str | None:
        """The loaded rival measured fastest, if it measured at DEMOTE_BELOW or more."""
        paying = [(self.measured(name), name) for name in RIVALS
                  if name in self.drafters and (self.measured(name) or 0.0) >= DEMOTE_BELOW]
        return max(paying)[1] if paying else None

    def record(self, turn: Turn) -> None:
        """Any answer's measured speed, the tuner's turn or not (a race's, an A/B's)."""
        if turn.speedup is not None and turn.tokens >= MIN_TURN_TOKENS:
            self.heard[turn.strategy] = [*self.heard.get(turn.strategy, []), turn.speedup][-RIVAL_RUNS:]
            if self.keep_heard is not None:
                self.keep_heard(self.heard)

    def _ladder_plan(self, context: float) -> Plan:
        plain_ms, scale = self.profile.plain_ms(context), self.draft_clock.scale
        clock = f"drafts measured {scale:.1f}x the profile's time" if not 2 / 3 < scale < 3 / 2 else ""
        note, measured = "; ".join(filter(None, [self.demoted, clock])), self.measured("eagle")
        top = self.rung - 1 if self.probe_due else self.rung
        if top < self.rung:
            note = "; ".join(filter(None, [f"probing {LABELS[self.rungs[top]]} again after {self.since_probe} turns "
                                           f"on {LABELS[self.rungs[self.rung]]}", note]))
        for index in range(top, len(self.rungs)):
            rung = self.rungs[index]
            # Reached only because the rungs above were predicted slow (not the ladder's own rung, nor a probe):
            # prompt lookup is passed over too while it measures slower than plain.
            slow = self.measured(rung) if rung == "prompt_lookup" and index > max(self.rung, top) else None
            if slow is not None and slow < SLOWER_THAN_PLAIN and index < len(self.rungs) - 1:
                note = "; ".join(filter(None, [f"{LABELS[rung]} measured {slow:.2f}x plain over its last "
                                               f"{len(self.recent(rung))} answers", note]))
                continue
            if rung not in ("tree", "chain"):
                return Plan(rung, None, None, self._why(rung, plain_ms, context, note))
            if self.pins.static is not None:
                return Plan(rung, self.pins.static, None, "EAGLE-1's static tree, as asked (--static-tree)")
            shape = self.shape(rung, context, scale)
            predicted = shape.tokens / shape.round_ms * plain_ms
            # The prediction is the profile's; EAGLE's answers time plain decoding themselves (meter.py), so
            # where they measured it paying, they outweigh a profile timed in another minute of a noisy host
            # (a server re-profiled at start predicted 0.95x for the chain the bench measured at 1.16x, and
            # answered plainly throughout). Slow answers bring the mean down, and the prediction back.
            trusted = measured is not None and measured >= DEMOTE_BELOW and predicted < 1.0
            if predicted >= 1.0 or trusted or index == len(self.rungs) - 1 or self.pins.strategy:
                t = shape.tree
                return Plan(rung, t, measured if trusted else predicted,
                            f"{LABELS[rung]} {shape_text(t)}: "
                            f"{shape.tokens:.2f} tokens per {shape.round_ms:.0f} ms round, predicted "
                            f"{predicted:.2f}x plain ({plain_ms:.0f} ms/token at {context:.0f} tokens)"
                            + (f", but EAGLE measured {measured:.2f}x over its last {len(self.recent('eagle'))} answers"
                               if trusted else "")
                            + (f"; {note}" if note else ""))
            note = "; ".join(filter(None, [f"{LABELS[rung]} predicted only {predicted:.2f}x plain", clock]))
        raise AssertionError("the ladder always ends in a rung that needs no model")

    def shape(self, rung: str, context: float, scale: float):
        """The EAGLE rung's best shape (a Shape, or big_trees.Budget: both have tree, tokens, round_ms):
        on a slow target the tree rung's is SpecExec's best-first budget (core/tune/big_trees.py)."""
        q = self.acceptance.q()
        if self.best_first and rung == "tree":
            room = self.drafters["eagle"].step.room   # the head cache's draft rows: steps x batch within it
            return best_first_budget(q, self.profile, context, self.max_size, room, self.pins, scale)
        return best_shape(q, self.profile, context, self.max_size, self.pins, rung == "chain", scale)

    def _why(self, rung: str, plain_ms: float, context: float, note: str) -> str:
        base = f"{LABELS[rung]} ({plain_ms:.0f} ms/token plain at {context:.0f} tokens)"
        if self.pins.strategy:
            return base + ", as asked"
        return base + (f"; {note}" if note else "")

    def observe_round(self, strategy: str, offers: Sequence[tuple[int, int]]) -> None:
        if strategy == "eagle" and self.pins.static is None:
            self.acceptance.observe(offers)
        elif strategy in self.tree_rivals:
            self.tree_rivals[strategy].acceptance.observe(offers)

    def meter(self, strategy: str, prompt_len: int) -> Meter:
        eagle = self.drafters.get("eagle")
        dynamic = strategy == "eagle" and eagle is not None and eagle.tree.choices is None
        return Meter(self.profile, strategy, prompt_len, tree=eagle.tree if dynamic else None)

    @property
    def probe_due(self) -> bool:
        """Whether the next turn tries the rung above (a pinned ladder has one rung: never)."""
        return self.rung > 0 and self.since_probe >= PROBE_EVERY

    def end_turn(self, turn: Turn) -> None:
        """Record a finished turn; step down the ladder after slow turns, back up after a won probe."""
        self.turns.append(turn)
        self.record(turn)
        if turn.strategy in RIVALS and not self.pins.strategy:
            return   # a rival's speed is its own record; the ladder stays where it was
        self.draft_clock.add(turn)
        if self.keep is not None and turn.strategy == "eagle":
            self.keep(self.acceptance)
        measured, trial, self.trial = turn.speedup, self.trial, None
        if measured is None or turn.tokens < MIN_TURN_TOKENS:
            return  # too short to judge: a due probe stays due
        if self.planned is not None and self.planned.rung in self.rungs and self.rungs.index(self.planned.rung) > self.rung:
            return  # a rung below the ladder's, planned because those above were predicted slow: its record judges it
        if trial is not None:
            self._judge_probe(trial, turn)
            return  # a lost probe says nothing about the rung the ladder stays on
        self.since_probe += 1
        if self.rungs[self.rung] == "plain":
            return
        self.runs = [*self.runs, turn][-RIVAL_RUNS:]
        mean = token_mean(self.runs)
        slow = len(self.runs) >= DEMOTE_TURNS and mean < SLOWER_THAN_PLAIN
        clearly = measured < CLEARLY_SLOWER and turn.tokens >= CLEAR_TOKENS
        if (slow or clearly) and self.rung < len(self.rungs) - 1:
            if self._replan(measured):
                return
            self.demoted = (f"{LABELS[self.rungs[self.rung]]} measured {mean:.2f}x plain over {len(self.runs)} turns"
                            if slow else
                            f"{LABELS[self.rungs[self.rung]]} measured {measured:.2f}x plain (< {CLEARLY_SLOWER})")
            self.rung, self.runs, self.since_probe, self.replanned = self.rung + 1, [], 0, False
            self.probed = []   # a probe of the rung above this one, left short, is not this rung's

    def _judge_probe(self, trial: int, turn: Turn) -> None:
        """A probe is judged like a rung's exit, over CLEAR_TOKENS tokens or more: one 31-token answer
        measured 0.78x in the page ran 1.34x through the API. Until then it stays due."""
        self.probed = [*self.probed, turn]
        if sum(t.tokens for t in self.probed) < CLEAR_TOKENS:
            return
        mean = token_mean(self.probed)
        self.since_probe, self.probed = 0, []
        if mean >= DEMOTE_BELOW:
            self.demoted = f"{LABELS[self.rungs[trial]]} probed at {mean:.2f}x plain: back up"
            self.rung, self.runs, self.replanned = trial, [], False

    def _replan(self, measured: float) -> bool:
        """Whether a slow turn on an EAGLE rung ran a shape that the acceptance it taught no longer
        picks (a first turn planned from the head's held-out prior, 2.6 tokens a round predicted
        where MT-bench gave 1.8): then the rung runs its new best shape before it can be left,
        once per visit. Otherwise one mis-planned turn sent a 1.15x EAGLE to plain decoding."""
        plan, rung = self.planned, self.rungs[self.rung]
        if self.replanned or plan is None or plan.rung != rung or rung not in ("tree", "chain") or self.pins.static is not None:
            return False
        shape = self.shape(rung, self.planned_context, self.draft_clock.scale)
        if shape.tree == plan.tree:
            return False
        old, new = plan.tree, shape.tree
        self.replanned, self.runs = True, []
        self.demoted = (f"d{old.depth}k{old.top_k}n{old.total_tokens} measured {measured:.2f}x plain: "
                        f"re-planned to d{new.depth}k{new.top_k}n{new.total_tokens} on what it taught")
        return True


def token_mean(turns: Sequence[Turn]) -> float:
    """The turns' measured speedup, each weighed by its tokens: a rung's or a probe's verdict."""
    return sum(t.tokens * t.speedup for t in turns) / sum(t.tokens for t in turns)
