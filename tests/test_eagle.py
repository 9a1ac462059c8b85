"""The EAGLE drafter: lossless for random EAGLE-1 and EAGLE-3 heads and any tree shape, on tiny
random targets and on the real embedded model; the head cache stays in step across turns."""

from dataclasses import replace

import pytest
import torch

from core.config import SamplingConfig, TreeConfig
from core.spec.eagle import EagleDrafter
from core.engine import Engine
from core.spec.tree import MC_SIM_7B_63
from tests.conftest import random_head, tiny_llama, tiny_target
from tests.fakes import run




@pytest.mark.parametrize("kind, draft_vocab", [("eagle1", None), ("eagle3", None), ("eagle3", 100)])
@pytest.mark.parametrize("shape", [TreeConfig(1, 1, 2), TreeConfig(3, 4, 12), TreeConfig(5, 8, 48),
                                   TreeConfig(choices=MC_SIM_7B_63)])
def test_random_heads_are_lossless(kind, draft_vocab, shape):
    model = tiny_llama(seed=1, layers=4)
    prompt = torch.randint(0, 256, (13,), generator=torch.Generator().manual_seed(2)).tolist()
    plain = run(Engine(tiny_target(model)), prompt, SamplingConfig(max_new_tokens=30))
    drafter = EagleDrafter(random_head(model, kind, 3, draft_vocab), model.config.num_hidden_layers, shape)
    engine = Engine(tiny_target(model), drafter)
    steps = list(engine.generate(prompt, SamplingConfig(max_new_tokens=30)))
    assert [t for s in steps for t in s.new_ids] == plain
    most = 1 + len(shape.choices) if shape.choices else max(shape.total_tokens, shape.copy + 1)  # a copy round's chain
    assert all(s.tree_size <= most for s in steps[1:])
    if shape.choices:
        assert all(s.tree_size == most for s in steps[1:])
    assert drafter.head_len <= len(engine.cached_ids) == engine.runner.length == int(engine.runner.cache.get_seq_length())


def test_multi_turn_prefix_reuse_keeps_the_head_in_step():
    model = tiny_llama(seed=4, layers=4)
    drafter = EagleDrafter(random_head(model, "eagle1", 5), 4, TreeConfig(2, 3, 8))
    engine = Engine(tiny_target(model), drafter)
    turn = [4, 8, 15, 16, 23, 42]
    for _ in range(3):
        answer = run(engine, turn, SamplingConfig(max_new_tokens=10))
        assert answer == run(Engine(tiny_target(model)), turn, SamplingConfig(max_new_tokens=10))
        turn = turn + answer + [1, 2]


def test_the_prefill_step_primes_the_head_on_the_prompt():
    """The head takes in the prompt's pairs in the prefill's step, all but the last, which the
    first draft feeds (one row, not the prompt's 40); that draft is the one an unprimed head
    makes over the whole prompt at once, and the answer stays plain decoding's."""
    model = tiny_llama(seed=5, layers=4)
    head = random_head(model, "eagle1", 4)
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    drafter = EagleDrafter(head, 4, TreeConfig(2, 3, 8))
    engine = Engine(tiny_target(model), drafter)
    steps = engine.generate(prompt, SamplingConfig(max_new_tokens=20))
    first = next(steps)
    assert drafter.head_len == len(prompt) - 1 and first.draft_s > 0
    fed = []
    feed = drafter.step.feed
    drafter.step.feed = lambda features, *rest, **kw: fed.append(features.shape[0]) or feed(features, *rest, **kw)
    second = next(steps)
    assert fed[0] == 1
    unprimed = EagleDrafter(head, 4, TreeConfig(2, 3, 8))
    other = Engine(tiny_target(model), unprimed)
    tree = unprimed.draft(prompt + [first.new_ids[0]], other.prefill(prompt)).tree
    assert second.tree_size == tree.size and second.drafted == tree.max_depth
    answer = [t for s in [first, second, *steps] for t in s.new_ids]
    assert answer == run(Engine(tiny_target(model)), prompt, SamplingConfig(max_new_tokens=20))


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_remembered_pairs_hold_what_a_catch_up_writes(kind):
    """A prompt's pairs put in the head cache by `remember` (keys and values alone, no attention)
    are the rows a full catch-up writes, bit for bit, and the next pair's draft is the same."""
    model = tiny_llama(seed=7, layers=4)
    head = random_head(model, kind, 8)
    fed, kept = (EagleDrafter(head, 4, TreeConfig(1, 1, 2)) for _ in range(2))
    g = torch.Generator().manual_seed(9)
    features = torch.randn(30, fed.feature_widths[0], generator=g)                     # (K, F)
    tokens = torch.randint(0, 256, (30,), generator=g).tolist()
    fed.catch_up(features[:-1], tokens[:-1])
    kept.remember(features[:-1], tokens[:-1])
    assert fed.head_len == kept.head_len == 29
    for a, b in zip(fed.step.cache.layers, kept.step.cache.layers):
        assert torch.equal(a.keys[:, :, :29], b.keys[:, :, :29]) and torch.equal(a.values[:, :, :29], b.values[:, :, :29])
    (out_fed, logp_fed), (out_kept, logp_kept) = (d.catch_up(features[-1:], tokens[-1:]) for d in (fed, kept))
    assert torch.equal(out_fed, out_kept) and torch.equal(logp_fed, logp_kept)


def test_reference_rounds_run_plainly_and_keep_the_head_in_step():
    """Every 4th answer's rounds 2 and 3 run plainly (the meter's reference): the text stays plain
    decoding's, and the head catches up on what it did not draft, within and across turns."""
    model = tiny_llama(seed=6, layers=4)
    drafter = EagleDrafter(random_head(model, "eagle1", 5), 4, TreeConfig(1, 2, 4))
    engine, turn = Engine(tiny_target(model), drafter), [9, 8, 7, 6, 5]
    for _ in range(2):
        steps = list(engine.generate(turn, SamplingConfig(max_new_tokens=24), reference_every=4))
        answer = [t for s in steps for t in s.new_ids]
        assert answer == run(Engine(tiny_target(model)), turn, SamplingConfig(max_new_tokens=24))
        rounds = steps[1:]
        assert [s.reference for s in rounds] == [i % 4 in (2, 3) for i in range(len(rounds))] and len(rounds) > 4
        assert all(s.tree_size == 1 and s.drafted == 0 and len(s.new_ids) == 1 for s in rounds if s.reference)
        assert all(s.tree_size > 1 for s in rounds[:2])
        turn = turn + answer + [3]


@pytest.mark.parametrize("sampling", [SamplingConfig(max_new_tokens=40),
                                      SamplingConfig(temperature=0.3, seed=3, max_new_tokens=40)])
def test_copy_rounds_are_lossless_and_keep_the_head_in_step(sampling):
    """Where the context repeats itself, copy rounds verify prompt lookup's chain with no head step
    in place of a tree of at most 4 tokens (and teach the tuner nothing); the head catches up on what they committed, across turns and
    reference rounds, and the text is plain decoding's (sampled: the same seed's again)."""
    model = tiny_llama(seed=3, layers=4)

    def chat(copy: int, tree: TreeConfig = TreeConfig(1, 2, 4)) -> list[tuple[list[int], list]]:
        """Two turns on one engine: each turn's prompt and its steps."""
        drafter = EagleDrafter(random_head(model, "eagle1", 5), 4, replace(tree, copy=copy))
        engine, turn, turns = Engine(tiny_target(model), drafter), [5, 6, 7, 8, 9] * 4, []
        for _ in range(2):
            steps = list(engine.generate(turn, sampling, reference_every=4))
            assert drafter.head_len <= len(engine.cached_ids) == engine.runner.length
            turns.append((turn, steps))
            turn = turn + [t for s in steps for t in s.new_ids] + [5, 6, 7]
        return turns

    def text(steps) -> list[int]:
        return [t for s in steps for t in s.new_ids]

    copying = chat(3)
    copies = [s for _, steps in copying for s in steps[1:] if s.copied]
    assert copies and all(s.tree_size <= 4 and s.offers == () and not s.reference for s in copies)
    for prompt, steps in copying if sampling.greedy else ():
        assert text(steps) == run(Engine(tiny_target(model)), prompt, sampling)
    if not sampling.greedy:
        assert [text(steps) for _, steps in copying] == [text(steps) for _, steps in chat(3)]
    assert not any(s.copied for _, steps in chat(0) for s in steps)
    assert not any(s.copied for _, steps in chat(3, TreeConfig(3, 4, 12)) for s in steps)   # a bigger tree pays more


def test_sampled_eagle_is_reproducible():
    model = tiny_llama(seed=6, layers=4)
    cfg = SamplingConfig(temperature=0.7, seed=9, max_new_tokens=25)

    def fresh():
        return Engine(tiny_target(model), EagleDrafter(random_head(model, "eagle1", 7), 4, TreeConfig(3, 4, 16)))

    assert run(fresh(), [3, 3, 3], cfg) == run(fresh(), [3, 3, 3], cfg)


@pytest.mark.slow
def test_embedded_model_with_a_random_head_is_lossless(embedded_target):
    from core.text import render_prompt

    model = embedded_target.model
    prompt = render_prompt(embedded_target.tokenizer, [{"role": "user", "content": "Name three colours."}])
    plain = run(Engine(embedded_target), prompt, SamplingConfig(max_new_tokens=24))
    drafter = EagleDrafter(random_head(model, "eagle1", 0), model.config.num_hidden_layers, TreeConfig(3, 4, 12))
    assert run(Engine(embedded_target, drafter), prompt, SamplingConfig(max_new_tokens=24)) == plain


def test_static_tree_follows_the_head_ranks():
    model = tiny_llama(seed=8, layers=4)
    head = random_head(model, "eagle1", 1)

    def first_tree(tree_config):
        engine = Engine(tiny_target(model), EagleDrafter(head, 4, tree_config))
        return engine.drafter.draft([1, 2, 3, 4, 9], engine.prefill([1, 2, 3, 4])).tree

    static = first_tree(TreeConfig(choices=((0,), (1,), (0, 0), (0, 1), (0, 0, 0))))
    dynamic = first_tree(TreeConfig(depth=0, top_k=2, total_tokens=3))  # the root's top-2 children
    assert static.parents.tolist() == [-1, 0, 0, 1, 1, 3]
    assert static.tokens[1:3].tolist() == dynamic.tokens[1:3].tolist()
    assert static.tokens[3] != static.tokens[4]


def test_a_draft_vocabulary_restricts_drafts_and_stays_lossless(tmp_path):
    from models.head_checkpoint import load_draft_vocab, save_draft_vocab

    model = tiny_llama(seed=9, layers=4)
    head = random_head(model, "eagle1", 2)
    prompt = [5, 9, 5, 9, 5]
    plain = run(Engine(tiny_target(model)), prompt, SamplingConfig(max_new_tokens=30))
    save_draft_vocab(tmp_path, torch.arange(0, 256, 2))      # even ids only
    vocab = load_draft_vocab(str(tmp_path), 256)
    drafter = EagleDrafter(head, 4, TreeConfig(3, 4, 12), vocab)
    engine = Engine(tiny_target(model), drafter)
    assert run(engine, prompt, SamplingConfig(max_new_tokens=30)) == plain
    tree = drafter.draft(prompt + [plain[0]], engine.prefill(prompt)).tree
    assert all(t % 2 == 0 for t in tree.tokens[1:].tolist())


def test_a_draft_vocabulary_names_its_narrow_rows_for_a_cpu(tmp_path):
    """A draft vocabulary with a narrow subset: a CPU drafts from it by default, a GPU from all of it
    (--draft-rows picks either anywhere); one without drafts from its one set everywhere."""
    from core.errors import HeadMismatchError, UnsupportedModelError
    from core.service.drafters import narrow_rows
    from models.head_checkpoint import load_draft_vocab, save_draft_vocab

    save_draft_vocab(tmp_path, torch.arange(0, 256, 2), torch.tensor([8, 0, 4]))
    assert load_draft_vocab(str(tmp_path), 256).tolist() == list(range(0, 256, 2))
    assert load_draft_vocab(str(tmp_path), 256, narrow=True).tolist() == [0, 4, 8]
    save_draft_vocab(tmp_path, torch.arange(0, 256, 2))
    assert load_draft_vocab(str(tmp_path), 256, narrow=True).tolist() == list(range(0, 256, 2))
    save_draft_vocab(tmp_path, torch.arange(0, 256, 2), torch.tensor([0, 3]))
    with pytest.raises(HeadMismatchError, match="not a subset"):
        load_draft_vocab(str(tmp_path), 256, narrow=True)
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert narrow_rows("auto", cpu) and not narrow_rows("auto", gpu)
    assert narrow_rows("narrow", gpu) and not narrow_rows("wide", cpu)
    with pytest.raises(UnsupportedModelError, match="--draft-rows 'all'"):
        narrow_rows("all", cpu)


def test_a_draft_vocabulary_out_of_range_is_refused(tmp_path):
    from core.errors import HeadMismatchError
    from models.head_checkpoint import load_draft_vocab, save_draft_vocab

    save_draft_vocab(tmp_path, torch.tensor([1, 300]))
    with pytest.raises(HeadMismatchError, match="outside this model's vocabulary of 256"):
        load_draft_vocab(str(tmp_path), 256)


@pytest.mark.slow
def test_the_shipped_head_is_lossless_and_accepts(embedded_target):
    from core.text import render_prompt
    from core.service.drafters import make_drafter
    from core.service.spec import EngineSpec
    from tests.conftest import ROOT_ASSETS

    shipped = ROOT_ASSETS / "heads" / "smollm2-135m-instruct"
    prompt = render_prompt(embedded_target.tokenizer, [{"role": "user", "content": "Give me three tips for better sleep."}])
    plain = run(Engine(embedded_target), prompt, SamplingConfig(max_new_tokens=40))
    # A CPU drafts from the draft vocabulary's narrow rows by default, a GPU (or --draft-rows wide) from all.
    for rows, drafted_from in (("auto", 8192), ("wide", 16384)):
        drafter = make_drafter(embedded_target, EngineSpec(head=str(shipped), draft_rows=rows))
        assert drafter.name == "eagle" and drafter.draft_rows == drafted_from
        steps = list(Engine(embedded_target, drafter).generate(prompt, SamplingConfig(max_new_tokens=40)))
        assert [t for s in steps for t in s.new_ids] == plain
        assert len(plain) / len(steps) > 1.2  # a trained head: well above one token per target forward


@pytest.mark.parametrize("shape", [TreeConfig(0, 1, 2), TreeConfig(3, 1, 5), TreeConfig(4, 1, 3), TreeConfig(2, 1, 9)])
def test_a_chain_is_the_tree_expand_and_rerank_would_draft(shape):
    """top_k 1 takes the chain path (no rerank, no levels past total_tokens - 1): the same tree as
    EAGLE-2's general expand-then-rerank, node for node."""
    model = tiny_llama(seed=1, layers=2)
    drafter = EagleDrafter(random_head(model, "eagle1", 3), model.config.num_hidden_layers, shape)
    engine = Engine(tiny_target(model), drafter)
    prompt = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    fresh = engine.prefill(prompt)
    out, logp = drafter.catch_up(fresh.features, prompt[1:] + [prompt[0]])
    chain = drafter.grow_chain(prompt[0], out, logp)
    tree, grafted = drafter.grow_tree(prompt[0], out, logp, [])
    assert grafted == () and torch.equal(chain.tokens, tree.tokens) and torch.equal(chain.parents, tree.parents)
    assert chain.size == min(shape.depth + 2, shape.total_tokens)


def test_a_copied_chain_grafted_into_a_big_tree_stays_lossless():
    """A prompt that repeats itself: prompt lookup finds what followed its last tokens before, and
    that chain is grafted into the EAGLE-2 tree (kept whatever the head scored it, appended where
    the head drafted none of it). The answer stays plain decoding's, the tree its size."""
    model = tiny_llama(seed=1, layers=4)
    phrase = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    prompt = phrase * 3 + phrase[:3]
    drafter = EagleDrafter(random_head(model, "eagle1", 3), 4, TreeConfig(2, 4, 10))
    engine = Engine(tiny_target(model), drafter)
    drafts, draft = [], drafter.draft
    drafter.draft = lambda context, fresh: drafts.append((list(context), draft(context, fresh))) or drafts[-1][1]
    steps = list(engine.generate(prompt, SamplingConfig(max_new_tokens=24)))
    assert [t for s in steps for t in s.new_ids] == run(Engine(tiny_target(model)), prompt, SamplingConfig(max_new_tokens=24))
    assert all(d.tree.size <= 10 for _, d in drafts)
    grafted = [(context, d) for context, d in drafts if d.grafted]
    assert grafted
    for context, d in grafted:   # the grafted nodes lie on one path whose tokens ran in the context before
        path = d.tree.paths[(d.tree.paths == d.grafted[-1]).any(1)][0]
        tokens = d.tree.tokens[path[path >= 0]].tolist()          # root .. the last grafted node
        assert any(context[i: i + len(tokens)] == tokens for i in range(len(context) - len(tokens)))
