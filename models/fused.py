"""Linears that read one input, computed as one matmul: a decoder layer's q, k and v projections,
its MLP's gate and up projections.

On a CPU each 4-bit linear call has a fixed cost (the op's dispatch, its two threads' fork and
join, its output's allocation) that a small projection does not hide: on the 2-core Zen 4, hot,
2 rows, q / k / v (576 / 192 / 192 outputs) took 8.7 + 6.2 + 6.2 us apart and 11.2 us as one
960-output call. Every output row is quantized and summed on its own (4-bit groups of 32 inputs
per row; each output a sum over its inputs in a fixed order), so the joined weight holds the very
codes and scales the parts would and gives the same bits. The embedded model's compiled verify,
one process alternating graphs of the two (median of 300 calls, three times): 1 token 4.86-5.49
-> 4.34-4.69 ms, 2 tokens 6.15-6.37 -> 5.29-5.57, 4 tokens 0.87-1.03x, the same logits; whole
answers, two engines alternated per prompt (16 MT-bench prompts x 128 tokens, twice): plain
155.5 -> 178.3 tokens/s, EAGLE 177.8 -> 197.2, the same text.

transformers' decoder layers call their projections as modules on the same hidden states, so each
projection becomes a `Part` of one `Joint`: the first part called with an input computes the
joined output for it, every part returns its slice of that, and the last part forgets it. A part
called with another input computes the joined output again (the same answer, a call more).
"""

import torch
from torch import nn

SHARED_INPUTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))   # children that read one input


class Joint(nn.Module):
    """One linear whose output (.., sum of sizes) is the parts' outputs side by side."""

    def __init__(self, linear: nn.Module, sizes: tuple[int, ...]):
        super().__init__()
        self.linear, self.sizes = linear, sizes
        self.input, self.output, self.left = None, None, 0   # the input being served, its output, parts still to read it

    def read(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        if self.input is not x:   # the first part to read this input
            self.input, self.output, self.left = x, self.linear(x), len(self.sizes)
        y = self.output[..., start:stop]
        self.left -= 1
        if not self.left:   # every part has read it: nothing held between forwards
            self.input, self.output = None, None
        return y


class Part(nn.Module):
    """Outputs [start, stop) of a Joint: what one of the joined linears computed."""

    def __init__(self, joint: Joint, start: int, stop: int):
        super().__init__()
        self.joint, self.start, self.stop = joint, start, stop

    @property
    def computed_by(self) -> nn.Module:
        """The linear that computes this part's outputs."""
        return self.joint.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.joint.read(x, self.start, self.stop)


def joinable(linears: list) -> bool:
    """nn.Linears without biases that read inputs of one width."""
    return all(isinstance(m, nn.Linear) and m.bias is None for m in linears) and \
        len({m.in_features for m in linears}) == 1


def fuse_shared_inputs(model: nn.Module) -> int:
    """Replace each group of SHARED_INPUTS children (plain nn.Linears, no biases) with Parts of one
    nn.Linear over their stacked weights, in place, before the model is quantized; -> the groups joined."""
    joined = 0
    for module in list(model.modules()):
        for names in SHARED_INPUTS:
            linears = [getattr(module, name, None) for name in names]
            if not joinable(linears):
                continue
            weight = torch.cat([m.weight.detach() for m in linears])      # (sum N, K)
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
            linear.weight = nn.Parameter(weight, requires_grad=False)
            joint, start = Joint(linear, tuple(m.out_features for m in linears)), 0
            for name, size in zip(names, joint.sizes):
                setattr(module, name, Part(joint, start, start + size))
                start += size
            joined += 1
    return joined
