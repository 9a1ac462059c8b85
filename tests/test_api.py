"""The OpenAI-compatible API (app/api.py): routes with a scripted fake service, the page and the API
on one server, a client that hangs up, the service's one-answer-at-a-time lock, and the real
`openai` client streaming from a real `launch.py` server with the embedded model."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from core.service.chat import ChatService
from core.config import ReplyEvent, ReplyStats, SamplingConfig
from core.errors import ContextOverflowError, OutOfMemoryError, StrategyUnavailableError
from tests.conftest import served_api
from tests.fakes import ApiFake, KEY, USER, client

ROOT = Path(__file__).resolve().parent.parent
def sse_data(lines) -> list:
    """The data of each server-sent event, JSON-decoded, with the closing [DONE] kept as is."""
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def test_models_lists_the_loaded_model():
    r = client().get("/v1/models")
    assert r.status_code == 200
    assert r.json() == {"object": "list", "data": [{"id": "fake-1b", "object": "model", "created": 0, "owned_by": "aerie"}]}


def test_completion_maps_the_request_onto_the_service():
    service = ApiFake()
    body = {"model": "anything", "temperature": 0.7, "top_p": 0.9, "max_tokens": 99, "max_completion_tokens": 33,
            "seed": 5, "stop": ["\n\n", "END"],
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Be kind."},
                         {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "!"}]},
                         {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again"}]}
    r = client(service).post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    call = service.calls[0]
    assert call.system_prompt == "Be brief.\n\nBe kind."
    assert call.messages == [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi."},
                             {"role": "user", "content": "Again"}]
    assert call.sampling == SamplingConfig(temperature=0.7, top_p=0.9, seed=5, max_new_tokens=33)
    assert call.stop_strings == ("\n\n", "END")
    out = r.json()
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-") and out["model"] == "fake-1b"
    assert out["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello there, friend."},
                               "logprobs": None, "finish_reason": "stop"}]
    assert out["usage"] == {"prompt_tokens": 0, "completion_tokens": 5, "total_tokens": 5}
    aerie = out["aerie"]
    assert (aerie["accept_len"], aerie["accept_rate"], aerie["tok_s"], aerie["strategy"]) == (1.0, 0.5, 2.0, "eagle")


def test_omitted_fields_take_the_defaults():
    service = ApiFake()
    defaults = SamplingConfig(temperature=0.0, max_new_tokens=77)
    assert client(service, defaults=defaults).post("/v1/chat/completions", json={"messages": USER}).status_code == 200
    assert service.calls[0].sampling == defaults and service.calls[0].system_prompt == "" and service.calls[0].stop_strings == ()


def test_streaming_sends_chunks_then_stats_usage_and_done():
    body = {"messages": USER, "stream": True, "stream_options": {"include_usage": True}}
    with client().stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_data(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks, usage, finish = events[:-3], events[-2], events[-3]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hello there, friend."
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in events[:-1])
    assert finish["choices"][0]["finish_reason"] == "stop" and finish["aerie"]["target_steps"] == 5
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("body, param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "Only a system prompt"}]}, "messages"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content"),
    ({"messages": USER, "temperature": 3}, "temperature"),
    ({"messages": USER, "temperature": "hot"}, "temperature"),
    ({"messages": USER, "top_p": 0}, "top_p"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "max_completion_tokens": 2.5}, "max_completion_tokens"),
    ({"messages": USER, "seed": -1}, "seed"),
    ({"messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": USER, "stream": "yes"}, "stream"),
    ({"messages": USER, "n": 2}, "n"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"messages": USER, "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": USER, "aerie": "plain"}, "aerie"),
    ({"messages": USER, "aerie": {"strategy": "jacobi"}}, "aerie.strategy"),
    ({"messages": USER, "aerie": {"strategy": "plain", "tree": 4}}, "aerie.tree"),
])
def test_bad_requests_are_400_in_openai_shape(body, param):
    service = ApiFake()
    r = client(service).post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    assert service.calls == []


def test_body_that_is_not_json_is_400():
    r = client().post("/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_neutral_values_of_unsupported_fields_are_accepted():
    body = {"messages": USER, "n": 1, "logprobs": False, "tools": [], "tool_choice": "none",
            "frequency_penalty": 0, "presence_penalty": 0.0, "response_format": {"type": "text"}}
    assert client().post("/v1/chat/completions", json=body).status_code == 200


def test_a_request_may_pick_the_strategy():
    service = ApiFake()
    for aerie, strategy in (({"strategy": "plain"}, "plain"), ({"strategy": "prompt_lookup"}, "prompt_lookup"),
                            ({}, None), (None, None)):
        body = {"messages": USER, **({} if aerie is None else {"aerie": aerie})}
        assert client(service).post("/v1/chat/completions", json=body).status_code == 200
        assert service.calls[-1].strategy == strategy


@pytest.mark.parametrize("error, status, code", [
    (ContextOverflowError("Your message is too long for this model."), 400, "context_length_exceeded"),
    (StrategyUnavailableError("This model cannot decode with 'eagle'; it has plain, prompt_lookup."), 400, None),
    (OutOfMemoryError("Out of GPU memory."), 500, None),
])
def test_service_errors_before_the_answer_are_json(error, status, code):
    for stream in (False, True):
        r = client(ApiFake(fail_at=0, error=error)).post("/v1/chat/completions", json={"messages": USER, "stream": stream})
        assert r.status_code == status
        assert r.json()["error"]["message"] == str(error) and r.json()["error"]["code"] == code


def test_service_error_mid_answer():
    service = ApiFake(fail_at=2, error=OutOfMemoryError("Out of GPU memory."))
    r = client(service).post("/v1/chat/completions", json={"messages": USER})
    assert r.status_code == 500 and r.json()["error"] == {"message": "Out of GPU memory.", "type": "server_error",
                                                          "param": None, "code": None}
    with client(service).stream("POST", "/v1/chat/completions", json={"messages": USER, "stream": True}) as r:
        events = sse_data(r.iter_lines())
    assert events[-2] == {"error": {"message": "Out of GPU memory.", "type": "server_error", "param": None, "code": None}}
    assert events[-1] == "[DONE]"


def test_api_key_is_checked_on_every_route():
    c = client(api_key=KEY)
    for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/chat/completions", {"messages": USER})):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = c.request(method, path, json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.request(method, path, json=body, headers={"Authorization": f"bearer {KEY}"}).status_code == 200


@pytest.fixture
def page_and_api():
    """A Gradio page launched as launch.py does, with the API routes and a slow fake service."""
    service = ApiFake(words=tuple(f" w{i}" for i in range(200)), delay=0.05)
    with served_api(service) as url:
        yield service, url


def test_page_and_api_share_one_server(page_and_api):
    _, url = page_and_api
    assert httpx.get(url + "/").status_code == 200 and "gradio" in httpx.get(url + "/config").text.lower()
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "fake-1b"


def test_a_client_that_hangs_up_cancels_the_answer(page_and_api):
    service, url = page_and_api
    with httpx.stream("POST", url + "/v1/chat/completions", json={"messages": USER, "stream": True}, timeout=10) as r:
        lines = r.iter_lines()
        assert sse_data([next(lines)])[0]["choices"][0]["delta"]["role"] == "assistant"
    deadline = time.monotonic() + 5
    while service.finish is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert service.finish == "cancelled" and service.calls[0].cancel.is_set()


def test_the_service_answers_one_reply_at_a_time():
    """The page and the API share one engine: a second reply waits for the first to end, and one
    cancelled while it waits yields nothing."""
    service = ChatService(engine=None)
    log = []

    def fake_reply(messages, *args):
        log.append(f"start {messages}")
        yield ReplyEvent("x", ReplyStats())
        yield ReplyEvent("y", ReplyStats())
        log.append(f"end {messages}")

    service._reply = fake_reply
    first = service.reply("A", "", SamplingConfig(), (), threading.Event())
    next(first)
    second = threading.Thread(target=lambda: list(service.reply("B", "", SamplingConfig(), (), threading.Event())),
                              daemon=True)
    second.start()
    time.sleep(0.3)
    # B waits while A's reader holds the engine (the worker may have made all of A's events by now)
    assert log in (["start A"], ["start A", "end A"])
    cancel = threading.Event()
    cancel.set()
    assert list(service.reply("C", "", SamplingConfig(), (), cancel)) == []
    first.close()                       # A is dropped mid-answer (as when a client hangs up): B runs
    second.join(5)
    assert log[-2:] == ["start B", "end B"] and "start C" not in log
    assert not service.busy.locked()


# ---------------------------------------------------------------- the real thing


@pytest.mark.slow
@pytest.mark.late
def test_openai_client_streams_from_a_real_aerie(keyed_aerie):
    openai = pytest.importorskip("openai")
    # The page, not compiling (test_cpu_quant.py); the same server serves test_browser_key.py.
    api = openai.OpenAI(base_url=keyed_aerie + "/v1", api_key=KEY, max_retries=0, timeout=300)
    model = api.models.list().data[0].id
    request = dict(model=model, messages=[{"role": "user", "content": "Name three colours of the rainbow."}],
                   temperature=0, max_tokens=40)
    pieces, usage = [], None
    for chunk in api.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}):
        pieces += [c.delta.content or "" for c in chunk.choices]
        usage = chunk.usage or usage
    whole = api.chat.completions.create(**request)
    streamed = "".join(pieces)
    assert streamed.strip() and streamed == whole.choices[0].message.content
    assert usage.completion_tokens == whole.usage.completion_tokens > 0 and whole.usage.prompt_tokens > 0
    assert whole.model_extra["aerie"]["accept_len"] >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed_aerie + "/v1", api_key="wrong", max_retries=0).models.list()


def test_launch_refuses_a_public_host_without_a_key(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "AERIE_API_KEY"}
    r = subprocess.run([sys.executable, str(ROOT / "launch.py"), "--host", "0.0.0.0", "--no-browser",
                        "--cache-dir", str(tmp_path)], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert [line for line in r.stderr.splitlines() if line.startswith("Aerie:")] == [
        "Aerie: --host 0.0.0.0 serves beyond this machine, so the API needs a key: give one with --api-key KEY "
        "or the AERIE_API_KEY environment variable (or serve on --host 127.0.0.1)."]
