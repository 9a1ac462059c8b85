"""The CPU kernel choice (core/tune/kernels.py): an int4 target whose big trees run on the fp32 twin
stays lossless, the chooser measures and leaves the layers as they were, and the choice is cached
per machine."""

import copy

import pytest
import torch

from core.config import SamplingConfig, TreeConfig
from core.spec.eagle import EagleDrafter
from core.engine import Engine
from core.service.factory import cpu_buckets
from core.tune.kernels import (HEAD_WEIGHTS, WIDE_ROWS, KernelChoice, TreeKernels, apply_wide, cached_choice,
                               choose_head_weights, choose_wide_from, head_weights_here, int4_layers, kernel_edges, load_kernel,
                               machine_key, pick_tree_kernels, time_draft_steps)
from core.runtime.runner import CPU_BUCKETS, RunnerConfig, TargetRunner
from models.cpu_quant import onednn_runs, quantize_cpu
from tests.conftest import chain_at_once, needs_onednn_bf16, one_token_at_a_time, random_head, tiny_llama, tiny_target


def int4_target(seed: int = 1):
    model = tiny_llama(seed=seed, layers=3)
    quantize_cpu(model, "int4")
    target = tiny_target(model)
    return type(target)(**{**target.__dict__, "quant": "int4"})


def greedy_run(engine, prompt) -> tuple[list[int], set[int]]:
    out, ties = [], set()
    for step in engine.generate(prompt, SamplingConfig(max_new_tokens=40)):
        ties.update(len(out) + i for i in step.near_ties)
        out += step.new_ids
    return out, ties


def test_trees_on_the_fp32_twin_give_plain_decodings_text():
    """Plain decoding runs the int4 kernel (one row); trees of 2+ rows the twin: the same weights,
    so greedy text may part from plain's only where a near-tie was logged, and here it does not."""
    target = int4_target()
    apply_wide(target, KernelChoice(2, 64))
    assert all(layer.wide_from == 2 for layer in int4_layers(target))
    prompt = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(5)).tolist()
    plain, ties = greedy_run(Engine(target), prompt)
    for shape in (TreeConfig(1, 2, 4), TreeConfig(3, 4, 16)):
        drafter = EagleDrafter(random_head(target.model, "eagle1", 3), 3, shape)
        runner = TargetRunner(target, RunnerConfig(compile=False, buckets=(1, 2, 4, 8, 16)), drafter.feature_layers)
        eagle, _ = greedy_run(Engine(target, drafter, runner), prompt)
        if eagle != plain:
            first = next(i for i, (a, b) in enumerate(zip(plain, eagle)) if a != b)
            assert first in ties, f"{shape}: parted from plain at token {first} without a near-tie"
        assert len(eagle) == len(plain)


def test_tree_logits_on_the_twin_match_one_token_at_a_time():
    target = int4_target(seed=2)
    runner = TargetRunner(target, RunnerConfig(compile=False, buckets=(1, 8)))
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    runner.prefill(ids[:16], 0)
    sequential = one_token_at_a_time(runner, ids[16:])   # on the int4 kernel
    apply_wide(target, KernelChoice(2, 64))
    tree = chain_at_once(runner, ids[16:], 16)
    torch.testing.assert_close(tree, sequential, atol=0.05, rtol=0.02)  # bf16 activations, fp32 sums
    assert (tree.argmax(-1) == sequential.argmax(-1)).all()


def test_choose_wide_from_measures_both_kernels_and_narrows_again():
    target = int4_target()
    before = [copy.deepcopy(layer.packed) for layer in int4_layers(target)]
    trees = choose_wide_from(target, rows=(2, 4))
    assert trees.wide_from in (None, 2, 4) and trees.largest in (2, 4)
    ms = trees.verify_ms
    assert set(ms) == {"1", "2", "4"} and set(ms["1"]) == {"int4"}
    assert all(v["int4"] > 0 and v["wide"] > 0 for n, v in ms.items() if n != "1")
    assert all(layer.wide is None and layer.wide_from is None for layer in int4_layers(target))
    assert all(torch.equal(b, layer.packed) for b, layer in zip(before, int4_layers(target)))


def test_head_weights_choice_needs_a_clear_win(tmp_path):
    def choose(ms: dict):
        return choose_head_weights(ms.get, tuple(ms))
    assert choose({"int8": 1.0, "int4": 0.96, "bf16": 0.95})[0] == "int8"   # 5%: noise
    assert choose({"int8": 1.0, "int4": 0.6, "bf16": 0.5}) == ("bf16", {"int8": 1.0, "int4": 0.6, "bf16": 0.5})
    assert choose({"int8": 1.0, "int4": 0.7, "bf16": 1.4, "q4_rows": 0.5})[0] == "q4_rows"
    assert head_weights_here(tmp_path) == (("int8", "int4", "bf16", "q4_rows") if onednn_runs("bf16") else ("int8", "int4", "q4_rows"))


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("weights", [pytest.param(w, marks=needs_onednn_bf16 if w == "bf16" else ()) for w in HEAD_WEIGHTS])
def test_every_head_weight_choice_drafts_and_stays_lossless(weights, kind, tmp_path):
    """Either head kind on each CPU weight choice (an EAGLE-3 head's own LM head among them)."""
    if weights == "q4_rows":
        load_kernel("rows", tmp_path)
    target = int4_target()
    prompt = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(6)).tolist()
    plain, ties = greedy_run(Engine(target), prompt)
    drafter = EagleDrafter(random_head(target.model, kind, 3), 3, TreeConfig(1, 4, 5))
    drafter.shrink(weights)
    own_lm_head = (drafter.head.lm_head,) if kind == "eagle3" else ()
    assert not any(isinstance(m, torch.nn.Linear) for m in (drafter.head.fc, *drafter.head.decoder.modules(), *own_lm_head))
    assert time_draft_steps(drafter) > 0
    eagle, _ = greedy_run(Engine(target, drafter), prompt)
    assert eagle == plain or next(i for i, (a, b) in enumerate(zip(plain, eagle)) if a != b) in ties


def test_kernel_choice_is_measured_once_per_machine(tmp_path):
    calls = []

    def measure():
        calls.append(1)
        return KernelChoice(16, 16, "bf16", verify_ms={"16": {"int4": 3.0, "wide": 1.0}},
                            head_ms={"int8": 1.0, "bf16": 0.5})

    key = {**machine_key(), "model": "m"}
    first, cached = cached_choice(tmp_path, key, measure)
    again, cached_again = cached_choice(tmp_path, key, measure)
    assert (cached, cached_again, len(calls)) == (False, True, 1) and again == first
    assert "fp32 twin from 16 rows" in again.describe() and machine_key()["flags"]


def test_big_cpu_buckets_only_up_to_the_largest_that_can_pay():
    assert cpu_buckets(KernelChoice(None)) == CPU_BUCKETS
    assert cpu_buckets(KernelChoice(None, 16)) == CPU_BUCKETS + (16,)
    assert cpu_buckets(KernelChoice(16, 64)) == CPU_BUCKETS + tuple(n for n in WIDE_ROWS if n > CPU_BUCKETS[-1])
    assert cpu_buckets(None) is None


def test_no_graph_spans_the_row_count_where_the_linears_switch_to_the_twin():
    """core/runtime/graphs.py row_groups: the fp32 twin's first row count is an edge; none without one."""
    assert kernel_edges(KernelChoice(16, 64)) == (16,) and kernel_edges(KernelChoice(None)) == ()


def test_a_tree_size_pays_only_under_three_one_token_verifies():
    """Eager verify ms measured on a 2-core Xeon with AMX (twin = fp32 on oneDNN): the twin wins
    only at 64 rows, where no tree can pay, so it is dropped and trees stop at 16."""
    xeon = {1: {"int4": 21.5}, 8: {"int4": 36.7, "wide": 71.4}, 16: {"int4": 53.8, "wide": 80.4},
            32: {"int4": 89.6, "wide": 111.0}, 64: {"int4": 169.6, "wide": 147.7}}
    trees = pick_tree_kernels(xeon, WIDE_ROWS)
    assert (trees.wide_from, trees.largest) == (None, 16) and trees.verify_ms["1"] == {"int4": 21.5}
    cheap = {**xeon, 32: {"int4": 91.4, "wide": 40.0}, 64: {"int4": 166.1, "wide": 50.0}}
    assert pick_tree_kernels(cheap, WIDE_ROWS) == TreeKernels(32, 64, pick_tree_kernels(cheap, WIDE_ROWS).verify_ms)
    gap = {**cheap, 16: {"int4": 80.0, "wide": 75.4}}   # 16 cannot pay, so nothing past 8 does
    assert pick_tree_kernels(gap, WIDE_ROWS).largest == 8
