"""Hardware-aware tuning (DESIGN.md section 6) with injected probes and given latency profiles:
NVML readings, the memory budget, the acceptance model, the chosen shapes and the fallback ladder."""

import itertools
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from core.tune.budget import GIB, MemoryBudgetError, ModelShape, largest_tree, plan_placement, tree_bytes, weight_bytes
from core.config import TreeConfig
from core.tune.probe import Probe
from core.tune.remembered import REMEMBERED, acceptance_path, keep, keep_speeds, recall, recall_speeds, speeds_path
from core.tune.latency import LatencyProfile, interpolate, monotone
from core.spec.tree import make_tree
from core.engine import StepResult
from core.tune.meter import MIN_DRAFTS, REFERENCE_EVERY, Meter, Turn
from core.tune.turn import TurnLog
from core.tune.shapes import PositionalAcceptance, Pins, TreeRival, best_shape, node_pools, prior_table
from core.tune.tuner import PROBE_EVERY, RIVAL_RUNS, Tuner
from core.spec.verify import Acceptance as Accepted, path_offers
from tests.fakes import FakeNvml

LLAMA2_7B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_size": 4096,
             "intermediate_size": 11008, "vocab_size": 32000, "max_position_embeddings": 4096}
LLAMA3_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
             "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 8192}


# ---------------------------------------------------------------- probe


@pytest.mark.parametrize("gb", [6, 8, 12, 24])
def test_probe_reads_each_card(gb):
    reading = Probe(FakeNvml([gb]), allocator=lambda i: int(0.25 * GIB)).read()
    (gpu,) = reading.gpus
    assert gpu.name == f"Fake {gb} GB" and gpu.total == gb * GIB and gpu.free == gpu.total - gpu.used
    assert gpu.others == int(0.25 * GIB)  # 0.5 GiB used, 0.25 of it ours
    assert reading.gpu_note is None and reading.host.ram_total > 0 and reading.host.cpu_count >= 1


def test_no_gpu_is_a_normal_reading():
    assert Probe(None).read().gpus == () and "nvidia-ml-py" in Probe(None).read().gpu_note
    probe = Probe(FakeNvml([8], fail_init=True))
    reading = probe.read()
    assert reading.gpus == () and "Driver Not Loaded" in reading.gpu_note


# ---------------------------------------------------------------- memory budget


def test_weights_and_kv_follow_the_formulas():
    shape = ModelShape.from_config(LLAMA2_7B)
    assert 6.6e9 < shape.linear_params + shape.embedding_params < 6.8e9            # "7B"
    assert 3.5 * GIB < weight_bytes(shape, "nf4", 2) < 4.0 * GIB                       # 4.13 bits per linear weight
    assert weight_bytes(shape, "none", 2) == 2 * (shape.linear_params + shape.embedding_params)
    from core.tune.budget import target_kv_per_token
    assert target_kv_per_token(shape, 2) == 2 * (32 + 1) * 32 * 128 * 2   # 512 KiB per token, plus the head's layer
    assert tree_bytes(shape, 64, 1000, 2) > tree_bytes(shape, 32, 1000, 2) > tree_bytes(shape, 32, 10, 2)


@pytest.mark.parametrize("gb, offload", [(6, True), (8, False), (12, False), (24, False)])
def test_placement_on_each_card(gb, offload):
    free = int((gb - 0.5) * GIB)
    placement = plan_placement(ModelShape.from_config(LLAMA2_7B), "nf4", 2, free, int(0.5 * GIB))
    assert placement.offload == offload
    if offload:  # what stays on the GPU leaves room for the reserve and a full-context chat
        assert placement.gpu_weight_bytes < placement.weights and "offloaded" in placement.reason


def test_a_card_too_small_for_even_a_share_is_refused():
    with pytest.raises(MemoryBudgetError, match="too little is left"):
        plan_placement(ModelShape.from_config(LLAMA3_8B), "nf4", 2, int(1.5 * GIB), int(0.5 * GIB))


def test_tree_shapes_that_do_not_fit_are_refused():
    shape = ModelShape.from_config(LLAMA3_8B)
    sizes = (1, 8, 16, 32, 48, 64, 96)
    room = tree_bytes(shape, 32, 4000, 2)
    assert largest_tree(shape, 4000, 2, room, sizes) == 32
    assert largest_tree(shape, 4000, 2, tree_bytes(shape, 1, 4000, 2) - 1, sizes) == 0


# ---------------------------------------------------------------- latency profile


def profile(round_ms, head_ms=(2.0,) * 6, slope=0.0) -> LatencyProfile:
    sizes = (1, 2, 4, 8, 16, 32, 48, 64, 96)
    return LatencyProfile(sizes, tuple(round_ms(n) for n in sizes), (32, 512), (1, 32), (slope, slope),
                          (1, 2, 4, 6, 8, 10), tuple(head_ms), 0.1)


CPU = profile(lambda n: 27.0 + 1.2 * (n - 1) + (2.0 if n > 1 else 0.0), head_ms=(3.0, 3.2, 3.6, 4.0, 4.5, 5.0))
GPU = profile(lambda n: 20.0 + 0.02 * n, head_ms=(1.5,) * 6)


def test_a_tree_costs_what_the_runner_pads_it_to():
    """Buckets up to 8: a 14-token tree runs as two 8-token forwards (16 rows), a 5-token one as 8."""
    padded = replace(profile(lambda n: 10.0 + n), buckets=(1, 2, 4, 8))
    assert padded.round(14, 32) == padded.round(16, 32) == pytest.approx(26.0)
    assert padded.round(5, 32) == padded.round(8, 32) and padded.round(17, 32) == padded.round(24, 32)
    assert padded.padded(3) == 4 and padded.padded(9) == 16
    assert profile(lambda n: 10.0 + n).round(14, 32) == pytest.approx(24.0)  # no buckets: the curve itself


def test_profile_interpolates_and_extrapolates():
    assert interpolate((1, 8), (10.0, 24.0), 4) == pytest.approx(16.0)
    assert interpolate((1, 8), (10.0, 24.0), 15) == pytest.approx(38.0)      # along the last segment
    sloped = profile(lambda n: 10.0, slope=0.01)
    assert sloped.plain_ms(1032) == pytest.approx(20.0)                     # 10 ms + 1000 tokens x 0.01
    assert monotone([5.0, 9.0, 7.0, 8.0]) == (5.0, 7.0, 7.0, 8.0)           # a noisy spike is removed


def test_head_steps_grow_with_context_and_shape_the_tree():
    """The head attends over the whole chat too: a draft at a long context costs its head steps'
    slope more, and where that makes every expansion dear the tuner drafts fewer levels."""
    flat = profile(lambda n: 10.0 + 0.5 * n, head_ms=(1.0,) * 6, slope=0.002)
    sloped = replace(flat, head_slope_ms=(0.002,) * 6)                       # +2 ms per head step per 1000 tokens
    assert sloped.draft(2, 4, 1, 32) == pytest.approx(flat.draft(2, 4, 1, 32))
    assert sloped.draft(2, 4, 1, 1032) == pytest.approx(flat.draft(2, 4, 1, 1032) + 3 * 2.0)   # catch-up + 2 levels
    q = prior_table([0.8, 0.7, 0.6, 0.5])
    short = best_shape(q, sloped, 32, 64, Pins(), chain=False).tree
    long_ = best_shape(q, sloped, 4032, 64, Pins(), chain=False).tree
    assert long_.depth < short.depth
    assert best_shape(q, flat, 4032, 64, Pins(), chain=False).tree.depth == short.depth   # without it, no change


def test_profile_round_trips_through_json():
    assert LatencyProfile.from_json(CPU.to_json()) == CPU


# ---------------------------------------------------------------- acceptance and shapes


def test_node_pools_of_a_chain_are_products_of_the_chain_acceptance():
    q = prior_table([0.8, 0.5, 0.5])
    values = list(itertools.islice(node_pools(q.tolist(), top_k=1), 3))[2]
    assert values == pytest.approx([0.8, 0.4, 0.2])


def test_node_pools_keep_only_the_frontier_expanded():
    q = torch.tensor([[0.6, 0.2, 0.1]] * 8)
    values = list(itertools.islice(node_pools(q.tolist(), top_k=2), 2))[1]  # root's 2 children, then 2 children of each
    assert values == pytest.approx([0.6, 0.36, 0.2, 0.12, 0.12, 0.04])


def test_acceptance_learns_per_depth_and_rank():
    acc = PositionalAcceptance(prior_table([0.5]))
    before = acc.q().clone()
    for _ in range(200):
        acc.observe([(4, 1), (4, -1)])  # depth 1: rank 1 accepted; depth 2: none of 4 accepted
    q = acc.q()
    assert q[0, 1] > 0.9 and q[0, 0] < before[0, 0] / 10 and q[1, :4].max() < 0.05
    assert torch.equal(q[2:], before[2:])  # depths never offered keep the prior


def test_path_offers_name_the_accepted_ranks():
    tree = make_tree([5, 6, 7, 8, 9], [-1, 0, 0, 1, 1])  # root -> {1, 2}; 1 -> {3, 4}
    assert path_offers(tree, Accepted(torch.tensor([0, 2]), [7, 1])) == ((2, 1),)
    assert path_offers(tree, Accepted(torch.tensor([0, 1, 4]), [6, 9, 3])) == ((2, 0), (2, 1))
    assert path_offers(tree, Accepted(torch.tensor([0, 1]), [6, 3])) == ((2, 0), (2, -1))


def test_root_ranking_reports_ranks_the_tree_left_out():
    tree = make_tree([5, 6, 7, 8, 9], [-1, 0, 0, 1, 1])  # the root kept only its 2 best drafts, 6 and 7
    ranking = (6, 7, 3, 4, 11)                            # the drafter's 5 best root drafts
    missed = Accepted(torch.tensor([0]), [4])            # the target chose 4: rank 3, not in the tree
    assert path_offers(tree, missed) == ((2, -1),)
    assert path_offers(tree, missed, ranking) == ((5, 3),)
    deeper = Accepted(torch.tensor([0, 1, 4]), [6, 9, 3])
    assert path_offers(tree, deeper, ranking) == ((5, 0), (2, 1))
    assert path_offers(tree, Accepted(torch.tensor([0]), [99]), ranking) == ((5, -1),)


def test_offers_stop_before_a_grafted_node():
    """A copied node grafted into the tree (Draft.grafted) has no rank of the head's: the offers
    along an accepted path through it stop before it; the root's ranking still counts."""
    tree = make_tree([5, 6, 7, 8, 9], [-1, 0, 0, 1, 1])  # 4 grafted under the head's best child 1
    through = Accepted(torch.tensor([0, 1, 4]), [6, 9, 3])
    assert path_offers(tree, through, grafted=(4,)) == ((2, 0),)
    assert path_offers(tree, through, (6, 7, 3), grafted=(4,)) == ((3, 0),)
    assert path_offers(tree, Accepted(torch.tensor([0, 1, 3]), [6, 8, 3]), grafted=(4,)) == ((2, 0), (2, 0))


def test_cpu_profile_picks_a_small_tree_and_gpu_a_large_deep_one():
    q = prior_table([0.7, 0.6, 0.6, 0.6])
    cpu = best_shape(q, CPU, 100, 96, Pins(), chain=False).tree
    gpu = best_shape(q, GPU, 100, 96, Pins(), chain=False).tree
    assert cpu.total_tokens <= 8 and gpu.total_tokens >= 32
    assert gpu.depth > cpu.depth


def test_a_chain_is_not_charged_the_rerank_a_tree_runs():
    """A draft of top-k 1 skips the rerank (EagleDrafter.grow_chain); a tree of top-k 2 or more and
    every best-first tree run it. Charged to chains too, it made a CPU's d0k2n3 look as cheap to
    draft as d0k1n2: the tuner drafted d0k2n3 at 1.07x plain where d0k1n2 ran 1.29x."""
    cpu = replace(profile(lambda n: {1: 4.8, 2: 5.0, 4: 5.8}.get(n, 4.0 + 0.9 * n), head_ms=(0.25,) * 6),
                  rerank_ms=0.3, draft_fixed_ms=0.4)
    chain, tree = cpu.draft(0, 1, 1, 32), cpu.draft(0, 2, 1, 32)
    assert chain == pytest.approx(0.25 + 0.4) and tree == pytest.approx(chain + 0.3)
    assert cpu.draft(3, 1, 1, 32, best_first=True) == pytest.approx(cpu.draft(3, 1, 1, 32) + 0.3)   # best-first
    # The second child (0.55 x 0.3 of the time) is worth its third row (0.4 ms) but not that and the rerank.
    q = prior_table([0.55])
    assert best_shape(q, cpu, 32, 3, Pins(depth=0), chain=False).tree == TreeConfig(0, 1, 2)
    assert best_shape(q, replace(cpu, rerank_ms=0.0), 32, 3, Pins(depth=0), chain=False).tree == TreeConfig(0, 2, 3)


def test_pins_are_kept():
    q = prior_table([0.7])
    shape = best_shape(q, GPU, 100, 96, Pins(depth=2, top_k=3), chain=False).tree
    assert (shape.depth, shape.top_k) == (2, 3)
    assert best_shape(q, GPU, 100, 96, Pins(total_tokens=10), chain=False).tree.total_tokens == 10
    assert best_shape(q, GPU, 100, 96, Pins(), chain=True).tree.top_k == 1
    assert best_shape(q, GPU, 100, 16, Pins(), chain=False).tree.total_tokens <= 16   # the budget's cap


# ---------------------------------------------------------------- the ladder


def tuner(pins=Pins(), alphas=(0.7, 0.6), prof=CPU, head=True) -> Tuner:
    drafters = {"plain": None, "prompt_lookup": None, **({"eagle": None} if head else {})}
    return Tuner(prof, PositionalAcceptance(prior_table(alphas)), pins, drafters, max_size=96)


def slow_turn(t: Tuner, speedup: float, strategy="eagle", tokens: int = 64) -> None:
    # engine time chosen so that tokens / time x plain_ms = speedup
    t.end_turn(Turn(strategy, tokens, tokens * t.profile.plain_ms(100) / 1000 / speedup, t.profile.plain_ms(100)))


def test_ladder_steps_down_when_a_rungs_last_answers_average_slower_than_plain():
    t = tuner()
    assert t.plan(100).rung == "tree"
    slow_turn(t, 0.9)
    slow_turn(t, 0.95)
    assert t.plan(100).rung == "tree"        # two slow answers are not yet a verdict: one answer's meter errs ~0.1
    slow_turn(t, 1.2)
    assert t.plan(100).rung == "tree"        # (0.9 + 0.95 + 1.2) / 3 >= 1.0
    slow_turn(t, 0.86)                       # the mean of the four: 0.98
    plan = t.plan(100)
    assert plan.rung == "chain" and plan.tree.top_k == 1 and "measured 0.98x plain over 4 turns" in plan.reason
    for _ in range(3):
        slow_turn(t, 0.97)
    assert t.plan(100).rung == "prompt_lookup"   # a new rung starts its own record
    for _ in range(3):
        slow_turn(t, 0.97, "prompt_lookup")
    assert t.plan(100).rung == "plain"
    for _ in range(4):
        slow_turn(t, 0.5, "plain")
    assert t.plan(100).rung == "plain"       # the bottom rung stays


def test_the_mean_weighs_answers_by_their_tokens():
    t = tuner()
    plain_ms = t.profile.plain_ms(100)
    for tokens, speedup in ((200, 1.15), (20, 0.9), (20, 0.9)):   # two short slow answers beside a long fast one
        t.end_turn(Turn("eagle", tokens, tokens * plain_ms / 1000 / speedup, plain_ms))
    assert t.plan(100).rung == "tree"            # (200 x 1.15 + 40 x 0.9) / 240 = 1.11


def test_an_answer_far_slower_than_plain_leaves_the_rung_at_once():
    t = tuner()
    slow_turn(t, 0.9)
    assert t.plan(100).rung == "tree"            # within one answer's noise of plain
    t = tuner()
    slow_turn(t, 0.8)
    plan = t.plan(100)
    assert plan.rung == "chain" and "measured 0.80x plain (< 0.85)" in plan.reason


def test_a_short_answer_alone_does_not_leave_the_rung():
    t = tuner()
    slow_turn(t, 0.78, tokens=31)                # too few rounds to judge alone
    assert t.plan(100).rung == "tree"
    slow_turn(t, 0.9, tokens=31)
    slow_turn(t, 0.95, tokens=64)                # but it counts in the rung's mean: 0.90x over three
    plan = t.plan(100)
    assert plan.rung == "chain" and "over 3 turns" in plan.reason


ENGINE = SimpleNamespace(set_drafter=lambda drafter: None)


def live_tuner() -> Tuner:
    """A tuner whose prepare() can run: drafters that take a shape, an engine that takes a drafter."""
    t = tuner()
    t.drafters = {name: SimpleNamespace(reshape=lambda tree: None) for name in t.drafters}
    return t


def turn(t: Tuner, speedup: float, tokens: int = 64) -> str:
    """One planned turn measured at `speedup`, as the chat service runs it; -> the rung it ran on."""
    plan = t.prepare(ENGINE, 100)
    plain_ms = t.profile.plain_ms(100)
    t.end_turn(Turn(plan.strategy, tokens, tokens * plain_ms / 1000 / speedup, plain_ms))
    return plan.rung


def test_a_lower_rung_probes_the_rung_above_and_climbs_back_when_it_wins():
    """A busy minute made EAGLE's tree lose twice; it must not stay on the chain for good."""
    t = live_tuner()
    assert turn(t, 0.8) == "tree"
    assert [turn(t, 1.2) for _ in range(PROBE_EVERY)] == ["chain"] * PROBE_EVERY
    plan = t.plan(100)
    assert plan.rung == "tree" and f"probing EAGLE tree again after {PROBE_EVERY} turns" in plan.reason
    assert turn(t, 1.3) == "tree"                # the probe wins...
    assert turn(t, 1.3) == "tree" and "probed at 1.30x plain: back up" in t.plan(100).reason  # ...and it stays


def test_a_lost_probe_keeps_the_rung_and_probes_again_later():
    t = live_tuner()
    for _ in range(3):                           # tree -> chain -> prompt lookup -> plain, each slower than plain
        turn(t, 0.8)
    assert t.plan(100).rung == "plain"
    assert [turn(t, 1.0) for _ in range(PROBE_EVERY)] == ["plain"] * PROBE_EVERY
    assert turn(t, 0.7, tokens=5) == "prompt_lookup"  # too short to judge: the probe stays due
    assert turn(t, 0.7) == "prompt_lookup"       # measured slower than plain: lost
    assert [turn(t, 1.0) for _ in range(PROBE_EVERY)] == ["plain"] * PROBE_EVERY  # not settled on the loser
    assert turn(t, 1.1) == "prompt_lookup"       # probed again PROBE_EVERY turns later, and won
    assert t.plan(100).rung == "prompt_lookup"


def test_a_probe_is_judged_over_clear_tokens():
    """One short answer measured fast is noise, as one measured slow is: the probe runs on until it
    has decoded CLEAR_TOKENS tokens, then its token-weighted mean decides."""
    t = live_tuner()
    turn(t, 0.8)                                 # on the chain now
    for _ in range(PROBE_EVERY):
        turn(t, 1.2)
    assert turn(t, 1.5, tokens=32) == "tree"     # fast, but too short alone: still probing
    assert turn(t, 0.7, tokens=32) == "tree"     # 64 tokens at a mean of 1.10x: 0.7 * 32 + 1.5 * 32 over 64
    assert t.plan(100).rung == "tree" and "probed at 1.10x plain: back up" in t.plan(100).reason
    t = live_tuner()
    turn(t, 0.8)
    for _ in range(PROBE_EVERY):
        turn(t, 1.2)
    assert turn(t, 1.3, tokens=20) == "tree"
    assert turn(t, 0.8, tokens=60) == "tree"     # 80 tokens at 0.93x: lost
    assert t.plan(100).rung == "chain"


def test_a_short_probe_does_not_outlive_a_step_down():
    """A probe left short, then the ladder's own rung steps down (a turn planned below the probe,
    as when the rung above is predicted slow): the next probe, of another rung, starts afresh."""
    t = live_tuner()
    turn(t, 0.8)                                 # tree -> chain
    for _ in range(PROBE_EVERY):
        turn(t, 1.2)
    assert turn(t, 3.0, tokens=32) == "tree" and t.probed   # fast but short: not judged yet
    plain_ms = t.profile.plain_ms(100)
    t.trial = None                               # the chain's own turn, clearly slow
    t.end_turn(Turn("eagle", 64, 64 * plain_ms / 1000 / 0.8, plain_ms))
    assert t.rungs[t.rung] == "prompt_lookup" and t.probed == []


def test_a_lost_probe_does_not_demote_the_rung_below():
    t = live_tuner()
    turn(t, 0.8)                                 # on the chain now
    for _ in range(PROBE_EVERY):
        turn(t, 1.2)
    assert turn(t, 0.5) == "tree"                # the probe loses badly...
    assert t.plan(100).rung == "chain"           # ...the chain, measured fast, is kept


def test_short_turns_do_not_move_the_ladder():
    t = tuner()
    for _ in range(5):
        t.end_turn(Turn("eagle", 5, 1.0, 27.0))
    assert t.plan(100).rung == "tree"


def test_a_hopeless_model_prediction_skips_eagle():
    t = tuner(alphas=(0.01,))
    plan = t.plan(100)
    assert plan.rung == "prompt_lookup" and "predicted only" in plan.reason


def test_eagle_predicted_slow_runs_while_its_answers_measure_it_paying():
    t = tuner(alphas=(0.05,))
    assert t.plan(100).rung == "prompt_lookup"     # the profile's prediction alone: under 1.0x
    for speedup in (1.2, 1.16):
        t.record(Turn("eagle", 64, 64 * t.profile.plain_ms(100) / 1000 / speedup, t.profile.plain_ms(100)))
    plan = t.plan(100)
    assert plan.rung == "tree" and plan.predicted == pytest.approx(1.18)
    assert "predicted 0." in plan.reason and "but EAGLE measured 1.18x over its last 2 answers" in plan.reason
    for _ in range(2):                               # then its answers measure slow: the prediction rules again
        t.record(Turn("eagle", 64, 64 * t.profile.plain_ms(100) / 1000 / 0.8, t.profile.plain_ms(100)))
    assert t.plan(100).rung == "prompt_lookup"


def test_without_a_head_the_ladder_starts_at_prompt_lookup():
    assert tuner(head=False).plan(100).rung == "prompt_lookup"


def test_a_pinned_strategy_is_never_demoted():
    t = tuner(pins=Pins(strategy="eagle"), alphas=(0.01,))
    for _ in range(4):
        slow_turn(t, 0.5)
    plan = t.plan(100)
    assert plan.rung == "tree" and plan.predicted < 1
    assert tuner(pins=Pins(strategy="eagle", top_k=1)).plan(100).rung == "chain"
    static = TreeConfig(choices=((0,), (1,)))
    assert tuner(pins=Pins(static=static)).plan(100).tree == static


def test_a_rival_measured_faster_than_the_ladders_plan_is_chosen_and_its_slow_answers_end_that():
    t = tuner(alphas=(0.01,))                      # EAGLE hopeless: the ladder plans prompt lookup
    t.drafters["lookahead"] = None
    assert t.plan(100).rung == "prompt_lookup"
    slow_turn(t, 1.01, "lookahead")                # measured, but under DEMOTE_BELOW: not worth it
    assert t.plan(100).rung == "prompt_lookup"
    t.record(Turn("lookahead", 64, 64 * t.profile.plain_ms(100) / 1000 / 1.6, t.profile.plain_ms(100)))  # a race
    plan = t.plan(100)
    assert plan.rung == "lookahead" and plan.tree is None and "measured 1.31x plain over its last 2" in plan.reason
    assert t.rung == 0 and "layer_skip" not in t.heard   # a rival's turns never move the ladder
    for _ in range(3):
        slow_turn(t, 0.6, "lookahead")
    assert t.plan(100).rung == "prompt_lookup"     # its own slow answers pulled its mean under
    t.pin("lookahead")                             # pinned from the page: it runs whatever it measured
    assert t.plan(100).rung == "lookahead" and t.rungs == ["lookahead"]
    t.pin(None)
    assert t.plan(100).rung == "prompt_lookup"
    with pytest.raises(ValueError, match="no medusa drafter"):
        t.pin("medusa")


def test_a_rival_must_beat_eagles_prediction():
    t = tuner()
    t.drafters["layer_skip"] = None
    slow_turn(t, 1.1, "layer_skip")
    plan = t.plan(100)
    assert plan.rung == "tree" and plan.predicted > 1.1
    t.record(Turn("layer_skip", 64, 64 * t.profile.plain_ms(100) / 1000 / 9.0, t.profile.plain_ms(100)))
    assert t.plan(100).rung == "layer_skip"


class Reshaped:
    """A drafter that only remembers the shape it was given."""
    tree = None

    def reshape(self, tree):
        self.tree = tree


def medusa_tuner(alphas, eagle_alphas=(0.7, 0.6), prof=GPU, level_ms=0.5) -> Tuner:
    rival = TreeRival(PositionalAcceptance(prior_table(alphas)), max_depth=2, fixed_ms=0.2, level_ms=level_ms)
    drafters = {"plain": None, "prompt_lookup": None, "eagle": None, "medusa": Reshaped()}
    return Tuner(prof, PositionalAcceptance(prior_table(eagle_alphas)), Pins(), drafters, max_size=96,
                 tree_rivals={"medusa": rival})


def test_medusas_tree_is_shaped_from_its_own_acceptance_within_its_heads():
    """The tree a raced or asked Medusa answer drafts is best_shape's on Medusa's own acceptance and
    draft cost, no deeper than its heads reach; its rounds teach that acceptance, not EAGLE's."""
    t = medusa_tuner((0.8, 0.8, 0.8))
    t.ready("medusa", 100)
    deep = t.drafters["medusa"].tree
    assert deep.depth == 2 and deep.total_tokens > 8          # a GPU verifies big trees for nearly free
    eagle_before = t.acceptance.q().clone()
    for _ in range(200):
        t.observe_round("medusa", ((10, -1),))                # the first head's guesses never taken
    assert torch.equal(t.acceptance.q(), eagle_before)
    t.ready("medusa", 100)
    assert t.drafters["medusa"].tree.total_tokens < deep.total_tokens


def test_medusa_is_planned_where_its_prediction_beats_the_ladders_until_it_measures_slow():
    t = medusa_tuner((0.95, 0.95, 0.95), eagle_alphas=(0.3,))
    plan = t.plan(100)
    assert plan.rung == "medusa" and plan.predicted > 1.05 and "Medusa heads" in plan.reason
    t.prepare(SimpleNamespace(set_drafter=lambda d: None), 100)
    assert plan.tree is not None and t.drafters["medusa"].tree == plan.tree   # drafted as predicted
    slow_turn(t, 0.9, "medusa")                               # its answers say otherwise
    assert t.plan(100).rung == "tree"
    assert medusa_tuner((0.2,), eagle_alphas=(0.7, 0.6)).plan(100).rung == "tree"   # EAGLE predicted faster


def test_plan_reason_is_one_line_with_the_numbers():
    plan = tuner().plan(100)
    assert "\n" not in plan.reason and "predicted" in plan.reason and "ms/token" in plan.reason


def test_meter_rescales_plain_time_by_the_measured_load():
    step = SimpleNamespace(tree_size=8, new_ids=(1, 2, 3), draft_s=0.004, verify_s=0.0, commit_s=0.001, reference=False, copied=False)
    calm, busy = Meter(CPU, "eagle", 100), Meter(CPU, "eagle", 100)
    calm.add(SimpleNamespace(**{**vars(step), "verify_s": CPU.round(8, 100) / 1000 - 0.001}))
    busy.add(SimpleNamespace(**{**vars(step), "verify_s": 2 * CPU.round(8, 100) / 1000 - 0.001}))
    assert calm.plain_ms == pytest.approx(CPU.plain_ms(101.5))
    assert busy.plain_ms == pytest.approx(2 * CPU.plain_ms(101.5))  # twice as slow now: plain would be too
    assert calm.turn().speedup == pytest.approx(3 / calm.engine_s * calm.plain_ms / 1000)
    slow = Meter(CPU, "eagle", 100)  # everything, drafting included, twice as slow: the same speedup
    slow.add(SimpleNamespace(**{**vars(step), "draft_s": 0.008, "commit_s": 0.002,
                                "verify_s": 2 * CPU.round(8, 100) / 1000 - 0.002}))
    assert slow.turn().speedup == pytest.approx(calm.turn().speedup)


def test_meter_times_plain_decoding_in_the_answers_reference_rounds():
    """The second plain round of each reference pair is plain decoding's cost now, whatever the
    profile says; the first (after a drafted round) is not timed, and neither teaches drafts. A
    reference round a burst of load slowed (over 1.5x their median) is left out: plain's side gets
    the bursts' share of the drafted rounds instead (none here)."""
    tree = TreeConfig(depth=0, top_k=1, total_tokens=2)
    drafted = SimpleNamespace(tree_size=2, new_ids=(1, 2), draft_s=0.001, verify_s=0.012, commit_s=0.0005, reference=False, copied=False)
    def plain(verify_s):
        return SimpleNamespace(tree_size=1, new_ids=(3,), draft_s=0.0, verify_s=verify_s, commit_s=0.0005, reference=True, copied=False)
    meter = Meter(CPU, "eagle", 100, tree=tree)
    pairs = [(0.030, 0.0095), (0.030, 0.0115), (0.030, 0.0495)]   # the last timed in a burst of load
    for first, second in pairs:
        for step in (drafted, drafted, plain(first), plain(second)):
            meter.add(step)
    assert meter.reference_ms == pytest.approx([10.0, 12.0, 50.0]) and meter.plain_ms == pytest.approx(11.0)
    assert meter.tokens == 6 * 2 + 6 and meter.engine_s == pytest.approx(6 * 0.0135 + 3 * 0.0305 + 0.072)
    turn = meter.turn()
    assert turn.drafts == 6 and turn.draft_s == pytest.approx(0.006)   # the plain rounds drafted nothing
    assert turn.speedup == pytest.approx(18 / meter.engine_s * meter.plain_ms / 1000)
    unreferenced = Meter(CPU, "eagle", 100, tree=tree)
    unreferenced.add(drafted)
    assert not unreferenced.reference_ms and unreferenced.plain_ms == pytest.approx(CPU.plain_ms(101) * unreferenced.load)


def test_meter_gives_plain_decoding_the_bursts_its_drafted_rounds_met():
    """Bursts of other work (a page's redraws) slow the rounds they hit, drafted or plain. The
    drafted rounds' time is a sum, so it holds their share; a few reference rounds mostly miss them
    and now and then catch one. So plain's cost is its unslowed reference rounds' mean times the
    share bursts added to the drafted rounds: the same speedup whichever rounds a burst hit."""
    tree = TreeConfig(depth=0, top_k=1, total_tokens=2)
    def drafted(verify_s):
        return SimpleNamespace(tree_size=2, new_ids=(1, 2), draft_s=0.001, verify_s=verify_s, commit_s=0.0005, reference=False, copied=False)
    def plain(verify_s):
        return SimpleNamespace(tree_size=1, new_ids=(3,), draft_s=0.0, verify_s=verify_s, commit_s=0.0005, reference=True, copied=False)
    def metered(drafted_verify, plain_verify):
        meter = Meter(CPU, "eagle", 100, tree=tree)
        for d, p in zip(drafted_verify, plain_verify):
            for step in (drafted(d), drafted(0.012), plain(0.0095), plain(p)):
                meter.add(step)
        return meter
    calm = metered([0.012] * 4, [0.0095] * 4)
    assert calm.plain_ms == pytest.approx(10.0)
    # one drafted round in four slowed 3x: plain pays the same share (the 8 drafted rounds' mean over
    # their unslowed mean), though no reference round was hit
    hit = metered([0.0385, 0.012, 0.012, 0.012], [0.0095] * 4)
    share = (7 * 13.5 + 40.0) / 8 / 13.5
    assert hit.plain_ms == pytest.approx(10.0 * share)
    # a reference round caught in a burst is left out rather than averaged in
    caught = metered([0.012] * 4, [0.0095, 0.0295, 0.0095, 0.0095])
    assert caught.reference_ms == pytest.approx([10.0, 30.0, 10.0, 10.0]) and caught.plain_ms == pytest.approx(10.0)


def test_a_copy_round_is_not_a_draft_of_the_tree():
    """A copy round (TreeConfig.copy) ran no head step: it counts for the speedup, not as a draft
    the profile's estimate for the tree is checked against; the next draft's catch-up, profiled,
    covers its tokens too."""
    tree = TreeConfig(depth=0, top_k=1, total_tokens=2)
    drafted = SimpleNamespace(tree_size=2, new_ids=(1, 2), draft_s=0.001, verify_s=0.012, commit_s=0.0005,
                              reference=False, copied=False)
    copied = SimpleNamespace(tree_size=4, new_ids=(1, 2, 3), draft_s=0.0001, verify_s=0.014, commit_s=0.0005,
                             reference=False, copied=True)
    meter = Meter(CPU, "eagle", 100, tree=tree)
    for step in (drafted, copied, drafted):
        meter.add(step)
    turn = meter.turn()
    assert turn.drafts == 2 and turn.draft_s == pytest.approx(0.002) and turn.tokens == 7
    # the first draft feeds the prefill's last pair (the prefill's step primed the head on the rest)
    assert meter.draft_profiled_s == pytest.approx((CPU.draft(0, 1, 1, 100) + CPU.draft(0, 1, 2 + 3, 105)) / 1000)


def test_meter_times_drafts_against_the_profile():
    tree = TreeConfig(depth=2, top_k=4, total_tokens=10)
    step = SimpleNamespace(tree_size=10, new_ids=(1, 2, 3), draft_s=0.05, verify_s=0.02, commit_s=0.001, reference=False, copied=False)
    eagle, plain = Meter(GPU, "eagle", 100, tree=tree), Meter(GPU, "plain", 100)
    for _ in range(2):
        eagle.add(step)
        plain.add(SimpleNamespace(**{**vars(step), "tree_size": 1, "new_ids": (1,), "draft_s": 0.0}))
    turn = eagle.turn()
    load = 2 * 0.021 / (2 * GPU.round(10, 100) / 1000)  # measured verify + commit against the profile's
    assert turn.drafts == 2 and turn.draft_s == pytest.approx(0.1)
    assert turn.draft_profiled_s == pytest.approx(2 * GPU.draft(2, 4, 3, 100) / 1000 * load)
    assert plain.turn().drafts == 0 and plain.turn().draft_profiled_s == 0
    busy = Meter(GPU, "eagle", 100, tree=tree)  # everything twice as slow: drafts no worse than profiled
    for _ in range(2):
        busy.add(SimpleNamespace(**{**vars(step), "draft_s": 0.1, "verify_s": 0.04, "commit_s": 0.002}))
    assert busy.turn().draft_s / busy.turn().draft_profiled_s == pytest.approx(turn.draft_s / turn.draft_profiled_s)


def test_drafts_slower_than_profiled_make_the_tuner_draft_less():
    """Measured on an H200: drafts took 72 ms where the profile predicted ~5, and the tuner, trusting
    the profile, kept a 64-token tree at 0.29x plain. Measured drafting time must win."""
    t = tuner(prof=GPU, alphas=(0.8, 0.75, 0.7))
    before = t.plan(100)
    tree = before.tree
    per_draft = GPU.draft(tree.depth, tree.top_k, 3, 100) / 1000

    def drafted(n):  # a turn whose n drafts each took 20x the profile's time, at 1.28x plain overall
        t.end_turn(Turn("eagle", 64, 1.0, 20.0, drafts=n, draft_s=20 * n * per_draft, draft_profiled_s=n * per_draft))

    drafted(MIN_DRAFTS - 1)
    assert t.plan(100) == before  # too few drafts yet to overrule the profile
    drafted(1)
    after = t.plan(100)
    assert after.tree != tree and "drafts measured 20.0x the profile's time" in after.reason
    assert after.rung != "tree" or GPU.draft(after.tree.depth, after.tree.top_k, 2, 100) < GPU.draft(tree.depth, tree.top_k, 2, 100)
    assert after.rung != "tree" or after.predicted < before.predicted


def test_tree_budget_caps_and_refuses_what_memory_cannot_hold():
    from core.service.factory import tree_budget
    from core.tune.latency import SIZES
    from tests.conftest import tiny_target

    target = tiny_target()
    assert tree_budget(target, Pins(), SIZES, 0, None) == 96
    with pytest.raises(MemoryBudgetError, match="1000000-token tree needs .* Lower --total-tokens"):
        tree_budget(target, Pins(total_tokens=10**6), SIZES, 0, None)
    with pytest.raises(MemoryBudgetError, match="not enough to verify a draft"):
        tree_budget(target, Pins(), SIZES, 10**15, None)  # a reserve bigger than the machine


def test_cpu_load_is_measured_per_probe_and_never_reads_zero_from_a_sliver(monkeypatch):
    """Machine-wide use over the window since this probe's last reading (scripted CPU times, so no
    busy loop and no dependence on what else the host runs); a reading right after repeats it."""
    from collections import namedtuple

    from core.tune.probe import CpuLoad
    Times = namedtuple("Times", "user system idle iowait")
    readings = iter([Times(10.0, 2.0, 100.0, 1.0), Times(10.6, 2.15, 100.2, 1.05)])  # 0.75 busy of 1.0 s
    monkeypatch.setattr("core.tune.probe.psutil.cpu_times", lambda: next(readings))
    load = CpuLoad()
    load.last_at -= 1.0                      # pretend a second passed
    assert load.percent() == pytest.approx(75.0)
    assert load.percent() == pytest.approx(75.0)   # a reading right after repeats the value, not ~0%


def test_a_slow_turn_on_a_shape_its_rounds_unteach_replans_the_rung_before_leaving_it():
    """The held-out prior planned a deep tree; the turn's rounds showed the head far weaker: the
    rung tries the shape those rounds point to before it steps down, once."""
    t = live_tuner()
    first = t.prepare(ENGINE, 100)
    assert first.rung == "tree" and first.tree.depth >= 1
    for _ in range(200):                          # what the turn taught: depth 0 at 0.5, deeper never
        t.observe_round("eagle", [(first.tree.top_k, 0), (first.tree.top_k, -1)])
    plain_ms = t.profile.plain_ms(100)
    t.end_turn(Turn("eagle", 64, 64 * plain_ms / 1000 / 0.8, plain_ms))
    plan = t.plan(100)
    assert plan.rung == "tree" and plan.tree != first.tree and "re-planned" in plan.reason
    assert turn(t, 0.8) == "tree"                 # the new shape is slow too: now the rung is left
    assert t.plan(100).rung == "chain"


def test_what_the_chats_taught_starts_the_next_session_scaled_down(tmp_path):
    path = acceptance_path(tmp_path, {"model": "m", "quant": "int4", "head": "h"})
    first = tuner()
    first.keep = lambda learned: keep(path, learned)
    for _ in range(500):                           # depth 0 at 0.5, deeper never
        first.observe_round("eagle", [(4, 0 if _ % 2 else -1), (4, -1)])
    assert not path.exists()
    plain_ms = first.profile.plain_ms(100)
    first.end_turn(Turn("eagle", 64, 64 * plain_ms / 1000, plain_ms))
    again = recall(path, prior_table((0.7, 0.6)))
    assert again.trials[0, 0].item() == REMEMBERED and again.trials[1, 0].item() == REMEMBERED   # scaled to REMEMBERED
    assert abs(again.q()[0, 0].item() - 0.5) < 0.1 and again.q()[1, 0].item() < 0.2
    fresh = Tuner(CPU, again, Pins(), first.drafters, max_size=96)
    assert fresh.plan(100).tree.depth < tuner().plan(100).tree.depth     # a shallower first plan than the prior's
    path.write_text("{not json")
    assert torch.equal(recall(path, prior_table((0.7,))).trials, torch.zeros_like(prior_table((0.7,))))  # said, ignored


def test_where_eagle_is_predicted_slow_prompt_lookup_measured_slow_is_passed_over():
    """A fresh server on a CPU where a 2-token verify costs 1.5x one: EAGLE predicted 0.93x, so the
    ladder fell to prompt lookup, which ran three answers at 0.6x before plain. Now one, and its
    slow answer moves no rung: EAGLE is predicted again at every turn."""
    t = live_tuner()
    t.acceptance = PositionalAcceptance(prior_table((0.01,)))   # EAGLE hopeless here
    assert turn(t, 0.6) == "prompt_lookup"
    plan = t.plan(100)
    assert plan.rung == "plain" and "prompt lookup measured 0.60x plain over its last 1 answers" in plan.reason
    assert [turn(t, 1.0) for _ in range(3)] == ["plain"] * 3
    assert t.rung == 0                                            # the ladder itself never moved
    t.acceptance = PositionalAcceptance(prior_table((0.9, 0.9)))  # the head proves good: EAGLE again
    assert t.plan(100).rung == "tree"
    for _ in range(4):
        t.record(Turn("prompt_lookup", 64, 64 * t.profile.plain_ms(100) / 1000 / 1.3, t.profile.plain_ms(100)))
    t.acceptance = PositionalAcceptance(prior_table((0.01,)))
    assert t.plan(100).rung == "prompt_lookup"                    # measured faster than plain since (a race)


def test_answers_measured_speeds_start_the_next_session(tmp_path):
    """A start knows what earlier answers measured on this machine: no first slow prompt lookup
    answer where it measured slower than plain, and a rival a race found faster is planned."""
    path = speeds_path(tmp_path, {"model": "m", "device": "cpu x2"})
    first = tuner(alphas=(0.01,))
    first.keep_heard = lambda heard: keep_speeds(path, heard)
    for speedup in (0.7, 0.6):
        slow_turn(first, speedup, "prompt_lookup")
    first.drafters["lookahead"] = None
    for _ in range(RIVAL_RUNS + 2):
        slow_turn(first, 1.3, "lookahead")
    heard = recall_speeds(path)
    assert heard == {"prompt_lookup": [0.7, 0.6], "lookahead": [1.3] * RIVAL_RUNS}   # each kept to its last RIVAL_RUNS
    fresh = Tuner(CPU, PositionalAcceptance(prior_table((0.01,))), Pins(), {**first.drafters}, max_size=96, heard=heard)
    assert fresh.plan(100).rung == "lookahead"
    del fresh.drafters["lookahead"]
    assert fresh.plan(100).rung == "plain"                       # prompt lookup measured 0.65x: passed over
    path.write_text("[1, 2")
    assert recall_speeds(path) == {}                              # said, ignored


def test_prompt_lookup_drafts_chains_as_long_as_pay_on_the_machine():
    """Its fixed 8-token, 2-branch trees cost 6x a token's verify on a 2-core CPU; shaped by its own
    acceptance and the profile, it drafts a short chain there and the longest on a GPU, and learns."""
    from core.service.drafters import lookup_rival
    from core.spec.drafters import PromptLookupDrafter

    lengths, tuners = {}, {}
    for name, prof in (("cpu", CPU), ("gpu", GPU)):
        drafter = PromptLookupDrafter()
        t = tuners[name] = Tuner(prof, PositionalAcceptance(prior_table((0.01,))), Pins(),
                                 {"plain": None, "prompt_lookup": drafter}, max_size=96,
                                 tree_rivals={"prompt_lookup": lookup_rival()})
        t.ready("prompt_lookup", 100)
        lengths[name] = drafter.cfg.num_tokens
        assert drafter.cfg.branches == 1 and drafter.tree.top_k == 1
        assert t.plan(100).rung == "prompt_lookup"          # a ladder rung still, never planned as a rival
    assert lengths["cpu"] < 8 == lengths["gpu"]
    cpu = tuners["cpu"]
    for _ in range(200):
        cpu.observe_round("prompt_lookup", [(1, 0)] * 8)   # here every copy it starts runs to the end
    cpu.ready("prompt_lookup", 100)
    assert cpu.drafters["prompt_lookup"].cfg.num_tokens > lengths["cpu"]   # longer chains, from what it taught


def test_reference_rounds_are_the_tuners_eagle_answers_and_stay_out_of_accepted_length():
    t = live_tuner()
    t.drafters["eagle"].tree = TreeConfig(0, 1, 2)
    engine = SimpleNamespace(set_drafter=lambda drafter: None, drafter=SimpleNamespace(name="eagle"))
    planned = TurnLog.planned(engine, t, 100)
    assert planned.stats.strategy == "eagle" and planned.reference_every == REFERENCE_EVERY
    assert TurnLog.asked(engine, t, 100, "as asked").reference_every == 0      # A/B, races, fixed trees
    assert TurnLog.planned(SimpleNamespace(set_drafter=lambda d: None, drafter=SimpleNamespace(name="plain")), None,
                           100).reference_every == 0
    rounds = [StepResult((5,), 0, 0, 20, 0.0, 0.1, 0.0)] + [StepResult((1, 2), 1, 1, 2, 0.001, 0.012, 0.0005)] * 4
    rounds += [StepResult((3,), 0, 0, 1, 0.0, 0.01, 0.0005, reference=True)] * 2
    for i, step in enumerate(rounds):
        stats = planned.add(step, 0.1 * (i + 1))
    assert stats.target_steps == 7 and stats.reference_rounds == 2 and stats.new_tokens == 11
    assert stats.accept_len == pytest.approx(9 / 5)      # the prefill's token and 4 rounds of 2
    assert stats.plain_ms == pytest.approx(10.5) and stats.round_tokens == 10   # the second plain round, timed
    # the first token came with the prefill at 0.1 s; 10 more tokens in the 0.6 s after it
    assert stats.prefill_s == pytest.approx(0.1) and stats.decode_tok_s == pytest.approx(10 / 0.6)
