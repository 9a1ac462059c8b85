"""From chat messages to streamed text: the chat template, context trimming, incremental
detokenization and stop strings. Everything here is text <-> token ids; the engine below it knows
only ids, the UI above it knows only text and `ReplyEvent`s.
"""

import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterator

from core.config import ReplyEvent, ReplyStats, SamplingConfig
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
        f"Your message is too long for this model: it needs {len(ids)} tokens and the context leaves {budget}. "
        "Shorten it, or lower 'max new tokens'.")


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


class StopMatcher:
    """Finds stop strings in streamed text. Text that could still become a stop string is held
    back, so the user never sees half of one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """-> (text safe to show, whether a stop string was hit)."""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        out, self.pending = self.pending[: len(self.pending) - hold], self.pending[len(self.pending) - hold:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class ChatService:
    """What the UI talks to: messages in, `ReplyEvent`s out. `loader(model, quant) -> Engine`
    is supplied by launch.py so the service can switch models without knowing how they load."""

    def __init__(self, engine, loader: Callable | None = None):
        self.engine = engine
        self.loader = loader
        self.default_system_prompt = ""

    @property
    def label(self) -> str:
        return f"{self.engine.target.label} · {self.engine.drafter.name}"

    def load_model(self, model: str, quant: str) -> str:
        if self.loader is None:
            raise RuntimeError("this ChatService was built without a model loader")
        self.engine.reset()  # free the KV cache first; the old weights stay until the new model loads
        self.engine = self.loader(model.strip() or None, quant)
        return self.label

    def reply(self, messages: list[dict], system_prompt: str, sampling: SamplingConfig,
              stop_strings: tuple[str, ...], cancel: threading.Event) -> Iterator[ReplyEvent]:
        engine, tokenizer = self.engine, self.engine.target.tokenizer
        budget = engine.target.context_len - min(sampling.max_new_tokens, engine.target.context_len // 2)
        fitted = fit_context(tokenizer, messages, system_prompt, budget)
        notice = (f"Dropped the {fitted.dropped_turns} oldest turn(s) to fit the model's context."
                  if fitted.dropped_turns else None)
        detok, stops = IncrementalDetokenizer(tokenizer), StopMatcher(stop_strings)
        stats, t0 = ReplyStats(strategy=engine.drafter.name), time.perf_counter()
        steps = engine.generate(fitted.ids, sampling, cancel)
        try:
            for step in steps:
                stats = replace(stats, new_tokens=stats.new_tokens + len(step.new_ids),
                                elapsed_s=time.perf_counter() - t0, target_steps=stats.target_steps + 1,
                                drafted=stats.drafted + step.drafted, accepted=stats.accepted + step.accepted)
                text, hit_stop = stops.push(detok.push(step.new_ids))
                finish = "stop" if hit_stop else step.finish
                if finish and not hit_stop:
                    text += stops.flush()  # the answer ended: held-back text was not a stop string
                yield ReplyEvent(text, stats, notice, finish)
                notice = None
                if finish:
                    return
            yield ReplyEvent(stops.flush(), stats, notice, "cancelled")
        finally:
            steps.close()  # frees the engine now, not when the generator is collected
