"""Precompiled graphs (core/runtime/graphs.py) and the warm-up that adopts them between rounds
(core/service/warmup.py).

Tiny random Llamas (fp32, CPU): a graph precompiled into a folder and loaded runs the runner's and
the head step's code on the loading owner's own cache; greedy output stays plain decoding's when
graphs arrive mid-chat, between rounds; a loaded graph refuses inputs it was not compiled for;
the warm-up adopts each graph a child reports, and reports the child's exit.
"""

import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from core.config import SamplingConfig, TreeConfig
from core.engine import Engine
from core.runtime.graphs import Precompiled, build, row_groups
from core.runtime.kv import set_length
from core.runtime.runner import RunnerConfig, TargetRunner
from core.service.warmup import STORED, Pending, Warmup
from core.spec.drafters import PromptLookupDrafter
from core.spec.eagle import EagleDrafter
from tests.conftest import random_head, tiny_llama, tiny_target

BUCKETS = (1, 2, 4)   # graphs: 1 alone, 2 and 4 in one with T symbolic


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=21, layers=2)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, model):
    """Every graph of a 3-bucket runner and of an EAGLE head's step (buckets 1, 2, 4, 8), precompiled once."""
    folder = tmp_path_factory.mktemp("graphs")
    runner, drafter = runner_and_drafter(model)
    built = []
    build(runner.graph_jobs() + drafter.graph_jobs(), folder, stored=lambda name, s: built.append(name), adopt=False)
    assert sorted(built) == sorted(p.name for p in folder.iterdir())
    assert sorted(built) == ["head-1x64", "head-2-8x64", "target-1", "target-2-4"], built
    assert not runner.compiled and drafter.compiled_sizes == ()   # adopt=False: stored only
    return folder


def runner_and_drafter(model) -> tuple[TargetRunner, EagleDrafter]:
    drafter = EagleDrafter(random_head(model, "eagle1", 12), model.config.num_hidden_layers, TreeConfig(2, 3, 8))
    runner = TargetRunner(tiny_target(model), RunnerConfig(compile=True, buckets=BUCKETS), drafter.feature_layers)
    return runner, drafter


def tokens_of(steps) -> list[int]:
    return [t for s in steps for t in s.new_ids]


def test_a_stored_graph_loads_and_runs_on_its_new_owner(model, folder):
    """Loaded into a runner and a head step made after the compile (their own caches), the graphs
    give eager's numbers, and a second build only loads: nothing is compiled again."""
    runner, drafter = runner_and_drafter(model)
    again = []
    build(runner.graph_jobs() + drafter.graph_jobs(), folder, stored=lambda name, s: again.append(name))
    assert again == [] and runner.compiled and drafter.compiled_sizes == drafter.step.buckets
    eager = TargetRunner(tiny_target(model), RunnerConfig(compile=False, buckets=BUCKETS), drafter.feature_layers)
    prompt = list(range(30, 75))
    for n in (1, 2, 3, 4, 6):  # exact buckets, padded ones, and chunks past the largest
        outs = []
        for r in (eager, runner):
            r.reset()
            r.prefill(prompt, 0)
            outs.append(r.verify(torch.arange(n) + 5, torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril()))
        torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(outs[1].features, outs[0].features, atol=1e-5, rtol=1e-5)


def test_graphs_adopted_mid_chat_keep_greedy_output(model, folder):
    """Eager rounds first, then each graph adopted between two rounds, as the warm-up does: the
    greedy text is plain eager decoding's, for EAGLE and prompt lookup alike."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 6
    sampling = SamplingConfig(max_new_tokens=60)
    plain = tokens_of(Engine(tiny_target(model)).generate(prompt, sampling))
    for make in ("eagle", "prompt_lookup"):
        runner, drafter = runner_and_drafter(model)
        jobs = runner.graph_jobs() + (drafter.graph_jobs() if make == "eagle" else [])
        engine = Engine(tiny_target(model), drafter if make == "eagle" else PromptLookupDrafter(), runner)
        out, rounds = [], 0
        for step in engine.generate(prompt, sampling):
            out += step.new_ids
            rounds += 1
            if rounds in (3, 6) and jobs:  # half the graphs after round 3, the rest after round 6
                half, jobs = jobs[: len(jobs) // 2 or 1], jobs[len(jobs) // 2 or 1:]
                build(half, folder)
        assert out == plain, make
        assert runner.compiled and rounds > 8


def test_a_loaded_graph_refuses_inputs_it_was_not_compiled_for(model, folder):
    runner, _ = runner_and_drafter(model)
    job = next(j for j in runner.graph_jobs() if j.name == "target-2-4")
    graph = Precompiled(folder / job.name, job)
    ids, positions, mask = job.args                                 # 2 rows
    wider = runner.mask(torch.ones(2, 2, dtype=torch.bool).tril(), 70)
    four = runner.mask(torch.ones(4, 4, dtype=torch.bool).tril(), 0)
    three = runner.mask(torch.ones(3, 3, dtype=torch.bool).tril(), 0)
    with torch.inference_mode():
        graph(ids, positions, wider)                       # a longer chat: the same graph
        graph(torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None], four)  # its other bucket
        for bad in ((torch.zeros(1, 3, dtype=torch.long), torch.arange(3)[None], three), (ids.int(), positions, mask),
                    (ids, positions, mask.half())):
            with pytest.raises(ValueError, match="precompiled for"):
                graph(*bad)
    with pytest.raises(ValueError, match="precompiled for"):  # compiled with autograd off
        graph(ids, positions, mask)


def test_a_loaded_graph_skips_dynamos_prologue_with_the_same_bits(model, folder):
    """After its first call a loaded graph runs without dynamo's prologue (core/runtime/prologue.py):
    the same outputs, bit for bit, as dynamo's own function on the same inputs, at other row counts
    and mask widths than the recorded call's, for the target's verify and the head's step."""
    runner, drafter = runner_and_drafter(model)
    jobs = {j.name: j for j in runner.graph_jobs() + drafter.graph_jobs()}
    for name, width in (("target-2-4", None), ("head-2-8x64", 64)):
        job = jobs[name]
        graph = Precompiled(folder / name, job)
        calls = []
        for rows, past in ((2, 0), (4, 70), (2, 130), (4, 0)):
            ids, positions = torch.randint(0, 100, (1, rows)), torch.arange(past, past + rows)[None]
            mask = runner.mask(torch.ones(rows, rows, dtype=torch.bool).tril(), past)   # (1, 1, rows, Lk)
            calls.append((ids, positions, mask) if width is None else (torch.randn(1, rows, width), ids, positions, mask))
        with torch.inference_mode():
            assert graph.flat is None
            for args in calls:
                past = int(args[-2][0, 0])
                set_length(graph.owner.cache, past)
                ours = graph(*args)
                set_length(graph.owner.cache, past)   # the same cache rows again
                dynamos = graph.code(graph.owner, *args)
                assert graph.flat is not None
                for a, b in zip(ours, dynamos):
                    assert (a is None and b is None) or torch.equal(a, b), name


def test_a_size_that_two_symbolic_sizes_held_is_not_learned():
    """Where a call's T and Lk are equal, which one an int of the flat list is cannot be told:
    nothing is learned (the next call records again). A fixed axis of the same value (the
    features' width) is no candidate."""
    from core.runtime.graphs import symbolic_sizes
    from core.runtime.prologue import taught

    sizes = symbolic_sizes(3, rows=True)   # features, ids, mask
    features, ids = torch.zeros(1, 64, 64), torch.zeros(1, 64, dtype=torch.long)
    flat, reason = taught(lambda *x: x, [64, ids], [ids], (features, ids, torch.zeros(1, 1, 64, 64)), (ids,), sizes)
    assert flat is None and "more than one" in reason
    features, ids, mask = torch.zeros(1, 2, 64), torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 1, 2, 64)
    flat, reason = taught(lambda *x: x, [2, ids, 64, mask], [mask], (features, ids, mask), (mask, None), sizes)
    assert flat is not None and flat.sizes_at == ((0, 0, 1), (2, 2, 3)) and flat.returns == (0, None), reason


def test_the_warmup_adopts_what_the_children_report_and_says_how_they_ended(model, folder):
    """Two stand-in children, a target graph each: one reports its graph, then fails; the other
    reports its own later and succeeds. Each graph is adopted at the next `adopt_ready` (between
    rounds), and `on_exit` is called once, after both, with the failure's code and last words."""
    runner, _ = runner_and_drafter(model)
    staged = SimpleNamespace(graphs=folder)
    failing = f"print('{STORED}target-1 0.1', flush=True); print('Aerie: no C++ compiler'); raise SystemExit(3)"
    later = f"import time; time.sleep(0.5); print('{STORED}target-2-4 0.1', flush=True)"
    ended = threading.Event()
    results = []
    warmup = Warmup(Pending(staged, runner.graph_jobs(), [[sys.executable, "-c", failing], [sys.executable, "-c", later]]),
                    lambda w, rc: (results.append(rc), ended.set()))
    assert "compiling graph 1 of 2" in warmup.status
    assert ended.wait(30)
    time.sleep(0.2)   # a second call would come about now
    assert results == [3] and "no C++ compiler" in warmup.failure
    assert warmup.adopt_ready() == 2 and runner.compiled and warmup.adopt_ready() == 0


def test_buckets_share_graphs_except_one_and_across_kernel_edges():
    """A size of 1 is torch's special case and plain decoding's: alone. The rest share one graph
    unless a layer switches kernels between them (an edge at 16: 8 and 16 must not share)."""
    assert row_groups((1, 2, 4, 8)) == [(1,), (2, 4, 8)]
    assert row_groups((1, 2, 4, 8, 16, 32), edges=(16,)) == [(1,), (2, 4, 8), (16, 32)]
    assert row_groups((1, 2, 4, 8), edges=(65,)) == [(1,), (2, 4, 8)]
    assert row_groups((4,)) == [(4,)] and row_groups((1,)) == [(1,)]


def test_a_new_graphs_version_or_draft_vocabulary_gets_a_new_folder(model, tmp_path, monkeypatch):
    """Bumping GRAPHS_VERSION must move the graphs (it was overwritten by the kernel key's own
    "version", so graphs compiled by older code were loaded as they were); so must another count of
    draft rows (--draft-rows), which the head step's graph scores."""
    import core.service.factory as factory
    from core.service.spec import EngineSpec

    runner, _ = runner_and_drafter(model)
    engine = SimpleNamespace(runner=runner, target=runner.target)
    spec = EngineSpec(cache_dir=tmp_path)
    first = factory.graph_folder(spec, engine, None, 96)
    assert factory.graph_folder(spec, engine, None, 96) == first
    assert factory.graph_folder(spec, engine, None, 128) != first
    monkeypatch.setattr(factory, "GRAPHS_VERSION", factory.GRAPHS_VERSION + 1)
    assert factory.graph_folder(spec, engine, None, 96) != first


def test_a_latency_profile_is_keyed_by_the_graphs_and_kernel_rules_it_timed(monkeypatch):
    """A new graphs or kernel-choice version times differently: the profile is measured again."""
    import core.service.factory as factory
    from core.tune.kernels import KernelChoice, TargetKernel

    choice = KernelChoice(wide_from=None, largest=16, target=TargetKernel("rows"))
    first = factory.timed_code(False, (1, 2, 4), (1, 2), choice, False)
    assert factory.timed_code(False, (), (), None, False) == "default eager"
    monkeypatch.setattr(factory, "GRAPHS_VERSION", factory.GRAPHS_VERSION + 1)
    second = factory.timed_code(False, (1, 2, 4), (1, 2), choice, False)
    monkeypatch.setattr(factory, "KERNELS_VERSION", factory.KERNELS_VERSION + 1)
    assert len({first, second, factory.timed_code(False, (1, 2, 4), (1, 2), choice, False)}) == 3
