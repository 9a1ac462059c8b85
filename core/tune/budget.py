"""The memory model: what the weights, a chat's KV cache and one verified tree cost, and what fits.

  KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element,
for the target and for the head (one decoder layer). A verify of N tree tokens at context C also
holds, at its peak: the logits N x V (compute dtype, plus the fp32 copy acceptance reads), every
layer's hidden states (L + 1) x N x hidden (the drafter asks for hidden states), the additive
mask N x (C + N) and one layer's attention scores heads x N x (C + N) in fp32 (eager and
math-sdpa paths materialise them). Sizes are bytes. Weights are estimated from the config before
loading: NF4 stores 4 bits per linear weight plus one fp32 absmax per 64 (double-quantised to
about 8.5 bits per 64); embeddings and the LM head stay 16-bit.

When the weights plus KV for `PLANNED_CONTEXT` tokens do not fit in free VRAM minus the reserve,
the target is split: what fits stays on the GPU, the rest lives in RAM (accelerate's offload),
and every verify then pays a weight transfer. With that slow a target much larger trees pay
(SpecExec), so the tuner is told `offloaded` and searches larger sizes.
"""

from dataclasses import dataclass

from core.config import PLANNED_CONTEXT

from models.errors import AerieError

NF4_BITS_PER_WEIGHT = 4 + 8.5 / 64
MIN_GPU_SHARE = 0.1         # below this share of the weights on the GPU, offloading is not worth it
GIB = 2**30


class MemoryBudgetError(AerieError):
    """The model, or the tree asked for, does not fit in the memory left."""


@dataclass(frozen=True)
class ModelShape:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    tied: bool
    context_len: int

    @classmethod
    def from_config(cls, config: dict) -> "ModelShape":
        c = config.get("text_config", config)
        heads = int(c["num_attention_heads"])
        return cls(layers=int(c["num_hidden_layers"]), heads=heads,
                   kv_heads=int(c.get("num_key_value_heads") or heads),
                   head_dim=int(c.get("head_dim") or c["hidden_size"] // heads), hidden=int(c["hidden_size"]),
                   intermediate=int(c["intermediate_size"]), vocab=int(c["vocab_size"]),
                   tied=bool(c.get("tie_word_embeddings", False)),
                   context_len=int(c.get("max_position_embeddings") or 2048))

    @property
    def linear_params(self) -> int:
        """Weights of one decoder layer's linears (q, k, v, o, gate, up, down), times layers."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return self.layers * (attn + 3 * self.hidden * self.intermediate)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)


def weight_bytes(shape: ModelShape, quant: str, dtype_bytes: int) -> int:
    linear_bits = NF4_BITS_PER_WEIGHT if quant == "nf4" else 8 * dtype_bytes
    return int(shape.linear_params * linear_bits / 8 + shape.embedding_params * dtype_bytes)


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def target_kv_per_token(shape: ModelShape, dtype_bytes: int) -> int:
    """The target's KV plus the draft head's (EAGLE heads are one decoder layer of the target's width)."""
    return kv_bytes_per_token(shape.layers + 1, shape.kv_heads, shape.head_dim, dtype_bytes)


def tree_bytes(shape: ModelShape, tokens: int, context: int, dtype_bytes: int) -> int:
    """Peak activation bytes of one verify of `tokens` tree tokens after `context` cached ones."""
    logits = tokens * shape.vocab * (dtype_bytes + 4)
    hidden = (shape.layers + 1) * tokens * shape.hidden * dtype_bytes
    seen = context + tokens
    mask = tokens * seen * dtype_bytes
    scores = shape.heads * tokens * seen * 4
    return logits + hidden + mask + scores


@dataclass(frozen=True)
class Placement:
    offload: bool
    gpu_weight_bytes: int | None  # cap on weights kept on the GPU when offloading; None = all of them
    weights: int                  # estimated bytes of all weights
    reason: str


def plan_placement(shape: ModelShape, quant: str, dtype_bytes: int, free: int, reserve: int) -> Placement:
    """Where the weights go on a GPU with `free` bytes, keeping `reserve` for the user, room for a
    chat's KV cache and one 96-token tree."""
    weights = weight_bytes(shape, quant, dtype_bytes)
    context = min(PLANNED_CONTEXT, shape.context_len)
    working = context * target_kv_per_token(shape, dtype_bytes) + tree_bytes(shape, 96, context, dtype_bytes)
    room = free - reserve - working
    if weights <= room:
        return Placement(False, None, weights, f"weights {weights / GIB:.1f} GiB fit beside {context}-token KV")
    if room < MIN_GPU_SHARE * weights:
        raise MemoryBudgetError(
            f"The GPU has {free / GIB:.1f} GiB free; after the {reserve / GIB:.1f} GiB reserve and "
            f"{working / GIB:.1f} GiB for a {context}-token chat, too little is left for this model's "
            f"{weights / GIB:.1f} GiB of weights. Pick a smaller model, lower --vram-reserve, or use --device cpu.")
    return Placement(True, int(room), weights,
                     f"weights {weights / GIB:.1f} GiB exceed the {room / GIB:.1f} GiB left: "
                     f"{room / weights:.0%} on the GPU, the rest offloaded to RAM")


def largest_tree(shape: ModelShape, context: int, dtype_bytes: int, available: int, sizes: tuple[int, ...]) -> int:
    """The largest of `sizes` whose verify fits in `available` bytes at `context`; 0 if none."""
    fitting = [n for n in sizes if tree_bytes(shape, n, context, dtype_bytes) <= available]
    return max(fitting, default=0)
