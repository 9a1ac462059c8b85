"""SpecExec's regime: best-first trees of hundreds of nodes for a slow target. The growth takes
exactly the best `budget` nodes by cumulative log-prob; EAGLE drafting with it is lossless; the
budget grows with the verify's fixed cost; the bench's simulated slow target slows every strategy."""

import heapq
import time

import pytest
import torch

from core.config import SamplingConfig, TreeConfig
from core.engine import Engine
from core.runtime.runner import RunnerConfig, TargetRunner
from core.spec.eagle import EagleDrafter
from core.spec.specexec import grow_best_first
from core.spec.tree import make_tree, rerank
from core.tune.big_trees import best_first_budget, best_first_growth
from core.tune.latency import LARGE_SIZES, LatencyProfile
from core.tune.shapes import Pins, prior_table
from models.errors import UnsupportedModelError
from tests.conftest import random_head, tiny_llama, tiny_target
from tests.fakes import run


def path_logp(path: tuple[int, ...], vocab: int) -> torch.Tensor:
    """A deterministic stand-in for the head: the children's log-probs (V,) after `path`."""
    g = torch.Generator().manual_seed(hash(path) % 2**31)
    return torch.log_softmax(2 * torch.randn(vocab, generator=g), -1)


def token_paths(tokens: list[int], parents: list[int], skip_root: bool) -> list[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tokens, parents):
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    return [p[1:] for p in paths[1:]] if skip_root else paths


def reference_best(vocab: int, width: int, budget: int) -> set[tuple[int, ...]]:
    """The best `budget` nodes of the width-limited tree, one node at a time from a heap of every
    child of every node taken: the textbook best-first search."""
    def children(path, score):
        logp, tokens = path_logp(path, vocab).topk(width)
        return [(-(score + lp), path + (t,)) for lp, t in zip(logp.tolist(), tokens.tolist())]
    heap, taken = children((), 0.0), set()
    heapq.heapify(heap)
    while len(taken) < budget:
        neg, path = heapq.heappop(heap)
        taken.add(path)
        for child in children(path, -neg):
            heapq.heappush(heap, child)
    return taken


@pytest.mark.parametrize("batch", [1, 3, 16])
def test_best_first_growth_takes_the_best_budget_nodes(batch):
    vocab, width, budget = 12, 4, 60

    def expand(pool, nodes):
        paths = token_paths(pool.tokens.tolist(), pool.parents.tolist(), skip_root=False)
        return torch.stack([path_logp(paths[m], vocab) for m in nodes.tolist()])

    pool = grow_best_first(path_logp((), vocab), expand, budget, batch, width, steps=1000)
    tree = rerank(pool.scores, pool.parents, pool.tokens, 99, budget + 1)   # asserts closure under ancestors
    assert tree.size == budget + 1
    make_tree(tree.tokens, tree.parents)                                    # parents before children
    grown = token_paths(tree.tokens.tolist(), tree.parents.tolist(), skip_root=True)
    assert set(grown) == reference_best(vocab, width, budget)
    assert bool(pool.expanded.sum() <= pool.size)


def test_best_first_growth_stops_at_its_head_steps():
    calls = []

    def expand(pool, nodes):
        calls.append(nodes.numel())
        return torch.log_softmax(torch.randn(nodes.numel(), 20), -1)

    pool = grow_best_first(torch.log_softmax(torch.randn(20), -1), expand, budget=500, batch=4, width=8, steps=3)
    assert calls == [4, 4, 4] and pool.size == 8 + 12 * 8


@pytest.mark.parametrize("budget, kind, draft_vocab", [(2, "eagle1", None), (12, "eagle1", None), (150, "eagle1", None),
                                                       (300, "eagle1", None), (120, "eagle3", 100)])
def test_best_first_trees_are_lossless(budget, kind, draft_vocab):
    model = tiny_llama(seed=1, layers=4)
    prompt = torch.randint(0, 256, (13,), generator=torch.Generator().manual_seed(2)).tolist()
    cfg = SamplingConfig(max_new_tokens=24)
    plain = run(Engine(tiny_target(model)), prompt, cfg)
    shape = TreeConfig(depth=60, top_k=8, total_tokens=budget + 1, best_first=True)
    drafter = EagleDrafter(random_head(model, kind, 3, draft_vocab), model.config.num_hidden_layers, shape)
    engine = Engine(tiny_target(model), drafter)
    steps = list(engine.generate(prompt, cfg))
    assert [t for s in steps for t in s.new_ids] == plain
    assert all(s.tree_size <= budget + 1 for s in steps[1:])
    if budget > 100:
        assert max(s.tree_size for s in steps[1:]) > 100   # a random head's flat guesses fill the budget
    assert drafter.head_len <= len(engine.cached_ids) == engine.runner.length


def test_sampling_through_best_first_trees_follows_the_target_distribution():
    """DESIGN invariant 3 for SpecExec's trees (tests/test_drafters.py's chi-square): on a 4-token
    vocabulary a 20-node best-first tree holds every short path, so drafts are taken. Depth 3: the
    answers are 3 tokens, so a deeper tree is trimmed to the same one (the same samples as depth 10
    on 100 seeds), its extra head steps only cost time."""
    from tests.test_drafters import assert_sampling_follows_the_target

    model = tiny_llama(vocab_size=4, seed=5, layers=4)
    shape = TreeConfig(depth=3, top_k=4, total_tokens=21, best_first=True)
    drafter = EagleDrafter(random_head(model, "eagle1", 3), model.config.num_hidden_layers, shape)
    assert_sampling_follows_the_target(Engine(tiny_target(model), drafter), model)


def test_a_big_tree_near_the_context_end_is_trimmed_to_the_cache():
    model = tiny_llama(seed=4, layers=2)
    cfg, prompt = SamplingConfig(max_new_tokens=100), [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    plain = run(Engine(tiny_target(model, context_len=64)), prompt, cfg)
    drafter = EagleDrafter(random_head(model, "eagle1", 5), 2, TreeConfig(20, 4, 200, best_first=True))
    assert run(Engine(tiny_target(model, context_len=64), drafter), prompt, cfg) == plain
    assert len(prompt) + len(plain) == 64   # it ran to the context's end


def test_the_head_cache_limits_the_head_steps():
    model = tiny_llama(seed=4, layers=2)
    drafter = EagleDrafter(random_head(model, "eagle1", 5), 2, TreeConfig(20, 4, 200, best_first=True))
    with pytest.raises(UnsupportedModelError, match="room"):
        drafter.reshape(TreeConfig(drafter.step.room, 2, 1000, best_first=True))


def test_an_offloaded_target_verifies_a_big_tree_in_one_forward():
    model = tiny_llama(seed=2, layers=2)
    runner = TargetRunner(tiny_target(model), RunnerConfig(compile=False))
    runner.prefill(list(range(20)), 0)
    tree = make_tree(torch.arange(40) + 3, [-1] + [(i - 1) // 3 for i in range(1, 40)])
    chunked = runner.verify(tree.tokens, tree.depth, tree.ancestor_mask).logits
    assert runner.rows_left == (runner.capacity - runner.length) // 8 * 8
    runner.truncate(20)
    runner.one_forward = True   # as an offloaded target's runner sets it
    whole = runner.verify(tree.tokens, tree.depth, tree.ancestor_mask).logits
    assert torch.allclose(chunked, whole, atol=1e-4)
    runner.truncate(20)
    assert runner.rows_left == runner.capacity - 20


def test_the_verify_delay_slows_every_forward_plain_included():
    runner = TargetRunner(tiny_target(tiny_llama()), RunnerConfig(compile=False, verify_delay_ms=30))
    runner.prefill([1, 2, 3], 0)
    t0 = time.perf_counter()
    runner.verify(torch.tensor([4]), torch.zeros(1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool))
    assert time.perf_counter() - t0 >= 0.03


def test_growth_values_are_the_best_products_of_acceptance():
    q = prior_table([0.7, 0.6, 0.5])
    growth = best_first_growth(q, 30, width=3)
    values = [q[0, r].item() for r in range(3)]   # every node to depth 8, by brute force
    frontier = [(v, 1) for v in values]
    for _ in range(7):
        frontier = [(v * q[min(d, len(q) - 1), r].item(), d + 1) for v, d in frontier for r in range(3)]
        values += [v for v, _ in frontier]
    assert growth.values[-1] > 0.7 * 0.6 * 0.5 ** 7  # nothing deeper could be among the best 30
    assert list(growth.values) == pytest.approx(sorted(values, reverse=True)[:30])
    assert all(a <= b for a, b in zip(growth.expanded, range(1, 31))) and growth.longest[0] == 1


def slow_profile(delay_ms: float, ms_per_token: float = 0.5) -> LatencyProfile:
    """A target whose verify costs a fixed `delay_ms` (weights streamed each forward) plus its compute."""
    sizes = LARGE_SIZES
    return LatencyProfile(sizes, tuple(delay_ms + 10 + ms_per_token * n for n in sizes), (32, 512), (1, 32), (0.0, 0.0),
                          (1, 2, 4, 6, 8, 10), (2.0, 2.1, 2.2, 2.4, 2.6, 2.8), 0.1)


def test_the_budget_grows_with_the_verify_delay():
    q = prior_table([0.8, 0.75, 0.7, 0.7])
    chosen = [best_first_budget(q, slow_profile(delay), 100, 1024, 1016, Pins()) for delay in (0, 100, 1000, 10000)]
    sizes = [c.tree.total_tokens for c in chosen]
    assert sizes == sorted(sizes) and sizes[0] <= 16 and sizes[-1] >= 256, sizes
    assert all(c.tree.best_first and c.tree.depth * c.tree.top_k <= 1016 for c in chosen)
    assert chosen[-1].tokens > chosen[0].tokens
    pinned = best_first_budget(q, slow_profile(1000), 100, 1024, 1016, Pins(total_tokens=64, top_k=4))
    assert (pinned.tree.total_tokens, pinned.tree.top_k) == (64, 4)
    cramped = best_first_budget(q, slow_profile(10000), 100, 1024, 40, Pins()).tree   # 40 draft rows in the head
    assert cramped.depth * cramped.top_k <= 40


def test_bench_verify_delay_option_is_parsed():
    from cli import parse_args

    assert parse_args(["--verify-delay-ms", "250"], bench=True).verify_delay_ms == 250
    assert parse_args([], bench=True).verify_delay_ms == 0
    from launch import engine_spec
    assert engine_spec(parse_args(["--verify-delay-ms", "250", "--head", "random"], bench=True)).verify_delay_ms == 250


def test_bench_with_a_slow_target_plans_best_first_trees(tiny_dir, tmp_path):
    from core.bench import bench
    from core.service.spec import EngineSpec
    from tests.conftest import ROOT_ASSETS

    spec = EngineSpec(model=str(tiny_dir), quant="none", device="cpu", cache_dir=tmp_path, head="random", compile=False,
                      verify_delay_ms=25)
    report = bench(spec, ROOT_ASSETS / "bench" / "mt_bench.jsonl", limit=1, max_new=6, strategies=("eagle",))
    s = report["strategies"]
    assert report["simulated_slow_target"]["verify_delay_ms"] == 25 and set(s) == {"plain", "eagle"}
    assert s["plain"]["tok_s"] < 1000 / 25   # plain decoding waited too
    assert s["eagle"]["lossless"] and "best-first (SpecExec)" in s["eagle"]["plan"]
    assert all(name.startswith("best_first_n") for name in s["eagle"]["trees_used"])
    assert s["eagle"]["tree"]["best_first"] and s["eagle"]["tree_tokens"] > 1
    with pytest.raises(ValueError, match="serve"):
        bench(spec, ROOT_ASSETS / "bench" / "mt_bench.jsonl", limit=1, max_new=2, strategies=("eagle",), serve=object())


@pytest.mark.slow
def test_the_shipped_head_drafts_best_first_trees_losslessly_on_the_embedded_model(embedded_target):
    """SpecExec's regime on the real model: the shipped head's best-first trees of 64 nodes (8 fed a
    head step) give plain decoding's text and accept more than a token a round."""
    from core.service.drafters import make_drafter
    from core.service.spec import EngineSpec
    from core.text import render_prompt
    from tests.conftest import ROOT_ASSETS

    shape = TreeConfig(depth=8, top_k=8, total_tokens=65, best_first=True)
    drafter = make_drafter(embedded_target, EngineSpec(head=str(ROOT_ASSETS / "heads" / "smollm2-135m-instruct"), tree=shape))
    prompt = render_prompt(embedded_target.tokenizer, [{"role": "user", "content": "Name four planets and one fact about each."}])
    cfg = SamplingConfig(max_new_tokens=40)
    plain = run(Engine(embedded_target), prompt, cfg)
    steps = list(Engine(embedded_target, drafter).generate(prompt, cfg))
    assert [t for s in steps for t in s.new_ids] == plain
    assert max(s.tree_size for s in steps[1:]) > 32 and all(s.tree_size <= 65 for s in steps[1:])
    assert len(plain) / len(steps) > 1.5   # a big tree of a trained head: well above one token a forward
