"""A precompiled graph called without dynamo's prologue.

A graph loaded from disk (core/runtime/graphs.py `Precompiled`) is a function dynamo wrote: its
bytecode fetches every weight and cache tensor the graph reads from its owner, attribute by
attribute (the target's verify: 370 inputs, ~2,600 bytecode instructions), reads the inputs'
symbolic sizes, calls the compiled graph with that flat list, and builds the method's return value
from the graph's outputs. On the 2-core Zen 4 that prologue cost 0.33 ms of a 4.8 ms 2-token
verify (min over 400 calls alternated with the graph called on the same flat list: 4.50 against
4.15 ms; median 5.23 against 4.91), paid by every token; the head's step reads 20 inputs and
pays ~0.015 ms. Without it, the same engine alternating the two per prompt (16 MT-bench prompts x
128 tokens, twice): plain 138.5 -> 143.3 tokens/s, EAGLE 158.9 -> 164.5 (both 1.035x), the same
tokens in every answer.

The owner's tensors are the same objects at every call (weights, and caches written in place), so
one call's flat list is a template: `record` captures it as dynamo's function calls the graph, and
`FlatCall` then puts each call's own inputs and sizes into it. The graphs' symbolic sizes are the
caller's `sizes`: groups of (input, axis) equal by construction (T: the ids', positions' and
features' axis 1 and the mask's axis 2; Lk: the mask's axis 3). An int in the flat list is read
from the group whose axes held its value in the recorded call; if two groups held it (T == Lk),
which one the graph meant is unknown, and the next call records instead. A fixed axis that holds
the same value (a feature width of 576, an Lk of 576) is no candidate: it cannot vary.
The prologue has no other effect to skip: what follows the graph in the bytecode returns its
outputs and sets transformers' output collector back to the state it is already in (a compile's
flags, off).
"""

from dataclasses import dataclass
from typing import Callable

import torch

GRAPH_PREFIX = "__compiled_fn"   # how dynamo names the graph its function calls


@dataclass(frozen=True)
class FlatCall:
    graph: Callable                          # the compiled graph: flat inputs -> flat outputs
    template: tuple                          # the recorded flat inputs; per-call slots are overwritten
    inputs_at: tuple[tuple[int, int], ...]   # (slot, index of the call's input)
    sizes_at: tuple[tuple[int, int, int], ...]   # (slot, input, axis): a symbolic size
    returns: tuple[int | None, ...]          # the method's return: the graph output at each place, or None

    def __call__(self, *args: torch.Tensor):
        flat = list(self.template)
        for slot, i in self.inputs_at:
            flat[slot] = args[i]
        for slot, i, axis in self.sizes_at:
            flat[slot] = args[i].shape[axis]
        out = self.graph(*flat)
        return tuple(None if j is None else out[j] for j in self.returns)


@dataclass(frozen=True)
class Recorded:
    """One call through dynamo's function: its result, and the FlatCall it teaches (None: why not, in `reason`)."""
    result: tuple
    flat: FlatCall | None
    reason: str = ""


Axes = tuple[tuple[int, int], ...]   # (input, axis) pairs of one symbolic size


def record(fn: Callable, owner, args: tuple, sizes: tuple[Axes, ...]) -> Recorded:
    """Call dynamo's function `fn` (owner, *args) once, watching the flat list it hands its graph;
    `sizes`: the symbolic sizes, each as the axes that hold it."""
    names = [n for n in fn.__code__.co_names if n.startswith(GRAPH_PREFIX)]
    if len(names) != 1:
        return Recorded(fn(owner, *args), None, f"the graph's function calls {len(names)} graphs")
    graph, seen = fn.__globals__[names[0]], {}

    def watched(*flat):
        seen["flat"], seen["out"] = list(flat), graph(*flat)   # the graph may empty the list it is given
        return seen["out"]

    fn.__globals__[names[0]] = watched
    try:
        result = fn(owner, *args)
    finally:
        fn.__globals__[names[0]] = graph
    if not seen:
        return Recorded(result, None, "the function did not call its graph")
    flat, reason = taught(graph, seen["flat"], seen["out"], args, result, sizes)
    return Recorded(result, flat, reason)


def taught(graph: Callable, flat: list, out, args: tuple, result, sizes: tuple[Axes, ...]) -> tuple[FlatCall | None, str]:
    """The FlatCall that rebuilds `flat` from args, and `result` from `out`; or None and why."""
    inputs_at, sizes_at = [], []
    for slot, x in enumerate(flat):
        mine = [i for i, a in enumerate(args) if x is a]
        if mine:
            inputs_at.append((slot, mine[0]))
        elif isinstance(x, int):
            held = [axes[0] for axes in sizes if any(args[i].shape[axis] == x for i, axis in axes)]
            if len(held) != 1:
                return None, f"input {slot} (= {x}) is {'none' if not held else 'more than one'} of the symbolic sizes"
            sizes_at.append((slot, *held[0]))
    if not isinstance(result, tuple):
        return None, f"the method returns a {type(result).__name__}, not a tuple"
    returns = []
    for r in result:
        at = [j for j, o in enumerate(out) if o is r]
        if r is not None and not at:
            return None, "the method returns a tensor the graph did not"
        returns.append(at[0] if at else None)
    return FlatCall(graph, tuple(flat), tuple(inputs_at), tuple(sizes_at), tuple(returns)), ""
