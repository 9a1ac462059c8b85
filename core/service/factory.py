"""Building an engine from what the user asked for: target, quantization, device, drafter.
launch.py calls this at start, for the bench, and whenever the UI switches models."""

import functools
import hashlib
import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import psutil
import torch

from core.config import PLANNED_CONTEXT
from core.tune.budget import (GIB, MemoryBudgetError, ModelShape, Placement, largest_tree, plan_placement,
                              target_kv_per_token, tree_bytes)
from core.runtime.cpu_linear import accelerate_cpu
from core.service.drafters import (layer_skip_drafter, lookahead_drafter, lookup_rival, make_drafter, medusa_drafter,
                                   medusa_rival, narrow_rows)
from core.service.spec import EngineSpec, resolved_strategy
from core.service.warmup import Pending
from core.runtime.graphs import GraphJob, build, compiled_all
from core.spec.drafters import PlainDrafter, PromptLookupDrafter
from core.engine import Engine
from core.runtime.runner import CPU_BUCKETS, RunnerConfig, TargetRunner
from core.errors import UnsupportedModelError
from core.tune.kernels import (VERSION as KERNELS_VERSION, WIDE_ROWS, KernelChoice, TargetKernel, TreeKernels,
                               apply_target_kernel, apply_wide, cached_choice, choose_head_weights, choose_target_kernel,
                               choose_wide_from, cpu_flags, head_weights_here, kernel_edges, machine_key, rows_alone,
                               time_draft_steps, twin_fits)
from core.tune.probe import Probe, load_nvml
from core.tune.latency import (LARGE_SIZES, SIZES, cached_profile, head_identity, measure_profile,
                               profile_key, profile_mismatch)
from core.tune.remembered import acceptance_path, keep, keep_speeds, recall, recall_speeds, speeds_path
from core.tune.shapes import Pins, PositionalAcceptance, prior_table
from core.tune.tuner import Tuner
from models import amx, attention, native, q4_rows, top2
from models.head_checkpoint import head_training_record
from models.native import NativeUnavailable
from models.quants import CPU_QUANTS
from models.target import LoadSpec, Target, load_resolved, resolve

GRAPHS_VERSION = 6   # 4: inductor kernels single-threaded (core/runtime/graphs.py ONE_THREAD); 5: a C++ wrapper (CPP_WRAPPER); 6: joined q/k/v and gate/up (models/fused.py)


@dataclass(frozen=True)
class Loaded:
    engine: Engine
    tuner: Tuner | None
    placement: Placement | None   # how the weights were placed on the GPU; None on CPU
    onednn: bool                  # CPU linears run through oneDNN
    profile_cached: bool          # the latency profile came from the cache (no measuring at start)
    compile_s: float = 0.0        # compiling (or loading the compiled) verify graphs at start
    kernels: KernelChoice | None = None   # a CPU target on small weights: what each part runs on
    pending: Pending | None = None        # graphs left to a child to compile (load_for_chat); no tuner until then


@dataclass(frozen=True)
class Staged:
    """An engine with every drafter the ladder may switch to, before its graphs and its tuner."""
    spec: EngineSpec
    engine: Engine
    drafters: dict
    placement: Placement | None
    onednn: bool
    kernels: KernelChoice | None
    graphs: Path | None           # a CPU's folder of precompiled graphs; None where none are used
    graph_jobs: tuple[GraphJob, ...] = ()   # what the folder holds or will: the runner's buckets, the head's steps

    def missing(self) -> list[GraphJob]:
        """The graphs no earlier run stored yet."""
        return [job for job in self.graph_jobs if not (self.graphs / job.name).is_file()]

    def adopt_stored(self) -> None:
        """Load and use every graph an earlier run stored."""
        build([job for job in self.graph_jobs if (self.graphs / job.name).is_file()], self.graphs)


def load_tuned(spec: EngineSpec, probe: Probe | None = None, report=print) -> Loaded:
    """The engine plus its tuner: its graphs compiled (or loaded), the machine's latency profile
    (measured once, then cached) and every drafter the ladder may switch to. `report` gets a line
    per compile step."""
    staged = stage(spec, probe, report)
    return tune(staged, probe, compile_graphs(staged, report))


# Children compiling a first start's graphs side by side, each its share (the missing graphs dealt
# in turn, the target's 1-token verify first): a graph's compile is mostly one core's Python and one
# g++, so on two cores two children compiled the embedded model's four graphs in 80 s against 128 s
# for one, and the tuner started 115 s after the page opened against 152 s (2-core Zen 4, a quiet
# host, fresh caches). More would add copies of the model for cores the chat needs.
COMPILE_CHILDREN = 2


def load_for_chat(spec: EngineSpec, compile_command: Callable[[EngineSpec, list[str]], list[str]],
                  probe: Probe | None = None, report=print) -> Loaded:
    """As load_tuned, except that on a CPU the graphs no earlier start stored are left to child
    processes (`compile_command(spec, graph names)`, core/service/warmup.py) while the chat answers
    eagerly: the page opens without waiting for a compile. -> Loaded without a tuner, and `pending`
    set, then."""
    staged = stage(spec, probe, report)
    missing = staged.missing() if staged.graphs is not None else []
    if not missing:
        return tune(staged, probe, compile_graphs(staged, report))
    need, free = psutil.Process().memory_info().rss, psutil.virtual_memory().available
    if free < 1.5 * need:  # a child holds a second copy of the model while it compiles
        report(f"Aerie: compiling before the chat opens: a compiling process would need {need / GIB:.1f} GiB "
               f"beside this one, and {free / GIB:.1f} GiB is free.")
        return tune(staged, probe, compile_graphs(staged, report))
    staged.adopt_stored()
    names = [job.name for job in missing]
    children = max(1, min(COMPILE_CHILDREN, len(names), os.cpu_count() or 1, int(free // (1.5 * need))))
    return Loaded(staged.engine, None, staged.placement, staged.onednn, False, 0.0, staged.kernels,
                  Pending(staged, missing, [compile_command(spec, names[i::children]) for i in range(children)]))


def stage(spec: EngineSpec, probe: Probe | None = None, report=print) -> Staged:
    """The target, this CPU's kernel choice, the drafters and the engine, all eager."""
    target, onednn, placement = load_fast_target(spec, probe)
    build_kernels(target, spec.cache_dir, report)
    greedy_kernel(target, spec.cache_dir, report)
    strategy = resolved_strategy(spec)
    asked = spec.attention == "rows" and row_attention(target, spec.cache_dir, report)
    kernels = cpu_kernels(target, spec, strategy, report, asked) if target.quant in CPU_QUANTS else None
    rows = asked or (spec.attention == "auto" and kernels is not None and rows_alone(kernels)
                     and row_attention(target, spec.cache_dir, report))
    drafters = {"plain": PlainDrafter(), "prompt_lookup": PromptLookupDrafter(),
                "lookahead": lookahead_drafter(target.device)}
    head_weights = kernels.head if kernels else "int8"
    if strategy == "eagle":
        drafters["eagle"] = make_drafter(target, replace(spec, strategy="eagle"), head_weights)
    last = target.model.config.get_text_config().num_hidden_layers   # Medusa reads the last layer's output
    features = drafters["eagle"].feature_layers if "eagle" in drafters else (last,) if spec.medusa else None
    if spec.medusa and last in features:
        drafters["medusa"] = medusa_drafter(target, spec, features, head_weights)
    elif spec.medusa:
        report(f"Aerie: the Medusa heads read the target's last layer, which this EAGLE-3 head's engine does not "
               f"capture (layers {list(features)}): no Medusa drafter beside it.")
    if strategy == "medusa" and "medusa" not in drafters:
        raise UnsupportedModelError("--strategy medusa needs Medusa heads for this model (--medusa), beside no EAGLE-3 head.")
    # oneDNN's prepacked fp32 linears compiled through MKL instead ran slower than eager oneDNN (25 vs
    # 42 tokens/s here): an fp32 CPU model stays eager. bitsandbytes' 4-bit layers on a CPU broke
    # inside inductor's code (an assert_size_stride after 305 s of compiling): they run eagerly too.
    nf4_cpu = target.quant == "nf4" and target.device.type == "cpu"
    if nf4_cpu and spec.compile:
        report("Aerie: nf4 runs eagerly on a CPU: bitsandbytes' 4-bit layers do not compile here "
               "(--quant int4, the CPU default, does).")
    runner = TargetRunner(target, RunnerConfig(compile=spec.compile and not onednn and not nf4_cpu,
                                               verify_delay_ms=spec.verify_delay_ms,
                                               buckets=cpu_buckets(kernels), row_attention=rows),
                          features)
    engine = Engine(target, drafters.get("eagle", drafters["prompt_lookup"]), runner)
    if not (runner.wants_graphs and target.device.type == "cpu"):
        return Staged(spec, engine, drafters, placement, onednn, kernels, None)
    # Built here, on the thread that runs torch: a job's example inputs are tensors (core/service/warmup.py).
    jobs = runner.graph_jobs(kernel_edges(kernels) if kernels else ())
    jobs += drafters["eagle"].graph_jobs() if "eagle" in drafters else []
    draft_rows = drafters["eagle"].draft_rows if "eagle" in drafters else None
    folder = graph_folder(spec, engine, kernels, draft_rows)
    return Staged(spec, engine, drafters, placement, onednn, kernels, folder, tuple(jobs))


def compile_graphs(staged: Staged, report=print) -> float:
    """Every graph of `staged`, in this process; -> seconds. On a CPU: those an earlier run stored
    are loaded, the rest precompiled and stored. On a GPU: CUDA graphs, captured here."""
    t0, runner, eagle = time.perf_counter(), staged.engine.runner, staged.drafters.get("eagle")
    if staged.graphs is not None:
        compiled_all(lambda: build(staged.graph_jobs, staged.graphs, lambda line: report(f"Aerie: {line}")), report)
        return time.perf_counter() - t0
    runner.warm_up(lambda line: report(f"Aerie: {line}"))
    # A compiled head step replays its ~30 small kernels without the host's dispatch per kernel: on
    # a GPU an eager d2k10n64 draft took 72 ms.
    if eagle is not None and runner.compiled:
        report("Aerie: compiling the draft head's step")
        eagle.warm_up(lambda line: report(f"Aerie: {line}"))
    return time.perf_counter() - t0


def timed_code(onednn: bool, graph_sizes: tuple[int, ...], head_sizes: tuple[int, ...], kernels: KernelChoice | None,
               row_attention: bool) -> str:
    """What a latency profile is timed on, for its key: a warm-up that failed part-way leaves some
    buckets eager; and which code: graphs of another version, or a kernel choice made by other
    rules, time differently (a profile of the old graphs steered the tuner after session 45's
    change: 4.52 ms a token where the new graphs took ~4.0)."""
    used = ("onednn" if onednn else "default") + (f" compiled {list(graph_sizes)} graphs v{GRAPHS_VERSION}"
                                                  if graph_sizes else " eager")
    if head_sizes:
        used += f", head compiled {list(head_sizes)}"
    if kernels is not None:
        used += f", {kernels.describe()} (kernel choice v{KERNELS_VERSION})"
    if row_attention:
        used += f", row attention {attention.source_digest(cpu_flags())}"
    return used


def tune(staged: Staged, probe: Probe | None = None, compile_s: float = 0.0) -> Loaded:
    """`staged` with its tuner: the latency profile of the engine as it runs now (cached per
    kernels), the prior from the head's training record, and the memory the trees may use."""
    spec, engine, drafters, target = staged.spec, staged.engine, staged.drafters, staged.engine.target
    runner = engine.runner
    offloaded = staged.placement is not None and staged.placement.offload
    used = timed_code(staged.onednn, runner.graph_sizes, drafters["eagle"].compiled_sizes if "eagle" in drafters else (),
                      staged.kernels, runner.row_attention)
    # A slow target (offloaded, or slowed on purpose) is SpecExec's regime: big best-first trees may
    # pay, so the profile also times large trees (those that fit half the context).
    slow = offloaded or spec.verify_delay_ms > 0
    sizes = SIZES + tuple(n for n in LARGE_SIZES[len(SIZES):] if n <= engine.context_len // 2) if slow else SIZES
    if slow:
        used += f", sizes to {sizes[-1]}" + (f", verify delay {spec.verify_delay_ms:g} ms" if spec.verify_delay_ms else "")
    if "eagle" in drafters:   # a head step's cost grows with the rows it scores (--draft-rows)
        used += f", {drafters['eagle'].draft_rows} draft rows"
    key = profile_key(engine, spec.head, used, offloaded)
    profile, cached = cached_profile(spec.cache_dir, key, lambda: measure_profile(engine, sizes),
                                     lambda stored: profile_mismatch(engine, stored))
    alphas = head_training_record(spec.head).get("val", {}).get("alphas") if "eagle" in drafters else None
    pins = spec.pins if spec.strategy == "auto" else replace(spec.pins, strategy=spec.strategy)
    max_size = tree_budget(target, pins, sizes, int(spec.vram_reserve_gb * GIB), probe)
    acceptance, keeper = PositionalAcceptance(prior_table(alphas)), None
    if "eagle" in drafters:   # what earlier sessions' chats taught this head, and where this one's goes
        path = acceptance_path(spec.cache_dir, {"model": str(target.model.config.name_or_path), "quant": target.quant,
                                                "head": head_identity(spec.head), "draft_rows": drafters["eagle"].draft_rows})
        acceptance, keeper = recall(path, acceptance.prior), functools.partial(keep, path)
    if spec.strategy == "layer_skip":   # measured on first use only: a minute on 2 cores for the embedded model
        drafters["layer_skip"] = layer_skip_drafter(engine, profile, spec.cache_dir)
    rivals = {"prompt_lookup": lookup_rival()}   # prompt lookup's chains shaped to this machine (core/spec/drafters.py)
    if "medusa" in drafters:
        rivals["medusa"] = medusa_rival(drafters["medusa"], engine, spec.medusa)
    speeds = speeds_path(spec.cache_dir, key)   # the answers' measured speedups, this machine's (remembered.py)
    tuner = Tuner(profile, acceptance, pins, drafters, max_size=max_size, keep=keeper,
                  best_first=slow and "eagle" in drafters, tree_rivals=rivals, heard=recall_speeds(speeds),
                  keep_heard=functools.partial(keep_speeds, speeds))
    return Loaded(engine, tuner, staged.placement, staged.onednn, cached, compile_s, staged.kernels)


def graph_folder(spec: EngineSpec, engine: Engine, kernels: KernelChoice | None, draft_rows: int | None) -> Path:
    """Where a CPU's precompiled graphs for this engine live: one folder per everything a graph's
    code depends on (the machine, torch, the model's shapes and kernels, the head and the draft
    vocabulary rows it scores, the buckets)."""
    runner = engine.runner
    key = {"graphs_version": GRAPHS_VERSION, **machine_key(), "model": str(engine.target.model.config.name_or_path),
           "quant": engine.target.quant, "dtype": str(engine.target.dtype),
           "kernels": {"edges": kernel_edges(kernels), "head": kernels.head, "kernel": kernels.target.kernel} if kernels else None,
           "head": head_identity(spec.head) if runner.feature_layers else None, "draft_rows": draft_rows,
           "attention": attention.source_digest(cpu_flags()) if runner.row_attention else "sdpa",
           "kv": str(runner.cache.layers[0].keys.dtype), "kv_values": str(runner.cache.layers[0].values.dtype),
           "buckets": list(runner.buckets), "capacity": runner.capacity,
           "features": runner.feature_layers}
    folder = spec.cache_dir / "graphs" / hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "key.json").write_text(json.dumps(key, indent=1))
    return folder


def build_kernels(target: Target, cache_dir: Path, report=print) -> None:
    """A CPU target's C++ kernels, built side by side before any is loaded or timed (a g++ beside
    the kernel timings would skew them): what a first start builds, in about half the time."""
    if target.device.type != "cpu":
        return
    flags = cpu_flags()
    kernels = [top2.kernel(flags)]
    if target.quant in CPU_QUANTS:   # the row attention, q4_rows for the target and the head, AMX for int4
        kernels += [attention.kernel(flags), q4_rows.kernel(flags),
                    amx.kernel(flags) if target.quant == "int4" else None]
    native.build_all([k for k in kernels if k is not None], cache_dir, report)


def row_attention(target: Target, cache_dir: Path, report=print) -> bool:
    """Whether a CPU target's exact attention runs on the row kernel (models/attention.py), built
    here once per machine; where it cannot be, say why: fp64 SDPA serves, as exact and slower."""
    if target.device.type != "cpu" or target.quant not in CPU_QUANTS:
        return False
    try:
        attention.load(cache_dir, cpu_flags())
    except NativeUnavailable as e:
        report(f"Aerie: attention runs in fp64, 2-4x slower: its fp32 row kernel cannot be built here ({e}).")
        return False
    return True


def greedy_kernel(target: Target, cache_dir: Path, report=print) -> None:
    """A CPU target's one-pass argmax and margin for greedy acceptance (models/top2.py), built here
    once per machine; where it cannot be, say why: torch's topk serves, ~0.1 ms a round slower."""
    if target.device.type != "cpu":
        return
    try:
        top2.load(cache_dir, cpu_flags())
    except NativeUnavailable as e:
        report(f"Aerie: greedy acceptance runs on torch's topk, ~0.1 ms a round slower: its kernel cannot be built here ({e}).")


def cpu_kernels(target: Target, spec: EngineSpec, strategy: str, report=print, rows: bool = False) -> KernelChoice:
    """This machine's kernel choice for `target` (core/tune/kernels.py), measured once and cached, and
    the target's int4 layers set up for it. rows: whether
    attention runs on the row kernel (`row_attention`), as the timed verifies do."""
    key = {**machine_key(), "model": str(target.model.config.name_or_path), "quant": target.quant,
           "head": head_identity(spec.head) if strategy == "eagle" else None, "amx_kernel": amx.source_digest(),
           "narrow_rows": narrow_rows(spec.draft_rows, target.device) if strategy == "eagle" else None,   # the timed head's rows
           "q4_rows": q4_rows.source_digest(cpu_flags()),
           "mix": spec.kernel_mix,
           "attention": attention.source_digest(cpu_flags()) if rows else "sdpa"}

    def measure() -> KernelChoice:
        report("Aerie: timing this CPU's kernels for trees and drafts (once; cached for later starts)...")
        kernel = choose_target_kernel(target, spec.cache_dir, report, spec.kernel_mix) if target.quant == "int4" else TargetKernel()
        trees = (choose_wide_from(target, row_attention=rows) if target.quant == "int4"
                 and twin_fits(target, psutil.virtual_memory().available) else TreeKernels(None, CPU_BUCKETS[-1], {}))
        head, head_ms = "int8", {}
        if strategy == "eagle":
            head, head_ms = choose_head_weights(lambda quant: time_draft_steps(make_drafter(target, spec, quant)),
                                                  head_weights_here(spec.cache_dir))
        return KernelChoice(trees.wide_from, trees.largest, head, trees.verify_ms, head_ms, kernel)

    choice, cached = cached_choice(spec.cache_dir, key, measure)
    if cached:
        try:
            apply_target_kernel(target, choice.target, spec.cache_dir)
        except NativeUnavailable as e:   # chosen here once, gone now (a compiler removed): say so, run int4
            report(f"Aerie: the {choice.target.kernel} kernel chosen for this machine cannot load ({e}); the target runs on int4.")
            choice = replace(choice, target=TargetKernel())
    apply_wide(target, choice)
    return choice


def cpu_buckets(kernels: KernelChoice | None) -> tuple[int, ...] | None:
    """A CPU's verify sizes: beyond 8 tokens only up to the largest that can pay on this machine's
    kernels (`KernelChoice.largest`); None on other devices (the runner's own)."""
    if kernels is None:
        return None
    return CPU_BUCKETS + tuple(n for n in WIDE_ROWS if CPU_BUCKETS[-1] < n <= kernels.largest)


def tree_budget(target: Target, pins: Pins, sizes: tuple[int, ...], reserve: int, probe: Probe | None) -> int:
    """The largest tree the memory left after the weights holds, beside a chat's KV cache at the
    planned context: what the tuner may choose. A pinned --total-tokens beyond it is refused."""
    shape = ModelShape.from_config(target.model.config.to_dict())
    context = min(PLANNED_CONTEXT, shape.context_len)
    dtype_bytes = target.dtype.itemsize
    if target.device.type == "cuda":
        free = gpu_free(target.device, probe)
    else:
        free = psutil.virtual_memory().available
    available = free - reserve - context * target_kv_per_token(shape, dtype_bytes)
    if pins.total_tokens and tree_bytes(shape, pins.total_tokens, context, dtype_bytes) > available:
        raise MemoryBudgetError(
            f"A {pins.total_tokens}-token tree needs {tree_bytes(shape, pins.total_tokens, context, dtype_bytes) / GIB:.2f} GiB "
            f"at a {context}-token context; {max(available, 0) / GIB:.2f} GiB is left beside the KV cache and the "
            f"reserve. Lower --total-tokens or --vram-reserve.")
    largest = largest_tree(shape, context, dtype_bytes, available, sizes)
    if largest < 2 and not pins.strategy:
        raise MemoryBudgetError(f"Only {max(available, 0) / GIB:.2f} GiB is left beside a {context}-token KV cache and the "
                                "reserve: not enough to verify a draft. Lower --vram-reserve or load a smaller model.")
    return max(largest, 2)


def load_fast_target(spec: EngineSpec, probe: Probe | None = None) -> tuple[Target, bool, Placement | None]:
    """The target, placed within the GPU's free memory (part offloaded to RAM if it must be), with
    oneDNN linears on CPU where they are faster; -> (target, whether they are, placement)."""
    resolved = resolve(target_load_spec(spec))
    placement = None
    if resolved.device.type == "cuda":
        placement = plan_placement(ModelShape.from_config(resolved.config), resolved.quant, resolved.dtype.itemsize,
                                   gpu_free(resolved.device, probe), int(spec.vram_reserve_gb * GIB))
    target = load_resolved(resolved, placement.gpu_weight_bytes if placement else None)
    return target, accelerate_cpu(target), placement


def target_load_spec(spec: EngineSpec) -> LoadSpec:
    return LoadSpec(model=spec.model, quant=spec.quant, device=spec.device, cache_dir=spec.cache_dir)


def gpu_free(device: torch.device, probe: Probe | None) -> int:
    """Free bytes on the card, as NVML sees it (all processes), else as the CUDA driver does."""
    index = device.index or 0
    gpus = {g.index: g for g in (probe or Probe(load_nvml())).read_gpus()}
    return gpus[index].free if index in gpus else torch.cuda.mem_get_info(index)[0]


