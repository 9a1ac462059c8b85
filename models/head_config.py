"""An EAGLE head's config.json, both ways: the SafeAILab fields (research/eagle.md 2.2, 3.3) as
read from any published head, and as written for Aerie's heads so that SafeAILab EAGLE, vLLM and
SGLang load them (eagle.md 10.3). The weights' layout (biases, own embedding) comes from the
checkpoint's keys, which the caller reads (models/head_checkpoint.py)."""

import torch

from models.errors import ModelLoadError, UnsupportedModelError
from models.heads import HeadConfig, RopeScaling

DEFAULT_ROPE_THETA = 10000.0  # EAGLE's head RoPE base when config.json has no rope_theta (eagle.md 2.1, 3.3)
ARCHITECTURES = {"eagle1": "LlamaForCausalLM", "eagle3": "LlamaForCausalLMEagle3"}
DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def head_config_for_target(target_config, kind: str, *, draft_vocab_size: int | None = None,
                           fc_norm: bool = False) -> HeadConfig:
    """The config of a new head for this target: its shapes and RoPE, no biases (eagle.md 10.3)."""
    raw = target_config.get_text_config().to_dict()
    raw["draft_vocab_size"] = draft_vocab_size
    return config_from_json(raw, kind=kind, fc_bias=False, qkv_bias=False, own_embedding=False, fc_norm=fc_norm)


def config_to_json(c: HeadConfig, dtype: torch.dtype = torch.float16) -> dict:
    raw = {
        "architectures": [ARCHITECTURES[c.kind]], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings, "hidden_act": "silu",
        "bias": c.fc_bias, "tie_word_embeddings": False, "torch_dtype": DTYPE_NAMES[dtype],
    }
    if c.head_dim != c.hidden_size // c.num_attention_heads:
        raw["head_dim"] = c.head_dim
    if c.qkv_bias:
        raw["qkv_bias"] = True
    if c.rope_scaling is not None:
        s = c.rope_scaling
        raw["rope_scaling"] = {"rope_type": s.kind, "factor": s.factor} if s.kind == "linear" else {
            "rope_type": s.kind, "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_position_embeddings}
    if c.kind == "eagle3":
        raw["draft_vocab_size"] = c.draft_vocab_size
        if c.target_hidden_size is not None:
            raw["target_hidden_size"] = c.target_hidden_size
    return raw


def config_from_json(raw: dict, *, kind: str, fc_bias: bool, qkv_bias: bool, own_embedding: bool,
                     fc_norm: bool = False) -> HeadConfig:
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"The head uses the {raw['hidden_act']} activation; Aerie's heads are SiLU (Llama) only.")
    try:
        H, heads, vocab = int(raw["hidden_size"]), int(raw["num_attention_heads"]), int(raw["vocab_size"])
        intermediate = int(raw["intermediate_size"])
    except (KeyError, TypeError, ValueError) as err:
        raise ModelLoadError(f"The head's config.json lacks a valid {err}; it is not an EAGLE head config.") from err
    target_hidden = raw.get("target_hidden_size") if kind == "eagle3" else None
    rope_theta, rope_scaling = rope(raw)
    try:
        return HeadConfig(
            kind=kind, hidden_size=H, num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),  # LlamaConfig default: no GQA
            head_dim=int(raw.get("head_dim") or H // heads), intermediate_size=intermediate,
            vocab_size=vocab, draft_vocab_size=int(raw.get("draft_vocab_size") or vocab) if kind == "eagle3" else vocab,
            rope_theta=rope_theta, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),  # LlamaConfig defaults
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            fc_bias=fc_bias, qkv_bias=qkv_bias, rope_scaling=rope_scaling,
            target_hidden_size=int(target_hidden) if target_hidden and target_hidden != H else None,
            own_embedding=own_embedding or bool(target_hidden and target_hidden != H), fc_norm=fc_norm,
        )
    except ValueError as err:
        raise ModelLoadError(f"The head's config.json is inconsistent: {err}.") from err


def rope(raw: dict) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes `rope_parameters` (theta inside); older configs `rope_theta` + `rope_scaling`.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta") or raw.get("rope_theta") or DEFAULT_ROPE_THETA)
    kind = params.get("rope_type", params.get("type", "default"))
    try:
        if kind == "default":
            return theta, None
        if kind == "linear":
            return theta, RopeScaling("linear", float(params["factor"]))
        if kind == "llama3":
            return theta, RopeScaling("llama3", float(params["factor"]), float(params["low_freq_factor"]),
                                      float(params["high_freq_factor"]), int(params["original_max_position_embeddings"]))
    except KeyError as err:
        raise ModelLoadError(f"The head's {kind} rope scaling lacks {err}; fix its config.json.") from err
    raise UnsupportedModelError(f"The head uses {kind} RoPE scaling, which Aerie does not implement; "
                                "use a head with default, linear or llama3 RoPE.")
