"""`launch.py bench` end to end on a tiny model: every strategy runs, the JSON line has its shape."""

import json

import pytest

from core.bench import bench, load_prompts
from core.config import TreeConfig
from core.factory import EngineSpec
from tests.conftest import ROOT_ASSETS


def test_bench_reports_every_strategy(tiny_dir, cache_dir, capsys):
    spec = EngineSpec(model=str(tiny_dir), quant="none", device="cpu", cache_dir=cache_dir, head="random",
                      tree=TreeConfig(2, 3, 6))
    report = bench(spec, ROOT_ASSETS / "bench" / "mt_bench.jsonl", limit=3, max_new=6)
    assert report["prompts"] == 3 and report["model"] == tiny_dir.name
    s = report["strategies"]
    assert set(s) == {"plain", "hf_generate", "hf_prompt_lookup", "prompt_lookup", "eagle"}
    assert all(e["lossless"] for e in s.values())
    assert s["plain"]["accept_len"] == 1.0 and s["plain"]["speedup_vs_plain"] == 1.0
    assert s["eagle"]["tree"] == {"depth": 2, "top_k": 3, "total_tokens": 6}
    assert set(s["eagle"]["round_ms"]) == {"draft", "verify", "commit"}
    assert s["eagle"]["accept_rate"] is not None and "speedup_vs_hf" in s["eagle"]
    json.dumps(report)
    assert "category" in capsys.readouterr().out  # the per-category table


def test_bench_refuses_unknown_strategies(tiny_dir, cache_dir):
    spec = EngineSpec(model=str(tiny_dir), quant="none", device="cpu", cache_dir=cache_dir)
    with pytest.raises(ValueError, match="Unknown strategies eagle"):
        bench(spec, ROOT_ASSETS / "bench" / "mt_bench.jsonl", limit=1, max_new=2, strategies=("eagle",))


def test_limit_picks_round_robin_across_categories():
    prompts = load_prompts(ROOT_ASSETS / "bench" / "mt_bench.jsonl", 8)
    assert len({p.category for p in prompts}) == 8
