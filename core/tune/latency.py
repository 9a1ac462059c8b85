"""The latency profile: what one round costs on this machine, measured, never assumed.

At start-up the engine times, on its real device and kernels:
  - the target's round at tree sizes `SIZES` (verify + accept + commit: everything but drafting)
    at a short context, and at `SLOPE_SIZES` also at a long one: attention's cost grows linearly
    with context, so round(size, context) = short(size) + context x slope(size), both interpolated
    piecewise-linearly in size (beyond the last size, along the last segment);
  - with a head, one head step at each frontier width in `WIDTHS` (its forward plus scoring the
    draft vocabulary and taking the top-k), at the short context and the long one: the head
    attends over the whole chat too (at 2,400 tokens a one-token draft cost 1.9x its short-context
    time, and the tuner planned it as cheap); and the rerank that turns the pool into a tree.
Plain decoding's time per token at context c is the round of size 1 at c: the speedup gauge
divides by it. A profile is cached as JSON per (model, quantization, device, kernels, head).
"""

import bisect
import hashlib
import platform
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from core.config import SamplingConfig, TreeConfig
from core.files import stored
from core.spec.eagle import EagleDrafter
from core.spec.tree import chain_tree, rerank

SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 96)  # the sizes plus 2 and 4: on a CPU the step from 1 token (no mask) to a small tree matters
LARGE_SIZES = SIZES + (128, 192, 256, 384, 512, 1024)   # a slow (offloaded) target: big trees may pay (SpecExec)
WIDTHS = (1, 2, 4, 6, 8, 10)
SLOPE_SIZES = (1, 8, 32)                # also timed at the long context: attention's growth with context
# The long context is long so that the slope is measured, not guessed: at 512 a host's noise moved a
# one-token round by as much as 512 tokens of attention add (5.7 or 7.1 ms against 5.3-5.6 at 32, the
# 2-core Zen 4), and extrapolated to a 2,400-token chat the profile said 15 ms a token for 8.2.
SHORT_CONTEXT, LONG_CONTEXT = 32, 2048
REPEATS = 5
WARM, WARM_FIRST = 2, 12
VERSION = 21   # 21: a draft's fixed cost measured without the rerank a chain skips; 20: graphs without dynamo's prologue and the target's q/k/v and gate/up joined (models/fused.py); 19: the slopes at 2,048 tokens; 18: head steps' context slope; 17: a CPU's graphs run from a C++ wrapper (core/runtime/graphs.py CPP_WRAPPER), ~1 ms less a verify


@dataclass(frozen=True)
class LatencyProfile:
    sizes: tuple[int, ...]
    round_ms: tuple[float, ...]               # [size]: verify + accept + commit at contexts[0]
    contexts: tuple[int, int]                 # (short, long)
    slope_sizes: tuple[int, ...]              # sizes also measured at the long context
    slope_ms: tuple[float, ...]               # [slope size]: extra ms per cached token of context
    widths: tuple[int, ...] = ()
    head_ms: tuple[float, ...] = ()           # [width]: one head step and its top-k; () without a head
    rerank_ms: float = 0.0                    # the pool -> tree step of a round
    measured_s: float = 0.0                   # how long measuring took
    buckets: tuple[int, ...] = ()             # the runner's verify buckets: a tree costs its bucket's round
    draft_fixed_ms: float = 0.0               # a draft's cost beyond its head steps and rerank, per round
    draft_level_ms: float = 0.0               # ... and per expansion level
    head_slope_ms: tuple[float, ...] = ()     # [width]: a head step's extra ms per cached token of context


    def round(self, size: float, context: float) -> float:
        """ms of a round verifying `size` tokens after `context` cached ones: the short-context cost
        plus attention's share, linear in context."""
        size = self.padded(size)
        # Below the short context attention is a rounding error: no extrapolation down there.
        extra = max(context - self.contexts[0], 0) * interpolate(self.slope_sizes, self.slope_ms, size)
        return max(interpolate(self.sizes, self.round_ms, size) + extra, 1e-3)

    def padded(self, size: float) -> float:
        """The tokens a verify of `size` runs, as the runner pads it: its bucket, or beyond the
        largest bucket whole chunks of it (a 14-token tree on buckets up to 8 costs two 8-token
        forwards, not the 14 the profile's curve would interpolate: that made prompt lookup's
        rounds look 15% cheaper than they ran, and its shown speedup that much too high)."""
        if not self.buckets:
            return size
        largest = self.buckets[-1]
        if size > largest:
            size = -(-size // largest) * largest
        return next((b for b in self.buckets if b >= size), size)

    def plain_ms(self, context: float) -> float:
        """Plain decoding's time per token at `context`: a round of the root alone."""
        return self.round(1, context)

    def head(self, width: float, context: float) -> float:
        """ms of a head step of `width` rows after `context` cached tokens (linear in context, as a round)."""
        if not self.head_ms:
            return 0.0
        # never negative: past the widest width timed the last segment is extended, and noise can tilt it down
        slope = max(0.0, interpolate(self.widths, self.head_slope_ms, width)) if self.head_slope_ms else 0.0
        extra = max(context - self.contexts[0], 0) * slope
        return interpolate(self.widths, self.head_ms, width) + extra

    def draft(self, depth: int, top_k: int, caught_up: float, context: float, best_first: bool = False) -> float:
        """ms of an EAGLE draft after `context` tokens: the catch-up over the `caught_up` tokens the
        last round committed, `depth` expansion steps at width top_k, the drafter's own bookkeeping
        and the rerank, which an EAGLE-2 chain (top_k 1) skips and a best-first tree always runs.
        Counted for chains too, it made a CPU's d0k2n3 look as cheap to draft as d0k1n2: the tuner
        drafted it for 1.07x plain where d0k1n2 ran 1.29x (2-core EPYC, 16 MT-bench prompts, one hour)."""
        rerank = self.rerank_ms if best_first or top_k > 1 else 0.0
        return (self.head(caught_up, context) + depth * self.head(top_k, context) + rerank
                + self.draft_fixed_ms + depth * self.draft_level_ms)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "LatencyProfile":
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def interpolate(xs, ys, x: float) -> float:
    """Piecewise-linear through (xs, ys), extended along the end segments."""
    if len(xs) == 1:
        return float(ys[0])
    i = max(1, min(len(xs) - 1, bisect.bisect_left(xs, x)))  # the first xs[i] >= x, kept inside the ends
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return float(y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def profile_key(engine, head_source: str | None, kernels: str, offloaded: bool) -> dict:
    target = engine.target
    device = (torch.cuda.get_device_name(target.device) if target.device.type == "cuda"
              else f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads")
    return {"version": VERSION, "model": str(target.model.config.name_or_path), "quant": target.quant,
            "dtype": str(target.dtype), "device": device, "kernels": kernels, "head": head_identity(head_source),
            "offloaded": offloaded, "torch": torch.__version__, "sizes": list(SIZES)}


def head_identity(source: str | None) -> str | None:
    """What the profile's key records of a head: a folder by its config and weights' sizes (so
    two checkouts of the same head share a profile), anything else by name."""
    folder = Path(source).expanduser() if source else None
    if folder is None or not folder.is_dir():
        return source
    parts = [(folder / "config.json").read_bytes() if (folder / "config.json").is_file() else b""]
    parts += [f"{f.name}:{f.stat().st_size}".encode() for f in sorted(folder.glob("*.safetensors"))]
    return "folder:" + hashlib.sha1(b"\n".join(parts)).hexdigest()[:16]


def cached_profile(cache_dir: Path, key: dict, measure, check=None) -> tuple[LatencyProfile, bool]:
    """The profile stored for `key`, or `measure()` stored now; -> (profile, whether it was cached).
    With `check` (profile -> why it no longer fits this machine, or None), a stored profile that
    fails it is measured again: one timed in a busy minute would steer the tuner for good."""
    return stored(cache_dir / "profiles", key, measure, LatencyProfile.to_json, LatencyProfile.from_json, check,
                  "Aerie: timing this machine for the draft-tree tuner (once; cached for later starts)...")


CHECK_SIZES = (1, 2, 4)    # the trees a CPU's tuner picks most: what a stored profile must still get right
CHECK_TOLERANCE = 0.15
CHECK_BUDGET_MS = 2000
CHECKS = 2   # a stored profile is measured again only if each of this many checks finds it off


@torch.inference_mode()
def profile_mismatch(engine, profile: LatencyProfile) -> str | None:
    """Why `profile` no longer describes this engine, or None. It times the rounds of CHECK_SIZES
    (about 0.4 s for the embedded model on a 2-core CPU) and compares each one's cost relative to a 1-token round with the
    profile's: a machine uniformly busier or quieter than when profiled is fine (the meter rescales
    by the measured load), a different shape (trees dearer or cheaper relative to plain decoding)
    is not."""
    sizes = tuple(n for n in CHECK_SIZES if n in profile.sizes)
    # rounds' warm-ups and timed passes, each size's block twice: skipped where that would hold a
    # start up for seconds (a big or offloaded model), whose profile is then trusted as before.
    count = WARM_FIRST - WARM + 2 * len(sizes) * (WARM + REPEATS)
    if len(sizes) < 2 or count * profile.round(sizes[-1], SHORT_CONTEXT) > CHECK_BUDGET_MS:
        return None
    ids = arbitrary_ids(engine, SHORT_CONTEXT + max(sizes))
    # One check alone re-measured a fine profile at 2 of 6 warm starts on a shared 2-core EPYC (a
    # burst of load, or the first rounds after a start running slow), 10-20 s each; a shape that
    # really changed fails the second check too.
    for _ in range(CHECKS):
        measured = monotone(rounds(engine, ids, SHORT_CONTEXT, sizes).round_ms)
        why = shape_mismatch(sizes, measured, [profile.round(n, SHORT_CONTEXT) for n in sizes])
        if why is None:
            break
    engine.reset()
    return why


def shape_mismatch(sizes, measured, profiled, tolerance: float = CHECK_TOLERANCE) -> str | None:
    """Where the cost of a round of n tokens relative to one token's differs from the profile's by
    more than `tolerance`: a line saying so, or None."""
    for n, m, p in zip(sizes[1:], measured[1:], profiled[1:]):
        now, then = m / measured[0], p / profiled[0]
        if abs(now / then - 1) > tolerance:
            return (f"a {n}-token round costs {now:.2f}x a 1-token one now, {then:.2f}x in the stored profile "
                    f"({measured[0]:.1f} / {m:.1f} ms against {profiled[0]:.1f} / {p:.1f})")
    return None


@torch.inference_mode()
def measure_profile(engine, sizes: tuple[int, ...] = SIZES) -> LatencyProfile:
    """Time the engine's target (and its EAGLE drafter's head, if any) as described above. Leaves
    the engine reset. Token ids are arbitrary: cost does not depend on them."""
    t0 = time.perf_counter()
    long_ = max(SHORT_CONTEXT + 1, min(LONG_CONTEXT, engine.context_len - max(sizes) - 1))
    ids = arbitrary_ids(engine, long_ + max(sizes))
    drafter = engine.drafter
    widths = WIDTHS if isinstance(drafter, EagleDrafter) else ()   # a head to time: its steps, whole drafts
    short = rounds(engine, ids, SHORT_CONTEXT, sizes, widths)
    short_ms, head_ms = monotone(short.round_ms), short.head_ms
    slope_sizes = tuple(n for n in sizes if n in SLOPE_SIZES) or sizes[:1]
    longer = rounds(engine, ids, long_, slope_sizes, widths)
    slopes = tuple(max(0.0, (ms - short_ms[sizes.index(n)]) / (long_ - SHORT_CONTEXT))
                   for n, ms in zip(slope_sizes, longer.round_ms))
    head_slopes = tuple(max(0.0, (b - a) / (long_ - SHORT_CONTEXT)) for a, b in zip(head_ms, longer.head_ms))
    rerank_ms, fixed, level = 0.0, 0.0, 0.0
    if widths:
        rerank_ms = time_rerank()
        # What a whole draft costs beyond its head steps and rerank: the drafter's own bookkeeping.
        flat = time_draft(drafter, engine, ids[:SHORT_CONTEXT], TreeConfig(0, 1, 2, copy=0))   # head steps, never a copy
        deep = time_draft(drafter, engine, ids[:SHORT_CONTEXT], TreeConfig(2, 2, 4, copy=0))
        fixed = max(0.0, flat - head_ms[0])   # a chain: no rerank
        level = max(0.0, (deep - flat - 2 * interpolate(widths, head_ms, 2) - rerank_ms) / 2)   # at the short context: no slope
    engine.reset()
    return LatencyProfile(tuple(sizes), short_ms, (SHORT_CONTEXT, long_), slope_sizes, slopes, widths, head_ms,
                          rerank_ms, time.perf_counter() - t0, engine.runner.buckets,  # eager or not, verifies pad to them
                          fixed, level, head_slopes)


def arbitrary_ids(engine, n: int) -> list[int]:
    """n token ids, the same every time: a round's cost does not depend on them."""
    vocab = engine.target.model.config.get_text_config().vocab_size
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(0)).tolist()


def monotone(costs: list[float]) -> tuple[float, ...]:
    """A bigger tree never costs less; noise from other programs only ever adds time. So where a
    cost exceeds a larger size's, the larger size's cost is the better estimate (running minimum
    from the right)."""
    out = list(costs)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return tuple(out)


@dataclass(frozen=True)
class Rounds:
    round_ms: list[float]             # [size]: verify + accept + commit
    head_ms: tuple[float, ...] = ()   # [width]: one head step, where widths were asked for (an EAGLE head)


def rounds(engine, ids: list[int], context: int, sizes: tuple[int, ...], widths: tuple[int, ...] = ()) -> Rounds:
    """ms of verify + accept + commit of a tree of each size after `context` cached tokens, each
    round as a chat runs it: a 1-token round right after another (plain decoding), a tree's right
    after a head step (EAGLE's draft, untimed). The median of REPEATS rounds after WARM untimed
    ones, in blocks by size, the sizes walked up and then down: drift and the first block's
    start-up land on all sizes alike, and a burst of load from other programs costs a block a pass
    or two, not its median. Interleaved round by round instead, a round paid for the larger one
    before it (on the 2-core AMX Xeon a 2-token round cost 10.1 ms where EAGLE's took 8.7, and one
    token as much as two); timed back to back without the head's step between, trees looked ~10%
    cheaper against one token than in EAGLE's own rounds. The tuner and the page's meter read these
    ratios. With `widths` (an EAGLE head), then one head step at each frontier width after the
    same context (forward, draft scores and their top-k), without reading the prompt again."""
    engine.reset()
    drafted = engine.prefill(ids[:context])
    # Without an EAGLE head (prompt lookup drafts in microseconds) trees follow each other back to back.
    steps = (engine.drafter.frontier_steps(drafted.features[:-1], ids[1:context], (1, *widths))  # pairs (f_t, x_{t+1})
             if isinstance(engine.drafter, EagleDrafter) else [lambda: None])
    head_step = steps[0]
    greedy, rng = SamplingConfig(), torch.Generator(device=engine.device)

    def once(tree) -> None:
        verified = engine.verify(tree)
        engine.commit(engine.accept(tree, verified.logits, greedy, rng), tree)
        engine.runner.truncate(context)

    def timed_round(tree) -> float:
        if len(tree.tokens) > 1:
            head_step()
        return timed_once(engine.device, lambda: once(tree))

    passes: dict[int, list[float]] = {n: [] for n in sizes}
    for i, n in enumerate([*sizes, *reversed(sizes)]):
        tree = chain_tree(ids[context], ids[context + 1: context + n])
        # First-call allocations, kernel selection, the caches of the size before; the first block
        # more: just after a start, one token's rounds ran ~40% slow for a while (9.6 ms against 6.7).
        for _ in range(WARM_FIRST if i == 0 else WARM):
            timed_round(tree)
        passes[n] += [timed_round(tree) for _ in range(REPEATS)]
    return Rounds([statistics.median(passes[n]) for n in sizes], tuple(timed(engine.device, step) for step in steps[1:]))


def time_draft(drafter, engine, ids: list[int], tree: TreeConfig) -> float:
    """ms of the drafter's whole round with `tree`'s shape after one committed token: catch-up,
    tree growth and rerank, each after a target verify, as in a chat's rounds (the target's weights
    push the head's out of the caches: timed back to back, drafts looked twice as cheap)."""
    engine.reset()
    fresh = engine.prefill(ids)
    context, kept = ids + [ids[0]], drafter.tree
    drafter.reshape(tree)
    drafter.draft(context, fresh)                         # the head catches up on the prompt
    last, between = replace(fresh, features=fresh.features[-1:]), chain_tree(ids[0], ids[1:4])
    best = float("inf")
    for rep in range(REPEATS + 1):                        # pass 0 warms up
        engine.verify(between)
        engine.runner.truncate(len(ids))
        drafter.rewind(len(ids))                          # forget the last pair: one fresh row again
        ms = timed_once(engine.device, lambda: drafter.draft(context, last))
        best = min(best, ms) if rep else best
    drafter.reshape(kept)
    return best


@torch.inference_mode()
def level_costs(drafter, engine, levels: int) -> tuple[float, float]:
    """(fixed, per level) ms of a drafter whose draft costs the same for every node of a level (Medusa's
    heads: one head and one projection row per depth), from whole drafts of one and `levels` levels after
    a target verify. Leaves the engine reset."""
    ids = arbitrary_ids(engine, SHORT_CONTEXT)
    one = time_draft(drafter, engine, ids, TreeConfig(0, 1, 2))
    deep = time_draft(drafter, engine, ids, TreeConfig(levels - 1, 1, levels + 1)) if levels > 1 else one
    engine.reset()
    level = max(0.0, (deep - one) / (levels - 1)) if levels > 1 else one
    return max(0.0, one - level), level


def time_rerank(pool: int = 100, keep: int = 48) -> float:
    """ms of turning a pool of drafted candidates into a tree (CPU-side, any device)."""
    scores = -torch.rand(pool).cumsum(0)                    # decreasing: parents score above children
    parents = torch.cat([torch.full((10,), -1), torch.arange(pool - 10) // 9])
    tokens = torch.arange(pool)
    return timed(torch.device("cpu"), lambda: rerank(scores, parents, tokens, 0, keep))


def timed(device: torch.device, fn) -> float:
    """ms of fn's fastest of REPEATS calls after a warm-up (interference only adds time)."""
    fn()  # warm-up: first-call allocations and kernel selection
    return min(timed_once(device, fn) for _ in range(REPEATS))


def timed_once(device: torch.device, fn) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 1000 * (time.perf_counter() - t0)

