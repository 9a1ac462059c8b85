"""The one-pass argmax and margin kernel (models/top2.py) that greedy acceptance reads on a CPU:
torch.argmax's index (the first maximal one) and topk's top-1 minus top-2 value, whatever the row's
length, repeated maxima, -inf and NaN; and greedy speculation through it equals plain decoding and
transformers' generate."""

import pytest
import torch

from core.config import SamplingConfig
from core.engine import Engine
from core.spec.drafters import PromptLookupDrafter
from core.spec.verify import best_two
from core.tune.kernels import cpu_flags
from models import top2
from tests.conftest import tiny_llama, tiny_target


@pytest.fixture(scope="module", autouse=True)
def kernel(cache_dir):
    top2.load(cache_dir, cpu_flags())


def reference(logits: torch.Tensor) -> torch.Tensor:
    values = logits.topk(2, dim=-1).values
    return torch.stack([logits.argmax(-1).double(), (values[:, 0] - values[:, 1]).double()], 1)


@pytest.mark.parametrize("vocab", [2, 15, 16, 17, 100, 49152, 49153])
def test_argmax_and_margin_equal_torchs(vocab):
    g = torch.Generator().manual_seed(vocab)
    for rows in (1, 2, 7):
        logits = torch.randn(rows, vocab, generator=g)
        assert torch.equal(top2.best_two(logits), reference(logits))
        logits[:, vocab // 3] = logits[:, -1] = 9.0     # the maximum twice: the first index, a margin of 0
        out = top2.best_two(logits)
        assert torch.equal(out, reference(logits)) and out[:, 1].eq(0).all() and out[:, 0].eq(vocab // 3).all()


def test_a_repeated_maximum_within_one_lane_and_a_non_contiguous_row():
    logits = torch.randn(3, 4096)
    logits[:, 32] = logits[:, 48] = 7.0   # 16 apart: the same vector lane on AVX-512
    wide = torch.randn(3, 8192)[:, ::2]   # a strided view
    wide[:, 5] = 11.0
    for x in (logits, wide):
        assert torch.equal(top2.best_two(x), reference(x))


def test_nan_ranks_first_and_all_minus_inf_picks_the_first_index():
    logits = torch.randn(2, 1000)
    logits[1, 300] = logits[1, 700] = float("nan")
    out = top2.best_two(logits)
    assert out[0, 0] == logits[0].argmax() and out[1, 0] == 300 and out[1, 1].isnan()
    assert out[0, 0] == torch.argmax(logits[0]) and int(logits[1].argmax()) == 300
    minus_inf = torch.full((1, 37), float("-inf"))
    assert top2.best_two(minus_inf)[0, 0] == 0 == int(minus_inf.argmax())


def test_the_engine_reads_it_and_greedy_speculation_stays_plain_decoding():
    model = tiny_llama(seed=4, layers=2)
    logits = torch.randn(3, 500)
    assert torch.equal(best_two(logits), reference(logits))
    prompt = [5, 6, 7, 8, 9] * 12   # repetitive: prompt lookup drafts chains that are partly accepted
    plain = [t for s in Engine(tiny_target(model)).generate(prompt, SamplingConfig(max_new_tokens=40)) for t in s.new_ids]
    lookup = Engine(tiny_target(model), PromptLookupDrafter())
    steps = list(lookup.generate(prompt, SamplingConfig(max_new_tokens=40)))
    assert [t for s in steps for t in s.new_ids] == plain
    assert any(s.accepted for s in steps)   # drafts were accepted: trees, not one token at a time
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, pad_token_id=0)
    assert hf[0, len(prompt):].tolist()[: len(plain)] == plain
