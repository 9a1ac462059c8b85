"""The row attention kernel (models/attention.py): softmax(q k^T + mask) v to fp32's precision, each
row the same alone as beside other rows and whatever the cache's padding, so an int4 target's
tree logits equal one token at a time bit for bit, and greedy EAGLE equals plain decoding."""

import pytest
import torch
import torch.nn.functional as F

from core.config import SamplingConfig, TreeConfig
from core.engine import Engine
from core.runtime.kv import keep_rows, key_blocks, static_cache
from core.runtime.runner import RunnerConfig, TargetRunner
from core.spec.drafters import PlainDrafter
from core.spec.eagle import EagleDrafter
from core.tune.kernels import cpu_flags
from models import attention, native
from models.cpu_quant import quantize_cpu
from tests.conftest import chain_at_once, one_token_at_a_time, random_head, tiny_llama, tiny_target


@pytest.fixture(scope="module", autouse=True)
def kernel(cache_dir):
    attention.load(cache_dir, cpu_flags())


def attend(q, k, v, mask, scale):
    """The kernel on keys (H, C, D) and values as the cache keeps them: keys in blocks, values in bf16."""
    return attention.attend(q, attention.blocked(k), v.bfloat16(), mask, scale)


def case(heads: int, rows: int, n: int, lk: int, dim: int, seed: int):
    """q (H, rows, D); k, v (H, lk + 9, D), v of bf16 values (as a 4-bit kernel's), with the 9 rows
    past Lk garbage; mask (n, lk): each row sees the first lk - n columns and, among the last n,
    itself and a random subset."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(heads, size, dim, generator=g) for size in (rows, lk + 9, lk + 9))
    v = v.bfloat16().float()
    k[:, lk:], v[:, lk:] = 1e30, 1e30   # garbage past Lk: never read, or read and ignored
    visible = (torch.rand(n, n, generator=g) < 0.5) | torch.eye(n, dtype=torch.bool)
    mask = torch.zeros(n, lk)
    mask[:, lk - n:].masked_fill_(~visible, torch.finfo(torch.float32).min)
    return q, k, v, mask


@pytest.mark.parametrize("dim", [16, 64, 128])
@pytest.mark.parametrize("n,lk", [(1, 1), (1, 70), (5, 37), (8, 300)])
def test_attend_matches_fp64_sdpa(dim, n, lk):
    q, k, v, mask = case(heads=3, rows=3 * n, n=n, lk=lk, dim=dim, seed=dim + lk)
    scale = dim ** -0.5
    out = attend(q, k, v, mask, scale)
    want = F.scaled_dot_product_attention(q.double(), k[:, :lk].double(), v[:, :lk].double(),
                                          attn_mask=mask.double().repeat(3, 1), scale=scale)
    assert out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=1e-5)


def test_a_row_is_the_same_alone_beside_others_and_whatever_the_padding():
    q, k, v, mask = case(heads=2, rows=3 * 8, n=8, lk=200, dim=64, seed=3)
    together = attend(q, k, v, mask, 0.125)
    for row in range(24):
        alone = attend(q[:, row: row + 1], k, v, mask[row % 8: row % 8 + 1], 0.125)
        assert torch.equal(alone[:, 0], together[:, row]), row
    padded = torch.cat([mask, torch.full((8, 7), torch.finfo(torch.float32).min)], 1)   # 7 more blocked columns
    k[:, 200:207], v[:, 200:207] = torch.randn(2, 7, 64), torch.randn(2, 7, 64)
    assert torch.equal(attend(q, k, v, padded, 0.125), together)


def test_values_in_bf16_or_fp32_give_the_same_rows():
    """The kernel reads V as the cache keeps it: bf16 values widened exactly, or fp32."""
    q, k, v, mask = case(heads=3, rows=3 * 5, n=5, lk=130, dim=64, seed=8)
    blocks = attention.blocked(k)
    assert torch.equal(attention.attend(q, blocks, v, mask, 0.125), attention.attend(q, blocks, v.bfloat16(), mask, 0.125))


def test_a_tree_nodes_row_is_its_token_alone_wherever_its_column_sits():
    """A tree puts node i's K/V at column L + i, its token alone sits at L + depth: with the
    siblings between blocked, the row must not change (it did, by fp32 rounding of the softmax's
    sum, when lanes took columns by index: compiled trees parted from plain decoding, issue 17)."""
    g = torch.Generator().manual_seed(4)
    blocked = torch.finfo(torch.float32).min
    for _ in range(40):
        past, gap = int(torch.randint(5, 150, (), generator=g)), int(torch.randint(1, 9, (), generator=g))
        q, k, v = (torch.randn(3, rows, 64, generator=g) for rows in (3, past + gap + 1, past + gap + 1))
        alone = attend(q, k, v, torch.zeros(1, past + 1), 0.125)          # the token at column `past`
        k[:, past + gap], v[:, past + gap] = k[:, past].clone(), v[:, past].clone()  # the node at past + gap
        k[:, past: past + gap], v[:, past: past + gap] = torch.randn(2, 3, gap, 64, generator=g)
        mask = torch.zeros(1, past + gap + 1)
        mask[0, past: past + gap] = blocked                                          # its siblings
        assert torch.equal(attend(q, k, v, mask, 0.125), alone), (past, gap)


def test_the_blocked_cache_holds_the_keys_a_plain_cache_holds_through_writes_and_commits():
    """kv.BlockedKVLayer's keys are `blocked` of a StaticLayer's after the same forwards' writes and
    a tree's commit (rows moved down across a block's edge), and `unblocked` gives them back."""
    plain = static_cache(2, 70, 3, 16, torch.float32, torch.device("cpu"))
    blocks = static_cache(2, 70, 3, 16, torch.float32, torch.device("cpu"), blocked_keys=True, value_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(6)
    for rows in (13, 6, 9):                                   # writes across the 16-row blocks
        k, v = torch.randn(2, 1, 3, rows, 16, generator=g)
        v = v.bfloat16().float()                              # a 4-bit kernel's outputs
        for cache in (plain, blocks):
            cache.update(k, v, 0)
            cache.update(k + 1, v * 2, 1)                     # v * 2: still bf16 values
    for cache in (plain, blocks):
        keep_rows(cache, 14, torch.tensor([0, 3, 4, 11]))     # rows 14, 17, 18, 25 -> 14..17
    for a, b in zip(plain.layers, blocks.layers):
        assert b.keys.shape == (1, 3, 5 * 16 * 16)
        assert b.values.dtype == torch.bfloat16 and b.values.shape == a.values.shape
        assert torch.equal(key_blocks(b.keys, 16), attention.blocked(a.keys)) and torch.equal(a.values, b.values.float())
        assert torch.equal(attention.unblocked(key_blocks(b.keys, 16), 18), a.keys[:, :, :18])
        assert int(a.cumulative_length) == int(b.cumulative_length) == 18


def test_bad_inputs_are_refused_with_the_reason():
    q, k, v, mask = case(heads=2, rows=4, n=4, lk=20, dim=64, seed=0)
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        attend(q, k.double(), v, mask, 1.0)
    with pytest.raises(RuntimeError, match="v must be contiguous fp32 or bf16"):
        attention.attend(q, attention.blocked(k), v.double(), mask, 1.0)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        attend(q[..., :40], k[..., :40].contiguous(), v[..., :40].contiguous(), mask, 1.0)
    with pytest.raises(RuntimeError, match=r"C/16, D, 16"):
        attention.attend(q, attention.blocked(k[:, :16]), v.bfloat16(), mask, 1.0)     # 16 key rows for Lk 20
    assert not attention.supports(40) and attention.supports(128) and not attention.supports(256)


def test_a_second_cache_folder_in_one_process_loads_nothing_twice(tmp_path):
    """torch registers an op namespace once per process: a second library of the same kernel from
    another folder would abort the process inside dlopen (CI, issue 17), so none is loaded."""
    assert native.build(attention.kernel(cpu_flags()), tmp_path) is False
    attention.load(tmp_path, cpu_flags())
    assert not (tmp_path / "kernels").exists()


def int4_target(seed: int):
    model = tiny_llama(seed=seed, layers=3)
    quantize_cpu(model, "int4")
    target = tiny_target(model)
    return type(target)(**{**target.__dict__, "quant": "int4"})


def test_the_cached_values_lose_nothing_in_bf16():
    """The cache keeps V in bf16 (kv.BlockedKVLayer) because the 4-bit kernels' outputs are bf16
    values: a bias-free v_proj's rows, written and read back, are the fp32 rows themselves."""
    target = int4_target(seed=3)
    written = []
    target.model.model.layers[1].self_attn.v_proj.register_forward_hook(lambda m, i, out: written.append(out))
    runner = TargetRunner(target, RunnerConfig(compile=False, buckets=(1, 8), row_attention=True))
    runner.prefill(torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(2)).tolist(), 0)
    rows = torch.cat([w.reshape(-1, w.shape[-1]) for w in written])[:20]           # (20, Hkv * D), less padding rows
    assert written and torch.equal(rows.bfloat16().float(), rows)
    cached = runner.cache.layers[1].values[0, :, :20]                              # (Hkv, 20, D) bf16
    assert cached.dtype == torch.bfloat16 and torch.equal(cached.float().transpose(0, 1).reshape(20, -1), rows)


def test_a_biased_v_proj_keeps_its_values_in_fp32():
    """A bias is added to V after the kernel's bf16 rounding (Qwen2's projections have one): its
    rows are no bf16 values, so the cache keeps them whole, and trees still equal one token's."""
    model = tiny_llama(seed=5, layers=3)
    for layer in model.model.layers:
        old = layer.self_attn.v_proj
        layer.self_attn.v_proj = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    quantize_cpu(model, "int4")
    target = tiny_target(model)
    target = type(target)(**{**target.__dict__, "quant": "int4"})
    runner = TargetRunner(target, RunnerConfig(compile=False, buckets=(1, 8), row_attention=True))
    assert runner.row_attention and runner.cache.layers[0].values.dtype == torch.float32
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    runner.prefill(ids[:24], 0)
    sequential = one_token_at_a_time(runner, ids[24:])
    assert torch.equal(chain_at_once(runner, ids[24:], 24), sequential)


def test_tree_logits_equal_one_token_at_a_time_bit_for_bit():
    target = int4_target(seed=2)
    runner = TargetRunner(target, RunnerConfig(compile=False, buckets=(1, 8), row_attention=True))
    assert runner.row_attention and runner.cache.layers[0].keys.dtype == torch.float32
    ids = torch.randint(0, 256, (90,), generator=torch.Generator().manual_seed(0)).tolist()
    runner.prefill(ids[:82], 0)                  # past one 64-row block of the cache
    sequential = one_token_at_a_time(runner, ids[82:])
    assert torch.equal(chain_at_once(runner, ids[82:], 82), sequential)


def test_greedy_eagle_on_row_attention_is_plain_decodings_text():
    target = int4_target(seed=1)
    prompt = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(5)).tolist()
    config = RunnerConfig(compile=False, buckets=(1, 2, 4, 8, 16), row_attention=True)
    texts = []
    for shape in (None, TreeConfig(1, 2, 4), TreeConfig(3, 4, 16)):
        drafter = PlainDrafter() if shape is None else EagleDrafter(random_head(target.model, "eagle1", 3), 3, shape)
        engine = Engine(target, drafter, TargetRunner(target, config, drafter.feature_layers))
        texts.append([t for step in engine.generate(prompt, SamplingConfig(max_new_tokens=40)) for t in step.new_ids])
    assert len(texts[0]) == 40 and texts[1] == texts[0] and texts[2] == texts[0]


def test_a_prompts_rows_do_not_depend_on_where_its_prefill_starts():
    """Read whole, from row 5 after another prompt with the same start, or one token at a time, a
    prompt gives the same logits and features bit for bit: an answer is a function of the prompt,
    not of what the cache held (in eager chunks, fp32 SDPA past 64 rows, they differed)."""
    target = int4_target(seed=4)
    runner = TargetRunner(target, RunnerConfig(compile=False, buckets=(1, 2, 4, 8, 16), row_attention=True),
                          feature_layers=(3,))
    rows = []   # each forward's query rows: the verify buckets' at most, never an eager chunk past them
    forward = runner.forward
    runner.forward = lambda token_ids, positions, mask: rows.append(token_ids.shape[1]) or forward(token_ids, positions, mask)
    ids = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    whole = runner.prefill(ids, 0)
    runner.reset()
    runner.prefill(ids[:5] + [7, 8, 9], 0)           # another chat's prompt, the same first 5 tokens
    later = runner.prefill(ids[5:], 5)
    assert runner.ids == ids and runner.length == 100
    runner.reset()
    for i, token in enumerate(ids):
        alone = runner.prefill([token], i)
    assert torch.equal(whole.logits, later.logits) and torch.equal(whole.logits, alone.logits)
    assert torch.equal(whole.features[5:], later.features) and torch.equal(whole.features[-1:], alone.features)
    assert max(rows) == 16 and set(rows) <= {1, 2, 4, 8, 16}
