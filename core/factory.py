"""Building an engine from what the user asked for: target, quantization, device, drafter.
launch.py calls this at start, for the bench, and whenever the UI switches models."""

from dataclasses import dataclass
from pathlib import Path

import torch

from core.config import TreeConfig
from core.cpu_linear import accelerate_cpu
from core.drafters import PlainDrafter, PromptLookupDrafter
from core.eagle import EagleDrafter
from core.engine import Engine
from core.errors import UnsupportedModelError
from models.head_checkpoint import head_config_for_target, load_draft_vocab, load_head
from models.heads import build_head
from models.target import LoadSpec, Target, load_target

STRATEGIES = ("auto", "eagle", "prompt_lookup", "plain")


@dataclass(frozen=True)
class EngineSpec:
    model: str | None = None          # Hub id, folder, or None for the embedded default
    quant: str | None = None
    device: str | None = None
    cache_dir: Path = LoadSpec.cache_dir
    head: str | None = None           # Hub id, folder, "random" (a random EAGLE-1 head), or None
    allow_pickle: bool = False        # allow a head's pytorch_model.bin (pickle) when no safetensors
    strategy: str = "auto"            # auto = eagle with a head, prompt lookup without
    tree: TreeConfig | None = None    # None = the device's default below


# Until the tuner measures the machine (issue 5). On the 2-core CPU (oneDNN linears, one thread) a
# verified token costs ~1 ms over the 27 ms of a one-token forward and each head step ~4 ms, so one
# level of 4 siblings won a grid of 6 shapes (1.18x plain; depth 1-4 trees 1.04x down to 0.73x).
# On a GPU a verify costs nearly the same for 1 or 60 tokens: EAGLE-2's own trees.
DEFAULT_TREES = {"cpu": TreeConfig(depth=0, top_k=4, total_tokens=5), "cuda": TreeConfig(depth=5, top_k=8, total_tokens=48)}


def default_tree(device: torch.device) -> TreeConfig:
    return DEFAULT_TREES.get(device.type, DEFAULT_TREES["cpu"])


def load_engine(spec: EngineSpec) -> Engine:
    target, _ = load_fast_target(spec)
    return Engine(target, make_drafter(target, spec))


def load_fast_target(spec: EngineSpec) -> tuple[Target, bool]:
    """The target, with oneDNN linears on CPU where they are faster; -> (target, whether they are)."""
    target = load_target(LoadSpec(model=spec.model, quant=spec.quant, device=spec.device, cache_dir=spec.cache_dir))
    return target, accelerate_cpu(target)


def make_drafter(target: Target, spec: EngineSpec):
    if spec.strategy not in STRATEGIES:
        raise UnsupportedModelError(f"Unknown strategy '{spec.strategy}': choose one of {', '.join(STRATEGIES)}.")
    strategy = spec.strategy if spec.strategy != "auto" else ("eagle" if spec.head else "prompt_lookup")
    if strategy == "plain":
        return PlainDrafter()
    if strategy == "prompt_lookup":
        return PromptLookupDrafter()
    if not spec.head:
        raise UnsupportedModelError("The eagle strategy needs a head: pass --head (a Hub id, a folder, or 'random').")
    head = load_eagle_head(target, spec.head, spec.allow_pickle)
    draft_vocab = None if spec.head == "random" else load_draft_vocab(spec.head, target.model.config.get_text_config().vocab_size)
    tree = spec.tree or default_tree(target.device)
    return EagleDrafter(head, target.model.config.get_text_config().num_hidden_layers, tree, draft_vocab)


def load_eagle_head(target: Target, source: str, allow_pickle: bool):
    model = target.model
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    if source == "random":  # untrained: accepts little, but exercises the whole EAGLE path
        with torch.random.fork_rng(devices=[]):  # seeded, without touching the caller's RNG
            torch.manual_seed(0)
            head = build_head(head_config_for_target(model.config, "eagle1"), embed, lm_head)
        return head.to(device=target.device, dtype=target.dtype).eval()
    return load_head(source, model.config, embed, lm_head, allow_pickle=allow_pickle, dtype=target.dtype,
                     device=target.device)
