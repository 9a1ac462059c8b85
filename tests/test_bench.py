"""`launch.py bench` end to end on a tiny model: every strategy runs, the JSON line has its shape."""

import json

import pytest

from core.bench import bench, load_prompts
from core.config import TreeConfig
from core.service.spec import EngineSpec
from core.tune.shapes import Pins
from tests.conftest import ROOT_ASSETS


def test_bench_reports_every_strategy(tiny_dir, cache_dir, capsys):
    spec = EngineSpec(model=str(tiny_dir), quant="none", device="cpu", cache_dir=cache_dir, head="random",
                      pins=Pins(depth=2, top_k=3, total_tokens=6), compile=False)
    report = bench(spec, ROOT_ASSETS / "bench" / "mt_bench.jsonl", limit=3, max_new=6,
                   fixed_trees={"eagle_default_tree": TreeConfig(6, 10, 60)})
    assert report["prompts"] == 3 and report["model"] == tiny_dir.name
    s = report["strategies"]
    assert set(s) == {"plain", "hf_generate", "hf_prompt_lookup", "prompt_lookup", "lookahead", "eagle", "eagle_default_tree"}
    assert s["eagle_default_tree"]["tree"] == {"depth": 6, "top_k": 10, "total_tokens": 60}
    assert s["eagle"]["trees_used"] == {"d2k3n6": 3}  # the tuner kept the pinned shape for every prompt
    assert "depth 2, top-k 3, 6 tokens" in s["eagle"]["plan"]
    vocab = json.loads((tiny_dir / "config.json").read_text())["vocab_size"]
    assert report["draft_rows"] == vocab   # a random head has no draft vocabulary: it scores the whole one
    assert all(e["lossless"] for e in s.values())
    assert s["plain"]["accept_len"] == 1.0 and s["plain"]["speedup_vs_plain"] == 1.0
    assert s["eagle"]["tree"] == {"depth": 2, "top_k": 3, "total_tokens": 6}
    assert set(s["eagle"]["round_ms"]) == {"draft", "verify", "commit"}
    assert s["eagle"]["accept_rate"] is not None and "speedup_vs_hf" in s["eagle"]
    assert s["eagle"]["shown_speedup"] > 0 and "shown_speedup" not in s["plain"]   # the page's, beside the wall clock's
    assert all(s[n]["decode_tok_s"] > 0 for n in ("plain", "eagle")) and "decode_tok_s" not in s["hf_generate"]
    assert json.loads(json.dumps(report))["strategies"].keys() == s.keys()  # launch.py prints it as one JSON line
    assert "category" in capsys.readouterr().out  # the per-category table


def test_bench_races_the_weightless_rivals(tiny_dir, cache_dir):
    """Lookahead and layer skip in one table beside plain, lossless; layer skip's measured choice reported."""
    spec = EngineSpec(model=str(tiny_dir), quant="none", device="cpu", cache_dir=cache_dir, compile=False)
    report = bench(spec, ROOT_ASSETS / "bench" / "mt_bench.jsonl", limit=2, max_new=8,
                   strategies=("lookahead", "layer_skip"))
    s = report["strategies"]
    assert set(s) == {"plain", "lookahead", "layer_skip"} and all(e["lossless"] for e in s.values())
    assert s["lookahead"]["window"] == "W2N3G1"
    skip = s["layer_skip"]["skip"]
    assert skip["layers"] and skip["depth"] >= 1 and "predicted" in skip["chosen"]
    assert set(s["layer_skip"]["round_ms"]) == {"draft", "verify", "commit"}


def test_bench_refuses_unknown_strategies(tiny_dir, cache_dir):
    spec = EngineSpec(model=str(tiny_dir), quant="none", device="cpu", cache_dir=cache_dir, compile=False)
    with pytest.raises(ValueError, match="Unknown strategies eagle"):
        bench(spec, ROOT_ASSETS / "bench" / "mt_bench.jsonl", limit=1, max_new=2, strategies=("eagle",))


def test_bench_tunes_the_eagle_shape(tiny_dir, cache_dir):
    spec = EngineSpec(model=str(tiny_dir), quant="none", device="cpu", cache_dir=cache_dir, head="random", compile=False)
    report = bench(spec, ROOT_ASSETS / "bench" / "mt_bench.jsonl", limit=2, max_new=6, strategies=("eagle",))
    eagle = report["strategies"]["eagle"]
    assert eagle["lossless"] and sum(eagle["trees_used"].values()) == 2
    assert set(eagle["tree"]) == {"depth", "top_k", "total_tokens"} and "predicted" in eagle["plan"]
    assert report["profile"]["plain_ms"] > 0


@pytest.fixture
def tiny_server(tiny_dir, tmp_path):
    """The tiny model with a random head served as launch.py serves it: the page's server with the API routes."""
    from core.service.chat import ChatService
    from tests.conftest import load_tuned_tiny, served_api

    loaded = load_tuned_tiny(tiny_dir, tmp_path)
    service = ChatService(loaded.engine, tuner=loaded.tuner)
    with served_api(service) as url:
        yield service, url


def test_bench_serve_asks_a_live_server_for_the_same_answers(tiny_dir, cache_dir, tiny_server, capsys, monkeypatch):
    from core.served import ServedClient

    service, url = tiny_server
    runner, starts = service.engine.runner, []   # where each of the server's prefills starts in its cache
    prefill = runner.prefill
    monkeypatch.setattr(runner, "prefill", lambda ids, start: starts.append((start, len(ids))) or prefill(ids, start))
    spec = EngineSpec(model=str(tiny_dir), quant="none", device="cpu", cache_dir=cache_dir, head="random", compile=False)
    report = bench(spec, ROOT_ASSETS / "bench" / "mt_bench.jsonl", limit=2, max_new=8,
                   strategies=("eagle", "prompt_lookup", "hf_generate"), serve=ServedClient(url))
    s = report["strategies"]
    assert "served" not in s["hf_generate"]  # transformers' own generate is not what the server runs
    for name in ("plain", "prompt_lookup", "eagle"):
        served = s[name]["served"]
        assert served["same_text"] == "2/2", name  # greedy: the server's answers are the bench's
        assert served["tok_s"] > 0 and served["vs_bench"] == pytest.approx(served["tok_s"] / s[name]["tok_s"], rel=0.01)
        assert served["server_tok_s"] >= served["tok_s"]  # the server's own clock runs inside the wall clock
    assert s["plain"]["served"]["strategies_used"] == {"plain": 2}  # asked for by name (aerie.strategy)
    assert s["prompt_lookup"]["served"]["strategies_used"] == {"prompt_lookup": 2}
    assert s["eagle"]["served"]["strategies_used"] == {"eagle": 2}  # the server's tuner chose
    assert s["eagle"]["served"]["shown_speedup"] > 0  # what the page showed, beside the measured speedup_vs_plain
    for name in ("plain", "prompt_lookup", "eagle"):  # per category, x the served plain answers of that category
        by_category = s[name]["served"]["xplain_by_category"]
        assert set(by_category) == {"writing", "roleplay"} and all(x > 0 for x in by_category.values())
    assert s["plain"]["served"]["xplain_by_category"] == {"writing": 1.0, "roleplay": 1.0}
    assert len(service.tuner.turns) == 2  # only the tuned answers counted as its turns
    # Every served answer read its whole prompt but the template's first tokens, as the bench's own
    # runs do: eagle's, asked right after plain's of the same prompt, did not find it cached.
    prompts = [(start, fed) for start, fed in starts if start + fed > 12]   # not the 1-token evictions'
    assert len(prompts) >= 6 and all(start <= 4 for start, _ in prompts), starts
    progress, table = capsys.readouterr().out.split("category", 1)
    assert "served" in table and "served API" in table  # the summary row and the per-category block
    assert progress.count("served: eagle") == 2 and "(EAGLE" in progress  # per prompt: the server's choice and why


def test_parse_trees():
    from core.bench import parse_trees
    assert parse_trees("0,4,5 2,3,8 0,1,2,0") == {"eagle_d0k4n5": TreeConfig(0, 4, 5), "eagle_d2k3n8": TreeConfig(2, 3, 8),
                                                  "eagle_d0k1n2c0": TreeConfig(0, 1, 2, copy=0)}
    for bad in ("0,4", "0,1,2,3,4", "0,1,2,-1"):
        with pytest.raises(ValueError, match="depth,top_k,total_tokens"):
            parse_trees(bad)


def test_limit_picks_round_robin_across_categories(tmp_path):
    prompts = load_prompts(ROOT_ASSETS / "bench" / "mt_bench.jsonl", 8)
    assert len({p.category for p in prompts}) == 8
    rows = [("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1"), ("c", "c1"), ("c", "c2")]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"category": c, "turns": [t]}) + "\n" for c, t in rows))
    # each category's first prompt, then each one's second, in file order; a short category runs out
    assert [p.text for p in load_prompts(path, None)] == ["a1", "b1", "c1", "a2", "c2", "a3"]
    assert [p.text for p in load_prompts(path, 4)] == ["a1", "b1", "c1", "a2"]


def test_bench_races_medusa_heads_shaped_by_the_tuner(tiny_dir, cache_dir, tmp_path):
    """Medusa heads in FasterDecoding's layout, next to a random EAGLE head: raced losslessly, each
    prompt's tree the tuner's choice from Medusa's own acceptance (reported per prompt)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from models.medusa import MedusaConfig, MedusaHeads

    config = AutoConfig.from_pretrained(tiny_dir)
    torch.manual_seed(1)
    heads = MedusaHeads(MedusaConfig(3, 1, config.hidden_size, config.vocab_size))
    save_file({k.removeprefix("heads."): t for k, t in heads.state_dict().items()}, str(tmp_path / "medusa_lm_head.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1}))
    spec = EngineSpec(model=str(tiny_dir), quant="none", device="cpu", cache_dir=cache_dir, head="random",
                      medusa=str(tmp_path), compile=False)
    report = bench(spec, ROOT_ASSETS / "bench" / "mt_bench.jsonl", limit=2, max_new=8, strategies=("medusa", "eagle"))
    medusa = report["strategies"]["medusa"]
    assert medusa["lossless"] and medusa["heads"] == 3 and sum(medusa["trees_used"].values()) == 2
    assert set(medusa["round_ms"]) == {"draft", "verify", "commit"}


def test_the_page_tally_holds_its_ab_against_the_speedup_shown():
    from core.served import ServedAnswer, ServedTally

    tally = ServedTally()
    assert tally.ab_entry() is None and "ab" not in tally.entry(1.0)
    for measured, shown, identical in ((1.2, 1.1, True), (None, 0.9, True), (1.4, 1.5, False)):
        tally.add(ServedAnswer("t", 8, 0.1, 0.1, "eagle", shown), True)
        tally.add_ab(measured, shown, identical)
    # an A/B that measured nothing (a one-token answer) is left out of both means, not its text
    assert tally.entry(1.0)["ab"] == {"measured": 1.3, "shown": 1.3, "shown_over_measured": 1.0, "answers": 2,
                                      "identical_text": "2/3"}
