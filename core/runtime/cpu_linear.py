"""Faster fp32 linears on CPU: oneDNN with prepacked weights instead of torch's default GEMM.

torch's default fp32 GEMM (MKL) runs AVX2 code on AMD CPUs and is slow for a few rows; oneDNN
uses AVX-512 where there is one. For the embedded model on this 2-core CPU (one thread): a
forward over 1 token 41 -> 27 ms, over 2 tokens 67 -> 29 ms, over 8 tokens -> 36 ms, which is
what makes a verified tree cheap. Same fp32 maths; only the summation order differs.

Batched generation (core/train/distill.py) may also take bf16 dot products (AMX or AVX512-BF16)
where they time faster: bf16x3 (models/cpu_quant.py: the weights exactly, inputs rounded to bf16
as the served int4 kernel rounds them) or bf16 (the weights rounded too). Its answers are training
data, not the chat's: greedy answers already differ between fp32 and the served int4 model's bf16
inputs (48 mix_v1 prompts, 2-core Xeon: 13 of 47 answers identical for bf16x3 and for bf16 against
fp32, the first difference after a median 40 and 31 tokens), and the head is trained on the
target's distribution, which these share.
"""

import time
from contextlib import contextmanager

import torch

from models.cpu_quant import OneDnnLinear, onednn_runs
from models.quants import LINEARS
from models.target import Target


BATCHED_KINDS = ("fp32", "bf16x3", "bf16")


def onednn_serves(model) -> bool:
    """Whether oneDNN's linears can stand in for this model's: fp32 on a CPU, with a oneDNN build."""
    weight = model.get_input_embeddings().weight
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def linear_seconds(model, rows: int, kinds: tuple[str, ...]) -> dict[str, float]:
    """Seconds of one MLP-shaped matmul at `rows` rows on torch's default GEMM ("default") and on
    oneDNN as each of `kinds`; {} where oneDNN cannot run (not a CPU fp32 model, no oneDNN)."""
    weight = model.get_input_embeddings().weight
    if not onednn_serves(model):
        return {}
    dense = torch.nn.Linear(weight.shape[1], 4 * weight.shape[1], bias=False)
    x = torch.randn(rows, 1, weight.shape[1])

    def seconds(layer) -> float:
        layer(x)  # warm-up
        t0 = time.perf_counter()
        for _ in range(5):
            layer(x)
        return time.perf_counter() - t0

    with torch.inference_mode():
        return {"default": seconds(dense), **{kind: seconds(OneDnnLinear(dense, rows, kind=kind)) for kind in kinds}}


def onednn_is_faster(model, rows: int) -> bool:
    """Whether oneDNN's fp32 GEMM saves 10% over torch's default at `rows` rows here (timed)."""
    timed = linear_seconds(model, rows, ("fp32",))
    return bool(timed) and timed["fp32"] < 0.9 * timed["default"]


def fastest_batched_linear(model, rows: int) -> str:
    """For batched generation: "default", "fp32" (oneDNN), "bf16x3" or "bf16", whichever times
    fastest at `rows` rows here; a kind must save 10% over the best before it in that order."""
    timed = linear_seconds(model, rows, tuple(k for k in BATCHED_KINDS if onednn_runs(k)))
    best = "default"
    for kind in BATCHED_KINDS:
        if kind in timed and timed[kind] < 0.9 * timed[best]:
            best = kind
    return best


# --linear (generate, train) -> the OneDnnLinear kind; "default" keeps torch's own GEMM.
LINEAR_KINDS = dict(zip(LINEARS, ("default", "fp32", "bf16x3", "bf16")))


def batched_linear_kind(model, name: str, rows: int) -> str:
    """The kind --linear `name` asks for ("auto": fastest_batched_linear's pick); "default" for a
    model oneDNN cannot serve (on a GPU, or quantized)."""
    if not onednn_serves(model):
        if name not in ("auto", "default"):
            raise ValueError(f"--linear {name} runs oneDNN on an unquantized model on a CPU; this one is not.")
        return "default"
    return fastest_batched_linear(model, rows) if name == "auto" else LINEAR_KINDS[name]


def use_onednn_linears(model: torch.nn.Module, rows: int, kind: str = "fp32") -> list[tuple]:
    """Swap every nn.Linear of `model` for a OneDnnLinear of `kind` packed for `rows` rows, in
    place (pass a model you own; it stays a CPU inference model). Returns (module, name, linear)
    of each swapped one."""
    swapped = []
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, torch.nn.Linear):
                swapped.append((module, name, child))
                setattr(module, name, OneDnnLinear(child, rows, kind=kind))
    return swapped


@contextmanager
def onednn_linears(model: torch.nn.Module, rows: int, kind: str):
    """`model`'s linears as OneDnnLinears of `kind` inside the block (no-op for "default"), its own
    nn.Linears again after: training reads their weights and needs their gradients."""
    swapped = use_onednn_linears(model, rows, kind) if kind != "default" else []
    try:
        yield
    finally:
        for module, name, linear in swapped:
            setattr(module, name, linear)


def accelerate_cpu(target: Target, rows: int = 16) -> bool:
    """Swap the target's linears for oneDNN ones when it is fp32 on CPU and oneDNN is faster here
    (timed, not assumed). The LM head keeps its `.weight` too: EAGLE heads and drafters read it.
    Returns whether it switched."""
    model = target.model
    if target.device.type != "cpu" or target.quant != "none" or not onednn_is_faster(model, rows):
        return False
    use_onednn_linears(model.get_decoder(), rows)
    lm_head = model.get_output_embeddings()
    if isinstance(lm_head, torch.nn.Linear):
        model.set_output_embeddings(OneDnnLinear(lm_head, rows, keep_weight=True))
    return True
