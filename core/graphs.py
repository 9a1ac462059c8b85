"""Compiled graphs for the target runner's verify and the EAGLE head's step.

Both callers pad their inputs to a few fixed sizes and build the additive attention mask outside
the graph, so each size compiles once. On a GPU a graph is a CUDA graph (torch.compile's
reduce-overhead): one launch replays every kernel of the forward, where eager decoding pays the
host's dispatch cost per kernel (on the H200 we measured 29 ms for one eager target token against
7.6 ms replayed). On a CPU it is inductor code, and the mask's width (the cache
rows attention reads) stays a symbolic size, so a chat growing longer never recompiles.
"""

import torch

RECOMPILE_LIMIT = 64  # graphs on one code object: every bucket of every runner and head a model switch builds


def compile_graph(fn, device: torch.device):
    """fn(*tensors, mask) -> a tensor or a tuple of tensors (None allowed), compiled whole; the last
    argument is the (1, 1, T, Lk) additive mask. On CUDA the outputs are cloned: the next replay
    overwrites a graph's own output buffers."""
    # Past the limit dynamo would fall back to eager without a word.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    if device.type == "cuda":
        compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True, dynamic=False)

        def replay(*args):
            torch.compiler.cudagraph_mark_step_begin()
            outputs = compiled(*args)
            return tuple(None if t is None else t.clone() for t in outputs)
        return replay
    # Lk, the mask's width, stays symbolic: one graph per size whatever the chat's length.
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)

    def run(*args):
        torch._dynamo.mark_dynamic(args[-1], 3)
        return compiled(*args)
    return run


def compiled_all(compile_each, report=None) -> bool:
    """Run `compile_each` (one call per graph, each compiling it); -> whether every graph compiled.
    Where torch cannot compile (no C++ compiler, say), say so through `report`: the caller drops
    its graphs and runs eagerly."""
    try:
        compile_each()
        return True
    except torch._dynamo.exc.BackendCompilerFailed as e:
        if report is not None:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            report(f"Compiling failed ({first}); running the eager forward instead (slower; --no-compile skips trying)")
        return False
