"""Frozen settings shared by every layer. No torch here: app/ builds these from UI controls."""

from dataclasses import dataclass

from models.quants import QUANTS  # noqa: F401  (re-exported for app/, which imports core only)


# Every drafter by name (core/spec/), cheapest first: what --strategy, the API's aerie.strategy and the bench accept.
DRAFTERS = ("plain", "prompt_lookup", "lookahead", "layer_skip", "medusa", "eagle")
# Which rows of an EAGLE-1 head's draft vocabulary it drafts from (--draft-rows; core/service/drafters.py narrow_rows).
DRAFT_ROWS = ("auto", "narrow", "wide")
# The drafters' names (ReplyStats.strategy) as people read them, the one place they are worded: the page's
# stats line ends with one (app/answers.py), and bench --page reads it back (core/served_page.py).
STRATEGY_LABELS = {"plain": "plain decoding", "prompt_lookup": "prompt lookup", "lookahead": "lookahead",
                   "layer_skip": "layer skip", "medusa": "Medusa heads", "eagle": "EAGLE head"}
TUNED = "Aerie: tuned"      # the app's line once its engine runs compiled and its tuner plans (bench --serve waits for it)
PLANNED_CONTEXT = 8192      # KV tokens the plan keeps room for (or the model's context, if shorter)


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0   # 0 = greedy (argmax); > 0 divides the logits
    top_p: float = 1.0         # keep the smallest set of tokens whose mass reaches top_p
    top_k: int = 0             # keep the k most likely tokens; 0 = no limit
    seed: int | None = None    # None = a fresh seed per generation
    max_new_tokens: int = 512

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class ReplyStats:
    """Cumulative numbers for one answer; `accept_len` is the mean accepted length (tokens gained
    per target forward, the bonus token included, reference rounds left out)."""

    new_tokens: int = 0
    elapsed_s: float = 0.0
    prefill_s: float = 0.0     # of elapsed_s, the time to the prefill's token: the time to the first token
    target_steps: int = 0      # target forwards (verify rounds) spent on this answer
    drafted: int = 0           # the most draft tokens the rounds could accept (sum of tree depths)
    accepted: int = 0          # draft tokens the target accepted
    strategy: str = "plain"    # which drafter produced the tree: plain, prompt_lookup, eagle
    prompt_tokens: int = 0     # the prompt as the model saw it: chat template applied, old turns trimmed
    round_tokens: int = 0      # tokens from the rounds after the prefill...
    round_s: float = 0.0       # ...and those rounds' engine time (draft + verify + commit)
    plain_ms: float | None = None  # plain decoding's ms per token at this context (core/tune/meter.py)
    reference_rounds: int = 0  # of target_steps, plain rounds timed for plain_ms (one token each)
    tuning: str = ""           # the tuner's choice for this answer and its reason, one line

    @property
    def tok_s(self) -> float:
        return self.new_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second after the first (the prefill's): what speculation changes. A prompt
        read from the cache (a rerun, a chat's history) takes less prefill, never fewer rounds."""
        seconds = self.elapsed_s - self.prefill_s
        return (self.new_tokens - 1) / seconds if self.new_tokens > 1 and seconds > 0 else 0.0

    @property
    def accept_len(self) -> float:
        drafted_steps = self.target_steps - self.reference_rounds
        return (self.new_tokens - self.reference_rounds) / drafted_steps if drafted_steps else 0.0

    @property
    def speedup(self) -> float | None:
        """Measured speed over plain decoding: tokens per second of engine time in the rounds,
        times plain decoding's time per token then (core/tune/meter.py)."""
        if not self.plain_ms or self.round_s <= 0:
            return None
        return self.round_tokens / self.round_s * self.plain_ms / 1000

    @property
    def accept_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


Spans = tuple[tuple[str, bool], ...]  # text as (piece, drafted) pairs, in order


@dataclass(frozen=True)
class ReplyEvent:
    """One streamed piece of an answer: `delta` is the text added since the previous event."""

    delta: str
    stats: ReplyStats
    notice: str | None = None   # e.g. "Dropped the 2 oldest turns to fit the context."
    finish: str | None = None   # None while streaming; then "eos", "stop", "length" or "cancelled"
    # `delta` split by where its tokens came from: drafted = draft tokens the target accepted, else
    # the target's own token of the round. Empty when the source does not say (all the target's own).
    spans: Spans = ()

    def __post_init__(self):
        if self.spans and "".join(text for text, _ in self.spans) != self.delta:
            raise ValueError("ReplyEvent spans must add up to its delta")

    @classmethod
    def of(cls, spans: Spans, stats: ReplyStats, notice: str | None = None,
           finish: str | None = None) -> "ReplyEvent":
        return cls("".join(text for text, _ in spans), stats, notice, finish, spans)

    @property
    def pieces(self) -> Spans:
        """The delta as (text, drafted) pairs, whether or not the source split it."""
        if self.spans:
            return self.spans
        return ((self.delta, False),) if self.delta else ()


# A copy round's chain: 3 tokens, a 4-token verify. MT-bench, 16 prompts x 128 tokens, 2-core Zen 4,
# EAGLE d0k1n2 in one bench run: no copy 1.19x plain, copy 2 1.21x, 3 1.25x, 5 1.12x (an 8-token
# verify); extraction 1.07x -> 1.31x, coding 1.23x -> 1.32x.
COPY_TOKENS = 3


@dataclass(frozen=True)
class TreeConfig:
    """EAGLE-2 dynamic tree shape (eagle.md 0.6): the longest draft is depth + 1 tokens."""

    depth: int = 5          # expansion steps after the root's children
    top_k: int = 8          # children per expanded node, and frontier width
    total_tokens: int = 32  # tokens the target verifies per round, root included
    # EAGLE-1 static tree instead: paths of top-k ranks from the root, e.g. core.spec.tree.MC_SIM_7B_63.
    # When set, depth/top_k/total_tokens are ignored: the shape is fixed.
    choices: tuple[tuple[int, ...], ...] | None = None
    # SpecExec's best-first tree instead (a slow, offloaded target): the best total_tokens - 1 nodes
    # by cumulative draft log-prob, top_k nodes fed per head step, at most depth head steps.
    best_first: bool = False
    # EAGLE's copy rounds: where the context's last 2-3 tokens appeared earlier in it (prompt lookup),
    # draft the `copy` tokens that followed them then, with no head step, in place of a tree of at
    # most copy + 1 tokens (core/spec/eagle.py `copy_round`); 0 = never.
    copy: int = COPY_TOKENS

    def __post_init__(self):
        if self.depth < 0 or self.top_k < 1 or self.total_tokens < 1 or self.copy < 0:
            raise ValueError(f"bad tree shape {self}")

    @property
    def copy_sized(self) -> bool:
        """Copying is on and the tree is no bigger than a copied chain: a copy round may stand in for
        it; a bigger tree takes the chain grafted in instead (core/spec/eagle.py)."""
        return self.copy > 0 and self.total_tokens <= self.copy + 1


@dataclass(frozen=True)
class ModelChoice:
    """What the user asked to load (command line or the page's Model panel)."""

    model: str | None = None     # Hub id, folder, or None for the embedded default
    quant: str | None = None     # nf4, none, or None for the device's default
    head: str | None = None      # Hub id, folder, "random", "" for none, or None for the model's default
