"""Building each drafter an engine may switch to: EAGLE and Medusa heads (on a CPU, on small
weights), prompt lookup and Lookahead, the layer-skip drafter measured on a loaded engine, and the
tuner's view of the drafters it shapes as trees (prompt lookup's chains, Medusa's trees)."""

from dataclasses import replace
from pathlib import Path

import torch

from core.config import DRAFT_ROWS, SamplingConfig, TreeConfig
from core.engine import Engine
from core.errors import UnsupportedModelError
from core.files import stored
from core.service.spec import EngineSpec, resolved_strategy
from core.spec.drafters import LookupConfig, PlainDrafter, PromptLookupDrafter
from core.spec.eagle import EagleDrafter
from core.spec.layer_skip import LayerSkipDrafter
from core.spec.lookahead import LookaheadConfig, LookaheadDrafter
from core.spec.medusa import MedusaDrafter
from core.text import render_prompt
from core.tune.kernels import load_kernel, machine_key
from core.tune.latency import LatencyProfile, level_costs, time_rerank
from core.tune.shapes import PositionalAcceptance, TreeRival, prior_table
from core.tune.skip import SkipChoice, choose_exit, choose_skip, is_layerskip_checkpoint
from models.head_checkpoint import head_training_record, load_draft_vocab, load_head
from models.head_config import head_config_for_target
from models.heads import build_head
from models.medusa import load_medusa
from models.quants import CPU_QUANTS
from models.target import Target


# The tree of an engine built without a tuner (the bench's fixed strategies, tests), and the first drafter's before
# the tuner's first plan. Measured on the 2-core CPU (oneDNN linears): one level of 4 siblings won a
# grid of 6 shapes; on a GPU a verify costs nearly the same for 1 or 60 tokens: EAGLE-2's own trees.
DEFAULT_TREES = {"cpu": TreeConfig(depth=0, top_k=4, total_tokens=5), "cuda": TreeConfig(depth=5, top_k=8, total_tokens=48)}
# Medusa's tree per device: its heads' guesses, best-first (core/spec/medusa.py). On a 2-core CPU a verified token
# costs ~1 ms more per row from 2 rows on, so a chain of two; on a GPU Medusa's own 63-node sparse tree's size.
MEDUSA_TREES = {"cpu": TreeConfig(depth=1, top_k=1, total_tokens=3), "cuda": TreeConfig(depth=3, top_k=8, total_tokens=64)}


def default_tree(device: torch.device) -> TreeConfig:
    return DEFAULT_TREES.get(device.type, DEFAULT_TREES["cpu"])


def narrow_rows(draft_rows: str, device: torch.device) -> bool:
    """Whether an EAGLE-1 head drafts from its draft vocabulary's narrow rows (models/head_checkpoint.py).
    auto: on a CPU, whose head step reads every row from memory: the shipped head's 8,192 wide-only
    rows (in the head's small CPU weights) cost ~0.13 ms a step on the 2-core EPYC, ~2.6% of a one-token
    round, for 0.4% more accepted tokens at the one-token draft its tuner picks (1.641 against 1.634 on
    MT-bench), and the tuned EAGLE ran 1.155x plain narrow, 1.139x wide (alternated; head README). A
    GPU's head step is bound by its kernel launches, not its bytes (16,384 bf16 rows are 19 MB: ~6 us
    at an H100's 3.3 TB/s), so there the wide rows' better drafts come free."""
    if draft_rows not in DRAFT_ROWS:
        raise UnsupportedModelError(f"Unknown --draft-rows '{draft_rows}': choose one of {', '.join(DRAFT_ROWS)}.")
    return draft_rows == "narrow" or (draft_rows == "auto" and device.type == "cpu")


# Lookahead's window per device. On a GPU the paper's 7B setting (W 7, N 5, G 7: 56 rows a verify, which
# cost about one token's there); on the 2-core CPU, where 8 rows cost 1.6 one-token verifies, the smallest window.
LOOKAHEADS = {"cpu": LookaheadConfig(window=2, ngram=3, guesses=1), "cuda": LookaheadConfig(window=7, ngram=5, guesses=7)}


def lookahead_drafter(device: torch.device) -> LookaheadDrafter:
    return LookaheadDrafter(LOOKAHEADS.get(device.type, LOOKAHEADS["cpu"]))


# Prompt lookup for the tuner: chains of up to LookupConfig's 8 tokens, shaped by its own acceptance per depth,
# learned from its rounds; the prior: a match's first token right half the time, a copy that started going on
# more often. Its draft (index lookups in Python) costs ~0.05 ms. On the 2-core AMX Xeon its fixed 8-token, 2-branch
# trees cost 27-30 ms a verify against 4.8 for one token, and measured 0.6x plain.
LOOKUP_ALPHAS = (0.5, 0.6, 0.7, 0.75)


def lookup_rival() -> TreeRival:
    return TreeRival(PositionalAcceptance(prior_table(LOOKUP_ALPHAS)), LookupConfig().num_tokens - 1, 0.05, 0.0,
                     chain=True)


def medusa_rival(drafter: MedusaDrafter, engine: Engine, source: str) -> TreeRival:
    """Medusa for the tuner: acceptance from its heads' held-out chain (train.json), a draft's cost
    timed now on this machine (a few ms: one and all of its levels)."""
    alphas = head_training_record(source).get("val", {}).get("alphas")
    levels = drafter.heads.config.num_heads
    fixed, level = level_costs(drafter, engine, levels)   # chains: a tree adds its rerank
    return TreeRival(PositionalAcceptance(prior_table(alphas)), levels - 1, fixed, level, time_rerank())


# Questions the target answers greedily to measure which layers a self-speculative draft may skip (core/tune/skip.py):
# everyday chat, apart from the benchmark's prompts.
CALIBRATION = ("Explain how a refrigerator keeps food cold.",
               "Write a short note inviting a neighbour to dinner on Friday.",
               "What should I pack for a weekend of hiking in the mountains?")
CALIBRATION_TOKENS = 64
SKIP_VERSION = 2


def layer_skip_drafter(engine: Engine, profile: LatencyProfile, cache_dir: Path) -> LayerSkipDrafter:
    """The self-speculative drafter on `engine`'s runner, skipping the layers measured fastest for
    this model on this machine, or on a LayerSkip checkpoint exiting at the layer measured fastest
    (core/tune/skip.py; measured once, then cached)."""
    target = engine.target
    name = str(target.model.config.name_or_path)
    early_exit = is_layerskip_checkpoint(name)
    key = {"skip_version": SKIP_VERSION, **machine_key(), "model": name, "early_exit": early_exit,
           "quant": target.quant, "dtype": str(target.dtype), "buckets": list(engine.runner.buckets)}

    def measure() -> SkipChoice:
        calibration = []
        for question in CALIBRATION:
            ids = render_prompt(target.tokenizer, [{"role": "user", "content": question}])
            plain = Engine(target, PlainDrafter(), engine.runner)
            answer = [t for step in plain.generate(ids, SamplingConfig(max_new_tokens=CALIBRATION_TOKENS)) for t in step.new_ids]
            calibration.append((ids + answer, len(ids) - 1))
        engine.reset()
        return (choose_exit if early_exit else choose_skip)(engine.runner, profile, calibration)

    choice, _ = stored(cache_dir / "skip", key, measure, SkipChoice.to_json, SkipChoice.from_json)
    return LayerSkipDrafter(engine.runner, choice.config, choice.describe())


def make_drafter(target: Target, spec: EngineSpec, head_weights: str = "int8"):
    strategy = resolved_strategy(spec)
    if strategy == "plain":
        return PlainDrafter()
    if strategy == "prompt_lookup":
        return PromptLookupDrafter()
    if strategy == "lookahead":
        return lookahead_drafter(target.device)
    if strategy == "layer_skip":
        raise UnsupportedModelError("A layer-skip drafter is measured on a loaded engine: core/service/drafters.py layer_skip_drafter.")
    if not spec.head:
        raise UnsupportedModelError("The eagle strategy needs a head: pass --head (a Hub id, a folder, or 'random').")
    head = load_eagle_head(target, spec.head, spec.allow_pickle, spec.cache_dir)
    draft_vocab = None if spec.head == "random" else load_draft_vocab(
        spec.head, target.model.config.get_text_config().vocab_size, narrow=narrow_rows(spec.draft_rows, target.device))
    tree = spec.tree or default_tree(target.device)
    drafter = EagleDrafter(head, target.model.config.get_text_config().num_hidden_layers, tree, draft_vocab)
    return shrunk(drafter, target, head_weights, spec.cache_dir)


def medusa_drafter(target: Target, spec: EngineSpec, features: tuple[int, ...], head_weights: str) -> MedusaDrafter:
    """The Medusa heads `spec` names, drafting the device's MEDUSA_TREES shape (no deeper than the heads
    reach) until the tuner shapes its trees, on the EAGLE head's CPU weights."""
    heads, vocab = load_medusa(spec.medusa, target.model.config, allow_pickle=spec.allow_pickle, dtype=target.dtype,
                               device=target.device, cache_dir=spec.cache_dir)
    tree = MEDUSA_TREES.get(target.device.type, MEDUSA_TREES["cpu"])
    tree = replace(tree, depth=min(tree.depth, heads.config.num_heads - 1))
    drafter = MedusaDrafter(heads, features, target.model.config.get_text_config().num_hidden_layers, tree, vocab,
                            target.model.get_output_embeddings())
    return shrunk(drafter, target, head_weights, spec.cache_dir)


def shrunk(drafter, target: Target, head_weights: str, cache_dir: Path):
    """A CPU target on small weights drafts on small weights too (core/tune/kernels.py HEAD_WEIGHTS);
    drafts only: the target checks every token."""
    if target.quant in CPU_QUANTS:
        if head_weights == "q4_rows":
            load_kernel("rows", cache_dir)
        drafter.shrink(head_weights)
    return drafter


def load_eagle_head(target: Target, source: str, allow_pickle: bool, cache_dir: Path | None = None):
    model = target.model
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    if source == "random":  # untrained: accepts little, but exercises the whole EAGLE path
        with torch.random.fork_rng(devices=[]):  # seeded, without touching the caller's RNG
            torch.manual_seed(0)
            head = build_head(head_config_for_target(model.config, "eagle1"), embed, lm_head)
        return head.to(device=target.device, dtype=target.dtype).eval()
    return load_head(source, model.config, embed, lm_head, allow_pickle=allow_pickle, dtype=target.dtype,
                     device=target.device, cache_dir=cache_dir)
