"""Draft heads: the published SafeAILab layouts load exactly, outputs are self-consistent, and every
mismatch fails with a message that names what is wrong. Tiny sizes, CPU, no downloads."""

import json
from dataclasses import replace

import huggingface_hub.constants
import pytest
import torch
from safetensors.torch import save_file
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import Cache
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import (LlamaAttention, LlamaMLP, LlamaRMSNorm,
                                                      LlamaRotaryEmbedding)

from core.runtime.kv import static_cache
from models.errors import HeadMismatchError, ModelLoadError, UnsupportedModelError
from models.head_checkpoint import expected_shapes, load_head, save_head
from models.head_config import head_config_for_target
from models.heads import RopeScaling, build_head, rope_inv_freq

H, V, NH, NKV, I, VD = 64, 256, 4, 2, 96, 48   # hidden, vocab, heads, kv heads, MLP, draft vocab


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=H, num_attention_heads=NH, num_key_value_heads=NKV, intermediate_size=128,
                         vocab_size=V, num_hidden_layers=6, rope_theta=500000.0)
    return LlamaForCausalLM(config).eval()


def load(folder, target, **kw):
    return load_head(str(folder), target.config, target.model.embed_tokens, target.lm_head, **kw)


def head_json(kind: str, **extra) -> dict:
    """A config.json as SafeAILab ships it (eagle.md 2.2, 3.3)."""
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1, "hidden_size": H,
           "intermediate_size": I, "num_attention_heads": NH, "num_key_value_heads": NKV, "vocab_size": V,
           "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "hidden_act": "silu", "torch_dtype": "float16"}
    if kind == "eagle1":
        raw |= {"rope_theta": 500000.0}
    else:
        raw |= {"draft_vocab_size": VD}  # no rope_theta: the head's RoPE base is 10000
    return raw | extra


def eagle1_state(fc_bias: bool) -> dict:
    g = torch.Generator().manual_seed(1)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.05  # noqa: E731
    p, kv = "layers.0.", NKV * H // NH
    state = {"fc.weight": r(H, 2 * H), f"{p}self_attn.q_proj.weight": r(H, H), f"{p}self_attn.k_proj.weight": r(kv, H),
             f"{p}self_attn.v_proj.weight": r(kv, H), f"{p}self_attn.o_proj.weight": r(H, H),
             f"{p}mlp.gate_proj.weight": r(I, H), f"{p}mlp.up_proj.weight": r(I, H), f"{p}mlp.down_proj.weight": r(H, I),
             f"{p}post_attention_layernorm.weight": 1 + r(H)}
    return state | ({"fc.bias": r(H)} if fc_bias else {})


def eagle3_state() -> dict:
    g = torch.Generator().manual_seed(2)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.05  # noqa: E731
    p, kv = "midlayer.", NKV * H // NH
    used = torch.randperm(V, generator=g)[:VD].sort().values  # the draft vocabulary, ascending (eagle.md 3.2)
    return {"fc.weight": r(H, 3 * H), f"{p}self_attn.q_proj.weight": r(H, 2 * H),
            f"{p}self_attn.k_proj.weight": r(kv, 2 * H), f"{p}self_attn.v_proj.weight": r(kv, 2 * H),
            f"{p}self_attn.o_proj.weight": r(H, H), f"{p}mlp.gate_proj.weight": r(I, H), f"{p}mlp.up_proj.weight": r(I, H),
            f"{p}mlp.down_proj.weight": r(H, I), f"{p}hidden_norm.weight": 1 + r(H), f"{p}input_layernorm.weight": 1 + r(H),
            f"{p}post_attention_layernorm.weight": 1 + r(H), "norm.weight": 1 + r(H), "lm_head.weight": r(VD, H),
            "d2t": used - torch.arange(VD), "t2d": torch.isin(torch.arange(V), used)}


def write(folder, raw: dict, state: dict, fmt: str = "safetensors"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    if fmt == "safetensors":
        save_file(state, str(folder / "model.safetensors"))
    else:
        torch.save(state, folder / "pytorch_model.bin")
    return folder


def assert_state_equal(head, state: dict):
    loaded = head.state_dict()
    assert set(loaded) == set(state)
    for k, t in state.items():
        assert torch.equal(loaded[k], t), k


def causal_mask(T: int, past: int) -> torch.Tensor:
    """(1, 1, T, past+T) additive: row i sees columns <= past + i."""
    allowed = torch.ones(T, past + T, dtype=torch.bool).tril(past)
    return torch.zeros(1, 1, T, past + T).masked_fill(~allowed, torch.finfo(torch.float32).min)


def run(head, features, tokens, chunks, cache):
    """Feed (features, tokens) through the head in chunks of the given sizes, one cache throughout."""
    outs, start = [], 0
    for n in chunks:
        pos = torch.arange(start, start + n)[None]
        outs.append(head(features[:, start:start + n], tokens[:, start:start + n], pos, causal_mask(n, start), cache))
        start += n
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("fc_bias", [False, True])
def test_eagle1_safetensors_loads_exactly(tmp_path, target, fc_bias):
    state = eagle1_state(fc_bias)
    ignored = {"embed_tokens.weight": target.model.embed_tokens.weight.detach().clone(),  # published extras
               "layers.0.self_attn.rotary_emb.inv_freq": torch.ones(H // NH // 2)}
    head = load(write(tmp_path, head_json("eagle1", bias=fc_bias), state | ignored), target)
    assert head.config.kind == "eagle1" and head.config.fc_bias == fc_bias and head.config.rope_theta == 500000.0
    assert_state_equal(head, state)
    assert head.feature_layers(6) == (6,)
    assert head.target.embed is target.model.embed_tokens  # shared, not copied


def test_eagle1_pickle_only_with_allow_pickle(tmp_path, target):
    state = eagle1_state(fc_bias=True)
    folder = write(tmp_path, head_json("eagle1"), state, fmt="bin")  # no "bias" key: the Vicuna configs
    with pytest.raises(ModelLoadError, match="--allow-pickle"):
        load(folder, target)
    assert_state_equal(load(folder, target, allow_pickle=True), state)


def test_eagle3_safetensors_loads_exactly(tmp_path, target):
    state = eagle3_state()
    head = load(write(tmp_path, head_json("eagle3", rope_theta=20000.0), state), target)
    c = head.config
    assert (c.kind, c.draft_vocab_size, c.rope_theta, c.rope_scaling) == ("eagle3", VD, 20000.0, None)
    assert_state_equal(head, state)
    base = 1.0 / 20000.0 ** (torch.arange(0, H // NH, 2).float() / (H // NH))
    assert torch.equal(head.rotary.inv_freq, base)  # the head's own base, not the target's 500000
    assert torch.equal(head.to_target_ids(torch.arange(VD)), torch.nonzero(state["t2d"]).squeeze(1))
    assert head.feature_layers(6) == (2, 3, 3)


def test_eagle3_defaults_rope_base_and_derives_t2d(tmp_path, target):
    state = eagle3_state()
    t2d = state.pop("t2d")
    head = load(write(tmp_path, head_json("eagle3"), state), target)
    assert head.config.rope_theta == 10000.0
    assert torch.equal(head.t2d, t2d)


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_save_then_load_round_trips_in_fp16(tmp_path, target, kind):
    torch.manual_seed(3)
    head = build_head(head_config_for_target(target.config, kind, draft_vocab_size=VD),
                      target.model.embed_tokens, target.lm_head).eval()
    save_head(head, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == [{"eagle1": "LlamaForCausalLM", "eagle3": "LlamaForCausalLMEagle3"}[kind]]
    loaded = load(tmp_path, target)
    assert loaded.config == head.config
    assert_state_equal(loaded, {k: t.half().float() if t.is_floating_point() else t for k, t in head.state_dict().items()})
    width = H if kind == "eagle1" else 3 * H
    features, tokens = torch.randn(1, 5, width), torch.randint(0, V, (1, 5))
    with torch.no_grad():
        want, got = (run(h, features, tokens, [5], DynamicCache()) for h in (head, loaded))
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(loaded.draft_logits(got), head.draft_logits(want), atol=2e-2, rtol=1e-2)


def preallocated() -> Cache:
    """The drafter's cache (core/runtime/head_step.py): 16 rows allocated up front, of which a mask of
    width P+T makes attention read the first P+T."""
    return static_cache(1, 16, NKV, H // NH, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("cache_type", [DynamicCache, preallocated])
@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_incremental_equals_batched(target, kind, cache_type):
    torch.manual_seed(4)
    head = build_head(head_config_for_target(target.config, kind, draft_vocab_size=VD),
                      target.model.embed_tokens, target.lm_head).eval()
    width = H if kind == "eagle1" else 3 * H
    features, tokens = torch.randn(1, 7, width), torch.randint(0, V, (1, 7))
    with torch.no_grad():
        batched = run(head, features, tokens, [7], cache_type())
        one_by_one = run(head, features, tokens, [1] * 7, cache_type())
        chunked = run(head, features, tokens, [3, 1, 3], cache_type())
    torch.testing.assert_close(one_by_one, batched, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked, batched, atol=1e-5, rtol=1e-5)


def reference_layer(head, prefix: str, attn_width: int):
    """transformers' own Llama attention / MLP / RMSNorm holding the head's weights."""
    c = head.config
    llama = LlamaConfig(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads, head_dim=c.head_dim,
                        num_key_value_heads=c.num_key_value_heads, intermediate_size=c.intermediate_size,
                        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta)
    llama._attn_implementation = "eager"
    wide = LlamaConfig(**{**llama.to_dict(), "hidden_size": attn_width})
    wide._attn_implementation = "eager"
    parts = torch.nn.ModuleDict({"self_attn": LlamaAttention(wide, 0), "mlp": LlamaMLP(llama)})
    parts["self_attn"].o_proj = torch.nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        parts[name] = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
    own = {k.removeprefix(prefix): t for k, t in head.state_dict().items() if k.startswith(prefix)}
    parts.load_state_dict(own, strict=False)  # eagle1 has no input_layernorm / hidden_norm
    return parts, LlamaRotaryEmbedding(llama)


def test_matches_transformers_llama_modules(tmp_path, target):
    """Independent maths for RMSNorm, RoPE, GQA attention and SwiGLU, composed as eagle.md 2.1 / 3.1 say."""
    T, pos, mask = 5, torch.arange(3, 8)[None], causal_mask(5, 0)
    tokens = torch.randint(0, V, (1, T))
    emb = target.model.embed_tokens(tokens)
    with torch.no_grad():
        head = load(write(tmp_path / "e1", head_json("eagle1"), eagle1_state(True)), target)
        ref, rotary = reference_layer(head, "layers.0.", H)
        features = torch.randn(1, T, H)
        h = head.fc(torch.cat([emb, features], -1))
        h = h + ref["self_attn"](h, rotary(h, pos), mask)[0]   # no input norm
        want = h + ref["mlp"](ref["post_attention_layernorm"](h))
        torch.testing.assert_close(head(features, tokens, pos, mask, None), want)

        head = load(write(tmp_path / "e3", head_json("eagle3", rope_theta=20000.0), eagle3_state()), target)
        ref, rotary = reference_layer(head, "midlayer.", 2 * H)
        features = torch.randn(1, T, 3 * H)
        h = head.fc(features)
        x = torch.cat([ref["input_layernorm"](emb), ref["hidden_norm"](h)], -1)
        h = h + ref["self_attn"](x, rotary(h, pos), mask)[0]
        want = h + ref["mlp"](ref["post_attention_layernorm"](h))
        torch.testing.assert_close(head(features, tokens, pos, mask, None), want)


def test_eagle3_skips_fc_for_its_own_outputs(target):
    torch.manual_seed(5)
    head = build_head(head_config_for_target(target.config, "eagle3", draft_vocab_size=VD),
                      target.model.embed_tokens, target.lm_head).eval()
    features, tokens = torch.randn(1, 4, 3 * H), torch.randint(0, V, (1, 4))
    with torch.no_grad():
        fused = run(head, features, tokens, [4], DynamicCache())
        fed_back = run(head, head.fc(features), tokens, [4], DynamicCache())  # width H: fc not applied again
    torch.testing.assert_close(fed_back, fused)


def test_layout_table_matches_modules(target):
    for kind in ("eagle1", "eagle3"):
        base = head_config_for_target(target.config, kind, draft_vocab_size=VD)
        variants = [base, replace(base, fc_bias=True, qkv_bias=True)]
        if kind == "eagle3":
            variants.append(replace(base, own_embedding=True, target_hidden_size=2 * H))
        for c in variants:
            state = build_head(c, target.model.embed_tokens, target.lm_head).state_dict()
            assert {k: tuple(t.shape) for k, t in state.items()} == expected_shapes(c)


def test_head_dtype_cast_keeps_rope_fp32_and_target_untouched(target):
    head = build_head(head_config_for_target(target.config, "eagle1"), target.model.embed_tokens, target.lm_head)
    head.half()
    assert head.fc.weight.dtype == torch.float16 and head.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(head.rotary.inv_freq, rope_inv_freq(head.config))
    assert target.model.embed_tokens.weight.dtype == torch.float32


def test_llama3_rope_matches_transformers(tmp_path, target):
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    config = LlamaConfig(hidden_size=H, num_attention_heads=NH, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", **scaling})
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = head_config_for_target(config, "eagle1")
    assert ours.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    torch.testing.assert_close(rope_inv_freq(ours), theirs)
    old_style = head_json("eagle1", rope_scaling={"type": "llama3", **scaling})  # transformers 4 spelling
    head = load(write(tmp_path, old_style, eagle1_state(False)), target)
    torch.testing.assert_close(head.rotary.inv_freq, theirs)


@pytest.mark.parametrize("kind, change, numbers", [
    ("eagle1", {"hidden_size": 32}, ["32", "64"]),
    ("eagle1", {"vocab_size": 300}, ["300", "256"]),
    ("eagle3", {"vocab_size": 300}, ["300", "256"]),
])
def test_config_mismatch_names_both_numbers(tmp_path, target, kind, change, numbers):
    state = eagle1_state(False) if kind == "eagle1" else eagle3_state()
    with pytest.raises(HeadMismatchError) as err:
        load(write(tmp_path, head_json(kind, **change), state), target)
    assert all(n in str(err.value) for n in numbers)


def test_d2t_out_of_range_is_a_mismatch(tmp_path, target):
    state = eagle3_state()
    state["d2t"][-1] += 1000
    with pytest.raises(HeadMismatchError) as err:
        load(write(tmp_path, head_json("eagle3"), state), target)
    assert str(VD - 1 + int(state["d2t"][-1])) in str(err.value) and str(V) in str(err.value)


def test_folder_without_weights(tmp_path, target):
    (tmp_path / "config.json").write_text(json.dumps(head_json("eagle1")))
    with pytest.raises(ModelLoadError, match="No head weights"):
        load(tmp_path, target)


def test_unknown_or_broken_layouts_name_the_keys(tmp_path, target):
    with pytest.raises(ModelLoadError, match=r"unexpected layers\.0\.extra\.weight"):
        load(write(tmp_path / "a", head_json("eagle1"), eagle1_state(False) | {"layers.0.extra.weight": torch.ones(2)}), target)
    renamed = {"model." + k: t for k, t in eagle1_state(False).items()}
    with pytest.raises(UnsupportedModelError, match=r"model\.fc\.weight"):
        load(write(tmp_path / "b", head_json("eagle1"), renamed), target)
    state = eagle3_state()
    del state["norm.weight"]
    with pytest.raises(ModelLoadError, match=r"missing norm\.weight"):
        load(write(tmp_path / "c", head_json("eagle3"), state), target)


def test_config_bias_must_agree_with_weights(tmp_path, target):
    with pytest.raises(ModelLoadError, match="fc.bias"):
        load(write(tmp_path, head_json("eagle1", bias=True), eagle1_state(fc_bias=False)), target)


def test_unsupported_feature_layers_and_rope(tmp_path, target):
    with pytest.raises(UnsupportedModelError, match=r"\[1, 2, 3\]"):
        load(write(tmp_path / "a", head_json("eagle3", eagle_aux_hidden_state_layer_ids=[1, 2, 3]), eagle3_state()), target)
    assert load(write(tmp_path / "b", head_json("eagle3", eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 2]}),
                      eagle3_state()), target).config.kind == "eagle3"  # SGLang's convention for the default
    with pytest.raises(UnsupportedModelError, match="yarn"):
        load(write(tmp_path / "c", head_json("eagle1", rope_scaling={"rope_type": "yarn", "factor": 2.0}),
                   eagle1_state(False)), target)


def test_hub_id_that_cannot_download(tmp_path, target, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import time
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError, match="could not be downloaded"):
        load("nobody/no-such-head", target)
