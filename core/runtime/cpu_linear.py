"""Faster fp32 linears on CPU: oneDNN with prepacked weights instead of torch's default GEMM.

torch's default fp32 GEMM (MKL) runs AVX2 code on AMD CPUs and is slow for a few rows; oneDNN
uses AVX-512 where there is one. For the embedded model on this 2-core CPU (one thread): a
forward over 1 token 41 -> 27 ms, over 2 tokens 67 -> 29 ms, over 8 tokens -> 36 ms, which is
what makes a verified tree cheap. Same fp32 maths; only the summation order differs.
"""

import time

import torch

from models.cpu_quant import OneDnnLinear
from models.target import Target


def onednn_is_faster(model, rows: int) -> bool:
    """Time one MLP-shaped matmul at `rows` rows both ways (CPU, fp32 weights only)."""
    weight = model.get_input_embeddings().weight
    if (weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available()
            or not hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    dense = torch.nn.Linear(weight.shape[1], 4 * weight.shape[1], bias=False)
    x = torch.randn(rows, 1, weight.shape[1])

    def seconds(layer) -> float:
        layer(x)  # warm-up
        t0 = time.perf_counter()
        for _ in range(5):
            layer(x)
        return time.perf_counter() - t0

    with torch.inference_mode():
        return seconds(OneDnnLinear(dense, rows)) < 0.9 * seconds(dense)


def use_onednn_linears(model: torch.nn.Module, rows: int) -> None:
    """Swap every nn.Linear of `model` for a OneDnnLinear packed for `rows` rows, in place (pass a
    model you own; it stays a CPU inference model)."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, torch.nn.Linear):
                setattr(module, name, OneDnnLinear(child, rows))


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
