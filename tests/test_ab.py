"""A/B and drafted spans on a real model (tiny, random, with the embedded tokenizer): plain decoding
through the service's one-answer override writes the speculative answer's text under greedy
decoding, and every answer's spans add up to its text, drafted wherever rounds accepted drafts."""

import threading

import pytest

from app import chats, compare, race
from app.handlers import Cancels
from app.store import ChatStore
from core.service.chat import ChatService
from core.text import IncrementalDetokenizer, StopMatcher, round_spans
from core.config import SamplingConfig
from core.engine import Engine
from tests.conftest import load_tuned_tiny
from tests.fakes import MULTIBYTE
from tests.fakes import OracleDrafter
from tests.fakes import session

HELLO = [{"role": "user", "content": "Say hello to the comparison."}]


@pytest.fixture(scope="module")
def loaded(tiny_dir, tmp_path_factory):
    # A cache of its own: test_monitor checks that its load measures the latency profile.
    return load_tuned_tiny(tiny_dir, tmp_path_factory.mktemp("ab-cache"))


def answer(service, max_new=32, strategy=None):
    events = list(service.reply(HELLO, "", SamplingConfig(max_new_tokens=max_new), (), threading.Event(),
                                strategy=strategy))
    return events, "".join(e.delta for e in events)


def test_plain_override_matches_greedy_speculation_and_is_not_a_tuner_turn(loaded):
    service = ChatService(loaded.engine, tuner=loaded.tuner)
    spec_events, spec_text = answer(service)
    turns = len(loaded.tuner.turns)
    plain_events, plain_text = answer(service, strategy="plain")
    spec, plain = spec_events[-1].stats, plain_events[-1].stats
    assert spec.strategy == "eagle" and plain.strategy == "plain" and plain.drafted == plain.accepted == 0
    assert plain_text == spec_text and spec_text
    assert len(loaded.tuner.turns) == turns  # the A/B run cannot demote the tuner's choice
    assert loaded.engine.drafter is loaded.tuner.drafters["eagle"]  # back to what it was
    assert answer(service)[0][-1].stats.strategy == "eagle"
    with pytest.raises(Exception, match="cannot decode with 'medusa'"):
        answer(service, strategy="medusa")


def test_spans_add_up_to_the_text_and_mark_accepted_drafts(loaded):
    target = loaded.engine.target
    plain_service = ChatService(Engine(target))
    _, plain_text = answer(plain_service, max_new=48)
    truth = list(plain_service.engine.cached_ids)  # the prompt and the greedy answer, as ids
    service = ChatService(Engine(target, OracleDrafter(truth, seed=3, vocab=len(target.tokenizer))))
    events, text = answer(service, max_new=48)
    assert text == plain_text and "".join(piece for e in events for piece, _ in e.pieces) == text
    assert events[-1].stats.accepted > 0
    drafted = [piece for e in events for piece, is_drafted in e.pieces if is_drafted]
    assert drafted and 0 < sum(map(len, drafted)) < len(text)  # the target's own tokens wrote the rest


def test_round_spans_split_each_round_at_its_drafted_tokens(tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog, then naps in the sun.",
                           add_special_tokens=False)
    detok, at, rounds = IncrementalDetokenizer(tokenizer), 0, []
    for accepted in [0, 3, 1, 2, 0, 4, 2, 3, 1, 5]:
        new = ids[at:at + accepted + 1]
        if not new:
            break
        rounds.append((new, round_spans(detok, new, min(accepted, len(new) - 1))))
        at += len(new)
    assert at == len(ids) and len(rounds) > 4
    assert "".join(p for _, spans in rounds for p, _ in spans) == tokenizer.decode(ids)
    for new, spans in rounds[1:]:
        expected = ((tokenizer.decode(new[:-1]), True),) if len(new) > 1 else ()
        assert spans == expected + ((tokenizer.decode(new[-1:]), False),)
    multibyte = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [round_spans(detok, multibyte[i:i + 3], 2) for i in range(0, len(multibyte), 3)]
    assert "".join(p for spans in pieces for p, _ in spans) == MULTIBYTE
    assert not any("\ufffd" in p for spans in pieces for p, _ in spans)


def test_stop_strings_keep_the_source_of_held_back_text():
    m = StopMatcher(("###",))
    assert m.push_spans((("Hello #", True),)) == ((("Hello ", True),), False)
    assert m.push_spans((("# not", False),)) == ((("#", True), ("# not", False)), False)
    assert m.push_spans((("a#", True), ("##b", False))) == ((("a", True),), True)
    assert m.push("x##") == ("x", False) and m.flush_spans() == (("##", False),)


def test_ab_button_on_the_real_model_says_identical(loaded, tmp_path):
    service, store = ChatService(loaded.engine, tuner=loaded.tuner), ChatStore(tmp_path / "chats.sqlite3")
    settings = ("", 0.0, 1.0, 0, -1, 24, "")
    view = list(chats.respond(store, service, Cancels(), None, "Compare me", [], *settings, request=session()))[-1][0]
    (chat,) = store.chats()
    assert "EAGLE" in view[2]["metadata"]["title"]
    shown, line = list(compare.compare(store, service, Cancels(), chat.id, True, request=session()))[-1]
    assert line.endswith("identical text: **yes**")
    answer_meta = store.messages(chat.id)[1].meta
    assert answer_meta["ab"]["text"] == store.messages(chat.id)[1].content
    assert answer_meta["ab"]["stats"]["strategy"] == "plain" and shown[-1]["metadata"]["title"] == line


def test_race_runs_every_drafter_and_each_says_plain_decodings_text(loaded, tmp_path):
    service = ChatService(loaded.engine, tuner=loaded.tuner, cache_dir=tmp_path / "cache")
    store = ChatStore(tmp_path / "chats.sqlite3")
    assert service.drafters == ("plain", "prompt_lookup", "lookahead", "layer_skip", "eagle")
    settings = ("", 0.8, 1.0, 0, 7, 24, "")   # sampled: the race still runs at temperature 0
    list(chats.respond(store, service, Cancels(), None, "Race me", [], *settings, request=session()))
    (chat,) = store.chats()
    turns = len(loaded.tuner.turns)
    shown, line = list(race.race(store, service, Cancels(), chat.id, False, request=session()))[-1]
    runs = store.messages(chat.id)[1].meta["race"]["runs"]
    assert [r["strategy"] for r in runs] == list(service.drafters)
    assert all(r["difference"] is None and r["stats"]["new_tokens"] > 0 for r in runs)
    assert line.startswith("Race of 5 drafters: fastest ") and line.endswith("identical text: all")
    assert shown[-1]["metadata"]["title"] == line and "| layer skip |" in shown[-1]["content"]
    assert len(loaded.tuner.turns) == turns and loaded.engine.drafter is loaded.tuner.drafters["eagle"]


def test_a_pinned_drafter_answers_until_unpinned(loaded, tmp_path):
    service = ChatService(loaded.engine, tuner=loaded.tuner, cache_dir=tmp_path / "cache")
    assert "lookahead" in service.pin("lookahead")
    assert answer(service)[0][-1].stats.strategy == "lookahead"
    with pytest.raises(Exception, match="cannot decode with 'medusa'"):
        service.pin("medusa")
    # The tuner's choice again: on this random head it predicts EAGLE loses, so prompt lookup, or plain
    # decoding where the race above measured prompt lookup slower than plain.
    service.pin(None)
    expected = "plain" if (loaded.tuner.measured("prompt_lookup") or 1.0) < 1.0 else "prompt_lookup"
    assert loaded.tuner.pins.strategy is None and answer(service)[0][-1].stats.strategy == expected
    service.pin("eagle")   # as the module's fixture was loaded
