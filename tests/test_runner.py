"""The target runner (core/runtime/runner.py): static cache, buckets, compiled graphs, commit, masks.

Tiny random Llamas (fp32, CPU): compiled equals eager per bucket, a tree verify equals sequential
decoding, padding rows are inert, a commit leaves the cache as a fresh prefill would, the 4D-mask
contract holds, and steady state never recompiles. The CUDA graph checks are in test_gpu.py.
"""

from dataclasses import replace

import pytest
import torch
from transformers import AttentionInterface

from core.spec.drafters import PromptLookupDrafter
from core.engine import Engine
from core.config import SamplingConfig
from core.runtime.graphs import NotCompiled, compiled_code
from core.runtime.kv import CPU_KV_BLOCK
from core.runtime.runner import ATTENTION, RunnerConfig, TargetRunner, tree_attention
from core.spec.tree import make_tree
from tests.conftest import guard_checked, tiny_llama, tiny_target

TREE = make_tree([7, 11, 12, 13, 21, 22], [-1, 0, 0, 0, 1, 4])  # 6 nodes: bucket 8 pads 2 rows


def chain(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril()


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3, layers=2)


@pytest.fixture(scope="module")
def compiled(model):
    runner = TargetRunner(tiny_target(model), RunnerConfig(compile=True, buckets=(1, 4, 8)), feature_layers=(2,))
    runner.warm_up()
    return runner


def eager_runner(model, buckets=(1, 4, 8)) -> TargetRunner:
    return TargetRunner(tiny_target(model), RunnerConfig(compile=False, buckets=buckets), feature_layers=(2,))


def verify_after(runner: TargetRunner, prompt: list[int], tree) -> torch.Tensor:
    runner.reset()
    runner.prefill(prompt, 0)
    return runner.verify(tree.tokens, tree.depth, tree.ancestor_mask)


def test_compiled_equals_eager_per_bucket(model, compiled):
    eager = eager_runner(model)
    prompt = list(range(40, 70))
    for n in (1, 3, 4, 6, 8):  # every bucket, padded and exact
        tokens = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n))
        depth, visible = chain(n)
        outs = []
        for runner in (eager, compiled):
            runner.reset()
            runner.prefill(prompt, 0)
            outs.append(runner.verify(tokens, depth, visible))
        assert (outs[0].logits - outs[1].logits).abs().max() < 1e-4
        assert (outs[0].features - outs[1].features).abs().max() < 1e-4
        for a, b in zip(eager.cache.layers, compiled.cache.layers):  # the KV each wrote at [L, L+n)
            assert torch.allclose(a.keys[:, :, 30:30 + n], b.keys[:, :, 30:30 + n], atol=1e-5)


@pytest.mark.parametrize("use_compiled", [False, True])
def test_tree_verify_equals_sequential_decoding(model, compiled, use_compiled):
    runner = compiled if use_compiled else eager_runner(model)
    prompt = list(range(100, 120))
    tree_logits = verify_after(runner, prompt, TREE).logits
    tol = 1e-4 if use_compiled else 1e-5
    for path in TREE.paths.tolist():  # every root-to-leaf path, one token at a time
        nodes = [i for i in path if i >= 0]
        runner.reset()
        runner.prefill(prompt, 0)
        for node in nodes:
            one = runner.verify(TREE.tokens[node:node + 1], torch.zeros(1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool))
            runner.commit(torch.tensor([0]), [int(TREE.tokens[node])])
            assert (one.logits[0] - tree_logits[node]).abs().max() < tol


def test_padding_rows_are_inert(model):
    padded, exact = eager_runner(model, (1, 8)), eager_runner(model, (1, 6))
    prompt = list(range(5, 25))
    a, b = verify_after(padded, prompt, TREE), verify_after(exact, prompt, TREE)
    assert padded.length == 20 + 8 and exact.length == 20 + 6   # the bucket's rows were written
    assert torch.isfinite(a.logits).all() and a.logits.shape == b.logits.shape == (6, 256)
    assert (a.logits - b.logits).abs().max() < 1e-5


@pytest.mark.parametrize("path", [[0], [0, 1, 4, 5], [0, 3]])
def test_commit_equals_a_fresh_prefill(model, path):
    runner, fresh = eager_runner(model), eager_runner(model)
    prompt = list(range(60, 90))
    verify_after(runner, prompt, TREE)
    kept = [int(TREE.tokens[i]) for i in path]
    runner.commit(torch.tensor(path), kept)
    assert runner.length == len(runner.ids) == 30 + len(path) and runner.ids == prompt + kept
    assert int(runner.cache.get_seq_length()) == runner.length
    nxt = torch.tensor([9])
    one = torch.zeros(1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool)
    after_commit = runner.verify(nxt, *one).logits
    fresh.prefill(prompt + kept, 0)
    after_prefill = fresh.verify(nxt, *one).logits
    assert (after_commit - after_prefill).abs().max() < 1e-5
    for a, b in zip(runner.cache.layers, fresh.cache.layers):
        assert torch.allclose(a.keys[:, :, :runner.length], b.keys[:, :, :runner.length], atol=1e-6)


def test_the_same_prompt_again_gives_the_same_logits(model):
    """Regenerate, an A/B run or the same question asked twice reuses all but the prompt's last
    token: that token's row must come out as a fresh prefill computed it, bit for bit."""
    runner = eager_runner(model)
    prompt = list(range(30, 100))
    fresh = runner.prefill(prompt, 0)
    runner.verify(TREE.tokens, TREE.depth, TREE.ancestor_mask)   # an answer's round, then the same prompt
    runner.commit(torch.tensor([0, 1]), [7, 11])
    again = runner.prefill(prompt[-1:], len(prompt) - 1)
    assert torch.equal(fresh.logits, again.logits) and torch.equal(fresh.features[-1:], again.features)
    assert runner.ids == prompt and runner.length == len(prompt) and fresh.features.shape[0] == len(prompt)


def test_the_4d_mask_reaches_attention_untouched(model):
    runner = eager_runner(model)
    seen, built = [], []
    AttentionInterface.register("aerie_spy", lambda m, q, k, v, mask, **kw: (seen.append(mask), tree_attention(m, q, k, v, mask, **kw))[1])
    make = runner.mask
    runner.mask = lambda visible, length, dtype=None: built.append(make(visible, length, dtype)) or built[-1]
    model.set_attn_implementation("aerie_spy")
    try:
        verify_after(runner, list(range(10)), TREE)
        assert len(built) == 3 and all(m is built[-1] for m in seen[-2:])   # prefill's chunk, its last token; the verify's own
        assert built[-1].shape == (1, 1, 8, CPU_KV_BLOCK)   # (1, 1, bucket, L+N rounded up to a block)
        with pytest.raises(RuntimeError):          # a mask wider than the cache cannot be attended
            runner.forward(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
                           torch.zeros(1, 1, 1, runner.capacity + 1))
    finally:
        model.set_attn_implementation(ATTENTION)
        runner.mask = make


def test_registered_attention_matches_sdpa_and_stays_causal_without_a_4d_mask(model):
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    runner = eager_runner(model)  # sets the model's attention to ATTENTION
    ours = runner.prefill(ids[0].tolist(), 0)
    hf = tiny_llama(seed=3, layers=2)
    hf.set_attn_implementation("sdpa")
    with torch.inference_mode():
        reference = hf(input_ids=ids).logits[0]                  # causal, HF's own mask and SDPA
        two_d = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]  # ATTENTION, a 2D mask
    assert (ours.logits[0] - reference[-1]).abs().max() < 1e-5
    assert (two_d - reference).abs().max() < 1e-5


def test_no_recompiles_in_steady_state(model, compiled, monkeypatch):
    """Two chats, every bucket, varying accepted lengths, the KV length crossing several blocks,
    every call checked against dynamo's guards: the code each graph calls directly is the code
    dynamo itself would have run, call after call."""
    for graph in compiled._graphs.values():
        monkeypatch.setattr(graph, "direct", guard_checked(graph))
    engine = Engine(tiny_target(model), PromptLookupDrafter(), compiled)
    prompt = [5, 6, 7, 8] * 60                    # repetitive: prompt lookup drafts, trees of many sizes
    for chat in range(2):
        engine.reset()
        steps = list(engine.generate(prompt[: 200 + 20 * chat], SamplingConfig(max_new_tokens=80)))
        assert compiled.length > 256 and len(steps) > 10
        for n in range(1, 9):                     # and chains of every size, whatever the chat drafted
            chain = make_tree(list(range(20, 20 + n)), list(range(-1, n - 1)))
            compiled.verify(chain.tokens, chain.depth, chain.ancestor_mask)
            compiled.commit(torch.tensor([0]), [20])
    assert all(graph.direct.calls for graph in compiled._graphs.values())


def test_compiled_engine_is_lossless(model, compiled):
    """Greedy speculation through the compiled runner equals plain greedy through the eager one."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 6
    plain = [t for s in Engine(tiny_target(model)).generate(prompt, SamplingConfig(max_new_tokens=60)) for t in s.new_ids]
    fast = Engine(tiny_target(model), PromptLookupDrafter(), compiled)
    assert [t for s in fast.generate(prompt, SamplingConfig(max_new_tokens=60)) for t in s.new_ids] == plain


def test_exact_attention_makes_int4_trees_equal_sequential_decoding():
    """With bf16 activations (int4 kernels) fp64 SDPA over an fp64 cache (`--attention sdpa`) keeps
    a tree's logits equal to one token at a time, bit for bit (fp32 SDPA differs by up to 0.375 on
    the embedded model; the row kernel's exactness: tests/test_row_attention.py)."""
    from models.cpu_quant import quantize_cpu
    model = tiny_llama(seed=5, layers=2)
    quantize_cpu(model, "int4")
    target = replace(tiny_target(model), quant="int4")
    runner = TargetRunner(target, RunnerConfig(compile=False, buckets=(1, 8)))
    assert runner.exact and runner.cache.layers[0].keys.dtype == torch.float64
    prompt = list(range(30, 60))
    tree_logits = verify_after(runner, prompt, TREE).logits
    for path in TREE.paths.tolist():
        runner.reset()
        runner.prefill(prompt, 0)
        for node in [i for i in path if i >= 0]:
            one = runner.verify(TREE.tokens[node:node + 1], torch.zeros(1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool))
            runner.commit(torch.tensor([0]), [int(TREE.tokens[node])])
            assert torch.equal(one.logits[0], tree_logits[node])


def test_a_tree_beyond_the_largest_bucket_goes_in_chunks(model):
    """A 6-node tree through buckets (1, 4): two chunks of 4 (2 padding rows), the second seeing
    the first; the same logits as one bucket of 8."""
    chunked, whole = eager_runner(model, (1, 4)), eager_runner(model, (1, 8))
    prompt = list(range(70, 95))
    a, b = verify_after(chunked, prompt, TREE), verify_after(whole, prompt, TREE)
    assert chunked.length == whole.length == 25 + 8
    assert (a.logits - b.logits).abs().max() < 1e-5 and (a.features - b.features).abs().max() < 1e-5
    chunked.commit(torch.tensor([0, 1, 4, 5]), [int(TREE.tokens[i]) for i in (0, 1, 4, 5)])
    assert chunked.length == 29


def test_a_failed_compile_falls_back_to_eager_and_says_so(model, monkeypatch):
    def broken(*args, **kwargs):
        raise torch._dynamo.exc.BackendCompilerFailed(lambda *a: None, RuntimeError("no C++ compiler found"), None)
    monkeypatch.setattr("core.runtime.runner.Graph", lambda fn, device: broken)
    runner = TargetRunner(tiny_target(model), RunnerConfig(compile=True, buckets=(1, 4)))
    lines = []
    runner.warm_up(lines.append)
    assert not runner.compiled and any("Compiling failed" in line and "eager" in line for line in lines)
    out = verify_after(runner, list(range(12)), TREE)    # and it still verifies
    assert torch.isfinite(out.logits).all()


def test_past_the_recompile_limit_a_runner_runs_eagerly_and_says_so(monkeypatch):
    """With fullgraph, dynamo raises at its recompile limit instead of falling back itself: the
    runner must catch that, say so, and still verify (eagerly)."""
    monkeypatch.setattr("core.runtime.graphs.RECOMPILE_LIMIT", 1)
    runner = TargetRunner(tiny_target(tiny_llama(seed=11, layers=1)), RunnerConfig(compile=True, buckets=(1, 2, 4)))
    lines = []
    with torch._dynamo.config.patch(recompile_limit=1):
        runner.warm_up(lines.append)
    assert not runner.compiled and any("Compiling failed" in line and "eager" in line for line in lines)
    assert torch.isfinite(verify_after(runner, list(range(12)), TREE).logits).all()


def test_compiled_graphs_run_their_code_without_dynamo(model, compiled, monkeypatch):
    """After its first call each CPU graph calls the code dynamo compiled directly (no guards); a
    call that bypassed it would go through torch.compile's wrapper, which this test breaks."""
    assert all(graph.direct is not None for graph in compiled._graphs.values())
    for graph in compiled._graphs.values():
        monkeypatch.setattr(graph, "compiled", None)   # calling it would raise TypeError
    eager = eager_runner(model)
    assert torch.equal(verify_after(compiled, list(range(30)), TREE).logits.argmax(-1),
                       verify_after(eager, list(range(30)), TREE).logits.argmax(-1))


def test_a_direct_graph_rejects_inputs_it_was_not_compiled_for(model, compiled):
    """Without dynamo's guards a direct call still checks grad mode and each input's shape and
    dtype (a clear error, not inductor's code run on other memory), while the mask's width may grow."""
    compiled.reset()
    compiled.prefill(list(range(10)), 0)
    graph = compiled._graphs[4]
    ids, positions = torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None]
    mask = compiled.mask(torch.ones(4, 4, dtype=torch.bool).tril(), 10)
    wider = compiled.mask(torch.ones(4, 4, dtype=torch.bool).tril(), 70)
    assert wider.shape[-1] > mask.shape[-1]
    with torch.inference_mode():                                    # as verify runs
        graph(ids, positions, wider)                                # a longer chat: same graph
        for bad in ((ids[:, :2], positions[:, :2], compiled.mask(torch.ones(2, 2, dtype=torch.bool), 10)),
                    (ids, positions, mask.half()), (ids.int(), positions, mask)):
            with pytest.raises(ValueError, match="compiled for"):
                graph(*bad)
    with pytest.raises(ValueError, match="compiled for"):           # compiled with autograd off
        graph(ids, positions, mask)


def test_code_torch_never_compiled_is_refused():
    runner = eager_runner(tiny_llama(seed=9, layers=1))   # no graph of this runner's shapes exists
    with torch.inference_mode(), pytest.raises(NotCompiled):
        compiled_code(runner.forward, (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
                                       runner.mask(torch.ones(1, 1, dtype=torch.bool), 0)))
