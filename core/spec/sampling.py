"""Turning target logits into a next-token distribution, and drawing from it.

Pure functions of tensors: no model, no state. `V` is the vocabulary size. The same
`target_probs` feeds plain sampling and speculative acceptance, which is what keeps
speculation lossless: both sample from exactly this distribution.
"""

import torch

from core.config import SamplingConfig


def target_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """logits (..., V) -> probabilities (..., V) after temperature, top-k and top-p.

    p(x) = softmax(logits / T) restricted to the top-k tokens and to the smallest prefix of the
    sorted distribution with mass >= top_p, then renormalised. Greedy is a one-hot on the argmax.
    """
    logits = logits.float()
    if cfg.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / cfg.temperature
    if 0 < cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p  # mass of strictly more likely tokens
        sorted_p = sorted_p.masked_fill(mass_before >= cfg.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return probs / probs.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs (..., V) -> token ids (...). One draw per row from the given generator."""
    flat = probs.reshape(-1, probs.shape[-1])
    ids = torch.multinomial(flat, 1, generator=generator).squeeze(-1)
    return ids.reshape(probs.shape[:-1])
