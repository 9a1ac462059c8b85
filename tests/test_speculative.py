"""DESIGN invariants 1 and 4 for every drafter: greedy speculative output equals plain greedy output
token for token (any tree shape, prompt length, stop token, budget); sampling is reproducible."""


import pytest
import torch

from core.config import SamplingConfig
from core.spec.drafters import PromptLookupDrafter
from core.engine import Engine
from tests.conftest import tiny_llama, tiny_target
from tests.fakes import OracleDrafter, run




@pytest.mark.parametrize("seed", range(6))
def test_greedy_speculation_is_lossless_for_any_tree(seed):
    model = tiny_llama(seed=seed)
    prompt_len = [1, 2, 9, 33, 70, 5][seed]
    prompt = torch.randint(0, 256, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    n = [40, 7, 25, 60, 33, 1][seed]
    plain = run(Engine(tiny_target(model)), prompt, SamplingConfig(max_new_tokens=n))
    engine = Engine(tiny_target(model), OracleDrafter(prompt + plain, seed))
    steps = list(engine.generate(prompt, SamplingConfig(max_new_tokens=n)))
    assert [t for s in steps for t in s.new_ids] == plain
    if n > 20:
        assert max(s.accepted for s in steps) >= 2  # long paths really were accepted


def test_greedy_speculation_stops_at_eos_inside_an_accepted_path():
    model = tiny_llama(seed=11)
    prompt = [7, 7, 3]
    plain = run(Engine(tiny_target(model)), prompt, SamplingConfig(max_new_tokens=50))
    eos = plain[12]
    expected = plain[: plain.index(eos) + 1]
    for seed in range(4):
        engine = Engine(tiny_target(model, eos_ids=(eos,)), OracleDrafter(prompt + plain, seed))
        assert run(engine, prompt, SamplingConfig(max_new_tokens=50)) == expected


def test_prompt_lookup_is_lossless_and_accepts_on_repetitive_text():
    model = tiny_llama(seed=2)
    prompt = [5, 6, 7, 8, 9] * 6 + [5, 6]
    plain = run(Engine(tiny_target(model)), prompt, SamplingConfig(max_new_tokens=60))
    engine = Engine(tiny_target(model), PromptLookupDrafter())
    steps = list(engine.generate(prompt, SamplingConfig(max_new_tokens=60)))
    assert [t for s in steps for t in s.new_ids] == plain
    assert len(steps) < 60  # random tiny models repeat themselves: lookup must pay off


def test_prompt_lookup_proposes_the_latest_continuations():
    d = PromptLookupDrafter()
    ctx = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3]
    assert d.continuations(ctx) == [[5, 6, 1, 2, 3], [4, 9, 1, 2, 3, 5, 6, 1]]
    tree = d.draft(ctx, None).tree
    assert tree.tokens[0] == 3 and tree.size == 1 + 5 + 8
    assert PromptLookupDrafter().continuations([7, 1, 8, 2, 9, 1]) == []  # a lone 1-gram match is not enough


def test_speculative_sampling_is_reproducible_with_a_seed():
    model = tiny_llama(seed=4)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    cfg = SamplingConfig(temperature=0.9, top_p=0.9, seed=3, max_new_tokens=40)
    engine = Engine(tiny_target(model), PromptLookupDrafter())
    first = run(engine, prompt, cfg)
    assert run(engine, prompt, cfg) == first
    assert run(Engine(tiny_target(model), PromptLookupDrafter()), prompt, cfg) == first
