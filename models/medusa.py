"""Medusa heads (Cai et al. 2024, arXiv 2401.10774): K extra decoding heads on the target's last feature.

Head k (0-based) reads h_t, the target's last layer output after its final norm (what its LM head
reads), and guesses the token k + 2 places ahead (the LM head itself gives the next one):
    p_k(x_{t+k+2} | x_<=t) = softmax(W_k r_k(h_t)),   r(h) = h + SiLU(U h + b)   (a ResBlock; L of them)
The heads never see the tokens between t and t+k+2, so one feature yields every level of a tree.

Checkpoints (research/peers.md A.3): FasterDecoding/Medusa's layout, config.json with
`medusa_num_heads`, `medusa_num_layers` (and `base_model_name_or_path`), weights in
medusa_lm_head.safetensors (or medusa_lm_head.pt, a pickle, read only when the user allows it) under
"{k}.{j}.linear.weight|bias" for block j < L and "{k}.{L}.weight" (V, H) for the projection, with an
optional "medusa_head." prefix. Aerie's own heads use the same layout with EAGLE-1's trick: W_k is
the target's own LM head, shared by every head and not stored (`aerie_shared_projection`), restricted
to the Vd most frequent answer tokens listed in draft_vocab.safetensors (drafts are restricted to
them, the target still checks every token). Per head that is 0.66 MB in fp16 instead of 10 MB, and a
draft reads the projection once for all K heads instead of K times.

This module knows nothing about drafting or training.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from models.errors import HeadMismatchError, ModelLoadError
from models.head_checkpoint import load_draft_vocab, read_json, read_weights, resolve_folder, save_draft_vocab

WEIGHTS = "medusa_lm_head.safetensors"
PICKLE = "medusa_lm_head.pt"


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int      # K
    num_layers: int     # ResBlocks per head, L
    hidden_size: int    # H, the target's
    out_size: int       # rows of each projection: the target's vocabulary V, or a draft vocabulary's Vd
    shared: bool = False  # the projection is the target's LM head (its draft-vocabulary rows), not the heads' own


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.heads = nn.ModuleList(nn.Sequential(*(ResBlock(H) for _ in range(config.num_layers)),
                                                 *([] if config.shared else [nn.Linear(H, config.out_size, bias=False)]))
                                   for _ in range(config.num_heads))

    def forward(self, hidden: torch.Tensor, levels: int | None = None) -> torch.Tensor:
        """hidden (..., H) -> each of the first `levels` heads' output (D, ..., Vout), or with a shared
        projection their features (D, ..., H), which the target's LM head rows turn into logits."""
        return torch.stack([head(hidden) for head in self.heads[:levels]])


def new_medusa(num_heads: int, num_layers: int, projection: torch.Tensor, shared: bool = True) -> MedusaHeads:
    """Medusa-1's start: every ResBlock zero (an identity) and every projection the target LM head's
    rows `projection` (Vout, H), shared or copied, so head k first guesses the next token again."""
    heads = MedusaHeads(MedusaConfig(num_heads, num_layers, projection.shape[1], projection.shape[0], shared))
    with torch.no_grad():
        for head in heads.heads:
            for block in head[:num_layers]:
                block.linear.weight.zero_()
                block.linear.bias.zero_()
            if not shared:
                head[-1].weight.copy_(projection)
    return heads.to(projection.device)


def save_medusa(heads: MedusaHeads, out_dir, draft_vocab: torch.Tensor | None, base_model: str,
                dtype: torch.dtype = torch.float16) -> None:
    """FasterDecoding's files (config.json, medusa_lm_head.safetensors), plus draft_vocab.safetensors
    when the projections cover a draft vocabulary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k.removeprefix("heads."): t.detach().to(dtype).cpu().contiguous() for k, t in heads.state_dict().items()}
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt"})
    c = heads.config
    config = {"medusa_num_heads": c.num_heads, "medusa_num_layers": c.num_layers, "base_model_name_or_path": base_model,
              "hidden_size": c.hidden_size, "vocab_size": c.out_size, "aerie_shared_projection": c.shared,
              "torch_dtype": str(dtype).removeprefix("torch.")}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if draft_vocab is not None:
        save_draft_vocab(out, draft_vocab)


def load_medusa(source: str, target_config, *, allow_pickle: bool = False, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", cache_dir: Path | None = None) -> tuple[MedusaHeads, torch.Tensor | None]:
    """The heads at `source` (a folder or a Hugging Face repo id) and their draft vocabulary
    (target ids (Vd,), or None when the projections cover the whole vocabulary)."""
    folder = resolve_folder(source, allow_pickle, cache_dir, (PICKLE,))
    raw = read_json(folder / "config.json", "Medusa heads")
    if not isinstance(raw.get("medusa_num_heads"), int) or raw["medusa_num_heads"] < 1:
        raise ModelLoadError(f"{folder / 'config.json'} has no medusa_num_heads; it is not a Medusa checkpoint.")
    if not isinstance(raw.get("medusa_num_layers", 1), int) or raw.get("medusa_num_layers", 1) < 0:
        raise ModelLoadError(f"{folder / 'config.json'} has a bad medusa_num_layers ({raw['medusa_num_layers']!r}).")
    state = {k.removeprefix("medusa_head."): t for k, t in read_weights(folder, allow_pickle, WEIGHTS, PICKLE).items()}
    text = target_config.get_text_config()
    vocab = load_draft_vocab(str(folder), text.vocab_size)
    config = MedusaConfig(raw["medusa_num_heads"], raw.get("medusa_num_layers", 1), text.hidden_size,
                          text.vocab_size if vocab is None else len(vocab), bool(raw.get("aerie_shared_projection")))
    _check_state(config, state, folder)
    with torch.device("meta"):
        heads = MedusaHeads(config)
    heads.load_state_dict({f"heads.{k}": t for k, t in state.items()}, strict=True, assign=True)
    return heads.to(device=device, dtype=dtype).eval(), vocab


def _check_state(c: MedusaConfig, state: dict, folder: Path) -> None:
    """Every key and shape the config implies, and nothing else. FasterDecoding's L > 1 heads repeat one
    block object, so their checkpoints hold equal tensors under each index: loaded as L equal blocks."""
    H, L = c.hidden_size, c.num_layers
    shapes = {} if c.shared else {f"{k}.{L}.weight": (c.out_size, H) for k in range(c.num_heads)}
    shapes |= {f"{k}.{j}.linear.{p}": (H, H) if p == "weight" else (H,)
               for k in range(c.num_heads) for j in range(L) for p in ("weight", "bias")}
    missing, unexpected = sorted(shapes.keys() - state.keys()), sorted(state.keys() - shapes.keys())
    if missing or unexpected:
        raise ModelLoadError(f"The Medusa heads in {folder} do not match their config.json "
                             f"(missing {missing[:4]}, unexpected {unexpected[:4]}).")
    for k, shape in shapes.items():
        if tuple(state[k].shape) != shape:
            what = "hidden size" if k.endswith("linear.weight") or k.endswith("bias") else "projection"
            raise HeadMismatchError(f"The Medusa heads were made for another model: {k} has shape "
                                    f"{tuple(state[k].shape)}, this model's {what} needs {shape}.")
