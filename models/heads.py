"""EAGLE draft heads: the two published architectures as small modules.

`Eagle1Head` is the EAGLE-1/EAGLE-2 head (SafeAILab `cnets1.py`, research/eagle.md section 2):
fc 2H->H over [embedding, feature], one Llama decoder layer with no input norm, and the target's
own embedding and LM head, shared and never copied. Its output is the predicted next target
feature (the post-final-norm hidden state), so its logits are target_lm_head(output).

`Eagle3Head` is the EAGLE-3 head (`cnets.py`, section 3): fc 3H->H fuses three target layers,
then one "midlayer" whose q/k/v read [input_layernorm(embedding), hidden_norm(feature)] (2H). It
has its own final norm and an LM head over a reduced draft vocabulary; draft index i is target
id i + d2t[i]. Its output is pre-norm, and the caller feeds it back as the next step's feature.

Module attribute names are the published checkpoint keys, so `state_dict()` is the checkpoint.
This module knows nothing about files, trees or the target's forward. The caller captures the
features, pairs them with tokens and owns the KV cache. Files live in head_checkpoint.py and
head_config.py.

Shapes: T tokens in this call, P positions already cached, H head width, F feature width (H or
3H), nh / nkv query / key-value heads, Dh head dim, V target vocab, Vd draft vocab.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache

from models.cpu_quant import quantize_cpu, quantized

KINDS = ("eagle1", "eagle3")


@dataclass(frozen=True)
class RopeScaling:
    """A Llama `rope_scaling` block of one of the two kinds implemented in `rope_inv_freq`."""

    kind: str                                       # "linear" or "llama3"
    factor: float                                   # how far the context is stretched
    low_freq_factor: float = 1.0                    # llama3 only
    high_freq_factor: float = 4.0                   # llama3 only
    original_max_position_embeddings: int = 8192    # llama3 only: the pre-training context


@dataclass(frozen=True)
class HeadConfig:
    """A head's shape, parsed from its config.json (SafeAILab fields, eagle.md 2.2 and 3.3).

    `fc_bias`, `qkv_bias` and `own_embedding` describe the weight layout: the loader reads them
    from the checkpoint's keys, not from config.json.
    """

    kind: str                      # "eagle1" (EAGLE-1/2 heads, cnets1.py) or "eagle3" (cnets.py)
    hidden_size: int               # H: width of the head's decoder layer
    num_attention_heads: int       # nh
    num_key_value_heads: int       # nkv; nkv < nh is grouped-query attention
    head_dim: int                  # Dh: config `head_dim`, else H // nh
    intermediate_size: int         # MLP width
    vocab_size: int                # V: the target's vocabulary
    draft_vocab_size: int          # Vd: rows of the eagle3 lm_head; == V for eagle1
    rope_theta: float              # the head's own RoPE base; 10000 when config.json has none
    rms_norm_eps: float
    max_position_embeddings: int   # recorded for export only: the RoPE here has no length limit
    fc_bias: bool                  # fc has a bias (EAGLE-1 Vicuna / LLaMA2 heads)
    qkv_bias: bool = False         # q/k/v have biases (EAGLE-1 Qwen2 heads)
    target_hidden_size: int | None = None   # eagle3: width of one target feature if it is not H
    own_embedding: bool = False    # eagle3: the head carries `embed_tokens` instead of the target's
    rope_scaling: RopeScaling | None = None  # None = plain RoPE
    fc_norm: bool = False          # eagle1: an RMSNorm on each of fc's inputs (EAGLE-3.1's fc_norm.{i})

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.num_attention_heads} attention heads cannot share {self.num_key_value_heads} key-value heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} is odd, so RoPE cannot rotate it in pairs")
        if self.kind == "eagle1" and (self.draft_vocab_size != self.vocab_size or self.own_embedding
                                      or self.target_width != self.hidden_size):
            raise ValueError("an eagle1 head uses the target's vocabulary, embedding and width")
        if self.fc_norm and self.kind != "eagle1":
            raise ValueError("fc_norm is implemented for eagle1 heads only")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft vocabulary {self.draft_vocab_size} exceeds the target's {self.vocab_size}")
        if self.target_width != self.hidden_size and not self.own_embedding:
            raise ValueError("a head narrower or wider than its target needs its own embedding")

    @property
    def target_width(self) -> int:
        """Width of one target feature: fc reads 3x this (eagle3); eagle1 reads exactly this."""
        return self.target_hidden_size or self.hidden_size


def rope_inv_freq(config: HeadConfig) -> torch.Tensor:
    """(Dh/2,) float32 rotary frequencies theta^(-2i/Dh), with `rope_scaling` applied."""
    dim = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":  # position p is read as p / factor
        return inv_freq / scaling.factor
    # llama3: r = context / wavelength. Frequencies with r < low are divided by factor, those with
    # r > high are kept, and those in between interpolate linearly in r.
    ratio = scaling.original_max_position_embeddings * inv_freq / (2 * math.pi)
    keep = ((ratio - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)).clamp(0, 1)
    return (1 - keep) * inv_freq / scaling.factor + keep * inv_freq


class Rotary(nn.Module):
    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)  # (Dh/2,) fp32

    def _apply(self, fn, recurse=True):
        # .half() or .to(dtype) would round inv_freq to 16 bits, an angle error of about
        # position * 5e-4 rad. Let fn move it, then put the fp32 values back on the new device.
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        return self

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = position_ids[..., None].float() * self.inv_freq   # (1, T, Dh/2)
        angles = torch.cat([angles, angles], dim=-1)[:, None]      # (1, 1, T, Dh)
        return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Rotate each pair (x_i, x_{i+Dh/2}) by angle position * inv_freq_i.
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], dim=-1) * sin.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # weight * x / sqrt(mean(x^2) + eps), normalised in fp32 as HF Llama does.
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: HeadConfig, in_features: int):
        super().__init__()
        self.head_dim = config.head_dim
        q_out, kv_out = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        self.q_proj = nn.Linear(in_features, q_out, bias=config.qkv_bias)
        self.k_proj = nn.Linear(in_features, kv_out, bias=config.qkv_bias)
        self.v_proj = nn.Linear(in_features, kv_out, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_out, config.hidden_size, bias=False)

    def keys_values(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, in) -> rotated keys and values (B, nkv, T, Dh), each row's from that row alone."""
        B, T, _ = x.shape
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, Dh)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, Dh)
        return apply_rope(k, cos, sin), v

    def remember(self, x, cos, sin, cache: Cache) -> None:
        """Write x's rows' keys and values into the cache at its length, attending to nothing."""
        cache.update(*self.keys_values(x, cos, sin), 0)

    def forward(self, x, cos, sin, mask: torch.Tensor, cache: Cache | None) -> torch.Tensor:
        B, T, _ = x.shape
        q = apply_rope(self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2), cos, sin)  # (B, nh, T, Dh)
        k, v = self.keys_values(x, cos, sin)                                                    # (B, nkv, T, Dh)
        if cache is not None:
            k, v = cache.update(k, v, 0)  # (B, nkv, C, Dh): the head's one layer is layer 0
        assert mask.is_floating_point() and mask.shape[-2] == T and mask.shape[-1] <= k.shape[2], \
            f"need an additive float mask (.., {T}, <= {k.shape[2]}), got {mask.dtype} {tuple(mask.shape)}"
        lk = mask.shape[-1]  # a preallocated cache returns all C rows; attention reads the first Lk
        k, v = k[:, :, :lk], v[:, :, :lk]
        repeat = q.shape[1] // k.shape[1]
        y = grouped_attention(q, k, v, mask.to(q.dtype), repeat, fold=cache is not None)   # (B, nh, T, Dh)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, repeat: int,
                      fold: bool) -> torch.Tensor:
    """Grouped-query attention: q (B, nh, T, Dh), k, v (B, nkv, L, Dh), each key-value head serving
    `repeat` query heads; mask (.., T, L) additive -> (B, nh, T, Dh). With `fold` (a draft's few
    rows over a long cache) the query heads of a key-value head become rows of one query, the mask
    repeated for them, so K and V are not copied: a head step at a 2,700-token context, 2-core Zen 4,
    0.8-1.8 ms with the copies, 0.3-0.5 without. Unfolded (training's long rows, where a repeated
    T x L mask would cost more than the copies) K and V are repeated per query head."""
    if repeat == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if not fold:
        return F.scaled_dot_product_attention(q, k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1),
                                              attn_mask=mask)
    B, nh, T, Dh = q.shape
    folded = q.reshape(B, nh // repeat, repeat * T, Dh)                       # query head h -> kv head h // repeat
    rows = mask.repeat(*([1] * (mask.dim() - 2)), repeat, 1)                    # (.., repeat * T, L)
    return F.scaled_dot_product_attention(folded, k, v, attn_mask=rows).view(B, nh, T, Dh)


class MLP(nn.Module):
    def __init__(self, config: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class Eagle1Layer(nn.Module):
    """A Llama decoder layer without `input_layernorm` (cnets1.py skips it for layer 0)."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.self_attn = Attention(config, config.hidden_size)
        self.mlp = MLP(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, cos, sin, mask, cache) -> torch.Tensor:
        h = h + self.self_attn(h, cos, sin, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Layer(nn.Module):
    """The EAGLE-3 midlayer: attention over [norm(embedding), norm(feature)], residual = feature."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.self_attn = Attention(config, 2 * config.hidden_size)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def attention_input(self, emb, h) -> torch.Tensor:
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], dim=-1)  # (1, T, 2H)

    def forward(self, emb, h, cos, sin, mask, cache) -> torch.Tensor:
        h = h + self.self_attn(self.attention_input(emb, h), cos, sin, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass(frozen=True)
class TargetParts:
    """The target's modules a head uses by reference. A plain attribute, so they stay out of the
    head's state_dict(), parameters() and .to(): the head does not own them."""

    embed: nn.Module
    lm_head: nn.Module | None


class EagleHead(nn.Module):
    """What the engine sees of a head, whichever kind."""

    config: HeadConfig

    def feature_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """Indices into the target's HF `output_hidden_states` tuple that form the head's input feature
        (concatenated in this order). hidden_states[i] is the input of decoder layer i; 0 is the embedding."""
        raise NotImplementedError

    def forward(self, features: torch.Tensor, token_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor, cache: Cache | None) -> torch.Tensor:
        """features (1, T, F) at positions t; token_ids (1, T): the token at t+1 for each feature t
        (the shift by one is the caller's job); position_ids (1, T); attention_mask (1, 1, T, P+T)
        additive (0 attends, finfo.min blocks), or (1, 1, T, Lk) with Lk <= C over a preallocated cache of C
        rows, of which attention reads the first Lk; cache: any transformers Cache (layer 0), or None.
        Returns the head's hidden state (1, T, H) for the token after token_ids."""
        raise NotImplementedError

    def remember(self, features: torch.Tensor, token_ids: torch.Tensor, position_ids: torch.Tensor,
                 cache: Cache) -> None:
        """Write these pairs' keys and values into `cache` (layer 0, at its length) as forward would,
        without their outputs. The head is one decoder layer, so a pair's key and value are a
        function of that pair alone; only attention mixes rows. A prompt's pairs, whose outputs
        no draft reads, need nothing else: their attention, queries and MLP are skipped."""
        raise NotImplementedError

    def shrink(self, quant: str) -> None:
        """Small weights for drafting on a CPU (models/cpu_quant.py `quantized`): fc and the decoder
        layer, read once per head step, and a head's own LM head where it has one. fc keeps
        `.weight` (fp32): the head reads its activations' dtype from it."""
        quantize_cpu(self.decoder, quant, join=False)   # `remember` reads k and v without q (models/fused.py)
        self.fc = quantized(self.fc, quant, keep_weight=True)

    @property
    def decoder(self) -> nn.Module:
        """The head's decoder layer(s)."""
        raise NotImplementedError

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (..., Vd) logits over the draft vocabulary."""
        raise NotImplementedError

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices -> target token ids."""
        return draft_ids


class Eagle1Head(EagleHead):
    def __init__(self, config: HeadConfig, target_embed: nn.Module, target_lm_head: nn.Module):
        super().__init__()
        assert config.kind == "eagle1", config.kind
        self.config = config
        self.target = TargetParts(target_embed, target_lm_head)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.fc_bias)
        if config.fc_norm:  # [norm(embedding), norm(feature)]: fc sees both at one scale, whatever each row's
            self.fc_norm = nn.ModuleList([RMSNorm(config.hidden_size, config.rms_norm_eps) for _ in range(2)])
        self.layers = nn.ModuleList([Eagle1Layer(config)])
        self.rotary = Rotary(config)

    def feature_layers(self, num_target_layers: int) -> tuple[int, ...]:
        return feature_layers("eagle1", num_target_layers)

    @property
    def decoder(self) -> nn.Module:
        return self.layers

    def forward(self, features, token_ids, position_ids, attention_mask, cache) -> torch.Tensor:
        cos, sin = self.rotary(position_ids)
        return self.layers[0](self.layer_input(features, token_ids), cos, sin, attention_mask, cache)  # (1, T, H)

    def remember(self, features, token_ids, position_ids, cache) -> None:
        self.layers[0].self_attn.remember(self.layer_input(features, token_ids), *self.rotary(position_ids), cache)

    def layer_input(self, features, token_ids) -> torch.Tensor:
        """fc over [embedding of the token at t+1, feature at t]: (1, T, F), (1, T) -> (1, T, H)."""
        emb, features = self.target.embed(token_ids).to(self.fc.weight.dtype), features.to(self.fc.weight.dtype)  # (1, T, H)
        if self.config.fc_norm:
            emb, features = self.fc_norm[0](emb), self.fc_norm[1](features)
        return self.fc(torch.cat([emb, features], dim=-1))              # (1, T, 2H) -> (1, T, H)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # No norm: the head was trained to predict the target's post-norm feature. `hidden` must be
        # in the lm_head's dtype, i.e. run the head in the target's compute dtype.
        return self.target.lm_head(hidden)  # (..., V)


class Eagle3Head(EagleHead):
    def __init__(self, config: HeadConfig, target_embed: nn.Module):
        super().__init__()
        assert config.kind == "eagle3", config.kind
        H, V, Vd = config.hidden_size, config.vocab_size, config.draft_vocab_size
        self.config = config
        self.target = TargetParts(target_embed, None)
        if config.own_embedding:
            self.embed_tokens = nn.Embedding(V, H)
        self.fc = nn.Linear(3 * config.target_width, H, bias=config.fc_bias)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))  # draft i -> target i + d2t[i]
        self.register_buffer("t2d", torch.arange(V) < Vd)              # target id is in the draft vocab
        self.rotary = Rotary(config)

    def feature_layers(self, num_target_layers: int) -> tuple[int, ...]:
        return feature_layers("eagle3", num_target_layers)

    @property
    def decoder(self) -> nn.Module:
        return self.midlayer

    def shrink(self, quant: str) -> None:
        super().shrink(quant)
        self.lm_head = quantized(self.lm_head, quant)   # its own draft vocabulary's rows, read every head step

    def forward(self, features, token_ids, position_ids, attention_mask, cache) -> torch.Tensor:
        cos, sin = self.rotary(position_ids)
        return self.midlayer(*self.inputs(features, token_ids), cos, sin, attention_mask, cache)  # (1, T, H), pre-norm

    def remember(self, features, token_ids, position_ids, cache) -> None:
        x = self.midlayer.attention_input(*self.inputs(features, token_ids))
        self.midlayer.self_attn.remember(x, *self.rotary(position_ids), cache)

    def inputs(self, features, token_ids) -> tuple[torch.Tensor, torch.Tensor]:
        """(1, T, F), (1, T) -> the embedding of the token at t+1 and the fused feature at t, (1, T, H) each."""
        embed = self.embed_tokens if self.config.own_embedding else self.target.embed
        emb = embed(token_ids).to(self.fc.weight.dtype)  # (1, T, H)
        h = features.to(emb.dtype)                       # (1, T, F)
        if h.shape[-1] != self.config.hidden_size:       # fuse target features; own outputs go in as is
            assert h.shape[-1] == self.fc.in_features, f"feature width {h.shape[-1]}"
            h = self.fc(h)                               # (1, T, 3H) -> (1, T, H)
        return emb, h

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))  # (..., Vd)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def feature_layers(kind: str, num_target_layers: int) -> tuple[int, ...]:
    """Indices into the target's `output_hidden_states` that a head of `kind` reads, concatenated."""
    L = num_target_layers
    if kind == "eagle1":
        return (L,)  # hidden_states[-1]: last layer's output after the final norm
    return (2, L // 2, L - 3)  # inputs of decoder layers 2, L//2, L-3 (eagle.md 0.1)


def build_head(config: HeadConfig, target_embed: nn.Module, target_lm_head: nn.Module) -> EagleHead:
    """A randomly initialised head of `config.kind` (the loader then assigns the weights)."""
    if config.kind == "eagle1":
        return Eagle1Head(config, target_embed, target_lm_head)
    return Eagle3Head(config, target_embed)


def vocab_rows(lm_head: nn.Module, ids: torch.Tensor | None) -> nn.Linear:
    """A Linear over the rows of the target's LM head for the token ids (Vd,) (all of them for None):
    a draft vocabulary's logits, reading Vd rows instead of the whole vocabulary's."""
    weight = lm_head.weight if ids is None else lm_head.weight[ids.to(lm_head.weight.device)]    # (Vd, H)
    rows = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    rows.weight.data = weight.detach().contiguous()
    return rows
