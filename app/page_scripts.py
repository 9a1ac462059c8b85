"""The page's own JavaScript: what runs in the browser without a round trip to the server.

On a 2-core machine the browser shares the cores with the engine, whose 4-bit linears split each
matmul over both: any work the page does while an answer streams stalls the engine for about as
long. So the page does the little it must in the browser, at once, and nothing else.
"""

import json
from typing import Any

# Delete asks first; declining sends no chat id, and chats.delete then does nothing.
CONFIRM_DELETE = ("(chat, highlight) => [chat !== null && confirm('Delete this chat? This cannot be undone.') "
                  "? chat : null, highlight]")

# Send: respond's JavaScript clicks a hidden button, whose event draws the message at once as the
# chat's last turn (Gradio 6's message format), empties the textbox, marks the stats line busy and
# locks the controls, all in the page. Respond's request leaves first: chained after that drawing
# (`.then`), it started 27-56 ms after Enter on the 2-core Zen 4, the page's re-render before it.
# Drawn by a first update from the server instead, the redraw took the cores from the prefill.
SHOW_SENT = """(text, chat) => { const sent = (text || "").trim(), skip = {__type__: "update"};
  return [sent ? [...(chat || []), {role: "user", metadata: null, options: null, content: [{type: "text", text: sent}]}]
          : skip, sent ? "…" : skip, ...%s]; }"""
# Respond's inputs are gathered before this runs: the textbox still holds the message.
DRAW_SENT_ID = "aerie-draw-sent"   # the hidden button's elem_id (ui.py)
DRAW_SENT = """(...inputs) => { document.getElementById(%s).click(); return inputs; }""" % json.dumps(DRAW_SENT_ID)


def in_page(updates: tuple[dict, ...], passed: int = 0, effect: str = "") -> dict[str, Any]:
    """An event's keywords to run it in the browser alone: it runs the statement `effect`, then
    returns its first `passed` inputs as they are, then `updates` (gr.update dicts). Locking and
    unlocking the controls around an answer so costs no round trip to the server: on the AMX Xeon
    such trips put 100-150 ms on every answer in the page (50-70 ms before it could start, 80-110
    ms between its last text and Send; 30-60 after)."""
    args = ", ".join(f"x{i}" for i in range(passed))
    returned = f"[{args}{', ' if passed else ''}...{json.dumps(list(updates))}]"
    body = f"{{ {effect} return {returned}; }}" if effect else returned
    return {"fn": None, "js": f"({args}) => {body}", "queue": False, "api_visibility": "private"}


# The chat list is locked while an answer streams (the answer is written into the chat it started
# in) by making it inert, no click, focus or key reaching it, rather than by Gradio updates of its
# `interactive`: each such update redraws every option, and twice an answer, with 300 saved chats,
# that cost Chromium ~40 ms of the cores a redraw beside the engine.
CHATS_ID = "aerie-chats"


def chats_inert(locked: bool) -> str:
    """The statement that locks the chat list or frees it (for `in_page`'s effect)."""
    return f"document.getElementById({json.dumps(CHATS_ID)}).inert = {json.dumps(locked)};"


# Gradio 6's status tracker animates its timer with requestAnimationFrame until its event's status
# leaves "pending"; the tracker shown while the page loads is removed in the same update that
# completes it, so its loop never learns and asks for a frame 60 times a second for the page's
# whole life (every Gradio 6.31 app; a one-textbox page shows it). Each frame costs Chromium its
# lifecycle: an idle page took ~10% of a core on the 2-core Zen 4, ~3.6% with this. The tracker
# captures requestAnimationFrame when its module loads, so this runs in the page's HTML, before
# any module (app/page_head.py): frames the trackers ask for come a quarter second later, so a
# timer they draw still counts. A frame is the tracker's when the caller's source is Gradio's
# statustracker chunk (frames[1]: frames[0] is this wrapper; V8 and Gecko stacks alike).
FRAME_THROTTLE = """(() => { const frame = window.requestAnimationFrame.bind(window);
  const tracker = /\\/statustracker-[\\w-]*\\.js/, at = /:\\d+:\\d+\\)?$/;
  window.requestAnimationFrame = (callback) => {
    const frames = (new Error().stack || "").split("\\n").filter((line) => at.test(line));
    if (!tracker.test(frames[1] || "")) return frame(callback);
    setTimeout(() => frame(callback), 250);
    return 0;   // nothing to cancel by: the trackers never cancel their frames
  }; })();"""
