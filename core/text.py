"""From chat messages to streamed text: the chat template, context trimming, incremental
detokenization and stop strings. Everything here is text <-> token ids; the engine below it knows
only ids, the UI above it knows only text and `ReplyEvent`s.
"""

import time
from dataclasses import dataclass
from typing import Generator, Iterator, Sequence

from core.config import ReplyEvent, Spans
from core.errors import AerieError, ContextOverflowError

REPLACEMENT_CHAR = "\ufffd"  # what a decoder prints for an incomplete UTF-8 sequence


def render_prompt(tokenizer, messages: list[dict], system_prompt: str = "") -> list[int]:
    """The model's own chat template, ready for the assistant to answer (no system message =
    the template's default)."""
    chat = ([{"role": "system", "content": system_prompt}] if system_prompt.strip() else []) + list(messages)
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


@dataclass(frozen=True)
class FittedPrompt:
    ids: list[int]
    dropped_turns: int   # user turns (with their answers) left out to fit the context


def fit_context(tokenizer, messages: list[dict], system_prompt: str, budget: int) -> FittedPrompt:
    """Drop the oldest user turns (each with the answers after it) until the prompt fits `budget`
    tokens. The last user message is never dropped; if it alone does not fit, that is an error."""
    starts = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not starts:
        raise AerieError("There is no user message to answer.")
    for dropped, start in enumerate(starts):
        ids = render_prompt(tokenizer, messages[start:], system_prompt)
        if len(ids) <= budget:
            return FittedPrompt(ids, dropped)
    raise ContextOverflowError(
        f"Your message is too long for this model: it needs {len(ids)} tokens and the context leaves {budget}.",
        answer_room=True)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas. Decoding a window that starts a few
    tokens back keeps the tokenizer's spacing rules right; a delta that ends in U+FFFD (an
    incomplete multi-byte character split across tokens) is held back until it completes."""

    def __init__(self, tokenizer, context: int = 5):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0   # start of the decode window
        self.read = 0     # ids[:read] are already emitted
        self.context = context

    def push(self, new_ids) -> str:
        self.ids.extend(new_ids)
        window = self.tokenizer.decode(self.ids[self.prefix:], skip_special_tokens=True)
        emitted = self.tokenizer.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        if window.endswith(REPLACEMENT_CHAR) or not window.startswith(emitted):
            return ""
        self.read = len(self.ids)
        self.prefix = max(self.prefix, self.read - self.context)
        return window[len(emitted):]


def merge_spans(spans: Sequence[tuple[str, bool]]) -> Spans:
    """Adjacent pieces from the same source joined, empty ones dropped."""
    out: list[tuple[str, bool]] = []
    for text, drafted in spans:
        if text and out and out[-1][1] == drafted:
            out[-1] = (out[-1][0] + text, drafted)
        elif text:
            out.append((text, drafted))
    return tuple(out)


def coalesced(events: Generator[ReplyEvent, None, None], every_s: float) -> Iterator[ReplyEvent]:
    """`events` merged so that at most one comes out every `every_s` seconds: those up to the first
    text (the time to the first token), one with a notice and the last at once, the rest held and
    merged into the next; held text still comes out before a failure is raised. A reader on another
    thread wakes per event it gets, and each wake needs the GIL the engine's next round wants.
    Closing this closes `events`."""
    held, shown_at, texted = None, 0.0, False
    try:
        for event in events:
            held = event if held is None else joined_events(held, event)
            now = time.monotonic()
            if not texted or held.finish or held.notice or now - shown_at >= every_s:
                shown_at, texted = now, texted or bool(held.delta)
                yield held
                held = None
    except Exception:
        if held is not None:
            yield held
        raise
    finally:
        events.close()
    if held is not None:
        yield held


def joined_events(first: ReplyEvent, then: ReplyEvent) -> ReplyEvent:
    """One event for two in a row: both deltas, the later stats and finish, a notice if either had one."""
    return ReplyEvent.of(merge_spans(first.pieces + then.pieces), then.stats, first.notice or then.notice, then.finish)


def split_spans(spans: Spans, at: int) -> tuple[Spans, Spans]:
    """Spans cut at character `at` of their joined text."""
    head, tail, seen = [], [], 0
    for text, drafted in spans:
        cut = min(max(at - seen, 0), len(text))
        head.append((text[:cut], drafted))
        tail.append((text[cut:], drafted))
        seen += len(text)
    return merge_spans(head), merge_spans(tail)


def round_spans(detok: "IncrementalDetokenizer", new_ids: Sequence[int], accepted: int) -> Spans:
    """One round's text by source: its first `accepted` tokens were drafted, the last is the
    target's own. Two pushes, so each piece decodes with its own tokens; text the detokenizer held
    back (half a character) goes with the push that completes it."""
    drafted = detok.push(new_ids[:accepted]) if accepted else ""
    return merge_spans(((drafted, True), (detok.push(new_ids[accepted:]), False)))


class StopMatcher:
    """Finds stop strings in streamed text. Text that could still become a stop string is held
    back, so the user never sees half of one. Held-back text keeps its source (`push_spans`)."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.pending: Spans = ()

    def push(self, text: str) -> tuple[str, bool]:
        """-> (text safe to show, whether a stop string was hit)."""
        spans, hit = self.push_spans(((text, False),))
        return "".join(t for t, _ in spans), hit

    def push_spans(self, spans: Spans) -> tuple[Spans, bool]:
        """`push` for text in (piece, drafted) pairs -> (the pairs safe to show, hit)."""
        self.pending = merge_spans(self.pending + tuple(spans))
        text = "".join(t for t, _ in self.pending)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = split_spans(self.pending, min(hits))[0], ()
            return out, True
        hold = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        out, self.pending = split_spans(self.pending, len(text) - hold)
        return out, False

    def flush(self) -> str:
        return "".join(t for t, _ in self.flush_spans())

    def flush_spans(self) -> Spans:
        out, self.pending = self.pending, ()
        return out
