"""Small CPU weights (models/cpu_quant.py): int4 / int8 linears match the matrices they encode,
the embedded model's Q4_1 grid is recovered exactly, and the embedded model in int4 with the
shipped head, compiled, gives plain's greedy text except at logged near-ties."""

import copy
import re
from pathlib import Path

import httpx
import pytest
import torch

from core.bench import load_prompts
from core.text import render_prompt
from core.config import SamplingConfig
from core.service.factory import load_tuned
from core.service.spec import EngineSpec
from core.tune.kernels import rows_alone
from core.tune.kernels import load_kernel
from models.cpu_quant import GROUP, TWINS, Int4Linear, Int8Linear, bf16_outputs, bf16_terms, quantize_cpu, quantized
from models.fused import Part
from models.native import NativeUnavailable
from tests.conftest import ROOT_ASSETS, needs_onednn_bf16, tiny_llama

HEAD = Path(__file__).resolve().parents[1] / "assets" / "heads" / "smollm2-135m-instruct"


def dequantized_int4(layer: Int4Linear, n: int, k: int) -> torch.Tensor:
    """The (n, k) matrix the kernel multiplies by, read through the kernel itself (x = identity;
    exact in bf16, the output rounded to bf16)."""
    w = layer(torch.eye(k)).T
    return w if layer.bias is None else w - layer.bias[:, None]


def test_int4_linear_is_the_matrix_it_encodes():
    dense = torch.nn.Linear(128, 96, bias=True)
    q = Int4Linear(dense)
    x = torch.randn(5, 128)
    w = dequantized_int4(q, 96, 128)
    # Every group of 32 holds at most 16 levels, spaced d = (max - min) / 15 apart (bf16-rounded).
    levels = torch.tensor([len(torch.unique(g.round(decimals=4))) for g in w.reshape(-1, GROUP)])
    assert levels.max() <= 16
    step = (dense.weight.reshape(-1, GROUP).amax(-1) - dense.weight.reshape(-1, GROUP).amin(-1)) / 15
    assert ((w - dense.weight).reshape(-1, GROUP).abs().amax(-1) <= step / 2 * 1.02 + 1e-3).all()
    # bf16 activations: the product agrees with the encoded matrix to bf16 precision.
    torch.testing.assert_close(q(x), x @ w.T + dense.bias, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("kind", [pytest.param(k, marks=needs_onednn_bf16 if "bf16" in k else ()) for k in TWINS])
def test_int4_twin_holds_the_kernels_own_weight_values(kind):
    """The fp32 twin of an int4 layer is the matrix the kernel computes with, exactly (read through
    the kernel, bf16-rounded, they agree bit for bit), and the bf16x3 twin splits it exactly, so a
    wide call differs from the kernel's only by the order of its fp32 sums: at most one bf16 step,
    on a sliver of the outputs."""
    dense = torch.nn.Linear(192, 96, bias=False)
    q = Int4Linear(dense)
    assert torch.equal(q.dequantized().bfloat16().float(), dequantized_int4(q, 96, 192))
    x = torch.randn(64, 192)
    narrow = q(x)
    q.widen(from_rows=16, kind=kind)
    assert torch.equal(q(x[:8]), narrow[:8])          # below from_rows: still the int4 kernel
    wide = q(x)
    ulp = narrow.abs().clamp(min=1e-3) * 2 ** -7
    assert ((wide - narrow).abs() <= ulp).all()
    assert (wide != narrow).float().mean() < 0.01
    q.narrow()
    assert q.wide is None and torch.equal(q(x), narrow)


def test_bf16_terms_split_fp32_exactly_or_refuse():
    weight = torch.randn(64, 96) * torch.logspace(-6, 2, 96)
    terms = bf16_terms(weight)                                        # (64, 3 * 96)
    assert terms.dtype == torch.bfloat16 and terms.shape == (64, 288)
    assert torch.equal(sum(t.float() for t in terms.split(96, 1)), weight)
    with pytest.raises(ValueError, match="do not split exactly"):
        bf16_terms(torch.tensor([[2.0 ** -120 * (1 + 2.0 ** -23)]]))  # its last bits underflow bf16


@needs_onednn_bf16
def test_onednn_bf16_linear_rounds_only_the_weights():
    dense = torch.nn.Linear(64, 96, bias=False)
    q = quantized(dense, "bf16", keep_weight=True)
    x = torch.randn(4, 64)
    expected = x.bfloat16().float() @ dense.weight.bfloat16().float().T
    torch.testing.assert_close(q(x), expected, atol=0.03, rtol=0.01)  # fp32 sums, one bf16 output rounding
    assert q.weight is dense.weight and q.packed.dtype == torch.bfloat16


def test_int8_linear_is_the_matrix_it_encodes():
    dense = torch.nn.Linear(64, 48, bias=False)
    q = Int8Linear(dense)
    w = q.codes.float() * q.scale.float()[:, None]
    # Half a step of rounding, plus 127 codes times bf16's rounding of the scale (2^-8 relative).
    assert ((w - dense.weight).abs() <= q.scale.float()[:, None] * (0.5 + 127 / 256) * 1.01).all()
    x = torch.randn(3, 64)
    torch.testing.assert_close(q(x), x @ w.T, atol=0.05, rtol=0.02)


def test_quantize_cpu_leaves_shapes_the_int4_kernel_cannot_pack():
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 100), torch.nn.Linear(100, 32),
                                torch.nn.Linear(32, 40))
    quantize_cpu(model, "int4")
    assert [type(m).__name__ for m in model] == ["Int4Linear", "Linear", "Linear", "Linear"]  # 48, 100 inputs; 40 outputs
    assert model(torch.randn(2, 64)).shape == (2, 40)


def test_quantize_cpu_swaps_every_linear_and_keeps_the_lm_head_weight():
    model = tiny_llama(seed=1)
    head_weight = model.get_output_embeddings().weight
    quantize_cpu(model, "int4")
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert model.get_output_embeddings().weight is head_weight
    with torch.inference_mode():
        assert torch.isfinite(model(input_ids=torch.tensor([[1, 2, 3]])).logits).all()


@pytest.mark.parametrize("quant", ["int4", "q4_rows", "int8"])
def test_joined_projections_give_the_separate_ones_bits(quant, cache_dir):
    """q/k/v and gate/up joined (models/fused.py) hold the codes and scales the separate linears
    would and give their logits bit for bit, at 1 to 5 rows, forgetting each input once every part
    has read it; a part read with another input computes it again."""
    if quant == "q4_rows":
        try:
            load_kernel("rows", cache_dir)
        except NativeUnavailable as e:
            pytest.skip(f"no q4_rows kernel here: {e}")
    joined, apart = tiny_llama(seed=3), tiny_llama(seed=3)
    quantize_cpu(joined, quant)
    quantize_cpu(apart, quant, join=False)
    attention = joined.model.layers[0].self_attn
    assert isinstance(attention.q_proj, Part) and isinstance(joined.model.layers[1].mlp.up_proj, Part)
    assert not any(isinstance(m, Part) for m in apart.modules())
    assert bf16_outputs(joined, "v_proj") and bf16_outputs(apart, "v_proj")   # a part rounds as its joined linear
    with torch.inference_mode():
        for rows in (1, 2, 5):
            ids = torch.randint(0, 256, (1, rows))
            assert torch.equal(joined(input_ids=ids).logits, apart(input_ids=ids).logits), rows
        assert attention.q_proj.joint.output is None                 # nothing held between forwards
        x = torch.randn(2, 64)
        q, k = attention.q_proj(x), attention.k_proj(x.clone())     # another input: computed again
        assert torch.equal(q, apart.model.layers[0].self_attn.q_proj(x))
        assert torch.equal(k, apart.model.layers[0].self_attn.k_proj(x))


def test_embedded_model_int4_recovers_its_q4_1_blocks(embedded_target):
    """llama.cpp's Q4_1 sets d = (max - min) / 15 and m = min per 32 weights, so re-quantizing the
    dequantized GGUF gives back the same codes: the int4 matrix differs from the fp32 one only by
    bf16's rounding of d and of the zero point, far below a quantization step."""
    layer = embedded_target.model.model.layers[0].mlp.down_proj   # (576, 1536)
    q = Int4Linear(copy.deepcopy(layer))
    n, k = layer.weight.shape
    groups = layer.weight.reshape(-1, GROUP)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    err = (dequantized_int4(q, n, k) - layer.weight).reshape(-1, GROUP).abs().amax(-1)
    assert (err <= step / 8 + 1e-3).all()        # a re-quantization would be off by up to step / 2


def ask(url: str) -> dict:
    """One short greedy answer through the API; -> Aerie's numbers for it."""
    reply = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "model": "aerie", "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 24,
        "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()["aerie"]


@pytest.mark.slow
@pytest.mark.first_start("open")
def test_a_first_start_opens_before_compiling(first_start):
    """The embedded model on a cache with no graphs yet: the page is up before any graph is
    compiled, and an answer meanwhile decodes plainly and says so. The suite's first test
    (conftest): the child compiles while the rest of the suite runs."""
    during = ask(first_start[1])
    assert during["strategy"] == "plain" and "compiling graph" in during["tuning"], during


@pytest.mark.slow
@pytest.mark.first_start("close")
def test_the_first_start_tunes_once_every_graph_is_stored(first_start, first_start_tuned, cache_dir):
    """The tuner starts once the child stored every graph (the target's 1-token verify and its
    larger buckets, the same for the head), and the next test loads them in seconds: the
    lossless test below needs no compile of its own."""
    tuned = re.search(r"after compiling (\d+) of (\d+) graphs", first_start_tuned)
    assert tuned and tuned[1] == tuned[2] and int(tuned[1]) >= 4, tuned
    after = ask(first_start[1])
    assert "compiling" not in after["tuning"] and after["speedup"] is not None, after
    folder = next(k.parent for k in cache_dir.glob("graphs/*/key.json") if "smollm2" in k.read_text())
    assert len([p for p in folder.iterdir() if p.name != "key.json"]) == int(tuned[1])


@pytest.mark.slow
@pytest.mark.first_start("close")
def test_embedded_int4_compiled_is_lossless_up_to_near_ties(first_start_tuned, cache_dir):
    """12 MT-bench prompts x 64 tokens: the tuned EAGLE engine's greedy text equals plain decoding's
    on the same runner. Its default attention (the fp32 row kernel beside a 4-bit kernel that
    computes each row alone, else fp64 SDPA) makes a tree's logits equal sequential decoding's, so
    every answer matches; a difference starting at a logged near-tie is reported, then fails."""
    loaded = load_tuned(EngineSpec(quant="int4", device="cpu", cache_dir=cache_dir, head=str(HEAD)))
    engine, tuner = loaded.engine, loaded.tuner
    print(f"graphs compiled or loaded in {loaded.compile_s:.1f} s")
    assert engine.runner.compiled and engine.runner.exact and engine.target.quant == "int4"
    assert engine.runner.row_attention == rows_alone(loaded.kernels)
    greedy = SamplingConfig(max_new_tokens=64)
    ties_seen = exact = 0
    for prompt in load_prompts(ROOT_ASSETS / "bench" / "mt_bench.jsonl", 12):
        ids = render_prompt(engine.target.tokenizer, [{"role": "user", "content": prompt.text}])
        outputs, ties = [], set()
        for name in ("plain", "eagle"):
            engine.set_drafter(tuner.drafters[name])
            engine.reset()
            out = []
            for step in engine.generate(ids, greedy):
                ties.update(len(out) + i for i in step.near_ties)
                out += step.new_ids
            outputs.append(out)
        plain, eagle = outputs
        if plain != eagle:
            first = next(i for i, (a, b) in enumerate(zip(plain, eagle)) if a != b)
            assert first in ties, f"diverged at token {first} without a near-tie: {prompt.text[:60]!r}"
            ties_seen += 1
        else:
            exact += 1
    assert exact == 12


def test_nf4_on_a_cpu_runs_eagerly_and_says_so(tiny_dir, tmp_path):
    """bitsandbytes' 4-bit layers broke inside inductor's code on a CPU (issue 21): no graph is
    compiled for them, one line says why, and the model still answers."""
    from core.service.factory import stage
    lines = []
    staged = stage(EngineSpec(model=str(tiny_dir), quant="nf4", device="cpu", cache_dir=tmp_path), report=lines.append)
    assert staged.engine.target.quant == "nf4" and staged.graphs is None and not staged.engine.runner.wants_graphs
    said = [line for line in lines if not line.startswith("Aerie: building ")]   # a first start's kernels aside
    assert [line for line in said if "nf4 runs eagerly" in line] and len(said) == 1
    steps = list(staged.engine.generate([5, 6, 7], SamplingConfig(max_new_tokens=6)))
    assert sum(len(s.new_ids) for s in steps) == 6
