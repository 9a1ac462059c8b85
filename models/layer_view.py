"""A decoder that runs only some of a model's layers, sharing every weight: the draft model of
self-speculative decoding (Draft & Verify, SWIFT) and, with the first E layers, LayerSkip's early
exit.

The view is an instance of the decoder's own class, built on the meta device (no weights) and then
given the decoder's own submodules, its layer list cut to the kept ones. It runs transformers'
forward unchanged: the config it carries says how many layers there are, and each kept layer keeps
its `layer_idx`, so it reads and writes the same `Cache` layer as in the full model.
"""

import copy
from collections.abc import Sequence

import torch
from torch import nn


def layer_view(decoder: nn.Module, keep: Sequence[int]) -> nn.Module:
    """`decoder` (a transformers decoder: embeddings, `layers`, norm) through the layers `keep`
    (ascending indices) only; every weight and buffer is the decoder's own."""
    total = decoder.config.num_hidden_layers
    keep = tuple(keep)
    if not keep or list(keep) != sorted(set(keep)) or keep[0] < 0 or keep[-1] >= total:
        raise ValueError(f"keep must be ascending distinct layer indices in [0, {total}), got {keep}")
    config = copy.deepcopy(decoder.config)
    config.num_hidden_layers = len(keep)
    if getattr(config, "layer_types", None) is not None:   # per-layer attention kinds follow the layers kept
        config.layer_types = [config.layer_types[i] for i in keep]
    with torch.device("meta"):
        view = type(decoder)(config)
    for name, child in decoder.named_children():
        setattr(view, name, nn.ModuleList([decoder.layers[i] for i in keep]) if name == "layers" else child)
    for name, tensor in decoder.named_parameters(recurse=False):
        setattr(view, name, tensor)
    for name, tensor in decoder.named_buffers(recurse=False):
        view.register_buffer(name, tensor)
    return view.eval()
