"""The engine's plain decoding against transformers, on tiny random Llamas built here."""

import threading

import pytest
import torch

from core.config import SamplingConfig
from core.engine import Engine
from tests.conftest import tiny_llama, tiny_target


def run(engine: Engine, prompt: list[int], sampling: SamplingConfig, cancel=None) -> list[int]:
    return [t for step in engine.generate(prompt, sampling, cancel) for t in step.new_ids]


def hf_greedy(model, prompt: list[int], n: int, eos: int | None) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0,
                         attention_mask=torch.ones_like(ids))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("prompt_len", [1, 7, 64])
def test_plain_greedy_equals_transformers_generate(prompt_len):
    model = tiny_llama(seed=prompt_len)
    prompt = torch.randint(0, 256, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = run(Engine(tiny_target(model)), prompt, SamplingConfig(max_new_tokens=40))
    assert ours == hf_greedy(model, prompt, 40, None)
    assert len(ours) == 40


def test_eos_ends_the_answer_like_transformers():
    model = tiny_llama(seed=3)
    prompt = [5, 17, 42]
    reference = hf_greedy(model, prompt, 60, None)
    eos = reference[10]  # a token the greedy answer reaches: both must stop right after it
    ours = run(Engine(tiny_target(model, eos_ids=(eos,))), prompt, SamplingConfig(max_new_tokens=60))
    assert ours == hf_greedy(model, prompt, 60, eos)
    assert ours[-1] == eos and eos not in ours[:-1]


def test_seeded_sampling_reproduces_and_seeds_differ():
    engine = Engine(tiny_target())
    prompt = [1, 2, 3, 4]
    cfg = SamplingConfig(temperature=1.0, top_p=0.95, top_k=50, seed=7, max_new_tokens=30)
    first = run(engine, prompt, cfg)
    assert run(engine, prompt, cfg) == first
    assert run(Engine(tiny_target()), prompt, cfg) == first  # a fresh engine: no hidden state
    other = run(engine, prompt, SamplingConfig(temperature=1.0, top_p=0.95, top_k=50, seed=8, max_new_tokens=30))
    assert other != first


def test_prefix_reuse_gives_the_same_answer_as_a_fresh_engine():
    model = tiny_llama(seed=5)
    engine = Engine(tiny_target(model))
    turn1 = [3, 1, 4, 1, 5, 9, 2, 6]
    answer1 = run(engine, turn1, SamplingConfig(max_new_tokens=12))
    turn2 = turn1 + answer1 + [7, 7, 7]
    assert run(engine, turn2, SamplingConfig(max_new_tokens=12)) == run(Engine(tiny_target(model)), turn2, SamplingConfig(max_new_tokens=12))
    assert engine.cached_ids[: len(turn2)] == turn2


def test_cancel_stops_the_work_and_leaves_the_engine_reusable():
    engine = Engine(tiny_target())
    cancel = threading.Event()
    cfg = SamplingConfig(temperature=0.8, seed=11, max_new_tokens=50)
    steps = 0
    for step in engine.generate([9, 8, 7], cfg, cancel):
        steps += 1
        if steps == 3:
            cancel.set()
    assert steps == 3  # no round runs after the flag is seen
    assert run(engine, [9, 8, 7], cfg) == run(Engine(tiny_target()), [9, 8, 7], cfg)


def test_a_failed_generation_leaves_the_engine_reusable():
    engine = Engine(tiny_target())
    cfg = SamplingConfig(max_new_tokens=20)
    expected = run(Engine(tiny_target()), [4, 4, 2], cfg)
    with pytest.raises(RuntimeError):
        for i, _ in enumerate(engine.generate([4, 4, 2], cfg)):
            if i == 4:
                raise RuntimeError("consumer failed mid-answer")
    assert run(engine, [4, 4, 2], cfg) == expected


def test_max_new_tokens_and_context_limit():
    engine = Engine(tiny_target(context_len=20))
    out = run(engine, list(range(15)), SamplingConfig(max_new_tokens=50))
    assert len(out) == 5  # stops where the context ends
    steps = list(engine.generate(list(range(15)), SamplingConfig(max_new_tokens=3)))
    assert sum(len(s.new_ids) for s in steps) == 3 and steps[-1].finish == "length"


@pytest.mark.parametrize("drafter", ["plain", "lookup"])
def test_near_ties_name_exactly_the_choices_within_the_runners_tolerance(drafter):
    """With a tolerance above every margin each greedy token is a near-tie, below every margin
    none is; the offsets index the round's new tokens (the prefill's first one included)."""
    from core.spec.drafters import PromptLookupDrafter
    model = tiny_llama(seed=2)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    for margin, everywhere in ((1e9, True), (-1.0, False)):
        engine = Engine(tiny_target(model), PromptLookupDrafter() if drafter == "lookup" else None)
        engine.runner.tie_margin = margin
        steps = list(engine.generate(prompt, SamplingConfig(max_new_tokens=20)))
        for step in steps:
            assert step.near_ties == (tuple(range(len(step.new_ids))) if everywhere else ())
    sampled = list(Engine(tiny_target(model)).generate(prompt, SamplingConfig(temperature=1.0, seed=1, max_new_tokens=5)))
    assert all(step.near_ties == () for step in sampled)  # sampling follows the distribution: no ties to log
