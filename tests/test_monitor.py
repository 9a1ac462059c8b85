"""The tuner inside the running service, the cached profile, memory by role and the monitor panel."""

import threading
from dataclasses import asdict
from types import SimpleNamespace

import pytest

from app import monitor
from app.store import ChatStore
from core.service.chat import ChatService
from core.config import ReplyStats, SamplingConfig
from core.runtime.memory import storage, tensor_bytes
from core.tune.monitor import engine_memory, gpu_bars, snapshot
from core.tune.probe import GpuReading, Probe
from core.tune.latency import LatencyProfile, Rounds, cached_profile, profile_mismatch, shape_mismatch
from tests.conftest import load_tuned_tiny
from tests.fakes import FakeNvml

GIB = 2**30
HELLO = [{"role": "user", "content": "Say hello to the tuner."}]


@pytest.fixture(scope="module")
def loaded(tiny_dir, tmp_path_factory):
    # Its own cache folder: another module's load of the same model would leave a profile to reuse.
    return load_tuned_tiny(tiny_dir, tmp_path_factory.mktemp("cache"))


def answer(service, max_new=24):
    events = list(service.reply(HELLO, "", SamplingConfig(max_new_tokens=max_new), (), threading.Event()))
    return "".join(e.delta for e in events), events[-1].stats


def test_profile_is_measured_at_load(loaded):
    p = loaded.tuner.profile
    assert not loaded.profile_cached and p.measured_s > 0
    assert all(ms > 0 for ms in p.round_ms) and list(p.round_ms) == sorted(p.round_ms)
    assert len(p.head_ms) == len(p.widths) > 0 and p.plain_ms(1000) >= p.plain_ms(10)


def test_profile_is_cached_per_key(loaded, tmp_path):
    calls = []

    def measure():
        calls.append(1)
        return loaded.tuner.profile

    key = {"model": "m", "quant": "none"}
    first, cached_first = cached_profile(tmp_path, key, measure)
    second, cached_second = cached_profile(tmp_path, key, measure)
    other, cached_other = cached_profile(tmp_path, {**key, "quant": "nf4"}, measure)
    assert (cached_first, cached_second, cached_other) == (False, True, False) and len(calls) == 2
    assert second == first == loaded.tuner.profile
    for stored in (tmp_path / "profiles").iterdir():
        stored.write_text("{not json")
    assert cached_profile(tmp_path, key, measure) == (loaded.tuner.profile, False)  # re-measured, not a crash
    assert cached_profile(tmp_path, key, measure, check=lambda stored: None) == (loaded.tuner.profile, True)
    n = len(calls)
    assert cached_profile(tmp_path, key, measure, check=lambda stored: "it drifted") == (loaded.tuner.profile, False)
    assert len(calls) == n + 1


def test_a_stored_profile_must_keep_the_shape_of_this_machines_costs():
    """Uniformly slower is load (the meter rescales); trees dearer relative to one token is not."""
    assert shape_mismatch((1, 2, 4), [20.0, 22.0, 26.0], [10.0, 11.0, 13.0]) is None
    assert shape_mismatch((1, 2, 4), [10.0, 11.5, 13.5], [10.0, 11.0, 13.0]) is None      # within 15%
    why = shape_mismatch((1, 2, 4), [15.8, 22.9, 24.8], [10.0, 10.4, 12.0])               # session 12's busy minute
    assert why is not None and why.startswith("a 2-token round costs 1.45x")


@pytest.mark.parametrize("checks, off", [([[30.0, 40.0, 50.0], [10.0, 11.0, 13.0]], False),   # one noisy check
                                         ([[30.0, 40.0, 50.0], [10.0, 20.0, 30.0]], True)])   # off twice
def test_a_profile_is_measured_again_only_if_every_check_finds_it_off(loaded, monkeypatch, checks, off):
    profile = LatencyProfile(sizes=(1, 2, 4), round_ms=(10.0, 11.0, 13.0), contexts=(32, 512), slope_sizes=(1,),
                             slope_ms=(0.0,))
    measured = iter(checks)
    monkeypatch.setattr("core.tune.latency.rounds", lambda *args: Rounds(next(measured)))
    why = profile_mismatch(loaded.engine, profile)
    assert (why is not None) == off and next(measured, None) is None   # both checks ran; the second decided


def test_the_check_reads_a_real_engine_and_keeps_a_fresh_profile(loaded):
    """Timed again right away, the engine's own profile passes the start-up check (or, on a noisy
    host, fails it with a reason that names the sizes)."""
    why = profile_mismatch(loaded.engine, loaded.tuner.profile)
    assert why is None or "-token round costs" in why


def test_tuned_service_is_lossless_and_reports_speedup(loaded):
    service = ChatService(loaded.engine, tuner=loaded.tuner)
    trials = float(loaded.tuner.acceptance.trials.sum())
    text, stats = answer(service)
    assert stats.strategy == "eagle" and "predicted" in stats.tuning
    assert stats.speedup is not None and stats.speedup > 0 and stats.plain_ms > 0
    assert stats.round_tokens == stats.new_tokens - 1    # every token after the prefill's came from a round
    assert loaded.tuner.acceptance.trials.sum() > trials  # it learned from the rounds
    assert loaded.tuner.acceptance.trials[0, -1] > 0       # every root rank, also those no tree held
    assert len(loaded.tuner.turns) >= 1
    loaded.engine.set_drafter(loaded.tuner.drafters["plain"])
    plain_text, _ = answer(ChatService(loaded.engine))
    assert text == plain_text


def test_engine_memory_counts_roles_once(loaded):
    engine = loaded.engine
    engine.set_drafter(loaded.tuner.drafters["eagle"])
    answer(ChatService(engine, tuner=None), max_new=8)
    mem = engine_memory(engine)
    params = list(engine.target.model.parameters()) + list(engine.target.model.buffers())
    assert mem.weights == tensor_bytes(params) and mem.device == "cpu"
    assert tensor_bytes(params + params) == mem.weights  # a tensor listed twice counts once
    assert mem.kv == engine.runner.cache_bytes() > 0
    head = engine.drafter.head
    own = [t for t in [*head.parameters(), *head.buffers()] if all(t is not w for w in params)]
    assert engine.drafter.cache_bytes() > 0
    # The head reads the target's embedding and LM head: they count once, as weights.
    assert mem.draft == tensor_bytes(own) + engine.drafter.cache_bytes()
    assert storage(head.target.embed.weight)[0] in {storage(t)[0] for t in params}


def test_gpu_bars_split_our_share():
    g = GpuReading(0, "Fake 8 GB", 8 * GIB, 5 * GIB, 3 * GIB, ours=4 * GIB)
    mem = SimpleNamespace(device="cuda:0", weights=2 * GIB, kv=GIB, draft=GIB // 4)
    bars = gpu_bars(g, mem)
    assert (bars.weights, bars.kv, bars.draft, bars.activations, bars.others, bars.free) == (
        2 * GIB, GIB, GIB // 4, GIB - GIB // 4, GIB, 3 * GIB)
    other_card = gpu_bars(GpuReading(1, "Fake", 8 * GIB, GIB, 7 * GIB, ours=None), mem)
    assert other_card.weights == 0 and other_card.others == GIB


def test_monitor_panel_renders_cards_ram_and_plot(loaded):
    snap = snapshot(Probe(FakeNvml([6, 24]), allocator=lambda i: None), loaded.engine)
    page = monitor.memory_html(snap)
    assert page.count("<b>GPU") == 2 and "Fake 24 GB" in page and "<b>RAM</b>" in page and "Weights" in page
    assert "No GPU: no NVIDIA driver" in monitor.memory_html(snapshot(Probe(FakeNvml([8], fail_init=True)), loaded.engine))
    answers = [ReplyStats(new_tokens=n, elapsed_s=1.0, target_steps=max(n // 2, 1)) for n in (10, 30, 20)]
    svg = monitor.history_svg(answers)
    assert svg.count("<polyline") == 2 and "tok/s 20.00 (max 30.00)" in svg
    assert "fills in" in monitor.history_svg([])


def test_monitor_refresh_shows_failures_instead_of_raising(tmp_path):
    class Broken:
        tuning = "EAGLE tree depth 0"

        def monitor(self):
            raise RuntimeError("NVML fell over")

    memory, plot, tuning = monitor.refresh(Broken(), ChatStore(tmp_path / "chats.sqlite3"), None)
    assert "Monitor unavailable: RuntimeError: NVML fell over" in memory and "Tuner" in tuning


def test_the_plot_follows_the_chat_shown(loaded, tmp_path):
    store = ChatStore(tmp_path / "chats.sqlite3")
    stats = [ReplyStats(new_tokens=n, elapsed_s=1.0, target_steps=n) for n in (12, 48)]
    first, second = store.create_chat("one").id, store.create_chat("two").id
    store.sync(first, [m for s in stats for m in ({"role": "user", "content": "q"},
                                                  {"role": "assistant", "content": "a", "meta": {"stats": asdict(s)}})])
    service = ChatService(loaded.engine, tuner=loaded.tuner)
    _, plot, _ = monitor.refresh(service, store, first)
    assert plot.count("<polyline") == 2 and "tok/s 48.00 (max 48.00)" in plot
    assert "fills in" in monitor.refresh(service, store, second)[1] and "fills in" in monitor.refresh(service, store, None)[1]
