"""Self-speculative decoding by layer skipping (Draft & Verify, Zhang et al. 2023; SWIFT, Xia et
al. 2024): the target drafts for itself with some of its layers skipped, then the full target
verifies. No draft weights; the draft reads the target's own KV cache in the layers it keeps.

The drafter feeds the root, then each drafted token, one at a time through the kept layers
(models/layer_view.py): token t sits at row and position L + t, sees the committed rows (written by
the full target) and the draft rows before it. It stops after `depth` tokens, or earlier once the
skipping model's top probability falls below `min_confidence` (Draft & Verify's adaptive draft
exit). Which layers to skip is measured on the user's model (core/tune/skip.py); on a LayerSkip
checkpoint, the skipped layers are the last ones: its early exit.
"""

from dataclasses import dataclass

import torch

from core.spec.tree import Draft, chain_tree
from models.layer_view import layer_view


@dataclass(frozen=True)
class SkipConfig:
    skip: tuple[int, ...]          # target layers the draft leaves out
    depth: int = 3                 # most tokens drafted a round
    min_confidence: float = 0.0    # stop drafting once the top probability falls below this

    def label(self) -> str:
        return f"skip {len(self.skip)} layers, depth {self.depth}"

    def exit_layer(self, layers: int) -> int | None:
        """E when the draft runs layers 0..E-1 of `layers` (an early exit), else None."""
        tail = tuple(range(layers - len(self.skip), layers))
        return layers - len(self.skip) if self.skip and tuple(sorted(self.skip)) == tail else None


class LayerSkipDrafter:
    name = "layer_skip"
    feature_layers = None

    def __init__(self, runner, cfg: SkipConfig, reason: str = ""):
        self.runner, self.cfg, self.reason = runner, cfg, reason   # reason: how cfg was chosen, for the page and bench
        layers = runner.num_layers
        if not cfg.skip or len(set(cfg.skip)) >= layers or not all(0 <= i < layers for i in cfg.skip):
            raise ValueError(f"A layer-skip draft must skip some but not all of the {layers} layers; got {cfg.skip}.")
        if not 1 <= cfg.depth <= runner.buckets[-1]:
            raise ValueError(f"A layer-skip draft's depth must be 1..{runner.buckets[-1]}; got {cfg.depth}.")
        self.view = layer_view(runner.target.model.get_decoder(), [i for i in range(layers) if i not in cfg.skip])

    def exit_layer(self) -> int | None:
        """E when this draft is an early exit after the target's first E layers, else None."""
        return self.cfg.exit_layer(self.runner.num_layers)

    def rewind(self, common: int) -> int:
        return common

    def memory_bytes(self, borrowed: set[int]) -> int:
        return 0  # the target's own weights and cache

    def prime(self, context: list[int], fresh):
        return fresh

    def draft(self, context: list[int], fresh) -> Draft:
        runner, tokens = self.runner, [context[-1]]
        for t in range(self.cfg.depth):
            at = runner.length + t
            ids = torch.tensor([tokens[-1:]], device=runner.device)
            visible = torch.ones(1, t + 1, dtype=torch.bool, device=runner.device)      # the draft rows so far
            logits = runner.side_forward(self.view, ids, torch.tensor([[at]], device=runner.device),
                                         runner.mask(visible, runner.length), at)          # (1, V)
            tokens.append(int(logits[0].argmax()))
            if self.cfg.min_confidence > 0 and float(torch.softmax(logits[0], -1).max()) < self.cfg.min_confidence:
                break
        return Draft(chain_tree(tokens[0], tokens[1:]))
