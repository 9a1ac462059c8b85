"""A/B: the last answer asked again with speculation off, both timings side by side.

The plain run asks exactly what the answer was asked (its stored system prompt, sampling settings
and stop strings), so under greedy decoding the two texts must match. It replaces nothing: the
comparison goes into the answer's meta["ab"] and shows in a row under it (app/answers.py), the
plain text folded inside. The service decodes that one run plainly and the tuner does not count
it as a turn (ChatService.reply's `strategy`), so the next answer speculates as before.
"""

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import gradio as gr

from app import answers, handlers
from app.answers import Answer, Request
from app.chats import stored_chat
from app.handlers import Cancels, Chat
from app.store import ChatStore, StoreError
from core.service.contract import ChatServiceApi

ACTION = "compare with plain decoding"


def _why_not(chat: Chat, verb: str) -> str | None:
    """Why the chat's last message cannot be compared (or raced: `verb`), or None if it can."""
    last = chat[-1] if chat else {}
    meta = last.get("meta") or {}
    if last.get("role") != "assistant":
        return f"The last message has no answer to {verb}: send or regenerate one first."
    if meta.get("stats") is None or "request" not in meta:
        return f"This answer was saved before Aerie kept answer statistics: regenerate it, then {verb}."
    if meta.get("finish") in (None, "cancelled", answers.INTERRUPTED):
        return f"The last answer was stopped before it ended: regenerate it, then {verb}."
    return None


def last_answer(store: ChatStore, chat_id: int | None, verb: str = "compare") -> tuple[Chat, Request] | None:
    """The chat whose last answer is to be compared (or raced), and what that answer was asked
    with; None (after telling the user why) when there is none."""
    if chat_id is None:
        handlers.toast("info", f"There is no answer to {verb} yet: send a message first.")
        return None
    try:
        chat = stored_chat(store, chat_id)
    except StoreError as exc:
        handlers.report(exc, ACTION if verb == "compare" else verb)
        return None
    why = _why_not(chat, verb)
    if why:
        handlers.toast("info", why)
        return None
    return chat, Request.from_dict(chat[-1]["meta"]["request"])


@dataclass(frozen=True)
class Rerun:
    """The last answer asked again (A/B, a race): what it was asked, and this run's Stop flag."""
    chat: Chat
    asked: Request
    key: str                   # the page session's, for Stop
    cancel: threading.Event
    shown: list[dict]          # the chat as the page shows it now


def begin(store: ChatStore, cancels: Cancels, chat_id: int | None, highlight: bool, request,
          verb: str = "compare") -> Rerun | None:
    """Start asking the chat's last answer again; None (after a toast saying why) if it cannot be."""
    found = last_answer(store, chat_id, verb)
    if found is None:
        return None
    key = handlers.session_key(request)
    return Rerun(*found, key, cancels.start(key), answers.view(found[0], highlight))


def streamed(cancels: Cancels, rerun: Rerun, updates: Iterator[tuple], action: str):
    """Yield `updates` (the page's, as the rerun streams); a failure becomes a toast naming
    `action`. Returns (`yield from`'s value) "cleared" when the page was cleared meanwhile (show
    nothing more), "failed", or "done"; in every case its Stop flag is released."""
    failed = False
    try:
        yield from updates
    except Exception as exc:  # noqa: BLE001 - every failure becomes a toast; unexpected ones are logged
        handlers.report(exc, action)
        failed = True
    finally:
        cleared = cancels.discarded(rerun.cancel)
        rerun.cancel.set()
        cancels.finish(rerun.key, rerun.cancel)
    return "cleared" if cleared else "failed" if failed else "done"


def _plain_run(service: ChatServiceApi, cancels: Cancels, cancel, chat: Chat,
               asked: Request) -> Iterator[tuple[Answer, str]]:
    """Stream the plain run: (answer so far, stats line) per event; the chat is left as it is
    (answers.running_line)."""
    plain = Answer()
    events = service.reply(handlers.service_messages(chat[:-1]), asked.system_prompt, asked.sampling, asked.stops,
                           cancel, strategy="plain", every_s=handlers.SHOW_EVERY_S)
    for event in events:
        plain = plain.add(event)
        if not cancels.discarded(cancel):
            yield plain, answers.running_line("A/B, plain decoding", plain)


def saved(store: ChatStore, chat_id: int, chat: Chat, key: str, record: dict, what: str) -> Chat:
    """The chat with `record` under `key` in its last answer's meta, saved (`what` names it in an error)."""
    last = {**chat[-1], "meta": {**chat[-1]["meta"], key: record}}
    chat = chat[:-1] + [last]
    try:
        store.sync(chat_id, chat)
    except StoreError as exc:
        handlers.report(exc, f"save the {what}")
    return chat


def compare(store: ChatStore, service: ChatServiceApi, cancels: Cancels, chat_id: int | None, highlight: bool,
            request: gr.Request | None = None) -> Iterator[tuple]:
    """A/B of the chat's last answer; yields (chatbot, stats line). Stop or a failure leaves the
    chat as it was: a half-finished plain run compares nothing."""
    rerun = begin(store, cancels, chat_id, highlight, request)
    if rerun is None:
        yield gr.skip(), gr.skip()
        return
    chat, asked, shown = rerun.chat, rerun.asked, rerun.shown
    runs = []

    def updates():
        for plain, line in _plain_run(service, cancels, rerun.cancel, chat, asked):
            runs[:] = [plain]
            yield gr.skip(), line
    outcome = yield from streamed(cancels, rerun, updates(), ACTION)
    if outcome == "cleared":
        return
    plain = runs[0] if runs else Answer()
    if outcome == "failed" or plain.finish in (None, "cancelled"):
        if outcome != "failed":
            handlers.toast("info", "A/B stopped before plain decoding finished: nothing was compared.")
        yield shown, ""
        return
    chat = saved(store, chat_id, chat, "ab", answers.ab_record(plain, asked), "comparison")
    yield answers.view(chat, highlight), answers.ab_verdict(chat[-1]["meta"], chat[-1]["content"])
