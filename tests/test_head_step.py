"""The EAGLE head's step (core/runtime/head_step.py): preallocated cache, padded buckets, compiled graphs.

Tiny random targets and heads (fp32, CPU): a compiled, padded step equals the eager, unpadded one
at every bucket and past the largest; a drafter whose head step is compiled drafts the same trees
as the eager one and stays lossless; steady state never recompiles. The CUDA graph check is in
test_gpu.py.
"""

import pytest
import torch

from core.config import SamplingConfig, TreeConfig
from core.spec.eagle import EagleDrafter
from core.engine import Engine
from core.runtime.head_step import STEP_CPU_BUCKETS
from tests.conftest import guard_checked, random_head, tiny_llama, tiny_target


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=11, layers=4)


def drafter_pair(model, kind: str, tree: TreeConfig) -> tuple[EagleDrafter, EagleDrafter]:
    """The same head twice: an eager drafter and one whose head step is compiled."""
    head = random_head(model, kind, 12)
    eager = EagleDrafter(head, model.config.num_hidden_layers, tree)
    compiled = EagleDrafter(head, model.config.num_hidden_layers, tree)
    compiled.warm_up()
    assert compiled.step.compiled and not eager.step.compiled
    assert compiled.compiled_sizes == compiled.step.buckets and eager.compiled_sizes == ()
    return eager, compiled


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_compiled_padded_step_equals_eager(model, kind):
    eager, compiled = drafter_pair(model, kind, TreeConfig(2, 3, 8))
    width = len(eager.feature_layers) * eager.head.config.target_width
    gen = torch.Generator().manual_seed(0)
    past = 50
    for drafter in (eager, compiled):  # the same 50 committed pairs in both caches
        drafter.step.feed(torch.randn(past, width, generator=torch.Generator().manual_seed(1)),
                          torch.arange(past), torch.arange(past), torch.ones(past, past, dtype=torch.bool).tril(), 0)
    for T in (1, 3, 4, 5, 8, 11):  # exact buckets, padded ones, and past the largest (eager in both)
        features = torch.randn(T, width, generator=gen)
        tokens = torch.randint(0, 256, (T,), generator=gen)
        visible = torch.rand(T, T, generator=gen).lt(0.5).tril() | torch.eye(T, dtype=torch.bool)
        outs = [d.step.feed(features, tokens, torch.full((T,), past), visible, past) for d in (eager, compiled)]
        torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(outs[1][1], outs[0][1], atol=1e-5, rtol=1e-5)
        assert outs[1][0].shape == (T, eager.head.config.hidden_size)
    assert {rows for rows, _ in compiled.step._graphs} == set(STEP_CPU_BUCKETS)


def test_a_catch_up_scores_only_its_last_row(model):
    """last_only: the last row's log-probs as a full step computes them, eager or compiled, in a
    bucket or past the largest (a prompt)."""
    eager, compiled = drafter_pair(model, "eagle1", TreeConfig(2, 3, 8))
    width = eager.head.config.target_width
    gen = torch.Generator().manual_seed(5)
    for T in (3, 20):
        args = (torch.randn(T, width, generator=gen), torch.randint(0, 256, (T,), generator=gen), torch.arange(T),
                torch.ones(T, T, dtype=torch.bool).tril(), 0)
        for step in (eager.step, compiled.step):
            out, logp = step.feed(*args)
            last_out, last_logp = step.feed(*args, last_only=True)
            assert last_logp.shape == (1, logp.shape[1]) and logp.shape[0] == T
            torch.testing.assert_close(last_logp[0], logp[-1])
            torch.testing.assert_close(last_out, out)


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("tree", [TreeConfig(3, 3, 10), TreeConfig(choices=((0,), (1,), (2,), (0, 0), (0, 1), (1, 0)))])
def test_compiled_drafter_drafts_the_same_trees_and_stays_lossless(model, kind, tree):
    eager, compiled = drafter_pair(model, kind, tree)
    prompt = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    sampling = SamplingConfig(max_new_tokens=40)
    plain = [t for s in Engine(tiny_target(model)).generate(prompt, sampling) for t in s.new_ids]
    trees = {}
    for name, drafter in (("eager", eager), ("compiled", compiled)):
        drafted, draft = [], drafter.draft
        drafter.draft = lambda context, fresh, draft=draft, drafted=drafted: drafted.append(draft(context, fresh)) or drafted[-1]
        out = [t for s in Engine(tiny_target(model), drafter).generate(prompt, sampling) for t in s.new_ids]
        assert out == plain, name
        trees[name] = [(d.tree.tokens.tolist(), d.tree.parents.tolist()) for d in drafted]
    assert trees["compiled"] == trees["eager"] and len(trees["eager"]) > 5


def test_no_head_recompiles_in_steady_state(model, monkeypatch):
    """Every call checked against dynamo's guards: each graph's direct code is what dynamo would run."""
    _, compiled = drafter_pair(model, "eagle1", TreeConfig(2, 4, 10))
    for graph in compiled.step._graphs.values():
        monkeypatch.setattr(graph, "direct", guard_checked(graph))
    engine = Engine(tiny_target(model), compiled)
    prompt = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(4)).tolist()
    for chat in range(2):  # the head's cache crosses several 64-row blocks
        engine.reset()
        steps = list(engine.generate(prompt[: 60 + 10 * chat], SamplingConfig(max_new_tokens=60)))
        assert len(steps) > 10 and compiled.head_len > 64
        width, past = compiled.head.config.target_width, compiled.head_len
        with torch.inference_mode():  # inputs made as the drafter makes them: inference tensors
            for T in range(1, 9):     # and feeds of every size, whatever the chat drafted
                compiled.step.feed(torch.zeros(T, width), torch.zeros(T, dtype=torch.long),
                                   torch.arange(past, past + T), torch.ones(T, T, dtype=torch.bool).tril(), past)
    assert all(graph.direct.calls for graph in compiled.step._graphs.values())   # every bucket ran


def test_a_tree_too_big_for_the_head_cache_is_refused_clearly(model):
    from models.errors import UnsupportedModelError

    head = random_head(model, "eagle1", 13)
    with pytest.raises(UnsupportedModelError, match="Lower --depth or --top-k"):
        EagleDrafter(head, model.config.num_hidden_layers, TreeConfig(100, 16, 32))
    drafter = EagleDrafter(head, model.config.num_hidden_layers, TreeConfig(6, 10, 60))  # EAGLE-2's default fits
    with pytest.raises(UnsupportedModelError):
        drafter.reshape(TreeConfig(70, 16, 60))
    assert drafter.tree == TreeConfig(6, 10, 60)
