"""What the chat page does, as plain functions that Gradio calls and tests call without a browser.

The service (built in launch.py) answers chats and loads models; these functions turn the page's
raw values into its calls and its events back into page updates. They know nothing about torch
or tokens: the service streams text deltas with running `ReplyStats`. A chat here is a list of
records: {"role", "content"}, answers with "meta" (app/answers.py says what it holds).
"""

import html
import logging
import math
import threading
from collections.abc import Iterator
from typing import Any

import gradio as gr

from app.answers import Answer, Request, format_stats, plain_text, strategy_label
from core.config import SamplingConfig
from core.errors import AerieError
from core.service.contract import ChatServiceApi

log = logging.getLogger(__name__)
# The page shows a streaming answer at most this often (and always its end: the service merges the
# rounds between, `reply(every_s=...)`). Each update costs the
# engine ~30-40 ms of the 2 cores (Gradio's diff and stream, Chromium's redraw; two busy threads lose
# more than the CPU time taken, as one waits for the other): on the AMX Xeon, plain decoding of 128
# tokens took 1.06 s in the page at 0.1 s against 0.72 through the API. Six MT-bench answers x 128
# tokens, the page against the API on one server (2026-12-06, a noisy host, alternated runs): 0.25 s
# 0.91 / 0.97 / 0.87 / 0.94, 0.5 s 1.01 / 0.93 / 1.04; only the end shown 1.06.
SHOW_EVERY_S = 0.5

Chat = list[dict[str, Any]]


class SettingsError(AerieError):
    """A settings value the user typed cannot be used; the message names the field."""


class Cancels:
    """The cancel flag of each browser session's running reply, keyed by session hash.

    It lives in build_ui, not in gr.State: State values are deep-copied, and the Event must be
    the very object the service polls between steps. A reply cancelled by Clear is also marked
    discarded, so that its last updates do not bring the cleared chat back.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._events: dict[str, threading.Event] = {}
        self._discarded: set[int] = set()  # ids of running events whose output the page threw away

    def start(self, key: str) -> threading.Event:
        event = threading.Event()
        with self._lock:
            self._events[key] = event
        return event

    def cancel(self, key: str, discard: bool = False) -> bool:
        with self._lock:
            event = self._events.get(key)
            if event is not None and discard:
                self._discarded.add(id(event))
        if event is not None:
            event.set()
        return event is not None

    def discarded(self, event: threading.Event) -> bool:
        with self._lock:
            return id(event) in self._discarded

    def finish(self, key: str, event: threading.Event) -> None:
        with self._lock:
            self._discarded.discard(id(event))
            if self._events.get(key) is event:
                del self._events[key]


# ---------------------------------------------------------------- history and settings


def _field(message: Any, name: str) -> Any:
    return message.get(name) if isinstance(message, dict) else getattr(message, name, None)


def content_text(content: Any) -> str:
    """The text of a message's content: a str, one part, or a list of parts (files are skipped)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return (content.get("text") or "") if content.get("type", "text") == "text" else ""
    if isinstance(content, (list, tuple)):
        return "\n".join(t for t in map(content_text, content) if t)
    return ""


def normalise_history(history: Any) -> Chat:
    """The chat as plain {"role", "content": str} dicts; Gradio 6 hands content back as parts.
    What the page added around the text (stats rows, highlighting) is left out."""
    chat = []
    for message in history or []:
        role = _field(message, "role")
        metadata = _field(message, "metadata") or {}
        if role not in ("user", "assistant") or metadata.get("title"):
            continue  # system rows and "thought" bubbles are display-only
        text = content_text(_field(message, "content"))
        text = plain_text(text) if role == "assistant" else text
        meta = _field(message, "meta")  # a stored answer's; the page never sends one back
        if text or role == "user":
            chat.append({"role": role, "content": text, "meta": meta} if role == "assistant" and meta
                        else {"role": role, "content": text})
    return chat


def service_messages(chat: Chat) -> Chat:
    """What the service sees: empty turns dropped, runs of one role merged (after a failed reply
    the next user message follows an unanswered one; chat templates want roles to alternate)."""
    merged: Chat = []
    for message in chat:
        if not message["content"].strip():
            continue
        if merged and merged[-1]["role"] == message["role"]:
            merged[-1] = {"role": message["role"], "content": merged[-1]["content"] + "\n\n" + message["content"]}
        else:
            merged.append({"role": message["role"], "content": message["content"]})  # never an answer's meta
    return merged


def _number(value: Any, label: str, whole: bool = False) -> float:
    try:
        number = float(str(value).strip()) if isinstance(value, str) else float(value)
    except (TypeError, ValueError):
        raise SettingsError(f"{label} must be a number, got {value!r}.") from None
    if not math.isfinite(number):
        raise SettingsError(f"{label} must be a finite number, got {value!r}.")
    if whole and number != int(number):
        raise SettingsError(f"{label} must be a whole number, got {value!r}.")
    return int(number) if whole else number


def parse_settings(temperature: Any, top_p: Any, top_k: Any, seed: Any, max_new_tokens: Any) -> SamplingConfig:
    """The sampling settings as typed in the page, checked; raises SettingsError naming the field."""
    temperature = _number(temperature, "Temperature")
    top_p = _number(top_p, "Top-p")
    top_k = _number(top_k, "Top-k", whole=True)
    max_new = _number(max_new_tokens, "Max new tokens", whole=True)
    blank_seed = seed is None or (isinstance(seed, str) and not seed.strip())
    seed = None if blank_seed else _number(seed, "Seed", whole=True)
    checks = [
        (temperature >= 0, "Temperature must be 0 (greedy) or more."),
        (0 < top_p <= 1, "Top-p must be above 0 and at most 1."),
        (top_k >= 0, "Top-k must be 0 (no limit) or more."),
        (max_new >= 1, "Max new tokens must be at least 1."),
        (seed is None or -1 <= seed < 2**63, "Seed must be -1 (random) or a number from 0 to 2^63-1."),
    ]
    for ok, message in checks:
        if not ok:
            raise SettingsError(message)
    seed = None if seed == -1 else seed
    return SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, max_new_tokens=max_new)


def parse_stop_strings(text: Any) -> tuple[str, ...]:
    """Stop strings separated by commas or newlines; `\\n` and `\\t` stand for a newline and a tab."""
    pieces = str(text or "").replace("\n", ",").split(",")
    stops = (p.strip().replace("\\n", "\n").replace("\\t", "\t") for p in pieces)
    return tuple(dict.fromkeys(s for s in stops if s))


# ---------------------------------------------------------------- what the page shows


def shown_label(label: str) -> str:
    """The service's label, "model · device · precision · drafter", with the drafter named for
    people (answers.STRATEGY_LABELS) instead of as core names it."""
    model, sep, drafter = label.rpartition(" · ")
    return model + sep + strategy_label(drafter)


def header(label: str) -> str:
    return f"## Aerie\n<span class='aerie-label'>{html.escape(shown_label(label))}</span>"


def toast(level: str, message: str) -> None:
    """A toast in the page (shown only from queued events). Toasts render HTML, so escape it;
    Gradio 6.31 titles them by level and ignores a `title`, so the message must stand alone."""
    show = gr.Info if level == "info" else gr.Warning
    show(html.escape(message), duration=6 if level == "info" else 15)


def report(exc: Exception, what: str) -> None:
    """Tell the user about a failure without a traceback; unexpected ones go to the log in full."""
    if isinstance(exc, AerieError):
        log.info("Could not %s: %s", what, exc)
        toast("warning", str(exc) or f"Could not {what}.")
        return
    log.exception("Unexpected error while trying to %s", what)
    first_line = (str(exc).strip().splitlines() or [""])[0][:160]
    detail = f"{type(exc).__name__}: {first_line}" if first_line else type(exc).__name__
    toast("warning", f"Could not {what}: unexpected {detail}. The details are in the console.")


def controls(mode: str, clear_textbox: bool = False) -> tuple[dict, ...]:
    """Updates for (textbox, send, stop, regenerate, load, A/B, race) in a mode: idle, answering or loading."""
    idle, answering = mode == "idle", mode == "answering"
    textbox = gr.update(interactive=idle, value="") if clear_textbox else gr.update(interactive=idle)
    return (
        textbox,
        gr.update(interactive=idle, visible=not answering),
        gr.update(visible=answering),
        gr.update(interactive=idle),
        gr.update(interactive=idle),
        gr.update(interactive=idle),
        gr.update(interactive=idle),
    )


# ---------------------------------------------------------------- events


def session_key(request: Any) -> str:
    return getattr(request, "session_hash", None) or "local"


def _answer(service: ChatServiceApi, cancels: Cancels, key: str, chat: Chat, system_prompt: str,
            settings: tuple) -> Iterator[tuple[Chat, str]]:
    """Stream an answer to the last user turn of `chat`, yielding (chat, stats line); `settings`
    are the page's raw (temperature, top_p, top_k, seed, max_new_tokens, stop_text).

    On any failure the page keeps `chat` as it was (the user's turn stays, no half answer) and
    the user gets a toast. The cancel flag is set on the way out, so a closed page stops the work.
    """
    cancel = cancels.start(key)
    answer, notices = Answer(), set()
    try:
        *numbers, stop_text = settings
        request = Request(system_prompt or "", parse_settings(*numbers), parse_stop_strings(stop_text))
        # Each update re-sends and re-renders the whole chat: at a round's pace (~100 a second on a
        # CPU) that work took most of a 2-core machine from the engine. The service merges the rounds.
        events = service.reply(service_messages(chat), request.system_prompt, request.sampling, request.stops,
                               cancel, every_s=SHOW_EVERY_S)
        for event in events:
            answer = answer.add(event)
            if event.notice and event.notice not in notices:
                notices.add(event.notice)
                toast("info", event.notice)
            if not cancels.discarded(cancel):
                shown = [answer.record(request)] if answer.text else []
                yield chat + shown, format_stats(answer.stats, event.finish)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a toast; unexpected ones are logged
        report(exc, "answer")
        if not cancels.discarded(cancel):
            yield chat, format_stats(answer.stats, "error") if answer.stats else ""
    finally:
        cancel.set()
        cancels.finish(key, cancel)


def sent_chat(message: Any, history: Any) -> Chat | None:
    """`history` with the user's message as its last turn, once (the page draws a message in the chat
    as it sends it, so it may be there already); None for an empty message."""
    text = content_text(message).strip()
    if not text:
        return None
    chat, turn = normalise_history(history), {"role": "user", "content": text}
    return (chat[:-1] if chat[-1:] == [turn] else chat) + [turn]


def respond(service: ChatServiceApi, cancels: Cancels, message: Any, history: Any, system_prompt: str,
            temperature: Any, top_p: Any, top_k: Any, seed: Any, max_new_tokens: Any, stop_text: Any,
            request: gr.Request | None = None) -> Iterator[tuple[Chat, str]]:
    """Add the user's message to the chat and stream the answer (the page drew the message itself)."""
    chat = sent_chat(message, history)
    if chat is None:
        yield gr.skip(), gr.skip()
        return
    settings = (temperature, top_p, top_k, seed, max_new_tokens, stop_text)
    yield from _answer(service, cancels, session_key(request), chat, system_prompt, settings)


def regenerate(service: ChatServiceApi, cancels: Cancels, history: Any, system_prompt: str,
               temperature: Any, top_p: Any, top_k: Any, seed: Any, max_new_tokens: Any, stop_text: Any,
               request: gr.Request | None = None) -> Iterator[tuple[Chat, str]]:
    """Drop the last answer and answer the last user turn again."""
    chat = normalise_history(history)
    users = [i for i, m in enumerate(chat) if m["role"] == "user"]
    if not users:
        toast("info", "There is no message to answer yet.")
        yield gr.skip(), gr.skip()
        return
    chat = chat[: users[-1] + 1]
    yield chat, "…"
    settings = (temperature, top_p, top_k, seed, max_new_tokens, stop_text)
    yield from _answer(service, cancels, session_key(request), chat, system_prompt, settings)


def stop(cancels: Cancels, request: gr.Request | None = None) -> None:
    """Stop this session's running reply; the service ends it and the partial answer stays."""
    cancels.cancel(session_key(request))


def clear(cancels: Cancels, request: gr.Request | None = None) -> tuple:
    """Empty the chat and the stats line; a reply still running is stopped, the page unlocked."""
    cancels.cancel(session_key(request), discard=True)
    return ([], "", *controls("idle"))
