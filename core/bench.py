"""`launch.py bench`: every strategy on the same prompts, in one process, greedy.

Strategies: plain (ours), hf_generate (transformers greedy), hf_prompt_lookup (transformers
assisted generation with prompt_lookup_num_tokens), prompt_lookup (ours), and with a head eagle
(the tuner's shape, re-planned per prompt) plus any fixed shapes asked for (eagle_d{depth}k{top_k}n{total}, and c{copy} where its copy length is not the default). Prints a per-category table, then one JSON line. Compare ratios from one run only: the
machines are shared and absolute times drift between runs. With --serve, plain, prompt_lookup and
eagle also answer each prompt through a live server's API (core/served.py): a `served` entry per
strategy and a row under the table give its wall-clock tok/s and its ratio to the bench's. With
--verify-delay-ms every prefill and verify of the target waits that long, plain's included (a
simulated offloaded target, SpecExec's regime on a CPU): the tuner plans big best-first trees, and
the report says the target was slowed (`simulated_slow_target`).
"""

import json
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from itertools import zip_longest
from pathlib import Path

import psutil
import torch

from core.text import render_prompt
from core.config import COPY_TOKENS, SamplingConfig, TreeConfig
from core.engine import Engine
from core.service.drafters import layer_skip_drafter, make_drafter
from core.service.factory import load_tuned, target_load_spec
from core.service.spec import EngineSpec
from core.served import SERVED, ServedClient, ServedTally
from core.served_page import PageClient
from core.tune.tuner import Tuner
from core.tune.turn import TurnLog
from models.quants import CPU_QUANTS
from models.target import Target, load_target

FILLER = "Here is some background you may ignore. "
HF_LOOKUP_TOKENS = 10  # transformers' documented example value for prompt_lookup_num_tokens


@dataclass(frozen=True)
class Prompt:
    category: str
    text: str


@dataclass
class Tally:
    """Totals for one strategy on one category."""
    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    accepted: int = 0
    drafted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    commit_s: float = 0.0
    lossless: bool | None = True   # None: a reference on other weights (hf_* on CPU)
    tie_divergences: int = 0    # answers that left plain's only at a near-tie (runner.tie_margin)
    tree_tokens: int = 0        # tokens verified by the rounds after the prefill (tree sizes, summed)
    reference_rounds: int = 0   # plain rounds a tuned EAGLE answer timed for its meter: not in `rounds`
    prefill_s: float = 0.0      # of `seconds`, until each answer's first token (Aerie's strategies)
    trees: Counter = field(default_factory=Counter)  # tuned runs: prompts per tree shape
    shown: list[float] = field(default_factory=list)  # each answer's speedup as the page shows it (a tuner's runs)

    @classmethod
    def of(cls, log: TurnLog, seconds: float) -> "Tally":
        s, tree = log.stats, log.plan.tree if log.plan and log.plan.strategy == "eagle" else None  # EAGLE's shapes
        return cls(s.new_tokens, seconds, s.target_steps - s.reference_rounds, s.accepted, s.drafted, log.draft_s,
                   log.verify_s, log.commit_s, reference_rounds=s.reference_rounds, prefill_s=s.prefill_s,
                   trees=Counter([shape_name(tree)]) if tree else Counter(), shown=[s.speedup] if s.speedup else [])

    @property
    def accept_len(self) -> float | None:
        """Tokens per target forward (the prefill's included), the meter's reference rounds left out."""
        return (self.tokens - self.reference_rounds) / self.rounds if self.rounds else None

    def add(self, other: "Tally") -> None:
        for name in ("tokens", "seconds", "rounds", "accepted", "drafted", "draft_s", "verify_s", "commit_s",
                     "tree_tokens", "reference_rounds", "prefill_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.lossless = None if None in (self.lossless, other.lossless) else self.lossless and other.lossless
        self.tie_divergences += other.tie_divergences
        self.trees.update(other.trees)
        self.shown += other.shown


@dataclass
class StrategyResult:
    by_category: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))
    outputs: list[list[int]] = field(default_factory=list)
    ties: list[set[int]] = field(default_factory=list)   # per prompt: offsets of near-tie choices
    peak_mem_mb: float = 0.0
    served: ServedTally | None = None   # the same prompts through a live server (--serve)
    served_by_category: dict[str, ServedTally] = field(default_factory=lambda: defaultdict(ServedTally))
    paged: ServedTally | None = None    # and typed into its page in Chromium (--page): the tuned eagle only

    @property
    def total(self) -> Tally:
        t = Tally()
        for v in self.by_category.values():
            t.add(v)
        return t


def load_prompts(path: Path, limit: int | None) -> list[Prompt]:
    """First turns of an MT-bench style jsonl; `limit` picks round-robin across categories."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_cat: dict[str, list[Prompt]] = defaultdict(list)
    for r in rows:
        by_cat[r.get("category", "all")].append(Prompt(r.get("category", "all"), r["turns"][0]))
    ordered = [p for group in zip_longest(*by_cat.values()) for p in group if p is not None]
    return ordered[:limit] if limit else ordered


def prompt_text(target: Target, prompt: Prompt, context: int) -> str:
    """The prompt, padded with filler text to about `context` tokens once chat-templated, if asked."""
    length = len(render_prompt(target.tokenizer, [{"role": "user", "content": prompt.text}]))
    if context <= length:
        return prompt.text
    per = len(target.tokenizer.encode(FILLER, add_special_tokens=False))
    return FILLER * ((context - length) // per) + prompt.text


def run_engine(engine: Engine, ids: list[int], max_new: int, tuner: Tuner | None = None,
               ties: set[int] | None = None, asked: bool = False) -> tuple[list[int], Tally]:
    """One greedy answer; with a tuner, planned and learned from as the chat does, one turn per prompt
    (`asked`: the engine's drafter as asked, shaped and learned from but not the tuner's turn)."""
    engine.reset()  # no prefix reuse across prompts: every strategy pays its own prefill
    log = TurnLog.asked(engine, tuner, len(ids), "as asked") if asked else TurnLog.planned(engine, tuner, len(ids))
    out, t0, verified = [], time.perf_counter(), []
    for step in engine.generate(ids, SamplingConfig(max_new_tokens=max_new), reference_every=log.reference_every):
        if ties is not None:
            ties.update(len(out) + j for j in step.near_ties)
        out += step.new_ids
        if not step.reference:   # the meter's plain rounds are not the tree's
            verified.append(step.tree_size)
        log.add(step, time.perf_counter() - t0)
    log.end()
    tally = replace(Tally.of(log, time.perf_counter() - t0), tree_tokens=sum(verified[1:]))  # [0]: the prefill
    return out, replace(tally, trees=Counter([shape_name(engine.drafter.tree)])) if asked else tally


def shape_name(tree: TreeConfig) -> str:
    if tree.best_first:  # SpecExec's: n tokens, b nodes per head step, at most d head steps
        return f"best_first_n{tree.total_tokens}b{tree.top_k}d{tree.depth}"
    copy = f"c{tree.copy}" if tree.copy != COPY_TOKENS else ""   # copy rounds other than the default's
    return "mc_sim_7b_63" if tree.choices else f"d{tree.depth}k{tree.top_k}n{tree.total_tokens}{copy}"


def parse_trees(text: str | None) -> dict[str, TreeConfig]:
    """'0,4,5 2,4,12 0,1,2,0' -> {'eagle_d0k4n5': TreeConfig(0, 4, 5), ..., 'eagle_d0k1n2c0': TreeConfig(0, 1, 2,
    copy=0)}: depth, top_k, total_tokens and optionally a copy round's length (TreeConfig.copy; 0: none)."""
    trees = {}
    for item in (text or "").split():
        try:
            values = [int(v) for v in item.split(",")]
            if len(values) not in (3, 4):
                raise ValueError(f"{len(values)} numbers")
            tree = TreeConfig(*values[:3], copy=values[3] if len(values) == 4 else COPY_TOKENS)
        except ValueError as e:
            raise ValueError(f"--trees takes depth,top_k,total_tokens[,copy] like '0,4,5' or '0,1,2,0'; got '{item}' ({e}).") from e
        trees[f"eagle_{shape_name(tree)}"] = tree
    return trees


def same_up_to_ties(out: list[int], plain: list[int], ties: set[int]) -> tuple[bool, bool]:
    """-> (lossless, diverged at a near-tie): equal, or the first difference is a choice that either
    run made by a top-2 margin within the runner's numeric tolerance (then the texts may part)."""
    if out == plain:
        return True, False
    first = next((i for i, (a, b) in enumerate(zip(out, plain)) if a != b), min(len(out), len(plain)))
    return first in ties, first in ties


def run_hf(target: Target, ids: list[int], max_new: int, lookup: bool) -> tuple[list[int], Tally]:
    input_ids = torch.tensor([ids], device=target.device)
    kwargs = {"prompt_lookup_num_tokens": HF_LOOKUP_TOKENS} if lookup else {}
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = target.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new,
                                    do_sample=False, eos_token_id=list(target.eos_ids), pad_token_id=target.eos_ids[0],
                                    **kwargs)
    new = out[0, len(ids):].tolist()
    return new, Tally(tokens=len(new), seconds=time.perf_counter() - t0)


def measured(device: torch.device, run):
    """run() -> (result, peak MB): the CUDA allocator's peak during the run, or on CPU the
    process's resident memory after it (RSS has no per-run peak)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    result = run()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else psutil.Process().memory_info().rss
    return result, peak / 2**20


def bench(spec: EngineSpec, prompts_path: Path, limit: int | None, max_new: int, context: int = 0,
          strategies: tuple[str, ...] | None = None, fixed_trees: dict[str, TreeConfig] | None = None,
          serve: ServedClient | None = None, page: PageClient | None = None) -> dict:
    """`eagle` runs the tuned shape (re-planned per prompt, learning as it goes, as the app does);
    `fixed_trees` adds EAGLE strategies with fixed shapes beside it (--trees, --compare-default-tree).
    With `serve`, each prompt of plain, prompt_lookup and eagle is also asked of that server, right
    after the bench's own run of it (core/served.py); with `page` too, eagle's is typed into the
    server's page (core/served_page.py)."""
    fixed_trees = fixed_trees or {}
    slow = spec.verify_delay_ms > 0   # transformers' generate is not slowed: no default there, and no server
    if slow and serve:
        raise ValueError("--serve with --verify-delay-ms: the server's target would not be slowed.")
    if fixed_trees and not spec.head:
        raise ValueError("Fixed EAGLE trees need a head (--head).")
    loaded = load_tuned(replace(spec, strategy="eagle" if spec.head else "prompt_lookup"))
    target, tuner = loaded.engine.target, loaded.tuner
    prompts = load_prompts(prompts_path, limit)
    known = (("plain", "hf_generate", "hf_prompt_lookup", "prompt_lookup", "lookahead", "layer_skip")
             + (("medusa",) if "medusa" in tuner.drafters else ()) + (("eagle",) if spec.head else ()) + tuple(fixed_trees))
    unknown = set(strategies or ()) - set(known)
    if unknown:
        raise ValueError(f"Unknown strategies {', '.join(sorted(unknown))}: choose from {', '.join(known)}.")
    asked = strategies if strategies is not None else tuple(n for n in known if n != "layer_skip"
                                                            and not (slow and n.startswith("hf_")))
    names = [n for n in known if n in asked or n == "plain" or n in fixed_trees]
    engines = strategy_engines(loaded, spec, names, fixed_trees)
    # transformers' own generate runs on the model as transformers loads it: on CPU a second, fp32 copy (ours has
    # int4 or oneDNN linears); on CUDA our NF4 model itself (a second copy might not fit; the runner changed only
    # its attention function, the same maths, which a 2D-mask caller like generate() reaches through sdpa's mask).
    stock = None
    if any(n.startswith("hf_") for n in names):
        stock = target if target.device.type == "cuda" else load_target(replace(target_load_spec(spec), quant="none"))

    def runner(name: str, ids: list[int], ties: set[int]) -> tuple[list[int], Tally]:
        if name.startswith("hf_"):
            return run_hf(stock, ids, max_new, lookup=name == "hf_prompt_lookup")
        rival = name in tuner.tree_rivals   # shaped by the tuner and teaching it, as a raced answer does in the app
        return run_engine(engines[name], ids, max_new, tuner if name == "eagle" or rival else None, ties, rival)

    texts = [prompt_text(target, p, context) for p in prompts]
    all_ids = [render_prompt(target.tokenizer, [{"role": "user", "content": text}]) for text in texts]
    run_engine(engines["plain"], all_ids[0], 8)  # warm-up: first-call allocations
    if serve:
        serve.answer(texts[0], 8, "plain")  # the server's too
    if page:
        page.answer(texts[0], 8)            # and the page's
    results = race(target, prompts, texts, all_ids, names, runner, max_new, serve, page,
                   lossless_reference=stock is None or stock.quant == target.quant)
    report = summarise(target, engines, prompts, results, context)
    report["cpu_linear"] = "onednn" if loaded.onednn else target.quant if target.quant in CPU_QUANTS else "default"
    report["runner"] = runner_entry(loaded)
    if stock is not None:
        report["hf_reference"] = f"transformers generate on {stock.label}"
    report["profile"] = {"cached": loaded.profile_cached, "plain_ms": round(tuner.profile.plain_ms(0), 2),
                         "measured_s": round(tuner.profile.measured_s, 2)}
    if "eagle" in results:
        report["strategies"]["eagle"]["plan"] = tuner.plan(len(all_ids[-1])).reason
    if "eagle" in tuner.drafters:   # the draft vocabulary's rows it scored (--draft-rows)
        report["draft_rows"] = tuner.drafters["eagle"].draft_rows
    if slow:
        report["simulated_slow_target"] = {
            "verify_delay_ms": spec.verify_delay_ms,
            "note": "every prefill and verify of Aerie's target waited this long, plain decoding's included "
                    "(as an offloaded target's weight transfer would); transformers' generate (hf_*) did not"}
    print_table(results)
    return report


def strategy_engines(loaded, spec: EngineSpec, names: list[str], fixed_trees: dict[str, TreeConfig]) -> dict[str, Engine]:
    """An engine per strategy, all on the tuned engine's runner: one cache and one set of compiled
    graphs (run_engine resets it per prompt); fixed shapes draft with the tuned drafter's head and step."""
    target, shared = loaded.engine.target, loaded.engine.runner
    engines = {n: Engine(target, make_drafter(target, replace(spec, strategy=n)), shared)
               for n in names if n in ("plain", "prompt_lookup", "lookahead")}
    if "layer_skip" in names:
        engines["layer_skip"] = Engine(target, layer_skip_drafter(loaded.engine, loaded.tuner.profile, spec.cache_dir), shared)
    if "medusa" in names:
        engines["medusa"] = Engine(target, loaded.tuner.drafters["medusa"], shared)
    engines.update({n: Engine(target, loaded.engine.drafter.sibling(tree), shared) for n, tree in fixed_trees.items()})
    if "eagle" in names:
        engines["eagle"] = loaded.engine
    return engines


def race(target: Target, prompts: list[Prompt], texts: list[str], all_ids: list[list[int]], names: list[str], runner,
         max_new: int, serve: ServedClient | None, page: PageClient | None,
         lossless_reference: bool) -> dict[str, StrategyResult]:
    """Every strategy on every prompt, interleaved so that drift on a shared machine hits them
    alike; each answer checked against plain decoding's (up to near-ties)."""
    results = {name: StrategyResult(served=ServedTally() if serve and name in SERVED else None,
                                    paged=ServedTally() if page and name == "eagle" else None) for name in names}
    for i, (prompt, ids) in enumerate(zip(prompts, all_ids)):
        tuned = ""   # the server's own choice for this prompt, when it made one
        api_tok_s = None  # the API's tok/s for eagle's answer to it, beside the page's
        for name in names:
            ties: set[int] = set()
            (out, tally), peak = measured(target.device, lambda: runner(name, ids, ties))
            res = results[name]
            res.outputs.append(out)
            res.ties.append(ties)
            if name.startswith("hf_") and not lossless_reference:
                tally.lossless = None  # other weights: a reference for speed, not for tokens
            else:
                tally.lossless, tied = same_up_to_ties(out, results["plain"].outputs[i], ties | results["plain"].ties[i])
                tally.tie_divergences = int(tied)
            res.by_category[prompt.category].add(tally)
            res.peak_mem_mb = max(res.peak_mem_mb, peak)
            if res.served is not None:
                serve.evict()   # each served answer reads its whole prompt, as the bench's runs do
                answer = serve.answer(texts[i], max_new, SERVED[name])
                same = answer.text == target.tokenizer.decode(out, skip_special_tokens=True)
                res.served.add(answer, same)
                res.served_by_category[prompt.category].add(answer, same)
                if res.paged is not None and answer.seconds > 0:
                    api_tok_s = answer.tokens / answer.seconds
                if SERVED[name] is None:
                    shown = f" {answer.speedup:.2f}x" if answer.speedup is not None else ""
                    tuned = f"\n      served: {answer.strategy}{shown} ({answer.tuning})"
            if res.paged is not None:
                serve.evict()
                answer = page.answer(texts[i], max_new)
                res.paged.add(answer, answer.text == target.tokenizer.decode(out, skip_special_tokens=True).rstrip())
                ab = page.ab()   # issue 17 pt 4: the page's A/B against the speedup it showed
                res.paged.add_ab(ab.ratio, answer.speedup, ab.identical)
                shown = f" {answer.speedup:.2f}x" if answer.speedup is not None else ""
                checked = f", A/B {ab.ratio:.2f}x" if ab.ratio is not None else ""
                page_tok_s = answer.tokens / answer.seconds if answer.seconds > 0 else None
                speed = f", {page_tok_s:.1f} tok/s" if page_tok_s else ""
                speed += f" ({page_tok_s / api_tok_s:.2f} of the API's)" if page_tok_s and api_tok_s else ""
                tuned += f"\n      page: {answer.strategy}{shown}{checked}{speed}"
        print(f"  [{i + 1}/{len(prompts)}] {prompt.category}: "
              + "  ".join(f"{n} {len(results[n].outputs[i])} tok" for n in names) + tuned, flush=True)
    return results


def runner_entry(loaded) -> dict:
    """The shared runner as the report shows it: compiled or not, its buckets, their verify ms."""
    shared, profile = loaded.engine.runner, loaded.tuner.profile
    return {"compiled": shared.compiled, "buckets": list(shared.buckets), "compile_s": round(loaded.compile_s, 1),
            "tie_margin": shared.tie_margin,
            "verify_ms": {n: round(ms, 2) for n, ms in zip(profile.sizes, profile.round_ms)
                          if n in shared.buckets or not shared.compiled}}


def summarise(target: Target, engines: dict[str, Engine], prompts: list[Prompt],
              results: dict[str, StrategyResult], context: int) -> dict:
    plain, hf = results["plain"].total, results.get("hf_generate")
    out = {"model": target.name, "device": target.device.type, "quant": target.quant, "prompts": len(prompts),
           "context_pad": context, "strategies": {}}
    for name, res in results.items():
        t = res.total
        entry = {"tok_s": round(t.tokens / t.seconds, 2), "accept_len": round(t.accept_len, 3) if t.rounds else None,
                 "speedup_vs_plain": round((t.tokens / t.seconds) / (plain.tokens / plain.seconds), 3),
                 "lossless": t.lossless, "tie_divergences": t.tie_divergences, "peak_mem_mb": round(res.peak_mem_mb)}
        if t.prefill_s:   # the tokens after each answer's first over the time after it: the decoding alone
            entry["decode_tok_s"] = round((t.tokens - len(prompts)) / (t.seconds - t.prefill_s), 2)
        if t.rounds > len(prompts):
            entry["tree_tokens"] = round(t.tree_tokens / (t.rounds - len(prompts)), 1)  # verified per round, mean
        if t.shown:   # what the page would have shown, against speedup_vs_plain (the wall-clock ratio)
            entry["shown_speedup"] = round(sum(t.shown) / len(t.shown), 3)
        if hf is not None:
            h = hf.total
            entry["speedup_vs_hf"] = round((t.tokens / t.seconds) / (h.tokens / h.seconds), 3)
        if t.rounds:
            r = t.rounds - len(prompts)  # rounds after the prefill
            entry["accept_rate"] = round(t.accepted / t.drafted, 3) if t.drafted else None
            entry["round_ms"] = {k: round(1000 * getattr(t, f"{k}_s") / max(r, 1), 2) for k in ("draft", "verify", "commit")}
        if name.startswith("eagle"):
            tree = engines[name].drafter.tree
            entry["tree"] = ({"static": "mc_sim_7b_63", "nodes": 1 + len(tree.choices)} if tree.choices else
                             {"depth": tree.depth, "top_k": tree.top_k, "total_tokens": tree.total_tokens}
                             | ({"best_first": True} if tree.best_first else {}))
            if t.trees:
                entry["trees_used"] = dict(t.trees.most_common())  # prompts per shape the tuner chose
        if name == "lookahead":
            entry["window"] = engines[name].drafter.cfg.label()
        if name == "layer_skip":
            drafter = engines[name].drafter
            entry["skip"] = {"layers": list(drafter.cfg.skip), "depth": drafter.cfg.depth, "chosen": drafter.reason,
                             "exit_layer": drafter.exit_layer()}   # LayerSkip's early exit, else None
        if name == "medusa":
            entry["heads"] = engines[name].drafter.heads.config.num_heads
            entry["trees_used"] = dict(t.trees.most_common())  # prompts per shape the tuner gave it
        if res.served is not None:
            entry["served"] = res.served.entry(t.tokens / t.seconds)
            if results["plain"].served is not None:   # issue 17 pt 4 through the API: x served plain, per category
                entry["served"]["xplain_by_category"] = {
                    cat: round(v.tok_s / results["plain"].served_by_category[cat].tok_s, 3)
                    for cat, v in res.served_by_category.items() if results["plain"].served_by_category[cat].tok_s}
        if res.paged is not None:
            entry["page"] = res.paged.entry(t.tokens / t.seconds)
        out["strategies"][name] = entry
    return out


def print_table(results: dict[str, StrategyResult]) -> None:
    plain = results["plain"]
    cats = list(plain.by_category)
    print(f"\n{'category':<12}" + "".join(f"{n:>22}" for n in results))
    print(f"{'':<12}" + "".join(f"{'tok/s  acc  xplain':>22}" for _ in results))
    for cat in cats + ["all"]:
        row = f"{cat:<12}"
        p = plain.total if cat == "all" else plain.by_category[cat]
        for res in results.values():
            t = res.total if cat == "all" else res.by_category[cat]
            acc = f"{t.accept_len:.2f}" if t.rounds else "  - "
            row += f"{t.tokens / t.seconds:>10.1f} {acc:>5} {(t.tokens / t.seconds) / (p.tokens / p.seconds):>5.2f}"
        print(row)
    served = {name: res.served_by_category for name, res in results.items() if res.served is not None}
    if "plain" in served and len(served) > 1:   # the same table through the API: x plain's served tok/s
        print(f"{'served API':<12}" + "".join(f"{n:>22}" for n in served))
        for cat in cats:
            print(f"{cat:<12}" + "".join(f"{t[cat].tok_s:>10.1f} {'':>5} {t[cat].tok_s / served['plain'][cat].tok_s:>5.2f}"
                                         for t in served.values()))
    for label, pick in (("served", lambda r: r.served), ("page", lambda r: r.paged)):
        live = {name: pick(res) for name, res in results.items()}   # wall-clock tok/s through the API / page, x the bench's
        if any(live.values()):
            print(f"{label:<12}" + "".join(
                f"{live[name].tok_s:>10.1f} {'':>5} {live[name].tok_s * res.total.seconds / res.total.tokens:>5.2f}"
                if live[name] else f"{'':>22}" for name, res in results.items()) + "   (tok/s, x bench)")
    ab = results["eagle"].paged.ab_entry() if "eagle" in results and results["eagle"].paged else None
    if ab:
        print(f"page A/B: measured {ab['measured']:.2f}x plain, shown {ab['shown']:.2f}x (x{ab['shown_over_measured']:.2f}) "
              f"over {ab['answers']} answers; identical text {ab['identical_text']}")
