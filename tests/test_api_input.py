"""The API's answers to odd input (app/api.py, app/api_request.py): bodies not declared JSON,
text that is not Unicode, bodies nested too deeply, readable range errors, the overflow advice in
the API's own words, and decode speed reported apart from the time to the first token."""

import json

import pytest

from app.api_request import readable
from core.config import ReplyEvent, ReplyStats
from core.errors import ContextOverflowError
from tests.fakes import USER, ApiFake, client

BODY = json.dumps({"messages": USER}).encode()


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_a_body_not_declared_json_is_refused_before_the_model_runs(content_type):
    service = ApiFake()
    headers = {} if content_type is None else {"Content-Type": content_type}
    r = client(service).post("/v1/chat/completions", content=BODY, headers=headers)
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    assert service.calls == []


def test_json_content_types_are_accepted():
    for content_type in ("application/json", "application/json; charset=utf-8", "application/vnd.api+json"):
        assert client().post("/v1/chat/completions", content=BODY,
                             headers={"Content-Type": content_type}).status_code == 200


@pytest.mark.parametrize("raw, param", [
    (b'{"messages": [{"role": "user", "content": "\\udc80"}]}', "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\ud800"}]}]}', "messages[0].content"),
    (b'{"messages": [{"role": "system", "content": "\\udfff"}, {"role": "user", "content": "Hi"}]}',
     "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": "Hi"}], "stop": "\\udc80"}', "stop"),
])
def test_a_lone_surrogate_is_a_400(raw, param):
    r = client().post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "lone surrogate" in error["message"]


def test_a_body_nested_too_deeply_is_a_400():
    r = client().post("/v1/chat/completions", content=b"[" * 100_000, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]


def test_range_errors_print_readable_numbers():
    r = client().post("/v1/chat/completions", json={"messages": USER, "max_tokens": 10**7})
    assert "'max_tokens' must be from 1 to 1,000,000" in r.json()["error"]["message"]
    r = client().post("/v1/chat/completions", json={"messages": USER, "seed": 2**64})
    assert "from 0 to 9,223,372,036,854,775,807" in r.json()["error"]["message"]
    assert (readable(0), readable(2), readable(0.5)) == ("0", "2", "0.5")


def test_the_overflow_advice_names_max_tokens_for_the_api_and_max_new_tokens_for_the_page():
    error = ContextOverflowError("Your message is too long: it needs 900 tokens and the context leaves 512.",
                                 answer_room=True)
    r = client(ApiFake(fail_at=0, error=error)).post("/v1/chat/completions", json={"messages": USER})
    assert r.status_code == 400 and r.json()["error"]["message"].endswith("Shorten it, or lower max_tokens.")
    assert str(error).endswith("Shorten it, or lower 'max new tokens'.")


class SlowPrefill(ApiFake):
    """A long prompt: 6 s to the first token, then 4 tokens a second."""

    def reply(self, messages, system_prompt, sampling, stop_strings, cancel, strategy=None, every_s=0.0):
        for n in range(1, 6):
            yield ReplyEvent(f" w{n}", ReplyStats(new_tokens=n, elapsed_s=6 + 0.25 * (n - 1), target_steps=n, prefill_s=6))
        yield ReplyEvent("", ReplyStats(new_tokens=5, elapsed_s=7, target_steps=5, prefill_s=6), finish="eos")


def test_tok_s_is_decode_speed_and_the_prefill_is_reported_apart():
    for stream in (False, True):
        r = client(SlowPrefill()).post("/v1/chat/completions", json={"messages": USER, "stream": stream})
        if stream:
            chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            aerie = next(c["aerie"] for c in chunks if "aerie" in c)
        else:
            aerie = r.json()["aerie"]
        assert (aerie["tok_s"], aerie["ttft_s"]) == (4.0, 6.0), aerie
