"""CUDA checks, skipped cleanly without a GPU: an NF4 target with bf16/fp16 compute loads, EAGLE
and prompt lookup stay lossless on it, and the CUDA graphs (one per bucket) of the runner and of
the head's step equal their eager forwards and hand out outputs that survive the next replay. Run them with
`python3 launch.py test -m gpu`."""

import pytest
import torch

from core.config import SamplingConfig, TreeConfig
from core.spec.eagle import EagleDrafter
from core.spec.drafters import PromptLookupDrafter
from core.engine import Engine
from core.runtime.runner import RunnerConfig, TargetRunner
from models.target import LoadSpec, load_target
from tests.conftest import random_head
from tests.fakes import run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def nf4_target(tiny_dir, cache_dir):
    return load_target(LoadSpec(model=str(tiny_dir), quant="nf4", device="cuda", cache_dir=cache_dir))


def test_nf4_loads_with_a_16_bit_compute_dtype(nf4_target):
    import bitsandbytes as bnb

    assert nf4_target.device.type == "cuda" and nf4_target.quant == "nf4"
    assert nf4_target.dtype in (torch.bfloat16, torch.float16)
    layers = [m for m in nf4_target.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and all(m.compute_dtype == nf4_target.dtype for m in layers)


def test_speculation_is_lossless_on_cuda(nf4_target):
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]
    plain = run(Engine(nf4_target), prompt, SamplingConfig(max_new_tokens=32))
    layers = nf4_target.model.config.num_hidden_layers
    head = random_head(nf4_target.model, "eagle1", 0).to(device="cuda", dtype=nf4_target.dtype)
    for drafter in (PromptLookupDrafter(), EagleDrafter(head, layers, TreeConfig(3, 4, 12))):
        assert run(Engine(nf4_target, drafter), prompt, SamplingConfig(max_new_tokens=32)) == plain


@pytest.fixture(scope="module")
def graphed(nf4_target):
    layers = nf4_target.model.config.num_hidden_layers
    runner = TargetRunner(nf4_target, RunnerConfig(compile=True, buckets=(1, 4, 8)), feature_layers=(layers,))
    runner.warm_up()
    return runner


def test_cuda_graphs_equal_eager_per_bucket(nf4_target, graphed):
    layers = nf4_target.model.config.num_hidden_layers
    eager = TargetRunner(nf4_target, RunnerConfig(compile=False, buckets=(1, 4, 8)), feature_layers=(layers,))
    prompt = list(range(10, 40))
    for n in (1, 3, 8):
        tokens, depth, visible = torch.arange(n) + 50, torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril()
        outs = []
        for runner in (eager, graphed):
            runner.reset()
            runner.prefill(prompt, 0)
            outs.append(runner.verify(tokens, depth, visible).logits)
        scale = outs[0].abs().max()
        assert (outs[0] - outs[1]).abs().max() <= 2e-2 * scale   # bf16 / fp16 compute
        top2 = outs[0].topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > graphed.tie_margin
        assert (outs[0].argmax(-1) == outs[1].argmax(-1))[clear].all()
    assert all(graph.direct is not None for graph in graphed._graphs.values())   # replayed without dynamo's guards


def test_cuda_graph_outputs_survive_the_next_replay(graphed):
    graphed.reset()
    graphed.prefill(list(range(20)), 0)
    one = torch.zeros(1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool)
    first = graphed.verify(torch.tensor([5]), *one)
    kept_logits, kept_features = first.logits.clone(), first.features.clone()
    graphed.commit(torch.tensor([0]), [5])
    graphed.verify(torch.tensor([6]), *one)                   # the next replay of the same graph
    assert torch.equal(first.logits, kept_logits) and torch.equal(first.features, kept_features)


def test_head_step_cuda_graphs_equal_eager_and_stay_lossless(nf4_target, graphed):
    """The head's step (core/runtime/head_step.py) as CUDA graphs: each padded bucket equals the eager,
    unpadded step, its outputs survive the next replay, and a graphed drafter's output equals plain decoding."""
    layers = nf4_target.model.config.num_hidden_layers
    head = random_head(nf4_target.model, "eagle1", 1).to(device="cuda", dtype=nf4_target.dtype)
    eager, fast = (EagleDrafter(head, layers, TreeConfig(2, 3, 8)) for _ in range(2))
    fast.warm_up()
    assert fast.step.compiled and (8, head.config.hidden_size) in fast.step._graphs
    H, past = head.config.hidden_size, 30
    gen = torch.Generator(device="cuda").manual_seed(0)
    for drafter in (eager, fast):
        drafter.step.feed(torch.ones(past, H, device="cuda"), torch.arange(past, device="cuda"),
                          torch.arange(past, device="cuda"), torch.ones(past, past, dtype=torch.bool, device="cuda").tril(), 0)
    for T in (1, 3, 8):
        features = torch.randn(T, H, device="cuda", generator=gen)
        visible = torch.ones(T, T, dtype=torch.bool, device="cuda").tril()
        tokens, positions = torch.arange(T, device="cuda") + 7, torch.full((T,), past, device="cuda")
        (out_e, logp_e), (out_g, logp_g) = (d.step.feed(features, tokens, positions, visible, past) for d in (eager, fast))
        assert (out_e - out_g).abs().max() <= 2e-2 * out_e.abs().max()          # bf16 / fp16 compute
        kept = logp_g.clone()
        fast.step.feed(features, tokens, positions, visible, past)            # the next replay of that graph
        assert torch.equal(logp_g, kept)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]
    plain = run(Engine(nf4_target), prompt, SamplingConfig(max_new_tokens=32))
    assert run(Engine(nf4_target, fast, graphed), prompt, SamplingConfig(max_new_tokens=32)) == plain
