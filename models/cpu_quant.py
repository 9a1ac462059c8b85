"""Small weights on CPU: int4 (group 32) and int8 (per channel) linears on torch's own kernels.

A CPU token is bound by streaming the weights: the embedded model is 538 MB in fp32, 135 MB in
int8 and ~84 MB in int4. torch ships weight-only kernels for both (`_weight_int4pack_mm_for_cpu`,
`_weight_int8pack_mm`), vectorised for bf16 activations only, so each linear casts its input to
bf16 and its output back; norms, RoPE, attention and the residual stream stay fp32.

int4 is asymmetric per group of 32 inputs: w = d * q + m with q in [0, 15], d = (max - min) / 15,
m = min. That is llama.cpp's Q4_1 rule, so re-quantizing the embedded model (a Q4_1 GGUF
dequantized to fp32) recovers its blocks exactly; only d and the kernel's zero point m + 8d are
rounded to bf16 (relative error up to 2^-8). Other models get ordinary Q4_1-style 4-bit weights.

Which 4-bit kernel computes a layer (`Int4Linear.use_kernel`, one of KERNELS): torch's, Aerie's
AMX one (models/amx.py) or q4_rows (models/q4_rows.py), all on the same codes, scales and zeros.

Trees of many rows: torch's int4 kernel dequantizes every weight tile again for each block of 4
rows, so its cost grows with the rows (a 576x1536 linear, 2-core AMD EPYC: 0.028 ms at 1 row,
0.68 at 64). `Int4Linear.widen` gives a layer a twin for calls of many rows: the very same weight
values, (q - 8) * scale + zero in fp32 as the kernel computes them (exact: a 4-bit code times a
bf16 scale fits fp32's mantissa, so the one rounding of the sum is the kernel's fused one), on
oneDNN's fp32 GEMM (0.52 ms at 64 rows there), its output rounded to bf16 as the kernel's is. Only
the order of the fp32 sums differs. It costs 4 bytes per weight, so it is only built on request.
A second kind of twin, "bf16x3", splits each of those fp32 values exactly into three bf16 terms
(hi + mid + lo: 8 significant bits each) and runs one bf16 GEMM over the input repeated three
times along K: a bf16 input times a bf16 term is exact in fp32, so again only the order of the
fp32 sums differs, and the GEMM runs on AMX or AVX512-BF16 (a 576x1536 linear at 512 rows, 2-core
Xeon with AMX: int4 5.7 ms, fp32 twin 2.9, bf16x3 1.4). 6 bytes per weight: for long prefills.
"""

import torch
from torch import nn

from models import q4_rows
from models.fused import Part, fuse_shared_inputs
from models.amx import pack as amx_pack
from models.quants import CPU_QUANTS

GROUP = 32
TWINS = ("fp32", "bf16x3")
KERNELS = ("int4", "amx", "rows")   # torch's int4 kernel, Aerie's AMX one (models/amx.py), q4_rows (models/q4_rows.py)


@torch.library.custom_op("aerie::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x (M, K) @ W^T with W prepacked by `torch.ops.mkldnn._reorder_linear_weight`. An opaque op:
    inductor lowers oneDNN's own linear only for weights frozen into the graph as constants."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


@onednn_linear.register_fake
def _(x, packed, out_features):
    return x.new_empty(x.shape[0], out_features)


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
        self.wide_from: int | None = None                          # rows from which `wide` computes
        self.wide_kind = "fp32"                                      # which of TWINS `wide` holds
        self.register_buffer("wide", None)                          # the same weights, fp32, packed for oneDNN
        self.kernel = "int4"           # the 4-bit kernel computing calls of `kernel_from` rows or more: one of KERNELS
        self.kernel_from = 1           # (fewer rows: torch's int4 kernel)
        self.tiles_from = q4_rows.NEVER   # q4_rows: calls of this many rows or more on its tiled path
        for name in ("amx_codes", "amx_d", "amx_z", "rows_codes"):   # the same weights for AMX / q4_rows (use_kernel)
            self.register_buffer(name, None)
        if keep_weight:  # for readers of `.weight` (a tied LM head that drafters slice)
            self.weight = linear.weight

    def codes(self) -> torch.Tensor:
        """(N, K) the 4-bit codes q, read back exactly through the kernel itself: with scale 1 and
        zero 8 it computes (q - 8) + 8 = q, and an identity input reads them out (integers up to 15
        are exact in bf16)."""
        k, n = self.in_features, self.out_features
        if self.packed is None:        # q4_rows alone holds them (use_kernel)
            return q4_rows.unpack(self.rows_codes, n, k)
        groups = self.scale_zero.shape[0]
        unit = torch.stack([torch.ones(groups, n), torch.full((groups, n), 8.0)], -1).bfloat16()
        codes = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(k, dtype=torch.bfloat16), self.packed, GROUP, unit)
        return codes.float().t().round().to(torch.uint8)

    def dequantized(self) -> torch.Tensor:
        """(N, K) fp32: the weight values the kernel computes with."""
        scale, zero = (self.scale_zero[..., i].float().t().repeat_interleave(GROUP, 1) for i in (0, 1))  # (N, K)
        return (self.codes().float() - 8) * scale + zero

    def use_kernel(self, kernel: str, from_rows: int = 1, free: bool = True, tiles_from: int = q4_rows.NEVER) -> None:
        """Compute calls of `from_rows` rows or more on `kernel` (one of KERNELS; amx and rows from
        models/amx.py and models/q4_rows.py, loaded first) from the same codes, scales and zeros:
        the same weight values, the output rounded to bf16 as the int4 kernel's is, so only the
        order of the fp32 sums differs. `free`: drop the copies no kernel in use needs (torch's
        own where q4_rows serves every size); without it, copies stay for switching back. Where
        a shape does not suit the kernel, raise ValueError. tiles_from: q4_rows' calls of this
        many rows or more take its tiled path (the same bits; `q4_rows.matmul`)."""
        if kernel not in KERNELS:
            raise ValueError(f"a 4-bit kernel is one of {KERNELS}, not {kernel!r}")
        k, n = self.in_features, self.out_features
        if kernel == "amx" and self.amx_codes is None:
            if k % 64 or n % 16:
                raise ValueError(f"a {k}x{n} linear does not fit the AMX kernel's tiles")
            packed = amx_pack(self.codes(), self.scale_zero[..., 0], self.scale_zero[..., 1])
            self.amx_codes, self.amx_d, self.amx_z = packed.codes, packed.d, packed.z
        if kernel == "rows" and self.rows_codes is None:
            if not q4_rows.fits(k, n):
                raise ValueError(f"a {k}x{n} linear does not fit the q4_rows kernel's vectors")
            self.rows_codes = q4_rows.pack(self.codes(), self.scale_zero)
        self.kernel, self.kernel_from, self.tiles_from = kernel, from_rows, tiles_from
        if not free:
            return
        rows_alone = kernel == "rows" and from_rows == 1           # torch's copy then serves nothing
        if self.packed is None and not rows_alone:                   # rebuilt before q4_rows' copy goes
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.codes().int(), 1)
        if kernel != "amx":
            self.amx_codes = self.amx_d = self.amx_z = None
        if kernel != "rows":
            self.rows_codes = None
        if rows_alone:
            self.packed = None

    def use_int4(self) -> None:
        """Back to torch's int4 kernel at every row count, freeing the other kernels' copies."""
        self.use_kernel("int4")

    def widen(self, from_rows: int, kind: str = "fp32", pack_rows: int = 32) -> None:
        """Compute calls of `from_rows` rows or more on oneDNN over `dequantized()`: its fp32
        GEMM, or for "bf16x3" a bf16 GEMM over the exact three-term split (`bf16_terms`)."""
        if kind not in TWINS:
            raise ValueError(f"a twin is one of {TWINS}, not {kind!r}")
        self.wide = onednn_pack(self.dequantized(), kind, pack_rows)
        self.wide_from, self.wide_kind = from_rows, kind

    def narrow(self) -> None:
        """Back to the int4 kernel at every row count, freeing the twin."""
        self.wide, self.wide_from = None, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])                              # (M, K)
        m, n, bf16 = flat.shape[0], self.out_features, torch.bfloat16
        # A compiled graph's rows are fixed or within a range no kernel switch splits: one kernel per graph.
        if self.wide_from is not None and m >= self.wide_from:
            y = onednn_matmul(flat.to(bf16), self.wide, n, self.wide_kind).to(bf16)
        elif self.kernel == "rows" and m >= self.kernel_from:
            y = q4_rows.matmul(flat, self.rows_codes, n, self.tiles_from)   # rounds fp32 inputs and outputs to bf16 itself
        elif self.kernel == "amx" and m >= self.kernel_from:
            y = torch.ops.aerie_amx.q41_mm(flat.to(bf16), self.amx_codes, self.amx_d, self.amx_z, n).to(bf16)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.to(bf16), self.packed, GROUP, self.scale_zero)
        y = y.reshape(*x.shape[:-1], n).to(x.dtype)
        return y if self.bias is None else y + self.bias


def bf16_outputs(model: nn.Module, name: str) -> bool:
    """Whether every linear called `name` in `model` (each layer's v_proj, say) returns bf16 values:
    an Int4Linear or Int8Linear without a bias (their kernels round outputs to bf16; a bias is added
    after, in fp32; a Part of a joined linear, models/fused.py, as that linear). False where there
    is no such linear."""
    found = [m.computed_by if isinstance(m, Part) else m for path, m in model.named_modules() if path.rsplit(".", 1)[-1] == name]
    return bool(found) and all(isinstance(m, (Int4Linear, Int8Linear)) and m.bias is None for m in found)


def bf16_terms(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) fp32 -> (N, 3K) bf16 [hi | mid | lo] with hi + mid + lo == weight exactly: each term
    takes the next 8 significant bits of what is left. Raises where a value needs more (none of
    the embedded model's 134M weights does: fp32 has 24 significant bits)."""
    terms, rest = [], weight
    for _ in range(3):
        terms.append(rest.bfloat16())
        rest = rest - terms[-1].float()
    if rest.any():
        raise ValueError(f"{int((rest != 0).sum())} weights do not split exactly into three bf16 terms")
    return torch.cat(terms, 1)


ONEDNN_KINDS = ("fp32", "bf16", "bf16x3")   # how a OneDnnLinear holds its weight


def onednn_runs(kind: str) -> bool:
    """Whether oneDNN runs weights of `kind` (one of ONEDNN_KINDS, or int8/int4: torch's own
    kernels) on this CPU: its bf16 GEMMs need AVX512-BF16-class hardware (AVX-512 BW/VL/DQ, AMX or
    AVX-NE-CONVERT) and are refused on a CPU with AVX2 alone (an AMD EPYC here)."""
    return "bf16" not in kind or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def onednn_pack(weight: torch.Tensor, kind: str, rows: int) -> torch.Tensor:
    """(N, K) fp32 -> oneDNN's prepacked weight of `kind`: fp32, bf16 (rounded), or bf16x3 (the
    exact three-term split, `bf16_terms`), packed for calls of about `rows` rows."""
    if kind not in ONEDNN_KINDS:
        raise ValueError(f"a oneDNN weight is one of {ONEDNN_KINDS}, not {kind!r}")
    if kind == "bf16x3":
        held = bf16_terms(weight.float())
    else:
        held = weight.to(torch.float32 if kind == "fp32" else torch.bfloat16)
    return torch.ops.mkldnn._reorder_linear_weight(held, rows)


def onednn_matmul(rows: torch.Tensor, packed: torch.Tensor, out_features: int, kind: str) -> torch.Tensor:
    """rows (M, K) @ W^T through `onednn_pack(W, kind)`: fp32 in fp32; bf16 on bf16 inputs; bf16x3
    on bf16 inputs repeated three times along K ((M, 3K) @ (3K, N): each bf16 product is exact in
    fp32, so it is W's own values on bf16-rounded inputs, up to the order of the sums)."""
    if kind == "bf16x3":
        return onednn_linear(torch.cat([rows.to(torch.bfloat16)] * 3, 1), packed, out_features)
    return onednn_linear(rows.to(torch.float32 if kind == "fp32" else torch.bfloat16), packed, out_features)


class OneDnnLinear(nn.Module):
    """nn.Linear through oneDNN with its weight prepacked once, as `kind` (the op inductor itself
    uses on CPU). torch's default fp32 GEMM (MKL) runs AVX2 code on AMD CPUs; oneDNN uses AVX-512
    where there is one (2.5x on SmolLM2's MLP at 64 rows), and bf16 dot products where the CPU has
    them (AVX512-BF16, AMX). fp32 keeps the maths (only the summation order differs); bf16 rounds
    the weights, for drafting only; bf16x3 keeps the weights exactly and rounds the inputs to bf16
    (as the int4 kernel does), for batched generation. Through `onednn_linear`, it compiles too."""

    def __init__(self, linear: nn.Linear, rows: int, keep_weight: bool = False, kind: str = "fp32"):
        super().__init__()
        weight = linear.weight.detach()
        self.register_buffer("packed", onednn_pack(weight, kind, rows))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        self.out_features, self.in_features = weight.shape
        self.kind = kind
        if keep_weight:  # for readers of `.weight` (a tied LM head that drafters slice); costs a copy
            self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])                                               # (M, K)
        y = onednn_matmul(rows, self.packed, self.out_features, self.kind)
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
    """`linear` as an Int4Linear or Int8Linear (`quant` one of CPU_QUANTS), for "q4_rows" an
    Int4Linear on that kernel (models/q4_rows.py, loaded first), or for "bf16" a OneDnnLinear
    holding bf16 weights."""
    if quant == "bf16":
        return OneDnnLinear(linear, rows=4, keep_weight=keep_weight, kind="bf16")
    if quant == "q4_rows":
        layer = Int4Linear(linear, keep_weight=keep_weight)
        layer.use_kernel("rows")
        return layer
    if quant not in CPU_QUANTS:
        raise ValueError(f"CPU weights are one of {CPU_QUANTS} or bf16, not {quant!r}")
    return (Int4Linear if quant == "int4" else Int8Linear)(linear, keep_weight=keep_weight)


def quantize_cpu(model: nn.Module, quant: str, join: bool = True) -> None:
    """Swap every nn.Linear in `model` (a causal LM's LM head included) for its int4 / int8 version,
    in place; with `join`, each layer's q/k/v and gate/up first become one linear each
    (models/fused.py). The LM head keeps `.weight`: EAGLE heads and drafters read it (tied to the
    embedding, so no extra memory for models that tie them)."""
    if quant not in (*CPU_QUANTS, "bf16", "q4_rows"):
        raise ValueError(f"CPU weights are one of {CPU_QUANTS}, q4_rows or bf16, not {quant!r}")
    if join:
        fuse_shared_inputs(model)
    get_lm_head = getattr(model, "get_output_embeddings", None)
    lm_head = get_lm_head() if get_lm_head is not None else None
    for module in list(model.modules()):
        for name, child in module.named_children():
            # The int4 kernel packs groups of 32 inputs and tiles of 16 outputs; any other shape stays fp32.
            if isinstance(child, nn.Linear) and (quant not in ("int4", "q4_rows") or (child.in_features % GROUP == 0
                                                                     and child.out_features % 16 == 0)):
                setattr(module, name, quantized(child, quant, keep_weight=child is lm_head))
