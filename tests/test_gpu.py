"""CUDA checks, skipped cleanly without a GPU: an NF4 target with bf16/fp16 compute loads, and
EAGLE and prompt lookup stay lossless on it. Run them with `python3 launch.py test -m gpu`."""

import pytest
import torch

from core.config import SamplingConfig, TreeConfig
from core.eagle import EagleDrafter
from core.drafters import PromptLookupDrafter
from core.engine import Engine
from models.target import LoadSpec, load_target
from tests.test_eagle import random_head, run

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
