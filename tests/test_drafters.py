"""The rivals of EAGLE as drafters in the one verifier (issue 19): Lookahead decoding and
self-speculative layer skip. DESIGN invariants for each: greedy output equals plain decoding's
token for token, sampled output follows the target's distribution (chi-square on a toy
vocabulary), and a stopped generation leaves the engine reusable; plus their own mechanics."""

import threading

import pytest
import torch

from core.config import SamplingConfig
from core.engine import Engine
from core.runtime.runner import RunnerConfig, TargetRunner
from core.spec.drafters import PromptLookupDrafter
from core.spec.layer_skip import LayerSkipDrafter, SkipConfig
from core.spec.lookahead import LookaheadConfig, LookaheadDrafter, add_ngrams, jacobi_step, window_rows
from core.spec.sampling import target_probs
from core.spec.tree import Draft, chain_tree
from core.tune.latency import LatencyProfile
from core.tune.skip import agreement, choose_exit, choose_skip, is_layerskip_checkpoint
from models.layer_view import layer_view
from tests.conftest import chain_at_once, tiny_llama, tiny_target
from tests.fakes import run

P_THRESHOLD = 1e-4
REPETITIVE = [5, 6, 7, 8, 9] * 3 + [5]


def lookahead(target, cfg=LookaheadConfig()):
    return Engine(target, LookaheadDrafter(cfg))


def layer_skip(target, skip=(1,), depth=3, min_confidence=0.0):
    runner = TargetRunner(target, RunnerConfig(compile=False))
    return Engine(target, LayerSkipDrafter(runner, SkipConfig(skip, depth, min_confidence)), runner)


ENGINES = {
    "lookahead W4N3G2": lambda t: lookahead(t),
    "lookahead W1N3G1": lambda t: lookahead(t, LookaheadConfig(1, 3, 1)),
    "lookahead W5N4G3": lambda t: lookahead(t, LookaheadConfig(5, 4, 3)),
    "layer skip 1 of 4, depth 3": lambda t: layer_skip(t),
    "layer skip 2 of 4, depth 2": lambda t: layer_skip(t, (0, 2), 2),
    "layer skip the last, depth 5, confidence 0.3": lambda t: layer_skip(t, (3,), 5, 0.3),
    "early exit after layer 1, depth 4": lambda t: layer_skip(t, (1, 2, 3), 4),
}


# (prompt, new tokens) per seed: a repetitive prompt, one token, a long one
GREEDY_CASES = [(REPETITIVE, 60), ([3], 9), (list(range(40, 73)), 45)]


@pytest.mark.parametrize("name", ENGINES)
@pytest.mark.parametrize("seed", range(3))
def test_greedy_output_is_plain_decodings(name, seed):
    model = tiny_llama(seed=seed, layers=4)
    prompt, cfg = GREEDY_CASES[seed][0], SamplingConfig(max_new_tokens=GREEDY_CASES[seed][1])
    plain = run(Engine(tiny_target(model)), prompt, cfg)
    steps = list(ENGINES[name](tiny_target(model)).generate(prompt, cfg))
    assert [t for s in steps for t in s.new_ids] == plain
    if seed == 0:
        assert len(steps) < len(plain)   # drafts really were accepted


def test_lookahead_stops_at_eos_inside_an_accepted_ngram():
    model = tiny_llama(seed=0, layers=4)
    plain = run(Engine(tiny_target(model)), REPETITIVE, SamplingConfig(max_new_tokens=60))
    eos = plain[30]
    engine = lookahead(tiny_target(model, eos_ids=(eos,)), LookaheadConfig(5, 4, 3))
    assert run(engine, REPETITIVE, SamplingConfig(max_new_tokens=60)) == plain[: plain.index(eos) + 1]


def exact_first_two(model, prompt: list[int], sampling: SamplingConfig) -> torch.Tensor:
    """(V, V) P(t1, t2) of plain sampling after `prompt`, from the model's own logits."""
    with torch.no_grad():
        first = target_probs(model(torch.tensor([prompt])).logits[0, -1:], sampling)[0]          # (V,)
        vocab = first.shape[0]
        batch = torch.tensor([prompt + [t] for t in range(vocab)])
        second = target_probs(model(batch).logits[:, -1], sampling)                                # (V, V)
    return first[:, None] * second


def first_two_counts(engine: Engine, prompt: list[int], trials: int, temperature: float) -> torch.Tensor:
    counts = None
    for seed in range(trials):
        out = run(engine, prompt, SamplingConfig(temperature=temperature, seed=seed, max_new_tokens=3))
        if counts is None:
            vocab = engine.target.model.config.vocab_size
            counts = torch.zeros(vocab, vocab)
        counts[out[0], out[1]] += 1
    return counts


@pytest.mark.parametrize("make", [lambda t: lookahead(t, LookaheadConfig(2, 3, 2)),
                                  lambda t: layer_skip(t, (1,), 2),
                                  lambda t: Engine(t, PromptLookupDrafter())],
                         ids=["lookahead", "layer_skip", "prompt_lookup"])
def test_sampled_output_follows_the_target_distribution(make):
    """DESIGN invariant 3 through the whole engine: on a 4-token vocabulary, the first two sampled
    tokens (the second from the first round's tree) over 1500 seeds against the exact
    P(t1) P(t2 | t1); Pearson chi-square, 15 degrees of freedom, fails below p = 1e-4. The same
    prompt each time, so lookahead's pool and prompt lookup's index offer drafts the target takes
    (the assert on accepted rounds checks they did)."""
    model = tiny_llama(vocab_size=4, seed=5, layers=4)
    assert_sampling_follows_the_target(make(tiny_target(model)), model)


def assert_sampling_follows_the_target(engine: Engine, model) -> None:
    """Chi-square (15 degrees of freedom) of the first two tokens of 1500 seeded answers against the
    exact P(t1) P(t2 | t1) of the 4-token `model`; some drafts must have been accepted."""
    prompt, temperature = [1, 2, 3, 1, 2, 3, 1, 2], 1.5
    counts = first_two_counts(engine, prompt, 1500, temperature)
    accepted = sum(s.accepted for s in engine.generate(prompt, SamplingConfig(temperature=temperature, seed=0,
                                                                               max_new_tokens=40)))
    assert accepted > 0
    expected = counts.sum() * exact_first_two(model, prompt, SamplingConfig(temperature=temperature))
    stat = ((counts - expected) ** 2 / expected).sum().double()
    p = float(torch.special.gammaincc(torch.tensor(15 / 2, dtype=torch.float64), stat / 2))
    assert p > P_THRESHOLD, (counts, expected)


@pytest.mark.parametrize("make", [lambda t: lookahead(t), lambda t: layer_skip(t)], ids=["lookahead", "layer_skip"])
def test_a_stopped_generation_leaves_the_engine_reusable(make):
    model = tiny_llama(seed=3, layers=4)
    assert_reusable_after_a_stop(make(tiny_target(model)), model)


def assert_reusable_after_a_stop(engine: Engine, model) -> None:
    """DESIGN invariant 4: stopped after 3 rounds, the engine answers as plain decoding does, and a
    new chat with the same seed gives the same sampled text."""
    cancel = threading.Event()
    for i, _ in enumerate(engine.generate(REPETITIVE, SamplingConfig(max_new_tokens=50), cancel)):
        if i == 2:
            cancel.set()
    greedy = SamplingConfig(max_new_tokens=30)
    assert run(engine, REPETITIVE, greedy) == run(Engine(tiny_target(model)), REPETITIVE, greedy)
    sampled = SamplingConfig(temperature=0.9, seed=4, max_new_tokens=30)
    engine.reset()   # a new chat: the same seed gives the same text
    first = run(engine, REPETITIVE, sampled)
    engine.reset()
    assert run(engine, REPETITIVE, sampled) == first


# ---------------------------------------------------------------- lookahead's mechanics

def test_window_rows_are_the_columns_chains():
    window = ((0, 11, 12, 13), (20, 21, 22, 23))          # N = 3, W = 4; level 0 column 0 is the root's place
    side = window_rows(window)
    assert side.tokens.tolist() == [11, 12, 13, 20, 21, 22, 23]
    assert side.depth.tolist() == [1, 2, 3, 1, 2, 3, 4]  # level l, column i at root + i + l
    seen = [torch.nonzero(row).flatten().tolist() for row in side.visible]
    assert seen == [[0], [0, 1], [0, 1, 2], [3], [0, 4], [0, 1, 5], [0, 1, 2, 6]]
    assert side.read.tolist() == [3, 4, 5, 6]              # the last level's rows


def test_a_jacobi_step_shifts_the_window_and_completes_each_columns_ngram():
    window = ((0, 11, 12), (20, 21, 22))
    after, grams = jacobi_step(window, root=7, guesses=[30, 31, 32], committed=1)
    assert after == ((20, 21, 22), (30, 31, 32))
    assert grams == [(7, 20, 30), (11, 21, 31), (12, 22, 32)]
    after, _ = jacobi_step(((0, 1), (2, 3), (4, 5)), root=7, guesses=[8, 9], committed=3)
    assert after == ((8, 9), (4, 5), (8, 9))               # each further shift refills the last level from the first


def test_the_pool_keeps_the_newest_distinct_ngrams_per_first_token():
    pool = {}
    add_ngrams(pool, [(1, 2, 3), (1, 4, 5), (1, 2, 3), (1, 6, 7), (9, 9, 9)], keep=2)
    assert pool == {1: [(4, 5), (6, 7)], 9: [(9, 9)]}


def test_the_pool_lasts_the_chat_and_a_new_chat_empties_it():
    model = tiny_llama(seed=0, layers=4)
    engine = lookahead(tiny_target(model))
    turn1 = run(engine, REPETITIVE, SamplingConfig(max_new_tokens=30))
    pool = dict(engine.drafter.pool)
    assert pool
    run(engine, REPETITIVE + turn1 + [5, 6], SamplingConfig(max_new_tokens=5))   # the chat goes on
    assert set(pool) <= set(engine.drafter.pool)    # kept (and grown), not emptied
    engine.reset()
    assert engine.drafter.pool == {}


def test_side_rows_leave_the_trees_logits_alone_and_see_their_own_chains():
    model = tiny_llama(seed=1)
    engine = Engine(tiny_target(model))
    prompt = [3, 1, 4, 1, 5]
    engine.prefill(prompt)
    tree = chain_tree(9, [2, 6])
    alone = engine.verify(tree).logits
    engine.runner.truncate(len(prompt))
    side = window_rows(((0, 7, 8), (1, 2, 3)))
    both = engine.verify(Draft(tree, side=side))
    assert torch.allclose(both.logits, alone, atol=1e-5)
    # Column 2's last-level row is the chain root, 7, 8, 3: its argmax is that chain's next token.
    chain = chain_at_once(engine.runner, [9, 7, 8, 3], len(prompt))
    assert int(both.side_next[2]) == int(chain[-1].argmax())


# ---------------------------------------------------------------- layer skip's mechanics

def test_a_view_over_every_layer_is_the_decoder_and_shares_its_weights():
    model = tiny_llama(seed=2, layers=4)
    decoder = model.get_decoder()
    view = layer_view(decoder, range(4))
    ids = torch.tensor([[5, 9, 2, 7]])
    with torch.no_grad():
        assert torch.equal(view(input_ids=ids).last_hidden_state, decoder(input_ids=ids).last_hidden_state)
    some = layer_view(decoder, (0, 3))
    assert some.layers[1] is decoder.layers[3] and some.embed_tokens is decoder.embed_tokens
    assert not any(p.is_meta for p in some.parameters())
    with pytest.raises(ValueError):
        layer_view(decoder, (2, 1))


def calibration(new_tokens: int):
    """A tiny 4-layer target's runner and its own greedy answer to a prompt: (model, runner, sequence, start)."""
    model = tiny_llama(seed=4, layers=4)
    target = tiny_target(model)
    prompt = [7, 3, 9, 1]
    answer = run(Engine(target), prompt, SamplingConfig(max_new_tokens=new_tokens))
    return model, TargetRunner(target, RunnerConfig(compile=False)), prompt + answer, len(prompt) - 1


def test_agreement_is_the_drafters_own_first_guess():
    model, runner, sequence, start = calibration(12)
    assert agreement(runner, layer_view(model.get_decoder(), range(4)), sequence, start) == 1.0
    drafter = LayerSkipDrafter(runner, SkipConfig((1, 2), depth=1))
    hits = 0
    for p in range(start, len(sequence) - 1):   # the drafter's first guess at every position, one at a time
        runner.reset()
        runner.prefill(sequence[:p], 0)
        hits += int(drafter.draft(sequence[:p + 1], None).tree.tokens[1]) == sequence[p + 1]
    assert agreement(runner, drafter.view, sequence, start) == pytest.approx(hits / (len(sequence) - 1 - start))


def test_the_skip_search_picks_a_valid_set_and_depth():
    _, runner, sequence, start = calibration(16)
    # A target whose verify costs the same for 1 or 8 tokens: drafting pays whenever a guess is right.
    profile = LatencyProfile(sizes=(1, 8), round_ms=(10.0, 10.0), contexts=(32, 512), slope_sizes=(1,), slope_ms=(0.0,))
    choice = choose_skip(runner, profile, [(sequence, start)], report=lambda line: None)
    assert 1 <= len(choice.config.skip) < 4 and 1 <= choice.config.depth
    assert len(choice.damage) == 4 and len(choice.curve) == 3
    assert choice.predicted > 0 and 0.0 <= choice.agreement <= 1.0


def test_the_exit_search_tries_every_early_exit():
    _, runner, sequence, start = calibration(16)
    profile = LatencyProfile(sizes=(1, 8), round_ms=(10.0, 10.0), contexts=(32, 512), slope_sizes=(1,), slope_ms=(0.0,))
    choice = choose_exit(runner, profile, [(sequence, start)], report=lambda line: None)
    assert [row[0] for row in choice.curve] == [1, 2, 3]              # exits after layers 3, 2, 1
    exit_at = choice.config.exit_layer(4)
    assert exit_at in (1, 2, 3) and choice.config.skip == tuple(range(exit_at, 4))
    assert f"exits after layer {exit_at} of 4 (early exit)" in choice.describe()
    assert SkipConfig((1, 3)).exit_layer(4) is None and SkipConfig((3,)).exit_layer(4) == 3


def test_layerskip_checkpoints_are_known_by_name():
    assert is_layerskip_checkpoint("facebook/layerskip-llama3.2-1B")
    assert is_layerskip_checkpoint("/home/me/.cache/hub/models--facebook--layerskip-llama2-7B/snapshots/abc")
    assert not is_layerskip_checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_a_layerskip_checkpoint_drafts_by_early_exit(tmp_path, tokenizer, cache_dir):
    """A model saved as a LayerSkip checkpoint (by name): the bench's layer-skip drafter exits early, losslessly."""
    from core.bench import bench
    from core.service.spec import EngineSpec
    from tests.conftest import ROOT_ASSETS

    folder = tmp_path / "models--facebook--layerskip-tiny"
    model = tiny_llama(vocab_size=len(tokenizer), seed=1, layers=4)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    spec = EngineSpec(model=str(folder), quant="none", device="cpu", cache_dir=cache_dir, compile=False)
    report = bench(spec, ROOT_ASSETS / "bench" / "mt_bench.jsonl", limit=1, max_new=8, strategies=("layer_skip",))
    entry = report["strategies"]["layer_skip"]
    skip = entry["skip"]
    assert entry["lossless"] and skip["exit_layer"] in (1, 2, 3)
    assert skip["layers"] == list(range(skip["exit_layer"], 4)) and "early exit" in skip["chosen"]


@pytest.mark.slow
def test_the_embedded_model_answers_the_same_with_each_rival(embedded_target):
    from core.text import render_prompt

    prompt = render_prompt(embedded_target.tokenizer, [{"role": "user", "content": "List the days of the week, then say why."}])
    cfg = SamplingConfig(max_new_tokens=40)
    plain = run(Engine(embedded_target), prompt, cfg)
    for engine in (lookahead(embedded_target, LookaheadConfig(4, 3, 2)),
                   layer_skip(embedded_target, skip=tuple(range(8, 22)), depth=3)):
        steps = list(engine.generate(prompt, cfg))
        assert [t for s in steps for t in s.new_ids] == plain, engine.drafter.name
        assert sum(s.accepted for s in steps) > 0, engine.drafter.name
