"""Aerie's 4-bit kernels, AMX (models/amx.py) and q4_rows (models/q4_rows.py): the int4 layers' own
weight values, each row computed alone (a tree's rows get what one row at a time gets, bit for
bit), greedy EAGLE on each equal to plain decoding on it, and the choice among them. A kernel's
tests skip where the CPU cannot run it or it cannot be built (AMX needs AMX; q4_rows runs on any
Linux CPU with g++)."""

import sys
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from core.config import TreeConfig
from core.engine import Engine
from core.runtime.runner import RunnerConfig, TargetRunner
from core.spec.eagle import EagleDrafter
from core.tune.kernels import (TILE_ROWS, KernelChoice, TargetKernel, apply_target_kernel, choose_target_kernel, first_winning,
                               int4_layers, kernel_edges, load_kernel, pick_kernel, rows_alone)
from models import q4_rows
from models.cpu_quant import Int4Linear, quantize_cpu
from models.native import NativeUnavailable
from tests.conftest import chain_at_once, one_token_at_a_time, random_head, tiny_target
from tests.test_kernels import greedy_run, int4_target


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("q4")


@pytest.fixture(params=["amx", "rows"])
def kernel(request, kernel_dir):
    try:
        load_kernel(request.param, kernel_dir)
    except NativeUnavailable as e:
        if request.param == "rows" and sys.platform.startswith("linux"):
            raise   # q4_rows builds on any Linux CPU with g++ (CI's included): failing to is a bug
        pytest.skip(f"no {request.param} kernel here: {e}")
    return request.param


def native_sums(layer: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    if layer.kernel == "amx":
        return torch.ops.aerie_amx.q41_mm(x, layer.amx_codes, layer.amx_d, layer.amx_z, layer.out_features)
    return q4_rows.matmul(x, layer.rows_codes, layer.out_features)


@pytest.mark.parametrize("shape", [(64, 32), (576, 1536), (1536, 576), (576, 192)])
def test_a_kernel_computes_the_int4_layers_weights_row_by_row(kernel, shape):
    k, n = shape
    torch.manual_seed(0)
    layer = Int4Linear(torch.nn.Linear(k, n, bias=False))
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(1))
    exact = x.bfloat16().double() @ layer.dequantized().double().t()          # the values int4 computes with
    int4 = layer(x)
    layer.use_kernel(kernel)
    sums = native_sums(layer, x.bfloat16())
    assert sums.dtype == torch.float32
    scale = exact.abs().max().item()
    if kernel == "amx":                                                  # fp32 sums of exact products
        assert (sums.double() - exact).abs().max().item() < 1e-5 * scale
    else:                                                                # the same, rounded to bf16 as int4's
        assert ((sums.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-5 * scale).all()
    y = layer(x)
    assert torch.equal(y, sums.bfloat16().float())                      # bf16 values, as int4's
    assert (int4.double() - exact).abs().max().item() < 1e-2 * scale    # int4's output is bf16
    assert (y - int4).abs().max().item() <= 2 ** -7 * int4.abs().max().item()   # a bf16 step apart at most
    for rows in (slice(3, 4), slice(0, 16), slice(16, 37), slice(5, 9), slice(0, 7)):   # any row count, blocks crossed
        assert torch.equal(layer(x[rows]), y[rows])
    layer.use_int4()
    assert torch.equal(layer(x), int4)


@pytest.mark.parametrize("shape", [(64, 32), (576, 1536), (1536, 576), (576, 192), (96, 80)])
def test_q4_rows_tiled_path_gives_its_register_paths_bits(kernel, shape):
    """Each output's sum runs over its inputs in one order on either path, so a tile serves any
    row count (up to and past the 48 rows one block keeps) with the same bits, bf16 inputs too."""
    if kernel != "rows":
        pytest.skip("q4_rows only")
    k, n = shape
    torch.manual_seed(0)
    layer = Int4Linear(torch.nn.Linear(k, n, bias=False))
    layer.use_kernel("rows")
    x = torch.randn(100, k, generator=torch.Generator().manual_seed(1))
    for m in (1, 2, 3, 4, 5, 7, 8, 13, 16, 47, 48, 49, 64, 100):
        registers = q4_rows.matmul(x[:m], layer.rows_codes, n)
        assert torch.equal(q4_rows.matmul(x[:m], layer.rows_codes, n, tiles_from=1), registers)
        assert torch.equal(q4_rows.matmul(x[:m].bfloat16(), layer.rows_codes, n, tiles_from=m), registers)
    y = layer(x)
    layer.use_kernel("rows", tiles_from=8)
    assert layer.tiles_from == 8 and torch.equal(layer(x), y) and torch.equal(layer(x[:5]), y[:5])


def test_q4_rows_alone_holds_the_codes_and_gives_them_back(kernel):
    """Serving every size, q4_rows frees torch's copy of the codes; a twin or int4 again reads them back exactly."""
    if kernel != "rows":
        pytest.skip("q4_rows only")
    layer = Int4Linear(torch.nn.Linear(96, 64, bias=False))
    codes, int4 = layer.codes(), layer(torch.eye(96))
    layer.use_kernel("rows")
    assert layer.packed is None and torch.equal(layer.codes(), codes)
    layer.use_int4()
    assert layer.packed is not None and layer.rows_codes is None and torch.equal(layer(torch.eye(96)), int4)


def test_a_kernel_refuses_shapes_it_does_not_fit(kernel):
    if kernel == "amx":
        with pytest.raises(ValueError, match="does not fit"):
            Int4Linear(torch.nn.Linear(96, 32, bias=False)).use_kernel(kernel)
        return
    # Every int4 layer fits q4_rows (int4 itself packs only whole groups of 32 inputs and 16 outputs); its op says why not.
    with pytest.raises(RuntimeError, match="K must be a multiple of 32"):
        torch.ops.aerie_q4.mm(torch.zeros(2, 40, dtype=torch.bfloat16), torch.zeros(40, dtype=torch.int32), 16)
    with pytest.raises(RuntimeError, match="from pack"):
        torch.ops.aerie_q4.mm(torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.int32), 16)


@pytest.mark.parametrize("tiles_from", [None, 2])
def test_tree_logits_on_a_kernel_equal_one_token_at_a_time_bit_for_bit(kernel, kernel_dir, tiles_from):
    if tiles_from and kernel != "rows":
        pytest.skip("q4_rows' tiled path only")
    target = int4_target(seed=2)
    apply_target_kernel(target, TargetKernel(kernel, tiles_from=tiles_from), kernel_dir)
    assert all(layer.kernel == kernel and layer.tiles_from == (tiles_from or q4_rows.NEVER) for layer in int4_layers(target))
    runner = TargetRunner(target, RunnerConfig(compile=False, buckets=(1, 8)))
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    runner.prefill(ids[:16], 0)
    sequential = one_token_at_a_time(runner, ids[16:])
    assert torch.equal(chain_at_once(runner, ids[16:], 16), sequential)


def test_greedy_eagle_on_a_kernel_equals_plain_on_it(kernel, kernel_dir):
    target = int4_target()
    apply_target_kernel(target, TargetKernel(kernel), kernel_dir)
    prompt = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(5)).tolist()
    plain, _ = greedy_run(Engine(target), prompt)
    for shape in (TreeConfig(1, 2, 4), TreeConfig(3, 4, 16)):
        drafter = EagleDrafter(random_head(target.model, "eagle1", 3), 3, shape)
        runner = TargetRunner(target, RunnerConfig(compile=False, buckets=(1, 2, 4, 8, 16)), drafter.feature_layers)
        assert greedy_run(Engine(target, drafter, runner), prompt)[0] == plain


def test_trees_on_amx_over_plain_decoding_on_int4_give_plain_decodings_text(kernel, kernel_dir):
    """The mix a machine may choose (int4 for one row, AMX from 2): the same weight values, so
    greedy EAGLE may part from plain decoding only where a near-tie was logged; here it does not."""
    if kernel != "amx":
        pytest.skip("only AMX may mix (--kernel-mix)")
    target = int4_target()
    prompt = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(5)).tolist()
    plain, ties = greedy_run(Engine(target), prompt)
    apply_target_kernel(target, TargetKernel("amx", 2), kernel_dir)
    assert all(layer.kernel_from == 2 for layer in int4_layers(target))
    for shape in (TreeConfig(1, 2, 4), TreeConfig(3, 4, 16)):
        drafter = EagleDrafter(random_head(target.model, "eagle1", 3), 3, shape)
        runner = TargetRunner(target, RunnerConfig(compile=False, buckets=(1, 2, 4, 8, 16)), drafter.feature_layers)
        out = greedy_run(Engine(target, drafter, runner), prompt)[0]
        first = next((i for i, (a, b) in enumerate(zip(out, plain)) if a != b), None)
        assert first is None or first in ties


def test_choose_target_kernel_times_each_and_leaves_the_layers_on_its_choice(kernel, kernel_dir):
    target = int4_target()
    choice = choose_target_kernel(target, kernel_dir, report=lambda line: None)
    chosen, ms = choice.kernel, choice.ms
    assert choice.from_rows == 1 and set(ms) == {"1", "2", "4", "8", "16"}
    assert all(kernel in v and "int4" in v and min(v.values()) > 0 for v in ms.values())
    assert chosen in ms["1"]
    assert all(layer.kernel == chosen for layer in int4_layers(target))
    assert set(choice.tiles_ms) == {str(n) for n in TILE_ROWS}    # q4_rows' two paths timed before it competes
    if chosen == "rows":   # the layers on the first size from which tiles won
        assert choice.tiles_from in (None, *TILE_ROWS)
        assert all(layer.tiles_from == (choice.tiles_from or q4_rows.NEVER) for layer in int4_layers(target))
    else:
        assert choice.tiles_from is None
    assert all((layer.rows_codes is None) == (chosen != "rows") and (layer.amx_codes is None) == (chosen != "amx")
               for layer in int4_layers(target))


def test_a_layer_that_does_not_fit_amx_leaves_the_whole_target_off_it(kernel, kernel_dir):
    if kernel != "amx":
        pytest.skip("every int4 layer fits q4_rows")
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    quantize_cpu(model, "int4")    # the MLP's down projection has 96 inputs: int4 packs it, AMX's tiles do not
    target = replace(tiny_target(model), quant="int4")
    lines = []
    choice = choose_target_kernel(target, kernel_dir, report=lines.append)
    chosen, ms = choice.kernel, choice.ms
    assert chosen != "amx" and all("amx" not in v for v in ms.values())
    assert all(layer.amx_codes is None for layer in int4_layers(target))
    assert any("96x64" in line for line in lines)


def test_a_kernel_serves_every_size_when_it_saves_overall_and_amx_mixes_only_on_request():
    """Compiled verify ms, 2-core Xeon with AMX (session 14): int4 is faster for one and four rows,
    AMX from eight on; and this session's EPYC with AVX2 alone (eager, q4_rows a little faster everywhere)."""
    xeon = {1: {"int4": 7.03, "amx": 9.18}, 2: {"int4": 9.72, "amx": 11.94}, 4: {"int4": 11.63, "amx": 12.40},
            8: {"int4": 18.36, "amx": 14.07}, 16: {"int4": 32.08, "amx": 18.56}}
    assert pick_kernel(xeon) == ("int4", 1)                               # AMX's one token costs 30% more
    assert pick_kernel(xeon, mix=True) == ("amx", 8)
    assert pick_kernel({**xeon, 16: {"int4": 18.0, "amx": 18.56}}, mix=True) == ("int4", 1)
    assert pick_kernel({n: {"int4": 10.0, "amx": 10.4} if n == 1 else {"int4": 10.0, "amx": 5.0} for n in xeon}) == ("amx", 1)
    epyc = {1: {"int4": 35.0, "rows": 30.1}, 2: {"int4": 41.0, "rows": 35.2}, 4: {"int4": 48.0, "rows": 41.0},
            8: {"int4": 70.0, "rows": 60.0}, 16: {"int4": 120.0, "rows": 100.0}}
    assert pick_kernel(epyc) == ("rows", 1)
    assert pick_kernel({**epyc, 1: {"int4": 35.0, "rows": 37.5}}) == ("int4", 1)   # plain decoding must not slow
    both = {n: {**epyc[n], "amx": 0.95 * epyc[n]["rows"]} for n in epyc}
    assert pick_kernel(both) == ("amx", 1)
    # 2-core Xeon with AMX, 2026-12-05 (linears alone): q4_rows costs what int4 does, and computing each row
    # alone it moves attention onto the fp32 row kernel (a 1-token verify 5.33 ms against int4's 8.13).
    tie = {1: {"int4": 8.79, "rows": 8.98, "amx": 10.82}, 2: {"int4": 9.42, "rows": 9.96, "amx": 10.82},
           4: {"int4": 11.54, "rows": 12.05, "amx": 13.07}, 8: {"int4": 22.08, "rows": 22.07, "amx": 14.19},
           16: {"int4": 37.59, "rows": 36.28, "amx": 17.77}}
    assert pick_kernel(tie) == ("rows", 1)
    assert pick_kernel({n: {**tie[n], "rows": 1.08 * tie[n]["int4"]} for n in tie}) == ("int4", 1)   # 8% dearer
    assert kernel_edges(KernelChoice(target=TargetKernel("amx", 8))) == (8,) and kernel_edges(KernelChoice(target=TargetKernel("rows"))) == ()
    assert kernel_edges(KernelChoice(16, 64, target=TargetKernel("amx", 4))) == (4, 16)
    assert kernel_edges(KernelChoice(target=TargetKernel("rows", tiles_from=8))) == ()    # an opaque op's own switch: the same bits


def test_q4_rows_tiles_serve_from_the_first_size_they_win_at_every_larger_one():
    """Linears-alone ms, 2-core EPYC with AVX2 (session 20's hot-cache ratios): registers win at
    2 rows, tiles from about 4-8. The same bits either way, so no margin: a tie goes to tiles."""
    epyc = {2: {"rows": 12.0, "tiles": 17.0}, 4: {"rows": 17.0, "tiles": 17.5}, 8: {"rows": 31.0, "tiles": 26.0},
            16: {"rows": 60.0, "tiles": 43.0}, 32: {"rows": 120.0, "tiles": 80.0}, 64: {"rows": 250.0, "tiles": 170.0}}
    assert first_winning(epyc, "tiles", "rows", win=1.0) == 8
    assert first_winning({**epyc, 4: {"rows": 17.0, "tiles": 17.0}}, "tiles", "rows", win=1.0) == 4
    assert first_winning({**epyc, 32: {"rows": 80.0, "tiles": 81.0}}, "tiles", "rows", win=1.0) == 64
    assert first_winning({n: {"rows": 1.0, "tiles": 2.0} for n in epyc}, "tiles", "rows", win=1.0) is None
    assert "tiled from 8 rows" in KernelChoice(target=TargetKernel("rows", tiles_from=8)).describe()


def test_row_attention_is_taken_only_beside_a_kernel_that_computes_each_row_alone():
    assert rows_alone(KernelChoice(target=TargetKernel("rows"))) and rows_alone(KernelChoice(target=TargetKernel("amx")))
    assert not rows_alone(KernelChoice())                                    # torch's int4 kernel
    assert not rows_alone(KernelChoice(target=TargetKernel("amx", 4)))         # a mix: one token on int4
    assert not rows_alone(KernelChoice(16, 64, target=TargetKernel("rows")))               # trees of 16 on the fp32 twin
