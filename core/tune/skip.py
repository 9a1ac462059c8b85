"""Which layers a self-speculative draft skips (core/spec/layer_skip.py), measured on the user's
own model and machine, once, then cached.

Draft & Verify searches the skipped set by Bayesian optimisation on the draft's acceptance; this is
a cheaper two-pass search of the same objective:
  1. damage: for each layer alone, the share of answer tokens the target still guesses right as a
     first draft with that layer skipped (`agreement`);
  2. for m = 1 .. L-1, skip the m least damaging layers together, measure their agreement a_m and
     one draft step's time s_m; for each chain depth d the predicted speedup is
        (1 + a + ... + a^d) / (d s_m + verify(d + 1)) x plain,
     with verify and plain from the latency profile (core/tune/latency.py).
The best (m, d) wins; every draft token's acceptance is taken as the first's (a chain's later
guesses read the draft's own rows, as in decoding, so they fare no better).

`agreement` computes what the drafter's first step computes, for every position at once: the
calibration answer is prefilled by the full target, then the view runs over the same tokens in
rows after it, row p seeing the full target's rows before p and its own row only.
"""

import time
from dataclasses import asdict, dataclass

import torch

from core.runtime.runner import TargetRunner
from core.spec.layer_skip import LayerSkipDrafter, SkipConfig
from core.tune.latency import LatencyProfile, timed
from models.layer_view import layer_view

MAX_DEPTH = 6


@dataclass(frozen=True)
class SkipChoice:
    config: SkipConfig
    agreement: float               # the chosen set's first-draft agreement on the calibration answers
    step_ms: float                 # one draft step with it
    predicted: float               # predicted speedup over plain decoding
    damage: tuple[float, ...]      # [layer]: agreement with that layer alone skipped
    curve: tuple[tuple[int, float, float], ...] = ()   # (layers skipped, agreement, step ms) per set tried
    measured_s: float = 0.0

    def describe(self) -> str:
        layers = len(self.damage)
        return (f"skips {len(self.config.skip)} of {layers} layers, drafts up to {self.config.depth}: first draft right "
                f"{self.agreement:.0%} of the time, {self.step_ms:.1f} ms a step, predicted {self.predicted:.2f}x plain")

    def to_json(self) -> dict:
        return {**asdict(self), "config": asdict(self.config), "curve": [list(row) for row in self.curve]}

    @classmethod
    def from_json(cls, d: dict) -> "SkipChoice":
        cfg = d["config"]
        return cls(SkipConfig(tuple(cfg["skip"]), cfg["depth"], cfg["min_confidence"]), d["agreement"], d["step_ms"],
                   d["predicted"], tuple(d["damage"]), tuple(tuple(row) for row in d["curve"]), d["measured_s"])


@torch.inference_mode()
def agreement(runner: TargetRunner, view, sequence: list[int], start: int) -> float:
    """Share of positions p in [start, S-1) where `view` (a layer view), reading the full target's
    KV of sequence[:p] and its own row for sequence[p], predicts sequence[p+1]: the target's own
    greedy answer from `start` on, so each hit is a first draft the target would accept."""
    n = len(sequence)
    runner.reset()
    runner.prefill(sequence, 0)                                                  # rows [0, S): the full target
    visible = torch.zeros(n, 2 * n, dtype=torch.bool, device=runner.device)
    visible[:, :n] = torch.ones(n, n, dtype=torch.bool, device=runner.device).tril(-1)   # the rows before p
    visible[:, n:] = torch.eye(n, dtype=torch.bool, device=runner.device)               # and its own
    ids = torch.tensor([sequence], device=runner.device)
    logits = runner.side_forward(view, ids, torch.arange(n, device=runner.device)[None], runner.mask(visible, 0), n)
    guesses = logits.argmax(-1)[start:n - 1].cpu()                              # (S-1-start,)
    runner.reset()
    return float((guesses == torch.tensor(sequence[start + 1:])).float().mean())


def predicted_speedup(a: float, step_ms: float, depth: int, profile: LatencyProfile, context: int) -> float:
    tokens = sum(a ** i for i in range(depth + 1))
    return tokens / (depth * step_ms + profile.round(depth + 1, context)) * profile.plain_ms(context)


def choose_skip(runner: TargetRunner, profile: LatencyProfile, calibration: list[tuple[list[int], int]],
                report=print) -> SkipChoice:
    """The skipped set and chain depth predicted fastest on `calibration`: (sequence, answer start)
    pairs, the target's own greedy answers."""
    t0, layers = time.perf_counter(), runner.num_layers
    decoder = runner.target.model.get_decoder()
    context = max(len(seq) for seq, _ in calibration)

    def agree(skip: tuple[int, ...]) -> float:
        view = layer_view(decoder, [i for i in range(layers) if i not in skip])
        return sum(agreement(runner, view, seq, start) for seq, start in calibration) / len(calibration)

    report(f"Aerie: measuring which of the {layers} layers a self-speculative draft can skip (once; cached)...")
    damage = tuple(agree((layer,)) for layer in range(layers))
    order = sorted(range(layers), key=lambda layer: -damage[layer])               # least damaging first
    best, curve = None, []
    for m in range(1, layers):
        skip = tuple(sorted(order[:m]))
        a = agree(skip)
        step = step_ms(runner, SkipConfig(skip, depth=1), calibration[0][0])
        curve.append((m, round(a, 4), round(step, 3)))
        for depth in range(1, min(MAX_DEPTH, runner.buckets[-1] - 1) + 1):
            speed = predicted_speedup(a, step, depth, profile, context)
            if best is None or speed > best.predicted:
                best = SkipChoice(SkipConfig(skip, depth), a, step, speed, damage)
    return SkipChoice(best.config, best.agreement, best.step_ms, best.predicted, damage, tuple(curve),
                      time.perf_counter() - t0)


def step_ms(runner: TargetRunner, cfg: SkipConfig, prompt: list[int]) -> float:
    """ms of one draft step (one token through the kept layers and the LM head) after `prompt`."""
    drafter = LayerSkipDrafter(runner, cfg)
    runner.reset()
    runner.prefill(prompt[:-1], 0)
    ms = timed(runner.device, lambda: drafter.draft(prompt, None))
    runner.reset()
    return ms
