"""Chat layer: template, context trimming, incremental detokenization, stop strings, and the real
embedded model answering a question end to end."""

import threading

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from core.service.chat import ChatService
from core.text import IncrementalDetokenizer, StopMatcher, fit_context, render_prompt
from core.config import SamplingConfig
from core.engine import Engine
from core.errors import ContextOverflowError
from tests.conftest import tiny_target
from tests.fakes import MULTIBYTE



def collect(service, messages, sampling=SamplingConfig(max_new_tokens=40), stops=()):
    events = list(service.reply(messages, "", sampling, stops, threading.Event()))
    return "".join(e.delta for e in events), events


def test_detokenizer_streams_multibyte_text_without_broken_characters(tokenizer):
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push([i]) for i in ids]
    assert "".join(deltas) == tokenizer.decode(ids)
    assert "".join(deltas) == MULTIBYTE
    assert not any("\ufffd" in d for d in deltas)
    assert sum(1 for d in deltas if d == "") > 0  # some tokens hold half a character


def test_detokenizer_keeps_spaces_across_pushes(tokenizer):
    text = "The quick brown fox jumps over the lazy dog.\n\nNew paragraph,  two spaces."
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    out = "".join(detok.push(ids[i:i + 3]) for i in range(0, len(ids), 3))
    assert out == text


def test_stop_matcher_holds_back_partial_stop_strings():
    m = StopMatcher(("###", "User:"))
    assert m.push("Hello #") == ("Hello ", False)  # '#' might start '###'
    assert m.push("# not") == ("## not", False)
    assert m.push(" done. Us") == (" done. ", False)
    assert m.push("er: next") == ("", True)
    m2 = StopMatcher(("STOP",))
    assert m2.push("abcSTOPdef") == ("abc", True)


def test_render_prompt_uses_the_models_template(tokenizer):
    ids = render_prompt(tokenizer, [{"role": "user", "content": "Hi"}], "Be brief.")
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    default = tokenizer.decode(render_prompt(tokenizer, [{"role": "user", "content": "Hi"}]))
    assert "You are a helpful AI assistant named SmolLM" in default


def test_fit_context_drops_oldest_turns_first(tokenizer):
    history = []
    for i in range(6):
        history += [{"role": "user", "content": f"Question {i}: " + "words " * 30},
                    {"role": "assistant", "content": f"Answer {i}: " + "more " * 30}]
    history.append({"role": "user", "content": "Last question?"})
    full = len(render_prompt(tokenizer, history))
    fitted = fit_context(tokenizer, history, "", full - 1)
    assert fitted.dropped_turns == 1
    assert "Question 0" not in tokenizer.decode(fitted.ids) and "Question 1" in tokenizer.decode(fitted.ids)
    assert fit_context(tokenizer, history, "", full).dropped_turns == 0
    with pytest.raises(ContextOverflowError, match="too long"):
        fit_context(tokenizer, [{"role": "user", "content": "word " * 500}], "", 100)


@pytest.fixture(scope="module")
def tiny_service(tokenizer):
    """A random Llama with the embedded tokenizer's vocabulary: real text, fast model."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
    model = LlamaForCausalLM(config).eval()
    return ChatService(Engine(tiny_target(model, tokenizer, eos_ids=(2,), context_len=300)))


def test_reply_stops_at_a_stop_string(tiny_service):
    text, events = collect(tiny_service, [{"role": "user", "content": "Say something"}],
                           SamplingConfig(max_new_tokens=60))
    assert len(text) > 10
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut, events = collect(tiny_service, [{"role": "user", "content": "Say something"}],
                          SamplingConfig(max_new_tokens=60), stops=(stop,))
    assert events[-1].finish == "stop"
    assert cut == text[: text.index(stop)]


def test_reply_trims_an_overflowing_chat_with_a_notice(tiny_service):
    history = []
    for i in range(8):
        history += [{"role": "user", "content": f"Tell me about topic {i} " * 5},
                    {"role": "assistant", "content": "Here is a long answer. " * 10}]
    history.append({"role": "user", "content": "And finally?"})
    _, events = collect(tiny_service, history, SamplingConfig(max_new_tokens=20))
    assert events[0].notice and "oldest turn" in events[0].notice
    assert events[-1].finish in ("length", "eos")
    assert all(e.notice is None for e in events[1:])


def test_reply_reports_cancel(tiny_service):
    cancel = threading.Event()
    events = []
    for e in tiny_service.reply([{"role": "user", "content": "Go on"}], "", SamplingConfig(max_new_tokens=100), (), cancel):
        events.append(e)
        cancel.set()
    assert events[-1].finish == "cancelled" and events[-1].stats.new_tokens < 100


def test_reply_merges_rounds_into_one_event_per_every_s(tiny_service):
    """The reader of a fast stream wakes a few times a second, not once a round: the first event
    and the last come at once, the text and its drafted spans are the same, the stats the last's."""
    sampling = SamplingConfig(max_new_tokens=40)
    text, every = collect(tiny_service, [{"role": "user", "content": "Go on"}], sampling)
    events = list(tiny_service.reply([{"role": "user", "content": "Go on"}], "", sampling, (), threading.Event(),
                                     every_s=60.0))
    assert len(every) > 3 and len(events) == 2
    assert "".join(e.delta for e in events) == text
    assert events[-1].stats.new_tokens == every[-1].stats.new_tokens and events[-1].stats.strategy == every[-1].stats.strategy
    assert events[-1].finish == every[-1].finish and events[0].delta == every[0].delta


def test_coalesced_keeps_notices_and_spans():
    from core.config import ReplyEvent, ReplyStats
    from core.text import coalesced

    def events():
        yield ReplyEvent.of((("a", False),), ReplyStats(new_tokens=1))
        yield ReplyEvent.of((("b", True),), ReplyStats(new_tokens=2))
        yield ReplyEvent.of((("c", True),), ReplyStats(new_tokens=3), notice="trimmed")
        yield ReplyEvent.of((("d", False),), ReplyStats(new_tokens=4))
        yield ReplyEvent.of((), ReplyStats(new_tokens=4), finish="eos")

    merged = list(coalesced(events(), 60.0))
    assert [e.delta for e in merged] == ["a", "bc", "d"] and merged[1].notice == "trimmed"
    assert merged[1].spans == (("bc", True),) and merged[-1].finish == "eos" and merged[-1].stats.new_tokens == 4
    assert [e.delta for e in coalesced(events(), 0.0)] == ["a", "b", "c", "d", ""]

    def failing():
        yield ReplyEvent.of((), ReplyStats())               # nothing to show yet (held back by a stop matcher)
        yield ReplyEvent.of((("a", False),), ReplyStats(new_tokens=1))
        yield ReplyEvent.of((("b", False),), ReplyStats(new_tokens=2))
        raise RuntimeError("engine failed")

    got = coalesced(failing(), 60.0)
    assert [next(got).delta, next(got).delta, next(got).delta] == ["", "a", "b"]   # the first text at once; held text kept
    with pytest.raises(RuntimeError, match="engine failed"):
        next(got)


def test_every_step_runs_on_the_services_worker(tiny_service, monkeypatch):
    """All torch work on one thread (core/service/worker.py): the engine's steps never run on the reader's."""
    engine, on_worker = tiny_service.engine, []
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda *a, **k: on_worker.append(tiny_service.worker.here) or step(*a, **k))
    collect(tiny_service, [{"role": "user", "content": "Go on"}], SamplingConfig(max_new_tokens=12))
    assert on_worker and all(on_worker)


def test_leaving_a_reply_early_frees_the_engine(tiny_service, monkeypatch):
    engine, steps, released = tiny_service.engine, [], threading.Event()
    step = engine.step

    def slow_step(*a, **k):  # one step at a time until the reader has left
        steps.append(1)
        released.wait(5)
        return step(*a, **k)

    monkeypatch.setattr(engine, "step", slow_step)
    events = tiny_service.reply([{"role": "user", "content": "Go on"}], "", SamplingConfig(max_new_tokens=200), (),
                                threading.Event())
    next(events)
    released.set()
    events.close()
    assert tiny_service.busy.acquire(blocking=False)  # released, with the engine's generator closed
    tiny_service.busy.release()
    assert tiny_service.worker.call(lambda: len(steps)) == len(steps) < 199  # and nothing runs on
    text, _ = collect(tiny_service, [{"role": "user", "content": "Again"}], SamplingConfig(max_new_tokens=5))
    assert text  # the engine is reusable


@pytest.mark.slow
def test_embedded_model_knows_the_capital_of_france(embedded_target):
    service = ChatService(Engine(embedded_target))
    text, events = collect(service, [{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in text
    assert events[-1].finish == "eos"
    assert events[-1].stats.accept_len == 1.0 and events[-1].stats.tok_s > 0


def test_fit_context_needs_a_user_message(tokenizer):
    from core.errors import AerieError

    with pytest.raises(AerieError, match="no user message"):
        fit_context(tokenizer, [], "", 100)


def test_the_chat_service_offers_what_the_app_asks_of_it(tiny_service):
    """app/ types the service with core/service/contract.py's Protocol: ChatService must have every
    member it names, and `reply` the same parameters."""
    import inspect

    from core.service.contract import ChatServiceApi
    wanted = {n for n in vars(ChatServiceApi) if not n.startswith("_")} | set(ChatServiceApi.__annotations__)
    assert wanted >= {"reply", "load_model", "fetch", "monitor", "label", "model_name", "tuning", "default_system_prompt"}
    assert all(hasattr(tiny_service, name) for name in wanted), wanted - {n for n in wanted if hasattr(tiny_service, n)}
    assert list(inspect.signature(ChatService.reply).parameters) == list(inspect.signature(ChatServiceApi.reply).parameters)
