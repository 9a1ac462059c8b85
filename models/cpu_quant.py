"""Small weights on CPU: int4 (group 32) and int8 (per channel) linears on torch's own kernels.

A CPU token is bound by streaming the weights: the embedded model is 538 MB in fp32, 135 MB in
int8 and ~84 MB in int4. torch ships weight-only kernels for both (`_weight_int4pack_mm_for_cpu`,
`_weight_int8pack_mm`), vectorised for bf16 activations only, so each linear casts its input to
bf16 and its output back; norms, RoPE, attention and the residual stream stay fp32.

int4 is asymmetric per group of 32 inputs: w = d * q + m with q in [0, 15], d = (max - min) / 15,
m = min. That is llama.cpp's Q4_1 rule, so re-quantizing the embedded model (a Q4_1 GGUF
dequantized to fp32) recovers its blocks exactly; only d and the kernel's zero point m + 8d are
rounded to bf16 (relative error up to 2^-8). Other models get ordinary Q4_1-style 4-bit weights.
"""

import torch
from torch import nn

from models.quants import CPU_QUANTS

GROUP = 32


class Int4Linear(nn.Module):
    """y = x W^T with W stored as 4-bit codes, d and zero per group of 32 (bf16)."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = False):
        super().__init__()
        w = linear.weight.detach().float()                       # (N, K)
        n, k = w.shape
        groups = w.reshape(n, k // GROUP, GROUP)                  # (N, K/g, g)
        low, high = groups.amin(-1), groups.amax(-1)              # (N, K/g)
        d = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        codes = torch.round((groups - low[..., None]) / d[..., None]).clamp(0, 15).to(torch.int32)
        # The kernel computes (q - 8) * scale + zero: zero = m + 8d reproduces d * q + m.
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.reshape(n, k), 1))
        self.register_buffer("scale_zero", torch.stack([d, low + 8 * d], -1).transpose(0, 1).contiguous().bfloat16())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        self.in_features, self.out_features = k, n
        if keep_weight:  # for readers of `.weight` (a tied LM head that drafters slice)
            self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)     # (M, K)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP, self.scale_zero)
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias


class Int8Linear(nn.Module):
    """y = x W^T with W stored as int8 codes and one bf16 scale per output channel (absmax / 127)."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = False):
        super().__init__()
        w = linear.weight.detach().float()                                          # (N, K)
        scale = (w.abs().amax(-1) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # (N,)
        self.register_buffer("codes", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.bfloat16())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        self.out_features, self.in_features = w.shape
        if keep_weight:
            self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)     # (M, K)
        y = torch.ops.aten._weight_int8pack_mm(rows, self.codes, self.scale)
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias


def quantized(linear: nn.Linear, quant: str, keep_weight: bool = False) -> nn.Module:
    """`linear` as an Int4Linear or Int8Linear (`quant` one of CPU_QUANTS)."""
    if quant not in CPU_QUANTS:
        raise ValueError(f"CPU weights are one of {CPU_QUANTS}, not {quant!r}")
    return (Int4Linear if quant == "int4" else Int8Linear)(linear, keep_weight=keep_weight)


def quantize_cpu(model: nn.Module, quant: str) -> None:
    """Swap every nn.Linear in `model` (a causal LM's LM head included) for its int4 / int8 version,
    in place. The LM head keeps `.weight`: EAGLE heads and drafters read it (tied to the embedding,
    so no extra memory for models that tie them)."""
    if quant not in CPU_QUANTS:
        raise ValueError(f"CPU weights are one of {CPU_QUANTS}, not {quant!r}")
    get_lm_head = getattr(model, "get_output_embeddings", None)
    lm_head = get_lm_head() if get_lm_head is not None else None
    for module in list(model.modules()):
        for name, child in module.named_children():
            # The int4 kernel packs groups of 32 inputs and tiles of 16 outputs; any other shape stays fp32.
            if isinstance(child, nn.Linear) and (quant == "int8" or (child.in_features % GROUP == 0
                                                                     and child.out_features % 16 == 0)):
                setattr(module, name, quantized(child, quant, keep_weight=child is lm_head))
