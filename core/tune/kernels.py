"""Which CPU kernel each part of a round runs on: measured on this machine, once, then cached.

Each choice timed the way a chat runs it, never taken from a table:
  - the target's 4-bit kernel (int4, q4_rows or AMX, the same weight values; `choose_target_kernel`)
    and, on q4_rows, the row count from which its tiled path (the same bits) runs;
  - the target's linears for a tree of many rows: torch's int4 kernel, or from some row count on
    the layer's exact fp32 twin on oneDNN (models/cpu_quant.py `Int4Linear.widen`: the same
    weight values, so greedy output stays plain decoding's). Timed as whole eager verifies with
    the weights cold, as in a round: a hot-cache microbenchmark flatters the twin, whose 4 bytes
    per weight must come from memory (2-core AMD EPYC, AVX-512 and AVX512-BF16, no AMX: 0.52 vs
    0.68 ms for one 576x1536 linear at 64 rows, but a 16-token verify 82 vs 50 ms in the model);
  (a prompt's prefill runs on the verify buckets, core/runtime/runner.py `prefill`, so no twin of
    its own; version 10's timing of one is gone);
  - the draft head's weights: int8 or int4 (torch's weight-only kernels), int4 on q4_rows, or
    bf16 on oneDNN (dot products in hardware where the CPU has AVX512-BF16 or AMX). Drafts
    only: the target verifies every token, so this changes speed and acceptance, never the output.
    A draft starts with the head's weights evicted by the verify, so fewer bytes win here: on the
    2-core EPYC a catch-up and two 4-row steps took 2.4-3.4 ms in int4, 4.1-4.6 in int8, 6.4 in
    bf16 (compiled), and MT-bench acceptance did not move (16 prompts x 64 tokens, accepted per
    round int8 / int4: d2k1n4 1.79 / 1.81, d1k2n4 1.86 / 1.85, d3k4n8 2.22 / 2.16).
"""

import hashlib
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from core.files import stored
from core.runtime.runner import RunnerConfig, TargetRunner
from core.spec.tree import chain_tree
from models import amx, q4_rows
from models.cpu_quant import Int4Linear, onednn_runs
from models.native import NativeUnavailable
from models.target import Target

WIDE_ROWS = (8, 16, 32, 64)    # verify sizes where the fp32 twin may win; below them int4 always does
# A verify of n rows pays only if a round of it accepts more tokens than it costs one-token
# verifies. The shipped head accepts 2.68 per round on a 64-token tree, 2.2 on 16 (MT-bench), so
# a bucket costing 3 one-token verifies or more cannot pay for any head Aerie has: it is not
# a bucket (no graph serves it; a tree that large goes in chunks) and its twin is not kept.
PAYING_TOKENS = 3.0
HEAD_WEIGHTS = ("int8", "int4", "bf16", "q4_rows")
WIN = 0.9                      # a kernel must save 10% to be chosen: timing noise must not flip it
# ...except a 4-bit kernel that computes each row alone: it also moves attention from fp64 SDPA to the fp32
# row kernel, so it serves where its linears cost no more than 5% over int4's. On a 2-core Xeon with AMX
# (2026-12-05) q4_rows' linears cost what int4's did (89.3 vs 89.4 ms over 1-16 rows, so int4 stayed), yet
# forced onto q4_rows a compiled 1-token verify took 5.33 ms against 8.13: plain decoding 125 vs 95 tokens/s.
ROWS_ALONE_WIN = 1.05
REPEATS = 3
VERSION = 12   # 12: the target's q/k/v and gate/up joined (models/fused.py); 11: no prefill twin (a prompt reads on the verify buckets); 10: ROWS_ALONE_WIN
TARGET_ROWS = (1, 2, 4, 8, 16)   # verify sizes timed on each 4-bit kernel
TILE_ROWS = (2, 4, 8, 16, 32, 64)   # sizes where q4_rows' tiled path may beat its register one
KERNEL_NAMES = {"int4": "int4", "amx": "AMX 4-bit", "rows": "q4_rows"}
TWIN_BYTES = 4                 # per weight: the fp32 twin's


@dataclass(frozen=True)
class TargetKernel:
    """The 4-bit kernel the target's int4 layers run on: all hold the same weight values."""
    kernel: str = "int4"            # one of KERNELS, serving calls of `from_rows` rows or more (fewer: int4)
    from_rows: int = 1
    ms: dict = field(default_factory=dict)          # rows -> {kernel: ms}, the linears alone (TARGET_ROWS)
    tiles_from: int | None = None   # q4_rows: rows from which its tiled path runs (`choose_tiles_from`)
    tiles_ms: dict = field(default_factory=dict)    # rows -> {"rows": ms, "tiles": ms} (TILE_ROWS)


@dataclass(frozen=True)
class KernelChoice:
    wide_from: int | None = None                     # verify rows from which linears run on the fp32 twin
    largest: int = 8                                 # the largest verify size that can pay (PAYING_TOKENS)
    head: str = "int8"                               # the draft head's CPU weights: one of HEAD_WEIGHTS
    verify_ms: dict = field(default_factory=dict)    # rows -> {"int4": ms, "wide": ms}, eager verifies (1: int4)
    head_ms: dict = field(default_factory=dict)      # head weights -> ms of a head step at 4 rows
    # verify_ms' "int4" was timed on this kernel
    target: TargetKernel = field(default_factory=TargetKernel)

    @staticmethod
    def from_dict(d: dict) -> "KernelChoice":
        return KernelChoice(**{**d, "target": TargetKernel(**d["target"])})

    def describe(self) -> str:
        t = self.target
        name = KERNEL_NAMES[t.kernel]
        kernel = name if t.from_rows == 1 else f"int4, {name} from {t.from_rows} rows"
        kernel += f" (tiled from {t.tiles_from} rows)" if t.tiles_from else ""
        wide = f"{kernel}, fp32 twin from {self.wide_from} rows" if self.wide_from else f"{kernel} at every size"
        return f"target {wide}, trees up to {self.largest}; head {self.head}"


def machine_key() -> dict:
    """What a kernel's speed depends on: the CPU (model and instruction sets), torch, threads."""
    return {"version": VERSION, "cpu": cpu_name(), "flags": cpu_flags_digest(), "torch": torch.__version__,
            "capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}


def cpu_name() -> str:
    for line in read_cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    for line in read_cpuinfo().splitlines():
        if line.startswith("flags"):
            return sorted(line.partition(":")[2].split())
    return []


def cpu_flags_digest() -> str:
    return hashlib.sha1(" ".join(cpu_flags()).encode()).hexdigest()[:12]


def read_cpuinfo() -> str:
    path = Path("/proc/cpuinfo")
    return path.read_text() if path.is_file() else ""


def cached_choice(cache_dir: Path, key: dict, measure) -> tuple[KernelChoice, bool]:
    """The choice stored for `key`, or `measure()` stored now; -> (choice, whether it was cached)."""
    return stored(cache_dir / "kernels", key, measure, asdict, KernelChoice.from_dict)


def int4_layers(target: Target) -> list[Int4Linear]:
    """The target's int4 linears."""
    return [m for m in target.model.modules() if isinstance(m, Int4Linear)]


@dataclass(frozen=True)
class TreeKernels:
    wide_from: int | None       # rows from which the fp32 twin wins at every larger timed size (None: never)
    largest: int                # the largest timed size whose verify costs under PAYING_TOKENS one-token ones
    verify_ms: dict             # rows -> {"int4": ms, "wide": ms}; "1" -> {"int4": ms}


def time_verifies(target: Target, kernels: dict, setup, row_attention: bool = False) -> dict:
    """kernels: rows -> the kernel names to time a verify of that many tokens on; setup(name)
    puts the target's layers on one; row_attention: the runner's (RunnerConfig). Eager verifies after a 128-token prefill, each size's kernels
    interleaved (a burst of load lands on all alike), best of REPEATS after a warm-up pass;
    -> rows -> {name: ms}."""
    rows = tuple(kernels)
    runner = TargetRunner(target, RunnerConfig(compile=False, buckets=tuple(sorted({1, *rows})), context=256,
                                               row_attention=row_attention))
    ids = torch.randint(0, target.model.config.get_text_config().vocab_size, (128 + max(rows),),
                        generator=torch.Generator().manual_seed(0)).tolist()
    runner.prefill(ids[:128], 0)
    best = {n: {name: float("inf") for name in names} for n, names in kernels.items()}
    for rep in range(REPEATS + 1):                       # pass 0 warms up
        for n, names in best.items():
            tree = chain_tree(ids[128], ids[129: 128 + n])
            for name in names:
                setup(name)
                t0 = time.perf_counter()
                runner.verify(tree.tokens, tree.depth, tree.ancestor_mask)
                ms = 1000 * (time.perf_counter() - t0)
                runner.truncate(128)
                names[name] = min(names[name], ms) if rep else names[name]
    return best


@torch.inference_mode()
def choose_wide_from(target: Target, rows: tuple[int, ...] = WIDE_ROWS, row_attention: bool = False) -> TreeKernels:
    """Time eager verifies of 1 token and of `rows` tokens with every int4 layer on its kernel
    ("int4": the 4-bit one set, KernelChoice.kernel) and on its fp32 twin; -> where the twin wins and how
    big a tree can pay. Leaves every layer on its kernel and drops the twins."""
    layers = int4_layers(target)
    for layer in layers:
        layer.widen(from_rows=1)

    def setup(kernel: str) -> None:
        for layer in layers:
            layer.wide_from = 1 if kernel == "wide" else None
    best = time_verifies(target, {1: ("int4",), **{n: ("int4", "wide") for n in rows}}, setup, row_attention)
    for layer in layers:
        layer.narrow()
    return pick_tree_kernels(best, rows)


def load_kernel(kernel: str, cache_dir: Path) -> None:
    """Build (once per machine) and load a 4-bit kernel of KERNELS; raises NativeUnavailable with
    the reason where this machine cannot run it."""
    if kernel == "amx":
        amx.load(cache_dir, cpu_flags())
    elif kernel == "rows":
        q4_rows.load(cache_dir, cpu_flags())


@torch.inference_mode()
def choose_target_kernel(target: Target, cache_dir: Path, report=print, mix: bool = False) -> TargetKernel:
    """Which 4-bit kernel the target's int4 layers run on: torch's, AMX (models/amx.py) or
    q4_rows (models/q4_rows.py), each built where it can be, by timing the target's linears at
    TARGET_ROWS rows on each (`time_linears`, `pick_kernel`; `mix`: whether AMX may serve trees
    beside int4's one token), q4_rows on its tiled path from where that pays (timed first, kept
    in `tiles_ms` whichever kernel wins). Leaves the layers on the choice. Says why a kernel
    cannot run."""
    layers = int4_layers(target)
    kernels = ["int4"]
    for kernel in ("rows", "amx"):
        try:
            load_kernel(kernel, cache_dir)
            for layer in layers:
                layer.use_kernel(kernel, free=False)
            kernels.append(kernel)
        except (NativeUnavailable, ValueError) as e:
            report(f"Aerie: no {KERNEL_NAMES[kernel]} kernel for the target here ({e}).")
    if len(kernels) == 1:
        return TargetKernel()
    # q4_rows competes on its best path: from 8 rows its tile may save a third (2-core Zen 3)
    tiles_from, tiles_ms = choose_tiles_from(layers) if "rows" in kernels else (None, {})

    def setup(kernel: str) -> None:
        for layer in layers:
            layer.use_kernel(kernel, free=False, tiles_from=(tiles_from or q4_rows.NEVER) if kernel == "rows" else q4_rows.NEVER)
    best = time_linears(layers, {n: tuple(kernels) for n in TARGET_ROWS}, setup)
    kernel, from_rows = pick_kernel(best, mix)
    tiles_from = tiles_from if kernel == "rows" else None
    for layer in layers:
        layer.use_kernel(kernel, from_rows, tiles_from=tiles_from or q4_rows.NEVER)
    return TargetKernel(kernel, from_rows, rounded(best), tiles_from, tiles_ms)


def choose_tiles_from(layers: list[Int4Linear]) -> tuple[int | None, dict]:
    """Time q4_rows' two paths (the same bits) on `layers` at TILE_ROWS rows: keeping weights in
    registers re-dequantizes them every 4-6 rows, a tile dequantizes each group once but loads
    and stores the sums from L1 -> (the first size from which the tile is no slower at each
    larger one, or None; the timings)."""
    def setup(path: str) -> None:
        for layer in layers:
            layer.use_kernel("rows", free=False, tiles_from=1 if path == "tiles" else q4_rows.NEVER)
    best = time_linears(layers, {n: ("rows", "tiles") for n in TILE_ROWS}, setup)
    return first_winning(best, "tiles", "rows", win=1.0), rounded(best)


def rounded(best: dict) -> dict:
    """rows -> {name: ms} with string keys and 0.01 ms, as the cache stores it."""
    return {str(n): {k: round(v, 2) for k, v in t.items()} for n, t in best.items()}


def time_linears(layers: list[Int4Linear], kernels: dict, setup) -> dict:
    """kernels: rows -> the kernel names to time that many rows on; setup(name) puts `layers` on
    one. Every layer called once in the model's order on `rows` rows, as a verify calls them (the
    weights stream from memory: they outgrow the caches), each size's kernels interleaved, best
    of REPEATS after a warm-up pass; -> rows -> {name: ms}. The linears alone: the rest of a
    verify is the same on every kernel, and eager it is dispatch a compiled graph does not pay
    (an eager verify of one token, 2-core EPYC: 38 ms, its linears 15 of them; compiled 16)."""
    best = {n: {name: float("inf") for name in names} for n, names in kernels.items()}
    generator = torch.Generator().manual_seed(0)
    for rep in range(REPEATS + 1):                       # pass 0 warms up
        for n, names in best.items():
            inputs = {k: torch.randn(n, k, generator=generator) for k in {layer.in_features for layer in layers}}
            for name in names:
                setup(name)
                t0 = time.perf_counter()
                for layer in layers:
                    layer(inputs[layer.in_features])
                ms = 1000 * (time.perf_counter() - t0)
                names[name] = min(names[name], ms) if rep else names[name]
    return best


def pick_kernel(best: dict, mix: bool = False) -> tuple[str, int]:
    """best: rows -> {kernel: ms} -> (kernel, from rows). A kernel serves every size where its
    timings at all sizes together cost at most ROWS_ALONE_WIN times int4's and its one token at most
    5% more (plain decoding lives there); the fastest such, else int4. Both other kernels compute
    each row alone, which lets attention run on the fp32 row kernel instead of fp64 SDPA
    (`rows_alone`): a gain the linears alone do not show. With `mix`, where none does, AMX
    may serve from the first size from which it wins at each (`pick_amx_from`): a tree summed in
    AMX's order and one token in int4's part at near-ties (1 of 16 MT-bench prompts, 2-core
    Xeon), so that is an option (--kernel-mix), never the default."""
    sizes = sorted(best)
    total = {k: sum(best[n][k] for n in sizes) for k in best[sizes[0]]}
    serving = [k for k in total if k != "int4" and best[sizes[0]][k] <= 1.05 * best[sizes[0]]["int4"]
               and total[k] <= ROWS_ALONE_WIN * total["int4"]]
    if serving:
        return min(serving, key=total.get), 1
    first = first_winning(best, "amx", "int4") if mix and "amx" in total else None
    return ("amx", first) if first is not None else ("int4", 1)


def first_winning(best: dict, kernel: str, other: str, win: float = WIN) -> int | None:
    """best: rows -> {kernel: ms, other: ms} -> the first timed size from which `kernel` serves
    every larger one: where it costs at most `win` times `other` at that size and each above
    (1 row: at most 5% more); None where it never does."""
    sizes = sorted(best)

    def wins(n: int) -> bool:
        return best[n][kernel] <= (1.05 if n == 1 else win) * best[n][other]
    return next((n for i, n in enumerate(sizes) if all(wins(m) for m in sizes[i:])), None)


def rows_alone(choice: KernelChoice) -> bool:
    """Whether every verify size runs the target's linears on one kernel that computes each row
    alone in one order (q4_rows, or AMX at every size) and no fp32 twin: then attention on the
    fp32 row kernel (models/attention.py) keeps a tree's logits equal to one token's, compiled
    too (16 of 16 MT-bench prompts x 64 tokens on q4_rows, 2-core EPYC). Beside torch's int4
    kernel compiled trees with fp32 attention parted from plain decoding on 4 of 16 prompts, but
    that was before the row kernel's sum stopped depending on where a node's column sits (the
    likelier cause); unchecked since, so fp64 SDPA stays there."""
    return choice.target.kernel in ("rows", "amx") and choice.target.from_rows == 1 and choice.wide_from is None


def apply_target_kernel(target: Target, choice: TargetKernel, cache_dir: Path) -> None:
    """Put the target's int4 layers on the kernel `choice` names (raises NativeUnavailable where it
    was chosen on this machine once and cannot be loaded now)."""
    if choice.kernel != "int4":
        load_kernel(choice.kernel, cache_dir)
        for layer in int4_layers(target):
            layer.use_kernel(choice.kernel, choice.from_rows, tiles_from=choice.tiles_from or q4_rows.NEVER)


def pick_tree_kernels(best: dict, rows: tuple[int, ...]) -> TreeKernels:
    """best: rows -> {kernel: ms} (1 -> int4 only) -> the twin's first size, the largest paying size."""
    wins = [n for n in rows if best[n]["wide"] < WIN * best[n]["int4"]]
    # The twin must win from its first size on: a layer switches kernels at one row count.
    start = next((n for n in rows if all(m in wins for m in rows if m >= n)), None)
    pays = [n for n in rows if min(best[n].values()) < PAYING_TOKENS * best[1]["int4"]]
    largest = max([rows[0], *(n for n in rows if all(m in pays for m in rows if m <= n))])
    return TreeKernels(start if start is not None and start <= largest else None, largest,
                       rounded(best))


def twin_fits(target: Target, free_bytes: int) -> bool:
    """Whether the int4 layers' fp32 twins (TWIN_BYTES per weight) fit in half the free RAM."""
    layers = int4_layers(target)
    return sum(TWIN_BYTES * m.in_features * m.out_features for m in layers) < free_bytes // 2


def kernel_edges(choice: KernelChoice) -> tuple[int, ...]:
    """The row counts from which the target's linears run on another kernel (the fp32 twin, AMX's
    mix): no graph may span one (core/runtime/graphs.py `row_groups`)."""
    edges = {choice.wide_from} if choice.wide_from is not None else set()
    from_rows = choice.target.from_rows
    return tuple(sorted(edges | ({from_rows} if from_rows != 1 else set())))


def apply_wide(target: Target, choice: KernelChoice) -> None:
    """Give the int4 layers the fp32 twin `choice` calls for, from its `wide_from` rows on."""
    if choice.wide_from is None:
        return
    for layer in int4_layers(target):
        layer.widen(from_rows=choice.wide_from, kind="fp32")


@torch.inference_mode()
def choose_head_weights(time_step, weights: tuple[str, ...] = HEAD_WEIGHTS) -> tuple[str, dict]:
    """time_step(quant) -> ms of the drafter's first head steps with its weights in `quant`; -> the
    fastest of `weights` (int8 among them; `head_weights_here`) if it saves 10% over int8 (else
    int8: noise must not flip it), and every timing."""
    ms = {quant: round(time_step(quant), 3) for quant in weights}
    best = min(ms, key=ms.get)
    return (best if ms[best] < WIN * ms["int8"] else "int8"), ms


def head_weights_here(cache_dir: Path) -> tuple[str, ...]:
    """The HEAD_WEIGHTS this CPU runs: bf16 only where oneDNN has bf16 GEMMs, q4_rows where its
    kernel builds (here, into `cache_dir`)."""
    try:
        load_kernel("rows", cache_dir)
        rows = True
    except NativeUnavailable as e:
        print(f"Aerie: no q4_rows kernel for the draft head here ({e}).", flush=True)
        rows = False
    return tuple(quant for quant in HEAD_WEIGHTS if onednn_runs(quant) and (rows or quant != "q4_rows"))


EVICT_BYTES = 64 << 20   # more than any CPU's last-level cache here (32 MiB): a verify's weights do this


@torch.inference_mode()
def time_draft_steps(drafter, rows: int = 4) -> float:
    """ms of the head steps an EAGLE drafter's draft starts with (a one-row catch-up on target
    features, two frontier steps of `rows`) with the head's weights cold, as after a target verify:
    a write of EVICT_BYTES first; best of REPEATS after a warm-up."""
    step, config = drafter.step, drafter.head.config
    device, width = step.device, config.hidden_size
    feature_width = len(drafter.feature_layers) * config.target_width
    evict = torch.zeros(EVICT_BYTES // 4)
    pair = torch.randn(1, feature_width, device=device)
    outs, tokens = torch.randn(rows, width, device=device), torch.arange(rows, device=device)
    positions, siblings = torch.full((rows,), 17, device=device), torch.eye(rows, dtype=torch.bool, device=device)

    def once() -> float:
        evict.add_(1.0)
        t0 = time.perf_counter()
        step.feed(pair, tokens[:1], positions[:1] - 1, siblings[:1, :1], 16)
        for _ in range(2):
            step.feed(outs, tokens, positions, siblings, 17)
        return 1000 * (time.perf_counter() - t0)

    once()
    return min(once() for _ in range(REPEATS))
