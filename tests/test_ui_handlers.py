"""The chat page's behaviour (app/handlers.py) with a scripted fake service: no browser, no torch."""

import logging
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import pytest

from app import handlers
from app.handlers import Cancels, SettingsError
from core.config import ReplyStats, SamplingConfig
from core.errors import ContextOverflowError, OutOfMemoryError
from tests.fakes import FakeService, SETTINGS, session

pytestmark = pytest.mark.usefixtures("every_event")

ROOT = Path(__file__).resolve().parent.parent


def run(service, message, history=(), settings=SETTINGS, cancels=None, request=None):
    return list(handlers.respond(service, cancels or Cancels(), message, list(history), *settings,
                                 request=request or session()))


def assistant_texts(outputs):
    return [chat[-1]["content"] for chat, _ in outputs if chat and chat[-1]["role"] == "assistant"]


def texts(chat):
    """The chat without what the page keeps beside the text (answers' meta)."""
    return [{"role": m["role"], "content": m["content"]} for m in chat]


def assert_no_traceback(chat):
    assert all("Traceback" not in m["content"] and "Error" not in m["content"] for m in chat)


def test_respond_streams_growing_text_and_stats(toasts):
    service = FakeService(notice="Dropped the 2 oldest turns to fit the context.")
    outputs = run(service, "Hi!", [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    texts = assistant_texts(outputs)
    assert texts[0] == "Hello" and texts[-1] == "Hello there, friend."
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))
    assert outputs[0][0][-2] == {"role": "user", "content": "Hi!"}  # the page drew it; each update keeps it
    final_chat, final_stats = outputs[-1]
    assert [m["role"] for m in final_chat] == ["user", "assistant", "user", "assistant"]
    assert "**5** tokens" in final_stats and "tok/s" in final_stats and "EAGLE" in final_stats
    assert "accepted length **1.00**" in final_stats and "acceptance **50%**" in final_stats
    call = service.calls[0]
    assert call.messages[-1] == {"role": "user", "content": "Hi!"} and call.system_prompt == "You are kind."
    assert call.sampling == SamplingConfig(temperature=0.0, top_p=1.0, top_k=0, seed=None, max_new_tokens=64)
    assert toasts == [("info", "Dropped the 2 oldest turns to fit the context.", {"duration": 6})]


def test_a_message_the_page_drew_as_it_sent_it_is_answered_once():
    service = FakeService()
    drawn = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}, {"role": "user", "content": "Hi!"}]
    outputs = run(service, "Hi!", drawn)
    assert service.calls[0].messages == drawn
    assert [m["role"] for m in outputs[-1][0]] == ["user", "assistant", "user", "assistant"]


def test_a_fast_stream_is_shown_a_few_times_a_second_and_always_at_its_end(monkeypatch):
    """200 events in a burst: the page gets the first piece and the finished answer, not 200
    re-renders of the whole chat."""
    monkeypatch.setattr(handlers, "SHOW_EVERY_S", 60.0)
    outputs = run(FakeService(words=tuple(f" w{i}" for i in range(200))), "Hi")
    assert len(outputs) == 2
    assert assistant_texts(outputs)[-1].split() == [f"w{i}" for i in range(200)] and "**200** tokens" in outputs[-1][1]


def test_empty_message_changes_nothing():
    service = FakeService()
    outputs = run(service, "   ")
    assert len(outputs) == 1 and all(isinstance(o, dict) and o.get("__type__") == "update" for o in outputs[0])
    assert service.calls == []


def test_stop_sets_the_flag_the_service_sees_and_keeps_the_partial_answer():
    service, cancels = FakeService(), Cancels()
    stream = handlers.respond(service, cancels, "Hi", [], *SETTINGS, request=session("me"))
    outputs = [next(stream), next(stream)]  # "Hello", "Hello there"
    handlers.stop(cancels, session("other"))  # another tab's Stop leaves this reply alone
    assert not service.calls[0].cancel.is_set()
    handlers.stop(cancels, session("me"))
    assert service.calls[0].cancel.is_set()
    outputs += list(stream)
    assert service.finish == "cancelled"
    chat, stats = outputs[-1]
    assert texts(chat)[-1] == {"role": "assistant", "content": "Hello there"}
    assert chat[-1]["meta"]["finish"] == "cancelled"
    assert stats.endswith("stopped")


def test_stop_from_another_thread_while_streaming():
    service, cancels = FakeService(words=tuple(f" w{i}" for i in range(200)), delay=0.005), Cancels()
    outputs = []
    worker = threading.Thread(target=lambda: outputs.extend(
        handlers.respond(service, cancels, "Hi", [], *SETTINGS, request=session())))
    worker.start()
    while len(outputs) < 4:
        time.sleep(0.005)
    handlers.stop(cancels, session())
    worker.join(timeout=5)
    assert not worker.is_alive() and service.finish == "cancelled"
    assert 0 < len(outputs[-1][0][-1]["content"].split()) < 200


def test_closing_the_stream_sets_the_cancel_flag():
    service = FakeService()
    stream = handlers.respond(service, Cancels(), "Hi", [], *SETTINGS, request=session())
    next(stream), next(stream)
    stream.close()  # what happens when the page goes away mid-answer
    assert service.calls[0].cancel.is_set()


def test_clear_empties_the_chat_and_stops_a_running_reply():
    service, cancels = FakeService(), Cancels()
    stream = handlers.respond(service, cancels, "Hi", [], *SETTINGS, request=session())
    next(stream), next(stream)
    chat, stats, textbox, *_ = handlers.clear(cancels, session())
    assert chat == [] and stats == "" and textbox["interactive"] is True
    assert service.calls[0].cancel.is_set()
    assert list(stream) == [] and service.finish == "cancelled"  # nothing brings the old chat back


def test_regenerate_replaces_the_last_answer():
    service = FakeService(words=("New", " answer"))
    history = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
               {"role": "user", "content": [{"type": "text", "text": "Q2"}]},
               {"role": "assistant", "content": [{"type": "text", "text": "old answer"}]}]
    outputs = list(handlers.regenerate(service, Cancels(), history, *SETTINGS, request=session()))
    assert outputs[0][0][-1] == {"role": "user", "content": "Q2"}
    assert texts(outputs[-1][0]) == [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
                              {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "New answer"}]
    assert service.calls[0].messages[-1] == {"role": "user", "content": "Q2"}


def test_regenerate_with_no_user_turn_does_nothing(toasts):
    service = FakeService()
    outputs = list(handlers.regenerate(service, Cancels(), [], *SETTINGS))
    assert len(outputs) == 1 and service.calls == [] and toasts[0][0] == "info"


@pytest.mark.parametrize("fail_at", [0, 3])
def test_aerie_error_keeps_history_and_shows_a_toast(toasts, fail_at):
    error = OutOfMemoryError("The GPU ran out of memory; try a shorter answer.")
    service = FakeService(fail_at=fail_at, error=error)
    history = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}]
    outputs = run(service, "Q2 <b>", history)
    chat, stats = outputs[-1]
    assert chat == history + [{"role": "user", "content": "Q2 <b>"}]  # no half answer
    assert_no_traceback(chat)
    assert toasts == [("warning", "The GPU ran out of memory; try a shorter answer.", {"duration": 15})]
    assert stats == "" if fail_at == 0 else stats.startswith("**3** tokens") and stats.endswith("failed")


def test_context_overflow_before_the_first_token(toasts):
    service = FakeService(fail_at=0, error=ContextOverflowError("This message alone is longer than the context."))
    chat, _ = run(service, "x" * 50)[-1]
    assert chat == [{"role": "user", "content": "x" * 50}]
    assert toasts[0][1] == "This message alone is longer than the context."


def test_unexpected_error_is_logged_not_shown(toasts, caplog):
    service = FakeService(fail_at=2, error=RuntimeError("CUDA error: device-side assert\nline two"))
    with caplog.at_level(logging.ERROR, logger="app.handlers"):
        chat, _ = run(service, "Hi")[-1]
    assert chat == [{"role": "user", "content": "Hi"}]
    level, message, _ = toasts[0]
    assert level == "warning" and message.startswith("Could not answer: unexpected RuntimeError: CUDA error")
    assert "line two" not in message and "Traceback" not in message
    assert caplog.records and caplog.records[0].exc_info is not None  # the traceback goes to the console


def test_bad_settings_keep_the_message_and_name_the_field(toasts):
    service = FakeService()
    bad = ("", 0.7, 0.9, "forty", -1, 64, "")
    chat, _ = run(service, "Hi", settings=bad)[-1]
    assert chat == [{"role": "user", "content": "Hi"}] and service.calls == []
    assert toasts[0][1] == "Top-k must be a number, got &#x27;forty&#x27;."  # escaped: toasts render HTML


def test_a_failed_turn_is_merged_with_the_next_message():
    service = FakeService()
    run(service, "second", [{"role": "user", "content": "first"}])
    assert service.calls[0].messages == [{"role": "user", "content": "first\n\nsecond"}]


@pytest.mark.parametrize("args, field", [
    (("abc", 1, 0, -1, 10), "Temperature"), ((-0.5, 1, 0, -1, 10), "Temperature"),
    ((0.5, 0, 0, -1, 10), "Top-p"), ((0.5, 1.5, 0, -1, 10), "Top-p"),
    ((0.5, 1, 2.5, -1, 10), "Top-k"), ((0.5, 1, -3, -1, 10), "Top-k"),
    ((0.5, 1, 0, "x", 10), "Seed"), ((0.5, 1, 0, -7, 10), "Seed"),
    ((0.5, 1, 0, -1, 0), "Max new tokens"), ((0.5, 1, 0, -1, None), "Max new tokens"),
    ((float("nan"), 1, 0, -1, 10), "Temperature"),
])
def test_parse_settings_rejects_bad_values_clearly(args, field):
    with pytest.raises(SettingsError, match=field):
        handlers.parse_settings(*args)


def test_parse_settings_accepts_page_values():
    assert handlers.parse_settings(0.7, 0.9, 40.0, None, 256.0) == SamplingConfig(0.7, 0.9, 40, None, 256)
    assert handlers.parse_settings("0", "1", "0", " ", "12").seed is None
    assert handlers.parse_settings(0, 1, 0, -1, 12).seed is None
    assert handlers.parse_settings(0, 1, 0, 1234, 12).seed == 1234


def test_parse_stop_strings():
    assert handlers.parse_stop_strings("User:, ###\n\\n\\n\n, User:") == ("User:", "###", "\n\n")
    assert handlers.parse_stop_strings(None) == ()


def test_normalise_history_handles_content_parts():
    history = [
        {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "file", "file": {"path": "/a.png"}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "thinking"}], "metadata": {"title": "Thought"}},
        {"role": "assistant", "content": "plain", "metadata": None},
        {"role": "system", "content": "ignored"},
        SimpleNamespace(role="user", content=["a", {"text": "b"}], metadata=None),
        {"role": "assistant", "content": []},
    ]
    assert handlers.normalise_history(history) == [
        {"role": "user", "content": "look"}, {"role": "assistant", "content": "plain"},
        {"role": "user", "content": "a\nb"},
    ]
    assert handlers.normalise_history(None) == []


def test_format_stats_shows_a_dash_without_drafts():
    line = handlers.format_stats(ReplyStats(new_tokens=10, elapsed_s=2.0, target_steps=10), "length")
    assert line == ("**10** tokens · **5.0** tok/s · accepted length **1.00** · acceptance **—** · "
                    "speedup **—** vs plain · plain decoding · max tokens reached")


def test_format_stats_shows_the_measured_speedup():
    stats = ReplyStats(new_tokens=11, elapsed_s=1.0, target_steps=5, round_tokens=10, round_s=0.2, plain_ms=30.0)
    assert "speedup **1.50×** vs plain" in handlers.format_stats(stats)  # 50 tok/s x 30 ms/token


@pytest.mark.parametrize("drafter, shown", [
    ("eagle", "EAGLE head"), ("prompt_lookup", "prompt lookup"), ("plain", "plain decoding"),
    ("jacobi", "jacobi"),  # a name this version does not know shows as it is
])
def test_the_header_names_the_drafter_for_people(drafter, shown):
    from app import model_panel

    label = f"SmolLM2 · cpu · nf4 · {drafter}"
    assert handlers.shown_label(label) == f"SmolLM2 · cpu · nf4 · {shown}"
    assert handlers.header(label).endswith(f"SmolLM2 · cpu · nf4 · {shown}</span>")
    assert model_panel.model_status(label) == f"Current: SmolLM2 · cpu · nf4 · {shown}"
    report = SimpleNamespace(label=label, device="cpu", freed=0, used=0)
    assert model_panel.switched_line(report).startswith(f"Loaded SmolLM2 · cpu · nf4 · {shown}.")


def test_send_locks_the_controls_in_the_page():
    """Send locks the controls in the browser, the textbox emptied, Stop shown in place of Send."""
    import json
    from app.page_scripts import chats_inert, in_page

    updates = handlers.controls("answering", clear_textbox=True)
    textbox, send, stop, *_ = updates
    assert textbox["value"] == "" and textbox["interactive"] is False
    assert send["visible"] is False and stop["visible"] is True
    assert all(u.get("interactive", True) for u in handlers.controls("idle"))
    event = in_page(updates, passed=1)
    assert event["fn"] is None and event["queue"] is False
    head, body = event["js"].split(" => ")
    assert head == "(x0)" and body.startswith("[x0, ...") and json.loads(body[len("[x0, ..."):-1]) == list(updates)
    assert in_page(updates)["js"].startswith("() => [...[")
    # An effect runs first: the chat list is locked as an attribute, not redrawn by an update.
    locking = in_page(updates, effect=chats_inert(True))["js"]
    assert locking.startswith('() => { document.getElementById("aerie-chats").inert = true; return [...[')
    assert chats_inert(False).endswith(".inert = false;")


def test_build_ui_constructs_and_wires_the_request(tmp_path):
    from app.store import ChatStore
    from app.ui import UiDefaults, bind, build_ui, launch_options

    store = ChatStore(tmp_path / "chats.sqlite3")
    demo = build_ui(FakeService(), UiDefaults(sampling=SamplingConfig(temperature=0.7, seed=3), model="m"), store=store)
    assert isinstance(demo, gr.Blocks)
    assert {"respond", "regenerate", "stop", "load_model"} <= {f.api_name for f in demo.fns.values()}
    assert isinstance(build_ui(FakeService(), {"quant": "none"}, store=store), gr.Blocks)
    assert "#aerie-stats" in launch_options()["css"]
    # Gradio injects gr.Request only into parameters it can see typed as such.
    from gradio.helpers import special_args
    args, *_ = special_args(bind(handlers.stop, Cancels()), inputs=[], request="REQ")
    assert args == ["REQ"]


def test_the_queue_looks_for_events_less_often(tmp_path):
    """build_ui slows Gradio's free-queue poll (ui.QUEUE_POLL_S): the attribute it sets must be the
    one Gradio's queue loop reads, not a new one a Gradio update would leave unread."""
    import inspect

    from gradio import queueing

    from app.store import ChatStore
    from app.ui import QUEUE_POLL_S, UiDefaults, build_ui

    assert "self.sleep_when_free" in inspect.getsource(queueing.Queue.start_processing)
    demo = build_ui(FakeService(), UiDefaults(), store=ChatStore(tmp_path / "chats.sqlite3"))
    assert demo._queue.sleep_when_free == QUEUE_POLL_S > 0.001


def test_app_does_not_import_torch():
    code = "import app.ui, app.handlers, sys; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
