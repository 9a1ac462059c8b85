"""Finding, reading, validating and writing EAGLE draft-head checkpoints.

A head is a folder (local, or a Hugging Face repo that is downloaded) holding config.json, a
LlamaConfig with a few EAGLE fields (research/eagle.md 2.2, 3.3), and the weights, under the
published SafeAILab key names (`expected_shapes`). safetensors is read first. A pickle
`pytorch_model.bin` is read only when the user allows it, and even then with weights_only=True.
The kind comes from the keys: `midlayer.*` is EAGLE-3, `layers.0.*` with `fc.weight` is EAGLE-1.
Any other layout, missing key or wrong shape is an error; no key is guessed.

`save_head` writes model.safetensors + config.json in the format that SafeAILab EAGLE, vLLM and
SGLang load (eagle.md 10.3), and `load_head` reads it back. config.json itself is head_config.py's.

This module knows nothing about drafting. Of the target it knows only its config, embedding and LM head.
"""

import json
import pickle
import re
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from models.download import HEAD_PATTERNS, hub_cache
from models.errors import HeadMismatchError, ModelLoadError, UnsupportedModelError
from models.head_config import config_from_json, config_to_json
from models.heads import EagleHead, HeadConfig, build_head

HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
# Published keys that carry nothing the head uses. The EAGLE-1 embedding is a frozen copy of the target's.
IGNORED_KEYS = {"eagle1": {"embed_tokens.weight", "layers.0.self_attn.rotary_emb.inv_freq"}, "eagle3": set()}



def expected_shapes(c: HeadConfig) -> dict[str, tuple[int, ...]]:
    """The published key table: every tensor a checkpoint of this config holds, with its shape."""
    H, I, q_out, kv_out = c.hidden_size, c.intermediate_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer, attn_in = ("layers.0.", H) if c.kind == "eagle1" else ("midlayer.", 2 * H)    # eagle.md 2.2 / 3.4
    shapes = {
        "fc.weight": (H, 2 * H if c.kind == "eagle1" else 3 * c.target_width),
        f"{layer}self_attn.q_proj.weight": (q_out, attn_in),
        f"{layer}self_attn.k_proj.weight": (kv_out, attn_in),
        f"{layer}self_attn.v_proj.weight": (kv_out, attn_in),
        f"{layer}self_attn.o_proj.weight": (H, q_out),
        f"{layer}mlp.gate_proj.weight": (I, H),
        f"{layer}mlp.up_proj.weight": (I, H),
        f"{layer}mlp.down_proj.weight": (H, I),
        f"{layer}post_attention_layernorm.weight": (H,),
    }
    if c.fc_bias:
        shapes["fc.bias"] = (H,)
    if c.fc_norm:  # EAGLE-3.1's keys (vLLM PR #42764): one gain per fc input, embedding then feature
        shapes |= {"fc_norm.0.weight": (H,), "fc_norm.1.weight": (H,)}
    if c.qkv_bias:
        shapes |= {f"{layer}self_attn.{p}_proj.bias": (n,) for p, n in (("q", q_out), ("k", kv_out), ("v", kv_out))}
    if c.kind == "eagle3":
        shapes |= {f"{layer}input_layernorm.weight": (H,), f"{layer}hidden_norm.weight": (H,), "norm.weight": (H,),
                   "lm_head.weight": (c.draft_vocab_size, H), "d2t": (c.draft_vocab_size,), "t2d": (c.vocab_size,)}
    if c.own_embedding:
        shapes["embed_tokens.weight"] = (c.vocab_size, H)
    return shapes


def load_head(source: str, target_config, target_embed: nn.Embedding, target_lm_head: nn.Module, *,
              allow_pickle: bool = False, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu", cache_dir: Path | None = None) -> EagleHead:
    """Read the head at `source` (a local folder or a Hugging Face repo id, fetched into
    `cache_dir/hub`, or huggingface_hub's own cache without one) and check it fits the target."""
    folder = resolve_folder(source, allow_pickle, cache_dir)
    raw = _read_config(folder)
    state = read_weights(folder, allow_pickle, "model.safetensors", "pytorch_model.bin")
    config = config_from_json(raw, **_layout(state, raw))
    text_config = target_config.get_text_config()
    _check_target(config, text_config)
    state = _check_keys(config, state, folder)
    if config.kind == "eagle3":
        _check_vocab_map(config, state)
        _check_feature_layers(raw, text_config.num_hidden_layers)
    with torch.device("meta"):  # no random init: every tensor is assigned from the checkpoint
        head = build_head(config, target_embed, target_lm_head)
    head.load_state_dict(state, strict=True, assign=True)
    return head.to(device=device, dtype=dtype).eval()


def save_head(head: EagleHead, out_dir, dtype: torch.dtype = torch.float16) -> None:
    """Write model.safetensors + config.json (eagle.md 10.3); float tensors are cast to `dtype`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: (t.to(dtype) if t.is_floating_point() else t).detach().cpu().contiguous()
             for k, t in head.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config_to_json(head.config, dtype), indent=2) + "\n")


DRAFT_VOCAB_FILE = "draft_vocab.safetensors"  # Aerie's addition to an EAGLE-1 head; vLLM and SGLang ignore it
NARROW_KEY = "narrow_ids"   # the file's rows for a CPU, where present


def save_draft_vocab(out_dir, token_ids: torch.Tensor, narrow_ids: torch.Tensor | None = None) -> None:
    """The target ids an EAGLE-1 head drafts from (ascending): its LM-head rows are then the only
    ones read each draft step, like EAGLE-3's reduced vocabulary but without retraining. `narrow_ids`
    (a subset) are the rows drafted where each row read costs time, a CPU (`load_draft_vocab`)."""
    tensors = {"token_ids": token_ids.to(torch.int64).sort().values.contiguous()}
    if narrow_ids is not None:
        tensors[NARROW_KEY] = narrow_ids.to(torch.int64).sort().values.contiguous()
    save_file(tensors, str(Path(out_dir) / DRAFT_VOCAB_FILE))


def load_draft_vocab(source: str, vocab_size: int, narrow: bool = False) -> torch.Tensor | None:
    """The head folder's draft vocabulary, or None when it has none (then the full vocabulary).
    `narrow`: its narrow subset where the file has one (else the same ids)."""
    path = Path(source).expanduser() / DRAFT_VOCAB_FILE
    if not path.is_file():
        return None
    tensors = load_file(str(path))
    ids = tensors["token_ids"]
    if ids.ndim != 1 or len(ids) == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise HeadMismatchError(f"{path} lists token ids outside this model's vocabulary of {vocab_size}.")
    subset = tensors.get(NARROW_KEY)
    if subset is not None and (subset.ndim != 1 or len(subset) == 0 or not bool(torch.isin(subset, ids).all())):
        raise HeadMismatchError(f"{path}: its {NARROW_KEY} are not a subset of its token_ids.")
    return subset if narrow and subset is not None else ids


def head_training_record(source: str | None) -> dict:
    """The train.json Aerie writes next to a head it trained (held-out acceptance per depth under
    "val"), or {} for heads from elsewhere: a starting point for the tuner, nothing more."""
    path = Path(source).expanduser() / "train.json" if source else None
    if path is None or not path.is_file():
        return {}
    try:
        record = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        return {}  # the record is informational; the head itself loads from its config and weights
    return record if isinstance(record, dict) else {}


def resolve_folder(source: str, allow_pickle: bool, cache_dir: Path | None,
                   pickles: tuple[str, ...] = ("pytorch_model*.bin", "pytorch_model.bin.index.json")) -> Path:
    """A draft checkpoint's folder: `source` itself, or a Hugging Face repo fetched into `cache_dir/hub`
    (its config, safetensors and, when the user allows them, the `pickles`)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelLoadError(f"{source} is a file; pass the folder that holds the head's config.json and weights.")
    if not HUB_ID.match(source):
        raise ModelLoadError(f"The head folder {source} does not exist; pass a local folder or a Hugging Face repo id.")
    patterns = list(HEAD_PATTERNS) + (list(pickles) if allow_pickle else [])
    try:
        hub = str(hub_cache(cache_dir)) if cache_dir is not None else None
        return Path(snapshot_download(repo_id=source, allow_patterns=patterns, cache_dir=hub))
    except (OSError, ValueError) as err:  # hub errors are OSError; a malformed repo id is ValueError
        raise ModelLoadError(f"The head {source} could not be downloaded from the Hugging Face Hub "
                             f"({type(err).__name__}); check the name and connection, or pass a local folder.") from err


def _read_config(folder: Path) -> dict:
    return read_json(folder / "config.json", "EAGLE head")


def read_json(path: Path, what: str) -> dict:
    """A checkpoint's config.json as a dict, or a clear error."""
    if not path.is_file():
        raise ModelLoadError(f"The folder {path.parent} has no {path.name}; {what} checkpoints need one next to their weights.")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelLoadError(f"The {what}'s {path} is not valid JSON ({err}); fix or re-download it.") from err
    if not isinstance(raw, dict):
        raise ModelLoadError(f"The {what}'s {path} is not a JSON object; fix or re-download it.")
    return raw


def _weight_files(folder: Path, single: str, index: str) -> list[Path]:
    """The shard files named by `index` if it exists, else [single] if it exists, else []."""
    if (folder / index).is_file():
        try:
            shards = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as err:
            raise ModelLoadError(f"The head's {index} in {folder} is not a valid weight index ({err}); re-download it.") from err
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise ModelLoadError(f"The head in {folder} lacks the shards {missing} named by {index}; re-download it.")
        return [folder / s for s in shards]
    return [folder / single] if (folder / single).is_file() else []


def read_weights(folder: Path, allow_pickle: bool, single: str, pickled: str) -> dict[str, torch.Tensor]:
    """The state dict in `single` (safetensors, or shards named by its .index.json), else, where the user
    allows pickles, in `pickled` (or its shards)."""
    if files := _weight_files(folder, single, f"{single}.index.json"):
        try:
            return {k: t for f in files for k, t in load_file(str(f)).items()}
        except (SafetensorError, OSError) as err:
            raise ModelLoadError(f"The head weights in {folder} could not be read ({err}); re-download them.") from err
    pickles = _weight_files(folder, pickled, f"{pickled}.index.json")
    if not pickles:
        hint = "" if allow_pickle else f", or if the head ships only {pickled} rerun with --allow-pickle"
        raise ModelLoadError(f"No head weights ({single}) were found in {folder}; pass a folder that has them{hint}.")
    if not allow_pickle:
        raise ModelLoadError(f"The head in {folder} ships only pickle weights ({pickled}); "
                             "rerun with --allow-pickle to load them, read as plain tensors only.")
    return {k: t for f in pickles for k, t in read_pickled(f).items()}


def read_pickled(path: Path) -> dict[str, torch.Tensor]:
    """A pickled state dict, read as plain tensors only (weights_only: no code runs)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as err:
        raise ModelLoadError(f"The head weights {path} could not be read as plain tensors ({err}); use a safetensors copy.") from err
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise ModelLoadError(f"The head weights {path} are not a plain state dict of tensors; use a safetensors copy.")
    return state


def _layout(state: dict, raw: dict) -> dict:
    """Kind and bias/embedding flags, read from the keys (eagle.md 2.2, 3.4)."""
    keys = set(state)
    if any(k.startswith("midlayer.") for k in keys):
        kind, layer = "eagle3", "midlayer."
    elif "fc.weight" in keys and any(k.startswith("layers.0.") for k in keys) and "d2t" not in keys:
        kind, layer = "eagle1", "layers.0."
    else:
        raise UnsupportedModelError(f"The head's weights are in an unknown layout (keys: {_names(keys)}); "
                                    "Aerie reads the SafeAILab EAGLE-1 and EAGLE-3 layouts.")
    if kind == "eagle1" and any("Eagle3" in a for a in raw.get("architectures") or []):
        raise ModelLoadError("The head's config.json says EAGLE-3 but its weights are EAGLE-1 (layers.0.*); fix the config.")
    fc_bias = "fc.bias" in keys
    if kind == "eagle1" and "bias" in raw and bool(raw["bias"]) != fc_bias:  # cnets1.py: "bias" = fc bias
        raise ModelLoadError(f"The head's config.json says bias={raw['bias']} but its weights "
                             f"{'have' if fc_bias else 'lack'} fc.bias; make the two agree.")
    return {"kind": kind, "fc_bias": fc_bias, "qkv_bias": f"{layer}self_attn.q_proj.bias" in keys,
            # eagle1's embed_tokens is a copy of the target's (ignored); eagle3's is the head's own, as vLLM loads it
            "own_embedding": kind == "eagle3" and "embed_tokens.weight" in keys,
            "fc_norm": kind == "eagle1" and "fc_norm.0.weight" in keys}


def _check_target(c: HeadConfig, text_config) -> None:
    if c.target_width != text_config.hidden_size:
        raise HeadMismatchError(f"The draft head was made for a target hidden size of {c.target_width} but this "
                                f"model's is {text_config.hidden_size}; use a head made for this model.")
    if c.vocab_size != text_config.vocab_size:
        raise HeadMismatchError(f"The draft head was made for a vocabulary of {c.vocab_size} tokens but this model "
                                f"has {text_config.vocab_size}; use a head made for this model.")


def _check_keys(c: HeadConfig, state: dict, folder: Path) -> dict:
    """The state dict the head loads: ignored keys dropped, derivable buffers filled, shapes checked."""
    shapes = expected_shapes(c)
    state = {k: t for k, t in state.items() if k not in IGNORED_KEYS[c.kind] - shapes.keys()}
    if c.kind == "eagle3" and "d2t" not in state and c.draft_vocab_size == c.vocab_size:
        state["d2t"] = torch.zeros(c.vocab_size, dtype=torch.long)  # full vocabulary: identity map
    derivable = {"t2d"} if c.kind == "eagle3" and "d2t" in state else set()  # t2d is implied by d2t
    missing, unexpected = sorted(shapes.keys() - state.keys() - derivable), sorted(state.keys() - shapes.keys())
    if missing or unexpected:
        found = "; ".join(f"{name} {_names(keys)}" for name, keys in (("missing", missing), ("unexpected", unexpected)) if keys)
        raise ModelLoadError(f"The head in {folder} does not match the {c.kind} layout ({found}); "
                             "check that config.json and the weights belong together.")
    for k, shape in shapes.items():
        if k in state and tuple(state[k].shape) != shape:
            raise ModelLoadError(f"The head tensor {k} has shape {tuple(state[k].shape)} but its config.json implies "
                                 f"{shape}; check that config.json and the weights belong together.")
    if c.kind == "eagle3":
        if state["d2t"].is_floating_point():
            raise ModelLoadError("The head's d2t map holds floats instead of token offsets; re-export the head.")
        state["d2t"] = state["d2t"].long()
    return state


def _check_vocab_map(c: HeadConfig, state: dict) -> None:
    """d2t must land inside the target vocabulary; t2d, if absent, is derived from it."""
    target_ids = torch.arange(c.draft_vocab_size) + state["d2t"]  # draft index i is target id i + d2t[i]
    low, high = int(target_ids.min()), int(target_ids.max())
    if low < 0 or high >= c.vocab_size:
        raise HeadMismatchError(f"The draft head maps its vocabulary onto target ids {low}..{high} but this model "
                                f"has {c.vocab_size} tokens; use a head made for this model.")
    if "t2d" not in state:
        state["t2d"] = torch.zeros(c.vocab_size, dtype=torch.bool).index_fill_(0, target_ids, True)
    state["t2d"] = state["t2d"].bool()


def _check_feature_layers(raw: dict, num_layers: int) -> None:
    """Engines let a config pin the EAGLE-3 feature layers, vLLM by HF index, SGLang one lower (eagle.md 10.1, 10.2).
    Only the default layers are supported; a pinned list must be the default in either convention."""
    eagle = raw.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        raise UnsupportedModelError("The head reads no fused target features (use_aux_hidden_state is false); Aerie needs a standard EAGLE-3 head.")
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    default = (2, num_layers // 2, num_layers - 3)
    if ids is not None and tuple(ids) not in (default, tuple(i - 1 for i in default)):
        raise UnsupportedModelError(f"The head reads target layers {list(ids)} instead of EAGLE-3's default "
                                    f"{list(default)}; Aerie supports only the default layers.")


def _names(keys, limit: int = 8) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more
