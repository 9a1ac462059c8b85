"""The Chats panel: which saved chat the page shows, and answers written into the store as they stream.

The chat list (a gr.Radio) is the page's only chat state: its value is the id of the chat shown,
None for a new chat. It holds the LISTED most recent chats, or those the Find box finds, and
always the chat shown. A new chat is stored when its first message is sent, so "New chat" leaves
no empty chats behind. The store, not the page, holds what a chat says: answers start from the
stored messages, so a tab showing an older copy of a chat cannot erase what another tab added.

Every `view` is the tuple (chat list, chatbot, stats line, title box, export box), the outputs
ui.py wires. A view that shows another chat hides the export box: its file is the old chat's.
The chatbot shows `answers.view` of the stored records: each answer with its statistics under it,
its drafted text marked when `highlight` (the page's checkbox) is on.
"""

import logging
import math
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gradio as gr

from app import answers, handlers
from app.handlers import Cancels, Chat
from app.private import write_private
from app.store import ChatNotFoundError, ChatStore, StoreError
from core.service.contract import ChatServiceApi

log = logging.getLogger(__name__)

# While an answer streams it is saved at most this often (and always when it ends, stops or
# fails): killing the app loses at most the text shown in the last half second.
SAVE_EVERY_S = 0.5
# An export's own file is deleted at the next export this long after it was written: by then
# Gradio has copied it into its cache (which ui.EXPORT_CACHE sweeps) and serves that copy.
EXPORT_KEEP_S = 60.0
EXPORTS = {"json": (ChatStore.export_json, ".json"), "markdown": (ChatStore.export_markdown, ".md")}
# Chats the list holds. Each list sent is redrawn whole, and every event the page sends copies
# every component's value first: with all of 1,000 saved chats listed, the first answer of a new
# chat cost Chromium ~0.4 s more and the page answered at 0.71x the API's speed, against 0.90x
# with one (2-core Zen 4). Older chats are a Find away.
LISTED = 40


class Finds:
    """What each browser session's Find box holds, by session hash: every chat list sent to that
    session (an answer's end, a rename, a delete) lists what it finds, as the box says. The last
    `SESSIONS` sessions that searched are kept (a reload starts a new session; Gradio's unload
    event, which would say when one ends, keeps a heartbeat stream open from every page)."""

    SESSIONS = 64

    def __init__(self):
        self._lock = threading.Lock()
        self._texts: dict[str, str] = {}   # oldest search first

    def text(self, request: Any) -> str:
        with self._lock:
            return self._texts.get(handlers.session_key(request), "")

    def set(self, request: Any, text: str) -> None:
        with self._lock:
            key = handlers.session_key(request)
            self._texts.pop(key, None)
            if text:
                self._texts[key] = text
                while len(self._texts) > self.SESSIONS:
                    del self._texts[next(iter(self._texts))]


class _Recorder:
    """Saves what the page shows of one chat into the store, throttled to SAVE_EVERY_S: the
    newest unsaved state waits for the next offer or for flush(). A store failure is told once;
    the answer goes on, unsaved."""

    def __init__(self, store: ChatStore, chat_id: int, new: bool = False, first: bool = False,
                 found: Callable[[], str] = str):
        self.store, self.chat_id, self.new = store, chat_id, new  # new: created for this answer
        self.first = first   # the newest chat when the answer started: the list keeps its order
        self.found = found   # -> the Find box's text now: the list sent at the end lists what it finds
        self.pending: Chat | None = None
        self.shown: Chat | None = None  # the last chat offered, saved or not
        self.saved_at = -math.inf
        self.failed = False

    def offer(self, chat: Chat) -> None:
        self.pending = self.shown = chat
        if time.monotonic() - self.saved_at >= SAVE_EVERY_S:
            self.flush()

    def interrupt(self) -> None:
        """The page went away mid-answer: save what it showed last, its answer marked as cut off
        (answers.interrupted), even if that state was already saved unmarked."""
        if self.shown is not None:
            self.pending = answers.interrupted(self.shown)
        self.flush()

    def flush(self) -> None:
        if self.pending is None or self.failed:
            return
        chat, self.pending = self.pending, None
        try:
            self.store.sync(self.chat_id, chat)
        except StoreError as exc:
            self.failed = True
            _unsaved(exc)
        self.saved_at = time.monotonic()


def _unsaved(exc: StoreError) -> None:
    log.warning("Chat not saved: %s", exc)
    handlers.toast("warning", f"{exc} This chat is not being saved.")


def stored_chat(store: ChatStore, chat_id: int) -> Chat:
    return [{"role": m.role, "content": m.content, **({"meta": m.meta} if m.meta else {})}
            for m in store.messages(chat_id)]


def _list(store: ChatStore, chat_id: int | None, found: str = "") -> dict:
    """The chat list, newest first: the LISTED most recent chats, or those whose title or messages
    hold `found`, and `chat_id` selected (listed first if it is not among them: the list's value is
    the chat the page shows). Only where its chats or their order changed: the page redraws every
    option of a list sent, where a selection alone redraws none."""
    listed = store.chats(LISTED, found)
    if chat_id is not None and all(c.id != chat_id for c in listed):
        listed = [store.chat(chat_id), *listed[:LISTED - 1]]
    return gr.update(choices=[(c.title, c.id) for c in listed], value=chat_id)


def _no_export() -> dict:
    """The export box emptied and hidden."""
    return gr.update(value=None, visible=False)


def _view(store: ChatStore, chat_id: int | None, highlight: bool = False, listed: bool = True,
          found: str = "") -> tuple:
    """The page showing chat `chat_id` (None: an empty one); `listed`: with the chat list (what
    `found` finds), else only its selection (the chats and their order are as the page has them)."""
    shown = _list(store, chat_id, found) if listed else gr.update(value=chat_id)
    if chat_id is None:
        return shown, [], "", "", _no_export()
    title, history = store.chat(chat_id).title, stored_chat(store, chat_id)
    return shown, answers.view(history, highlight), "", title, _no_export()


def _skip_view() -> tuple:
    return (gr.skip(),) * 5


# ---------------------------------------------------------------- answering into a chat


def _open(store: ChatStore, chat_id: int | None, page_history: Any, create: bool,
          found: Callable[[], str] = str) -> tuple[_Recorder | None, Any]:
    """The recorder for the chat an answer goes into (a new chat is created when `create`) and
    the history to answer from. If the store fails, the answer still comes from the page's
    history, unsaved, and the user is told."""
    try:
        if chat_id is None:
            return (_Recorder(store, store.create_chat().id, new=True, found=found) if create else None), page_history
        newest = store.chats(1)
        first = newest[0].id == chat_id if newest else False
        return _Recorder(store, chat_id, first=first, found=found), stored_chat(store, chat_id)
    except StoreError as exc:
        _unsaved(exc)
        return None, page_history


def _listing(store: ChatStore, recorder: _Recorder) -> tuple[dict, Any] | None:
    """The chat list with the answered chat selected, and its title for the title box if new;
    neither where the answered chat was the newest already (the list stays as it is)."""
    if recorder.first and not recorder.new:
        return gr.skip(), gr.skip()
    try:
        return (_list(store, recorder.chat_id, recorder.found()),
                store.chat(recorder.chat_id).title if recorder.new else gr.skip())
    except StoreError as exc:
        _unsaved(exc)
        return None


def _recorded(store: ChatStore, recorder: _Recorder | None, stream: Iterator, highlight: bool) -> Iterator[tuple]:
    """The (chat, stats) updates of `stream`, each saved as it passes and shown as `answers.view`
    (streaming: without the answer's stats row) until the one where the answer has ended, shown
    whole (its stats row under it) with the chat list and title box (a new chat appears with its
    title, an old one moves to the top; sent with the first update, their redraw in the browser took
    the engine's cores during the prefill) and `answered` (the page unlocks its controls on it). That
    last update leaves at once, not after the service's work behind the answer (the tuner's turn)
    and not as a second copy of the text (one redraw fewer). A stream that ends otherwise (a failure,
    no answer) gets its last update so after its end. Closed before that, it saves the answer
    marked interrupted."""
    ended, shown, last = False, (gr.skip(), gr.skip()), None
    try:
        for chat, stats in stream:
            if ended:
                continue   # nothing follows an answer's end but the stream's own
            if isinstance(chat, list):
                if recorder is not None:
                    recorder.offer(chat)
                last = chat
                if answers.finished(chat):
                    yield _done(store, recorder, answers.view(chat, highlight), stats)
                    ended = True
                    continue
                chat = answers.view(chat, highlight, streaming=True)
            shown = chat, stats
            yield *shown, gr.skip(), gr.skip(), gr.skip()
        if not ended:
            yield _done(store, recorder, answers.view(last, highlight) if last is not None else shown[0], shown[1])
            ended = True
    finally:
        stream.close()  # a closed page: stop the engine first, then save what was shown
        if recorder is not None and not ended:  # Gradio closed this generator: page closed, reloaded or cleared
            recorder.interrupt()
        elif recorder is not None:
            recorder.flush()


def _done(store: ChatStore, recorder: _Recorder | None, chat: Any, stats: Any) -> tuple:
    """An answer's last update: (chat, stats, chat list, title box, answered)."""
    listing = _listing(store, recorder) if recorder is not None else None
    return chat, stats, *(listing or (gr.skip(), gr.skip())), answered()


def answered() -> float:
    """A new value for the page's hidden `answered` number, the last output of respond and
    regenerate: its change unlocks the controls in the page (ui.py) with the answer's last update,
    not after the event's completion (a round trip and the store's last write later). Only a
    failed event unlocks them afterwards."""
    return time.monotonic()


def respond(store: ChatStore, service: ChatServiceApi, cancels: Cancels, chat_id: int | None, message: Any, history: Any,
            system_prompt: str, temperature: Any, top_p: Any, top_k: Any, seed: Any, max_new_tokens: Any,
            stop_text: Any, highlight: bool = False, request: gr.Request | None = None,
            finds: Finds | None = None) -> Iterator[tuple]:
    """handlers.respond into chat `chat_id` (None: a new chat), saved as it streams;
    yields (chat, stats, chat list, title box, answered)."""
    if not handlers.content_text(message).strip():
        yield gr.skip(), gr.skip(), gr.skip(), gr.skip(), answered()
        return
    recorder, history = _open(store, chat_id, history, create=True, found=_finding(finds, request))
    if recorder is not None:
        recorder.offer(handlers.sent_chat(message, history))  # saved before the prefill: a kill keeps the message
    settings = (system_prompt, temperature, top_p, top_k, seed, max_new_tokens, stop_text)
    yield from _recorded(store, recorder, handlers.respond(service, cancels, message, history, *settings,
                                                           request=request), highlight)


def regenerate(store: ChatStore, service: ChatServiceApi, cancels: Cancels, chat_id: int | None, history: Any,
               system_prompt: str, temperature: Any, top_p: Any, top_k: Any, seed: Any, max_new_tokens: Any,
               stop_text: Any, highlight: bool = False, request: gr.Request | None = None,
               finds: Finds | None = None) -> Iterator[tuple]:
    """handlers.regenerate in chat `chat_id`, the new answer saved over the old as it streams."""
    recorder, history = _open(store, chat_id, history, create=False, found=_finding(finds, request))
    settings = (system_prompt, temperature, top_p, top_k, seed, max_new_tokens, stop_text)
    yield from _recorded(store, recorder, handlers.regenerate(service, cancels, history, *settings,
                                                              request=request), highlight)


def controls(mode: str) -> tuple[dict, dict]:
    """Updates for (New chat, Delete): locked while an answer streams, because the answer is
    written into the chat it started in and the page would show it over another (the chat list
    is locked in the page: app/page_scripts.py `chats_inert`)."""
    return tuple(gr.update(interactive=mode == "idle") for _ in range(2))


# ---------------------------------------------------------------- the panel's actions


def open_latest(store: ChatStore, highlight: bool = False) -> tuple:
    """Page load: the most recently changed chat, so that a reload shows where the user was."""
    try:
        latest = store.chats(1)
        return _view(store, latest[0].id if latest else None, highlight)
    except StoreError as exc:
        handlers.report(exc, "open the saved chats")
        return _skip_view()


def switch(store: ChatStore, chat_id: int | None, highlight: bool = False) -> tuple:
    """Show the chat picked in the list (which the page keeps as it is)."""
    try:
        return _view(store, chat_id, highlight, listed=False)
    except ChatNotFoundError as exc:
        handlers.report(exc, "open the chat")
        return _view(store, None)
    except StoreError as exc:
        handlers.report(exc, "open the chat")
        return _skip_view()


def new_chat(store: ChatStore) -> tuple:
    """An empty page; the chat is stored with its first message. The chat shown before stays in the
    list, unselected (the store is not read: the page's list stands)."""
    return _view(store, None, listed=False)


def _finding(finds: Finds | None, request: Any) -> Callable[[], str]:
    """-> what this page's Find box holds when called ("" without a Finds)."""
    return str if finds is None else lambda: finds.text(request)


def find(store: ChatStore, finds: Finds, text: str, chat_id: int | None, request: gr.Request | None = None) -> Any:
    """The Find box changed: list the chats whose title or messages hold its text (without text,
    the most recent), the chat shown kept in; later lists sent to this page list the same."""
    text = (text or "").strip()
    finds.set(request, text)
    try:
        return _list(store, chat_id, text)
    except StoreError as exc:
        handlers.report(exc, "find chats")
        return gr.skip()


def redraw(store: ChatStore, chat_id: int | None, highlight: bool) -> Any:
    """The chat shown again, with drafted text marked or not (the highlight checkbox changed)."""
    if chat_id is None:
        return gr.skip()  # a new chat has no answers yet, or was never saved: nothing to redraw from
    try:
        return answers.view(stored_chat(store, chat_id), highlight)
    except StoreError as exc:
        handlers.report(exc, "redraw the chat")
        return gr.skip()


def rename(store: ChatStore, chat_id: int | None, title: str, request: gr.Request | None = None,
           finds: Finds | None = None) -> tuple[dict, str]:
    """-> (chat list, title box)."""
    if chat_id is None:
        handlers.toast("info", "A new chat is saved with its first message; rename it after that.")
        return gr.skip(), ""
    try:
        info = store.rename(chat_id, title)
        return _list(store, chat_id, _finding(finds, request)()), info.title
    except StoreError as exc:
        handlers.report(exc, "rename the chat")
        return gr.skip(), gr.skip()


def delete(store: ChatStore, chat_id: int | None, highlight: bool = False, request: gr.Request | None = None,
           finds: Finds | None = None) -> tuple:
    """Delete the chat shown (the page asked first) and show the most recent one left (of those
    the Find box finds, if any)."""
    if chat_id is None:  # a new chat is not stored yet, or the user said no
        return _skip_view()
    try:
        store.delete(chat_id)
        found = _finding(finds, request)()
        left = store.chats(1, found)
        return _view(store, left[0].id if left else None, highlight, found=found)
    except StoreError as exc:
        handlers.report(exc, "delete the chat")
        return _skip_view()


def export(store: ChatStore, folder: Path, fmt: str, chat_id: int | None) -> dict:
    """Write the chat shown as a JSON or Markdown file (0600, in its own folder under the private
    `folder`) and offer it for download. Gradio copies it into its cache as the event returns,
    so older exports' files, long since copied, are deleted here."""
    if chat_id is None:
        handlers.toast("info", "There is nothing to export yet: send a message first.")
        return gr.skip()
    write, suffix = EXPORTS[fmt]
    try:
        text = write(store, chat_id)
        name = re.sub(r"[^\w-]+", "-", store.chat(chat_id).title).strip("-")[:60] or "chat"
        drop_old_exports(folder, time.time() - EXPORT_KEEP_S)
        path = write_private(Path(tempfile.mkdtemp(prefix="export-", dir=folder)) / f"{name}{suffix}", text)
    except (StoreError, OSError) as exc:
        handlers.report(exc, "export the chat")
        return gr.skip()
    return gr.update(value=str(path), visible=True)


def drop_old_exports(folder: Path, before: float) -> None:
    """Delete the export folders made before `before` (Unix seconds)."""
    for old in folder.glob("export-*"):
        if old.stat().st_mtime < before:
            shutil.rmtree(old)
