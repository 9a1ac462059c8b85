"""Medusa heads as a drafter in the one verifier (issue 19): the DESIGN invariants (greedy output is
plain decoding's for any tree, sampled output follows the target's distribution, a stopped
generation leaves the engine reusable), the tree the heads' guesses make, the checkpoint layouts
(FasterDecoding's, pickle or safetensors, and Aerie's over a draft vocabulary), and training."""

import copy
import json

import pytest
import torch
from safetensors.torch import save_file

from core.config import SamplingConfig, TreeConfig
from core.engine import Engine
from core.runtime.runner import RunnerConfig, TargetRunner
from core.spec.medusa import MedusaDrafter, medusa_tree, static_medusa_tree
from core.spec.tree import MC_SIM_7B_63, static_shape
from core.train.loop import TrainConfig
from core.train.medusa import train_medusa
from models.errors import HeadMismatchError, ModelLoadError, UnsupportedModelError
from models.medusa import MedusaConfig, MedusaHeads, load_medusa, new_medusa, save_medusa
from tests.conftest import tiny_llama, tiny_target
from tests.fakes import run
from tests.test_drafters import GREEDY_CASES, assert_reusable_after_a_stop, assert_sampling_follows_the_target
from tests.test_train import answers, data, model  # noqa: F401  (fixtures: a sharp tiny Llama and its own answers)

TREES = {"chain d2": TreeConfig(1, 1, 3), "d1k2n4": TreeConfig(1, 2, 4), "d3k4n16": TreeConfig(3, 4, 16),
         "static": TreeConfig(choices=MC_SIM_7B_63[:12])}


def random_heads(llama, num_heads: int = 4, vocab: torch.Tensor | None = None, seed: int = 0,
                 shared: bool = True) -> MedusaHeads:
    """Heads that start as the target's LM head (Medusa-1's init), then a seeded random nudge."""
    torch.manual_seed(seed)
    weight = llama.lm_head.weight.detach() if vocab is None else llama.lm_head.weight.detach()[vocab]
    heads = new_medusa(num_heads, 1, weight, shared)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return heads.eval()


def medusa_engine(target, tree: TreeConfig, heads=None, vocab=None, shared: bool = True) -> Engine:
    layers = target.model.config.num_hidden_layers
    runner = TargetRunner(target, RunnerConfig(compile=False), (layers,))
    heads = heads if heads is not None else random_heads(target.model, vocab=vocab, shared=shared)
    drafter = MedusaDrafter(heads, (layers,), layers, tree, vocab, target.model.get_output_embeddings())
    return Engine(target, drafter, runner)


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("seed", range(3))
def test_greedy_output_is_plain_decodings(tree, seed):
    llama = tiny_llama(seed=seed, layers=3)
    prompt, cfg = GREEDY_CASES[seed][0], SamplingConfig(max_new_tokens=GREEDY_CASES[seed][1])
    vocab = torch.arange(0, 256, 2) if seed == 2 else None   # a draft vocabulary of half the tokens
    assert run(medusa_engine(tiny_target(llama), TREES[tree], vocab=vocab, shared=seed != 1), prompt, cfg) == \
        run(Engine(tiny_target(llama)), prompt, cfg)


def test_trained_heads_draft_what_the_target_takes(model, answers, tmp_path):  # noqa: F811
    """Training lowers each head's loss; the saved heads load back and are accepted, losslessly."""
    cfg = TrainConfig(kind="medusa", medusa_heads=3, epochs=12, lr=1e-2, warmup_steps=5, batch_tokens=200, log_every=4,
                      save_every=1000)
    summary = train_medusa(tiny_target(model), data(answers, tmp_path), cfg, tmp_path / "medusa")
    curve = [r["loss"] for r in map(json.loads, (tmp_path / "medusa" / "log.jsonl").read_text().splitlines()) if "loss" in r]
    assert curve[-1] < 0.7 * curve[0], curve
    assert summary["finished"] and summary["val"]["acc"][0] > 0.2 and summary["val"]["tau_chain"] > 1.2
    heads, vocab = load_medusa(str(tmp_path / "medusa"), model.config)
    assert vocab is None and heads.config == MedusaConfig(3, 1, 64, 256, shared=True)
    prompt = json.loads(answers.read_text().splitlines()[0])["prompt_ids"]
    plain = run(Engine(tiny_target(model)), prompt, SamplingConfig(max_new_tokens=32))
    steps = list(medusa_engine(tiny_target(model), TreeConfig(2, 2, 6), heads).generate(prompt, SamplingConfig(max_new_tokens=32)))
    assert [t for s in steps for t in s.new_ids] == plain
    assert len(plain) / len(steps) > 1.3   # mean accepted length on a training prompt


def test_sampled_output_follows_the_target_distribution():
    """DESIGN invariant 3 (as tests/test_drafters.py checks the rivals): chi-square on the first two
    sampled tokens of a 4-token vocabulary over 1500 seeds, the second from the first round's tree."""
    llama = tiny_llama(vocab_size=4, seed=5, layers=3)
    assert_sampling_follows_the_target(medusa_engine(tiny_target(llama), TreeConfig(1, 2, 4)), llama)


def test_a_stopped_generation_leaves_the_engine_reusable():
    llama = tiny_llama(seed=3, layers=3)
    assert_reusable_after_a_stop(medusa_engine(tiny_target(llama), TreeConfig(2, 2, 6)), llama)


def test_the_tree_keeps_the_best_paths_of_the_heads_guesses():
    """Every node's children are its depth's head's top-k, whatever the parent; the kept nodes are the
    best total_tokens - 1 by summed log-prob and include every ancestor."""
    logp = torch.log_softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(1)), -1)   # (K, V)
    tree = medusa_tree(7, logp, 4, 12, lambda ids: ids)
    assert tree.size == 12 and int(tree.tokens[0]) == 7
    scores = [0.0]
    for i in range(1, tree.size):
        d, tok = int(tree.depth[i]), int(tree.tokens[i])
        assert tok in logp[d - 1].topk(4).indices.tolist()
        scores.append(scores[int(tree.parents[i])] + float(logp[d - 1, tok]))
    # A child never outscores its parent, so the kept children of the root are head 0's best guesses.
    first = sorted(int(t) for t in tree.tokens[tree.depth == 1])
    assert first == sorted(logp[0].topk(len(first)).indices.tolist())
    assert tree.max_depth <= 3


def test_a_static_tree_takes_each_heads_ranked_guess():
    logp = torch.log_softmax(torch.randn(5, 30, generator=torch.Generator().manual_seed(2)), -1)
    parents, rank = static_shape(MC_SIM_7B_63)
    tree = static_medusa_tree(3, logp, parents, rank, lambda ids: ids + 100)
    ranked = logp.topk(4, dim=-1).indices
    for i in range(1, tree.size):
        assert int(tree.tokens[i]) == int(ranked[int(tree.depth[i]) - 1, int(rank[i])]) + 100


def test_trees_deeper_than_the_heads_and_other_feature_layers_are_refused():
    llama = tiny_llama(layers=3)
    heads = random_heads(llama, num_heads=2)
    with pytest.raises(UnsupportedModelError, match="needs 3 Medusa heads"):
        MedusaDrafter(heads, (3,), 3, TreeConfig(2, 2, 6), None, llama.lm_head)
    with pytest.raises(UnsupportedModelError, match="last layer"):
        MedusaDrafter(heads, (1, 2), 3, TreeConfig(0, 2, 3), None, llama.lm_head)
    with pytest.raises(UnsupportedModelError, match="share the target's LM head"):
        MedusaDrafter(heads, (3,), 3, TreeConfig(0, 2, 3))


def faster_decoding_state(heads: MedusaHeads, prefix: str = "") -> dict:
    return {prefix + k.removeprefix("heads."): t.clone() for k, t in heads.state_dict().items()}


@pytest.mark.parametrize("form", ["pickle", "safetensors with prefix"])
def test_faster_decoding_checkpoints_load(tmp_path, form):
    llama = tiny_llama(layers=3)
    heads = random_heads(llama, num_heads=3, seed=4, shared=False)
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1,
                                                      "base_model_name_or_path": "tiny"}))
    if form == "pickle":
        torch.save(faster_decoding_state(heads), tmp_path / "medusa_lm_head.pt")
        with pytest.raises(ModelLoadError, match="allow-pickle"):
            load_medusa(str(tmp_path), llama.config)
    else:
        save_file(faster_decoding_state(heads, "medusa_head."), str(tmp_path / "medusa_lm_head.safetensors"))
    loaded, vocab = load_medusa(str(tmp_path), llama.config, allow_pickle=True)
    x = torch.randn(5, 64)
    assert vocab is None and torch.equal(loaded(x), heads(x))
    assert not torch.equal(loaded.heads[0][-1].weight, loaded.heads[1][-1].weight)   # each head its own projection


def test_aerie_heads_over_a_draft_vocabulary_round_trip_and_other_models_are_refused(tmp_path):
    llama = tiny_llama(layers=3)
    vocab = torch.arange(0, 256, 4)
    heads = random_heads(llama, vocab=vocab)
    save_medusa(heads, tmp_path, vocab, "tiny", dtype=torch.float32)
    loaded, loaded_vocab = load_medusa(str(tmp_path), llama.config)
    x = torch.randn(2, 64)
    assert torch.equal(loaded_vocab, vocab) and torch.equal(loaded(x), heads(x))
    other = copy.deepcopy(llama.config)
    other.hidden_size = 32
    with pytest.raises(HeadMismatchError, match="another model"):
        load_medusa(str(tmp_path), other)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ModelLoadError, match="medusa_num_heads"):
        load_medusa(str(tmp_path), llama.config)


@pytest.mark.slow
def test_the_shipped_heads_draft_for_the_embedded_model_losslessly(embedded_target):
    """The heads Aerie ships (assets/heads/smollm2-135m-instruct-medusa) load beside the shipped EAGLE
    head's draft vocabulary, are accepted on a real prompt, and change no token of plain decoding's."""
    from cli import default_medusa
    from core.text import render_prompt

    heads, vocab = load_medusa(default_medusa(None), embedded_target.model.config)
    assert vocab is not None and heads.config.num_heads >= 3
    prompt = render_prompt(embedded_target.tokenizer, [{"role": "user", "content": "List the days of the week, then say why."}])
    cfg = SamplingConfig(max_new_tokens=40)
    plain = run(Engine(embedded_target), prompt, cfg)
    steps = list(medusa_engine(embedded_target, TreeConfig(2, 3, 10), heads, vocab).generate(prompt, cfg))
    assert [t for s in steps for t in s.new_ids] == plain
    assert sum(s.accepted for s in steps) > 5
