"""oneDNN linears on CPU: the same function as nn.Linear, and an engine on them stays lossless."""

import copy

import pytest
import torch

from core.config import SamplingConfig, TreeConfig
from core.runtime.cpu_linear import accelerate_cpu, batched_linear_kind
from models.cpu_quant import OneDnnLinear
from core.spec.eagle import EagleDrafter
from core.engine import Engine
from tests.conftest import tiny_llama, tiny_target
from tests.conftest import random_head
from tests.fakes import run

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")


@needs_onednn
def test_onednn_linear_matches_nn_linear():
    dense = torch.nn.Linear(64, 96)
    fast = OneDnnLinear(dense, rows=8, keep_weight=True)
    x = torch.randn(5, 64)
    torch.testing.assert_close(fast(x), dense(x), atol=1e-5, rtol=1e-5)
    assert fast.weight is dense.weight  # readers of .weight see the original matrix


@needs_onednn
def test_an_accelerated_target_gives_the_same_logits_and_stays_lossless(monkeypatch):
    monkeypatch.setattr("core.runtime.cpu_linear.onednn_is_faster", lambda model, rows: True)
    model = tiny_llama(seed=3, layers=4)
    fast = tiny_target(copy.deepcopy(model))
    assert accelerate_cpu(fast)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(fast.model(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)
    prompt = ids[0].tolist()
    plain = run(Engine(fast), prompt, SamplingConfig(max_new_tokens=24))
    head = random_head(fast.model, "eagle1", 1)
    drafter = EagleDrafter(head, 4, TreeConfig(2, 3, 7), torch.arange(0, 256, 3))
    assert run(Engine(fast, drafter), prompt, SamplingConfig(max_new_tokens=24)) == plain


def test_quantized_or_gpu_targets_are_left_alone():
    target = tiny_target()
    assert not accelerate_cpu(type(target)(**{**target.__dict__, "quant": "nf4"}))
    assert isinstance(target.model.lm_head, torch.nn.Linear)


def test_a_linear_kind_onednn_cannot_serve_is_refused_not_ignored():
    """--linear on a model oneDNN cannot run (here bf16 weights; on a GPU likewise): auto keeps
    torch's matmuls, a named kind is a clear error."""
    model = tiny_llama().to(torch.bfloat16)
    assert batched_linear_kind(model, "auto", 8) == "default" and batched_linear_kind(model, "default", 8) == "default"
    with pytest.raises(ValueError, match="--linear bf16"):
        batched_linear_kind(model, "bf16", 8)
    assert batched_linear_kind(tiny_llama(), "onednn", 8) == "fp32"
