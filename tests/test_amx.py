"""The AMX 4-bit kernel (models/amx.py): the int4 layers' own weight values, each row computed
alone (a tree's rows get what one row at a time gets, bit for bit), and greedy EAGLE on it equal
to plain decoding on it. Skipped where the CPU has no AMX or the kernel cannot be built."""

from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from core.config import TreeConfig
from core.engine import Engine
from core.runtime.runner import RunnerConfig, TargetRunner
from core.spec.eagle import EagleDrafter
from core.tune.kernels import (KernelChoice, apply_target_kernel, choose_target_kernel, cpu_flags, int4_layers,
                               kernel_edges, pick_amx_from)
from models import amx
from models.cpu_quant import Int4Linear, quantize_cpu
from tests.conftest import random_head, tiny_target
from tests.test_kernels import greedy_run, int4_target


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("amx")
    try:
        amx.load(folder, cpu_flags())
    except amx.AmxUnavailable as e:
        pytest.skip(f"no AMX kernel here: {e}")
    return folder


@pytest.mark.parametrize("shape", [(64, 32), (576, 1536), (1536, 576)])
def test_amx_computes_the_int4_layers_weights_row_by_row(kernel_dir, shape):
    k, n = shape
    torch.manual_seed(0)
    layer = Int4Linear(torch.nn.Linear(k, n, bias=False))
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(1))
    exact = x.bfloat16().double() @ layer.dequantized().double().t()          # the values int4 computes with
    int4 = layer(x)
    layer.use_amx()
    sums = torch.ops.aerie_amx.q41_mm(x.bfloat16(), layer.amx_codes, layer.amx_d, layer.amx_z, n)
    assert sums.dtype == torch.float32
    scale = exact.abs().max().item()
    assert (sums.double() - exact).abs().max().item() < 1e-5 * scale     # fp32 sums of exact products
    y = layer(x)
    assert torch.equal(y, sums.bfloat16().float())                      # the layer rounds them as int4 does
    assert (int4.double() - exact).abs().max().item() < 1e-2 * scale    # int4's output is bf16
    assert (y - int4).abs().max().item() <= 2 ** -7 * int4.abs().max().item()   # a bf16 step apart at most
    for rows in (slice(3, 4), slice(0, 16), slice(16, 37), slice(5, 9)):   # any row count, blocks of 16 crossed
        assert torch.equal(layer(x[rows]), y[rows])
    layer.use_int4()
    assert torch.equal(layer(x), int4)


def test_amx_refuses_shapes_its_tiles_do_not_fit(kernel_dir):
    with pytest.raises(ValueError, match="tiles"):
        Int4Linear(torch.nn.Linear(96, 32, bias=False)).use_amx()


def test_tree_logits_on_amx_equal_one_token_at_a_time_bit_for_bit(kernel_dir):
    target = int4_target(seed=2)
    apply_target_kernel(target, KernelChoice(amx_from=1), kernel_dir)
    assert all(layer.amx_codes is not None for layer in int4_layers(target))
    runner = TargetRunner(target, RunnerConfig(compile=False, buckets=(1, 8)))
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    runner.prefill(ids[:16], 0)
    rows = []
    for t in ids[16:]:
        rows.append(runner.verify(torch.tensor([t]), torch.zeros(1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool)).logits)
        runner.commit(torch.tensor([0]), [t])
    runner.truncate(16)
    tree = runner.verify(torch.tensor(ids[16:]), torch.arange(8), torch.ones(8, 8, dtype=torch.bool).tril()).logits
    assert torch.equal(tree, torch.cat(rows))


def test_greedy_eagle_on_amx_equals_plain_on_amx(kernel_dir):
    target = int4_target()
    apply_target_kernel(target, KernelChoice(amx_from=1), kernel_dir)
    prompt = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(5)).tolist()
    plain, _ = greedy_run(Engine(target), prompt)
    for shape in (TreeConfig(1, 2, 4), TreeConfig(3, 4, 16)):
        drafter = EagleDrafter(random_head(target.model, "eagle1", 3), 3, shape)
        runner = TargetRunner(target, RunnerConfig(compile=False, buckets=(1, 2, 4, 8, 16)), drafter.feature_layers)
        assert greedy_run(Engine(target, drafter, runner), prompt)[0] == plain


def test_trees_on_amx_over_plain_decoding_on_int4_give_plain_decodings_text(kernel_dir):
    """The mix a machine may choose (int4 for one row, AMX from 2): the same weight values, so
    greedy EAGLE may part from plain decoding only where a near-tie was logged; here it does not."""
    target = int4_target()
    prompt = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(5)).tolist()
    plain, ties = greedy_run(Engine(target), prompt)
    apply_target_kernel(target, KernelChoice(amx_from=2), kernel_dir)
    assert all(layer.amx_from == 2 for layer in int4_layers(target))
    for shape in (TreeConfig(1, 2, 4), TreeConfig(3, 4, 16)):
        drafter = EagleDrafter(random_head(target.model, "eagle1", 3), 3, shape)
        runner = TargetRunner(target, RunnerConfig(compile=False, buckets=(1, 2, 4, 8, 16)), drafter.feature_layers)
        out = greedy_run(Engine(target, drafter, runner), prompt)[0]
        first = next((i for i, (a, b) in enumerate(zip(out, plain)) if a != b), None)
        assert first is None or first in ties


def test_choose_target_kernel_times_both_and_leaves_the_layers_on_its_choice(kernel_dir):
    target = int4_target()
    amx_from, ms = choose_target_kernel(target, kernel_dir, report=lambda line: None)
    assert amx_from in (None, 1, 2, 4, 8, 16) and set(ms) == {"1", "2", "4", "8", "16"}
    assert all(set(v) == {"int4", "amx"} and min(v.values()) > 0 for v in ms.values())
    assert all(layer.amx_from == amx_from and (layer.amx_codes is None) == (amx_from is None) for layer in int4_layers(target))


def test_a_layer_that_does_not_fit_leaves_the_whole_target_on_int4(kernel_dir):
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    quantize_cpu(model, "int4")    # the MLP's down projection has 96 inputs: int4 packs it, AMX's tiles do not
    target = replace(tiny_target(model), quant="int4")
    lines = []
    assert choose_target_kernel(target, kernel_dir, report=lines.append) == (None, {})
    assert all(layer.amx_codes is None for layer in int4_layers(target))
    assert "96x64" in lines[0]


def test_amx_serves_from_the_first_size_it_wins_at_and_every_one_above():
    """Compiled verify ms, 2-core Xeon with AMX (session 14): int4 is faster for one and four rows,
    AMX from eight on. A win must hold at every larger size, and one row needs only a near-tie."""
    xeon = {1: {"int4": 7.03, "amx": 9.18}, 2: {"int4": 9.72, "amx": 11.94}, 4: {"int4": 11.63, "amx": 12.40},
            8: {"int4": 18.36, "amx": 14.07}, 16: {"int4": 32.08, "amx": 18.56}}
    assert pick_amx_from(xeon, mix=True) == 8 and pick_amx_from(xeon) is None   # the default: one kernel at every size
    assert pick_amx_from({**xeon, 16: {"int4": 18.0, "amx": 18.56}}) is None
    assert pick_amx_from({n: {"int4": 10.0, "amx": 10.4} if n == 1 else {"int4": 10.0, "amx": 5.0} for n in xeon}) == 1
    assert pick_amx_from({**xeon, 16: {"int4": 18.0, "amx": 18.56}}, mix=True) is None
    assert kernel_edges(KernelChoice(amx_from=8)) == (8,) and kernel_edges(KernelChoice(amx_from=1)) == ()
    assert kernel_edges(KernelChoice(16, 64, amx_from=4)) == (4, 16)
