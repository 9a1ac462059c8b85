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

A LayerSkip checkpoint (Elhoushi et al. 2024: trained with layer dropout and one early-exit loss
shared by every layer, e.g. facebook/layerskip-llama3.2-1B) drafts by early exit instead: its
first E layers, then its own final norm and LM head, the exit it was trained for. `choose_exit`
searches E alone (skipping layers E..L-1), with the same agreement, step time and prediction.

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
    layers: int = 0                # the target's

    def describe(self) -> str:
        exit_at = self.config.exit_layer(self.layers)
        kept = f"exits after layer {exit_at} of {self.layers} (early exit)" if exit_at else \
            f"skips {len(self.config.skip)} of {self.layers} layers"
        return (f"{kept}, drafts up to {self.config.depth}: first draft right "
                f"{self.agreement:.0%} of the time, {self.step_ms:.1f} ms a step, predicted {self.predicted:.2f}x plain")

    def to_json(self) -> dict:
        return {**asdict(self), "config": asdict(self.config), "curve": [list(row) for row in self.curve]}

    @classmethod
    def from_json(cls, d: dict) -> "SkipChoice":
        cfg = d["config"]
        return cls(SkipConfig(tuple(cfg["skip"]), cfg["depth"], cfg["min_confidence"]), d["agreement"], d["step_ms"],
                   d["predicted"], tuple(d["damage"]), tuple(tuple(row) for row in d["curve"]), d["measured_s"], d["layers"])


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
    report(f"Aerie: measuring which of the {layers} layers a self-speculative draft can skip (once; cached)...")
    damage = tuple(mean_agreement(runner, (layer,), calibration) for layer in range(layers))
    order = sorted(range(layers), key=lambda layer: -damage[layer])               # least damaging first
    candidates = [tuple(sorted(order[:m])) for m in range(1, layers)]
    return search(runner, profile, calibration, candidates, damage, t0)


def choose_exit(runner: TargetRunner, profile: LatencyProfile, calibration: list[tuple[list[int], int]],
                report=print) -> SkipChoice:
    """LayerSkip's early exit: the exit layer E (the draft runs layers 0..E-1) and chain depth
    predicted fastest on `calibration`."""
    t0, layers = time.perf_counter(), runner.num_layers
    report(f"Aerie: measuring where this LayerSkip model's draft can exit among its {layers} layers (once; cached)...")
    candidates = [tuple(range(exit_at, layers)) for exit_at in range(layers - 1, 0, -1)]   # fewest skipped first
    return search(runner, profile, calibration, candidates, (), t0)


def is_layerskip_checkpoint(name_or_path: str) -> bool:
    """Whether a model was trained for early exit: Meta publishes its LayerSkip checkpoints as plain
    Llama configs, named facebook/layerskip-*, so the name is the only mark they carry."""
    return "layerskip" in name_or_path.lower()


def mean_agreement(runner: TargetRunner, skip: tuple[int, ...], calibration: list[tuple[list[int], int]]) -> float:
    view = layer_view(runner.target.model.get_decoder(), [i for i in range(runner.num_layers) if i not in skip])
    return sum(agreement(runner, view, seq, start) for seq, start in calibration) / len(calibration)


def search(runner: TargetRunner, profile: LatencyProfile, calibration: list[tuple[list[int], int]],
           candidates: list[tuple[int, ...]], damage: tuple[float, ...], t0: float) -> SkipChoice:
    """Of the skipped sets `candidates`, the set and chain depth with the best predicted speedup."""
    context = max(len(seq) for seq, _ in calibration)
    best, curve = None, []
    for skip in candidates:
        a = mean_agreement(runner, skip, calibration)
        step = step_ms(runner, SkipConfig(skip, depth=1), calibration[0][0])
        curve.append((len(skip), round(a, 4), round(step, 3)))
        for depth in range(1, min(MAX_DEPTH, runner.buckets[-1] - 1) + 1):
            speed = predicted_speedup(a, step, depth, profile, context)
            if best is None or speed > best.predicted:
                best = SkipChoice(SkipConfig(skip, depth), a, step, speed, damage)
    return SkipChoice(best.config, best.agreement, best.step_ms, best.predicted, damage, tuple(curve),
                      time.perf_counter() - t0, runner.num_layers)


def step_ms(runner: TargetRunner, cfg: SkipConfig, prompt: list[int]) -> float:
    """ms of one draft step (one token through the kept layers and the LM head) after `prompt`."""
    drafter = LayerSkipDrafter(runner, cfg)
    runner.reset()
    runner.prefill(prompt[:-1], 0)
    ms = timed(runner.device, lambda: drafter.draft(prompt, None))
    runner.reset()
    return ms
