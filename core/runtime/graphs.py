"""Compiled graphs for the target runner's verify and the EAGLE head's step.

Both callers pad their inputs to a few fixed sizes and build the additive attention mask outside
the graph, so each size compiles once. On a GPU a graph is a CUDA graph (torch.compile's
reduce-overhead): one launch replays every kernel of the forward, where eager decoding pays the
host's dispatch cost per kernel (on the H200 we measured 29 ms for one eager target token against
7.6 ms replayed). On a CPU it is inductor code, and the mask's width (the cache
rows attention reads) stays a symbolic size, so a chat growing longer never recompiles.

Once compiled, a graph's code is called directly, as vLLM does: through torch.compile, dynamo
checks ~600 guards on every call (each weight's and cache row's shape, dtype and strides, the
modules' hooks) before it runs the compiled code, 1.7 ms of a 10 ms CPU token of the embedded
model (measured: 91 -> 108 tokens/s). A graph's inputs are its bucket's fixed shapes and its
runner's own weights and cache, so the guards that chose the code on the first call hold on
every later one. What stays checked: grad mode and each input's dtype, device and shape against
the first call's (`signature`, two microseconds); on a GPU also inductor's own asserts of sizes and
strides; not the mask's width against the cache, which `attended_rows` bounds. A CPU's precompiled
graph is compiled without those asserts (`NO_ASSERTS`): the target's reads ~700 weight and cache
tensors, fixed by the graph folder's key, and checking each at every call cost 0.4-0.5 ms of a 7 ms
token (2-core EPYC, the same runner alternating between graphs with and without: 1 / 4 / 16 tokens
7.57 / 10.12 / 24.34 ms with, 7.07 / 9.58 / 23.83 without).

A CPU precompiles one graph for several buckets: their row count T stays symbolic too, within the
buckets' range (`GraphJob.rows`), so the first start compiles the target twice (1 token, and 2-16
tokens) instead of once per bucket. Inductor's kernels for a symbolic T gave the static ones'
outputs bit for bit and their speed within noise (2-core Xeon, 2 / 4 / 8 / 16 tokens: 19.3 / 22.8
/ 29.7 / 51.5 ms static, 18.8 / 23.6 / 32.8 / 51.7 symbolic), and one compile cost 72 s against
45-59 s per static bucket. A size of 1 gets its own graph: torch specializes sizes of 1, and it is
plain decoding's. A range never spans a row count where a layer switches kernels (`row_groups`).
"""

import functools
import inspect
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch._inductor.config
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from core.runtime.prologue import FlatCall, record

RECORD_TRIES = 3      # calls a precompiled graph may record before it keeps dynamo's prologue (core/runtime/prologue.py)
RECOMPILE_LIMIT = 64  # graphs on one code object: every bucket of every runner and head a model switch builds


class NotCompiled(RuntimeError):
    pass


# What torch raises where it cannot compile or store a graph (no C++ compiler, past RECOMPILE_LIMIT
# graphs after many model switches, a graph it cannot serialize).
COMPILE_ERRORS = (torch._dynamo.exc.BackendCompilerFailed, torch._dynamo.exc.FailOnRecompileLimitHit,
                  torch._dynamo.exc.PackageError, NotCompiled)


class Graph:
    """fn(*tensors, mask) -> a tensor or a tuple of tensors (None allowed), compiled whole on the
    first call, then its compiled code called without dynamo. fn is a bound method (the runner's
    or the head step's forward); the last argument is the (1, 1, T, Lk) additive mask."""

    def __init__(self, fn, device: torch.device):
        # Past the limit a fullgraph compile raises (FailOnRecompileLimitHit) instead of compiling.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self.cuda = device.type == "cuda"
        mode = "reduce-overhead" if self.cuda else None
        self.fn = fn
        self.compiled = torch.compile(fn, mode=mode, fullgraph=True, dynamic=False)
        self.direct = None  # the compiled code, bound after the first call
        self.signature = None  # the inputs it was compiled for

    def __call__(self, *args):
        if self.cuda:
            torch.compiler.cudagraph_mark_step_begin()
        if self.direct is not None:
            if signature(args, self.cuda) != self.signature:
                raise ValueError(f"{self.fn.__qualname__} was compiled for inputs {self.signature}; "
                                 f"called with {signature(args, self.cuda)}")
            outputs = self.direct(*args)
        else:
            if not self.cuda:  # Lk stays symbolic: one graph per size whatever the chat's length
                torch._dynamo.mark_dynamic(args[-1], 3)
            outputs = self.compiled(*args)
            self.direct, self.signature = compiled_code(self.fn, args), signature(args, self.cuda)
        # The next replay overwrites a CUDA graph's own output buffers.
        return tuple(None if t is None else t.clone() for t in outputs) if self.cuda else outputs


def signature(args: tuple, cuda: bool, rows: bool = False) -> tuple:
    """Whether autograd records, and each input's dtype, device and shape; on a CPU the mask's
    width (last input, last axis) is left out: it is symbolic in the graph. With `rows`, T too
    (axis 1; the mask's axis 2): a graph serving several buckets checks it against its `rows`."""
    last = len(args) - 1

    def shape(i: int, t: torch.Tensor) -> tuple:
        dims = list(t.shape[:-1] if i == last and not cuda else t.shape)
        if rows:
            dims[2 if i == last else 1] = None
        return tuple(dims)

    return (torch.is_grad_enabled(), *((t.dtype, t.device, shape(i, t)) for i, t in enumerate(args)))


def compiled_code(method, args: tuple):
    """The code dynamo compiled for method(*args), as a function of the same arguments: the cache
    entry of method's code whose guards these arguments pass, the one dynamo itself would run."""
    func, owner = method.__func__, method.__self__
    bound = inspect.signature(func).bind(owner, *args)
    bound.apply_defaults()  # the guards may read any argument, defaulted ones too
    frame = dict(bound.arguments)
    entry = next((e for e in _debug_get_cache_entry_list(func.__code__) if e.code is not None and e.guard_manager.check(frame)), None)
    if entry is None:  # dynamo ran it eagerly (disabled, say)
        raise NotCompiled(f"torch did not compile {func.__qualname__}")
    compiled = types.FunctionType(entry.code, func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    compiled.__kwdefaults__ = func.__kwdefaults__  # the code has fn's signature; defaults live on the function
    return functools.partial(compiled, owner)


@dataclass(frozen=True)
class GraphJob:
    """One graph to precompile: `fn` (a bound method: the runner's or the head step's forward) on
    example inputs `args` of rows[0] rows, serving every row count in `rows`, stored as `name`;
    `adopt` hands the loaded graph to its owner. Inputs are (1, T, ...), the mask (1, 1, T, Lk)."""
    name: str                      # its file's name, e.g. "target-2-16"
    label: str                     # for people, e.g. "the target's 2- to 16-token verifies"
    fn: Callable
    args: tuple
    adopt: Callable[["Precompiled"], None]
    rows: tuple[int, ...]          # the buckets it serves: one, or several with T symbolic


def row_groups(sizes: Sequence[int], edges: Sequence[int] = ()) -> list[tuple[int, ...]]:
    """Buckets -> the groups that share a graph: 1 alone (torch specializes a size of 1), the rest
    in runs that no edge splits (a layer that computes calls of `edge` rows or more on another
    kernel: a symbolic T must not span the switch)."""
    groups: list[list[int]] = []
    for size in sorted(sizes):
        if groups and size > 1 and groups[-1][0] > 1 and not any(groups[-1][-1] < e <= size for e in edges):
            groups[-1].append(size)
        else:
            groups.append([size])
    return [tuple(g) for g in groups]


def graph_name(prefix: str, rows: tuple[int, ...], suffix: str = "") -> str:
    """e.g. "target-1", "target-2-16", "head-2-8x576"."""
    span = str(rows[0]) if len(rows) == 1 else f"{rows[0]}-{rows[-1]}"
    return f"{prefix}-{span}{suffix}"


def rows_label(rows: tuple[int, ...]) -> str:
    """e.g. "1-token", "2- to 16-token"."""
    return f"{rows[0]}-" if len(rows) == 1 else f"{rows[0]}- to {rows[-1]}-"


def symbolic_sizes(inputs: int, rows: bool) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The sizes a graph leaves symbolic, each as the (input, axis) pairs that hold it: the mask's
    width (the last input's axis 3), and with `rows` T (every input's axis 1, the mask's axis 2)."""
    last = inputs - 1
    width = ((last, 3),)
    return (width, (*((i, 1) for i in range(last)), (last, 2))) if rows else (width,)


def mark_rows(args: tuple, rows: tuple[int, ...]) -> None:
    """Leave the `symbolic_sizes` symbolic: the mask's width always (one graph whatever the chat's
    length), T within rows' range where the graph serves several."""
    width, *counts = symbolic_sizes(len(args), len(rows) > 1)
    for i, axis in width:
        torch._dynamo.mark_dynamic(args[i], axis)
    for i, axis in (counts[0] if counts else ()):
        torch._dynamo.mark_dynamic(args[i], axis, min=rows[0], max=rows[-1])


def no_guards(entries) -> list[bool]:
    """Keep none of dynamo's guards: a precompiled graph is checked by `signature` (module docstring)."""
    return [False] * len(entries)


# Nor inductor's per-call asserts on every input's size, stride and alignment (module docstring).
# A config patch around the compile, not torch.compile's options: with those, saving the dynamic-T
# graph failed to pickle dynamo's guard manager.
NO_ASSERTS = {"size_asserts": False, "alignment_asserts": False}
# Inductor's own kernels single-threaded: a graph's norms, rotary embeddings, residuals and cache
# writes touch at most 64 rows of 576-1536 values, and on a symbolic T inductor opened an OpenMP
# team for each of them anyway (12 of the 14 kernels of the 2-16-token verify), ~250 fork-joins a
# verify that wait on the slower core of a shared host. The 4-bit linears and attention keep both
# cores (their own at::parallel_for). Same arithmetic per row (the teams split rows, not sums).
# Median verify on the embedded model, 2-core Zen 4, 40 rounds each, alternating graph folders in
# one session, ms at 1 / 2 / 3 / 4 / 8 tokens: 7.24 / 8.77 / 11.39 / 11.45 / 19.10 with the
# teams, 6.33 / 6.76 / 7.91 / 8.11 / 14.04 without.
ONE_THREAD = {"cpp.threads": 1}
# Inductor's wrapper in C++: its Python wrapper called each of a verify's ~300 kernels and 4-bit
# linears from Python. 2-core Zen 4, the target's graphs alternated, median of 80 calls, 1 / 2 / 4 /
# 8 tokens: 0.56 / 0.85 / 0.78 / 0.88 ms less a verify of 5-13 ms; 8 MT-bench prompts x 128 tokens,
# one engine alternating graph folders, median of 4: plain 112.5 -> 124.8 tok/s, EAGLE d0k1n2
# 131.4 -> 145.1, the same tokens in every answer. Built apart from the kernels, the four graphs
# compiled in 62 s from cold caches, against 87 s with the Python wrapper.
CPP_WRAPPER = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}


def precompile(job: GraphJob, folder: Path) -> Path:
    """Trace and compile job.fn(*job.args) whole, without running it, into folder/job.name; -> the file."""
    mark_rows(job.args, job.rows)
    compiled = torch.compile(job.fn, fullgraph=True, dynamic=False, options={"guard_filter_fn": no_guards})
    with torch.inference_mode(), torch._inductor.config.patch({**NO_ASSERTS, **ONE_THREAD, **CPP_WRAPPER}):  # as verifies and drafts run
        fn = compiled.aot_compile((job.args, {}))
    folder.mkdir(parents=True, exist_ok=True)
    fn.save_compiled_function(str(folder / job.name))  # written whole or not at all
    return folder / job.name


class Precompiled:
    """A graph `precompile` stored, loaded and called as the method it was compiled from, on this
    process's own owner (runner or head step): its weights and cache, not the compiling process's.
    After its first call, without dynamo's prologue (core/runtime/prologue.py)."""

    def __init__(self, path: Path, job: GraphJob):
        with open(path, "rb") as f:
            self.code = torch.compiler.load_compiled_function(f)
        self.code.disable_guard_check()
        self.rows, self.name = job.rows, job.name
        with torch.inference_mode():  # the state it is called in
            self.owner, self.signature = job.fn.__self__, signature(job.args, cuda=False, rows=True)
        self.flat: FlatCall | None = None   # the graph without dynamo's prologue, once a call taught it
        self.tries = RECORD_TRIES

    def __call__(self, *args):
        called = signature(args, cuda=False, rows=True)
        if called != self.signature or args[0].shape[1] not in self.rows:
            raise ValueError(f"a graph precompiled for inputs {self.signature} of {self.rows} rows was called with "
                             f"{called} of {args[0].shape[1]} rows")
        if self.flat is not None:
            return self.flat(*args)
        if not self.tries:
            return self.code(self.owner, *args)
        recorded = record(self.code.fn, self.owner, args, symbolic_sizes(len(args), len(self.rows) > 1))
        self.flat, self.tries = recorded.flat, self.tries - 1
        if self.flat is None and not self.tries:
            print(f"Aerie: the graph {self.name} keeps dynamo's prologue (~0.3 ms a verify more): {recorded.reason}",
                  flush=True)
        return recorded.result


def build(jobs: Sequence[GraphJob], folder: Path, report=None, stored=None, adopt: bool = True) -> None:
    """Each job's graph: precompiled into `folder` unless an earlier run stored it there (then
    `stored(name, seconds)`), and with `adopt` loaded and handed to its owner."""
    missing, start = [job.name for job in jobs if not (folder / job.name).is_file()], time.perf_counter()
    for job in jobs:
        if job.name in missing:
            t0 = time.perf_counter()
            if report is not None:
                report(f"compiling {job.label} ({missing.index(job.name) + 1} of {len(missing)}, {t0 - start:.0f} s so far; "
                       "once per machine: 1-2 minutes each on 2 busy cores; later starts load them)")
            precompile(job, folder)
            if stored is not None:
                stored(job.name, time.perf_counter() - t0)
        if adopt:
            job.adopt(Precompiled(folder / job.name, job))


def compiled_all(compile_each, report) -> bool:
    """Run `compile_each` (one call per graph, each compiling it); -> whether every graph compiled.
    Where torch cannot compile (no C++ compiler, or past RECOMPILE_LIMIT graphs after many model
    switches), say so through `report` (never silently): the caller drops its graphs and runs eagerly."""
    try:
        compile_each()
        return True
    except COMPILE_ERRORS as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        report(f"Compiling failed ({first}); running the eager forward instead (slower; --no-compile skips trying)")
        return False
