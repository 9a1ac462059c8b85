"""`launch.py train`: an EAGLE draft head by self-distillation (research/eagle.md 7, calibration.md).

train(): answers -> split -> target features captured once (core/train/data.py) -> epochs of
unroll + loss + AdamW (core/train/losses.py) -> DIR/model.safetensors + config.json (eagle.md 10.3).
Along the way: DIR/log.jsonl (training and validation records), DIR/checkpoint.pt, and a head
snapshot per validation under DIR/snapshots/ for learning curves with `launch.py bench`.

Validation runs the unroll without noise as greedy chain drafting (`chain_hits`): alpha_d =
P(match at depth d | matched before), alpha_0 the top-1 proxy, and the chain's mean accepted
length tau = 1 + sum_k prod_{d<=k} alpha_d.

Resume is exact: the LR is a function of the step, the batch order of (seed, epoch), and the
checkpoint holds head, optimizer, noise RNG and the position in the epoch.
"""

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from tqdm import tqdm

from core.files import written_whole
from core.train.data import (Batch, DataConfig, FeatureSet, TrainDataError, capture, length_batches,
                             load_conversations, make_batch, split, training_sets)
from core.train.losses import (OBJECTIVES, DraftVocab, LossWeights, chain_hits, draft_vocab, losses, narrow_vocab, new_head,
                               start_fc_norm, unroll, warm_start)
from models.errors import AerieError, UnsupportedModelError
from models.head_checkpoint import load_draft_vocab, save_draft_vocab, save_head
from models.heads import KINDS, EagleHead
from models.target import Target

CHECKPOINT = "checkpoint.pt"
TRAIN_KINDS = (*KINDS, "medusa")   # EAGLE heads (this module) and Medusa heads (core/train/medusa.py)
RUN_CONTROL = ("save_every", "eval_every", "log_every", "stop_at_step", "time_limit_s", "threads", "amp")  # may change on resume


@dataclass(frozen=True)
class TrainConfig:
    kind: str = "eagle1"
    draft_vocab: int | None = None     # eagle3: its d2t's size (None = all); eagle1: rows drafted from (None = 8,192)
    epochs: int = 2
    lr: float = 7e-4                   # calibration.md for this ~4M-parameter head (EAGLE: 3e-5 for 0.25B)
    warmup_steps: int = 30
    final_lr_ratio: float = 0.1        # cosine decay from lr to lr * this at the last step
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    grad_clip: float = 0.5             # max global gradient norm
    batch_tokens: int = 1536           # padded tokens per step
    w_reg: float | None = None         # feature regression weight; None = 1.0 (eagle1), 0 (eagle3)
    w_cls: float | None = None         # token loss weight; None = 0.1 (eagle1), 1.0 (eagle3)
    noise: float = 0.1                 # step-0 features get U(-a, a), a = noise * feature RMS (EAGLE: U(-0.1, 0.1))
    ttt_steps: int | None = None       # unroll steps; None = 1 (eagle1), 5 (eagle3, its paper)
    ttt_decay: float = 0.8
    objective: str = "ce"              # token loss (losses.OBJECTIVES): ce, lk (-log acceptance), lk-greedy
    replay: float = 0.0                # a row the head's chain reaches and the target rejects weighs 1 + this
    flattest: float | None = None      # train on this share of the conversations, those the target is least sure of
    fc_norm: bool = False              # eagle1: EAGLE-3.1's RMSNorm on each of fc's inputs
    amp: str = "fp32"                  # the head's matmuls on a CPU: fp32, or bf16 autocast (fp32 master weights)
    medusa_heads: int = 4              # medusa: heads, guessing 2..K+1 tokens ahead
    medusa_layers: int = 1             # medusa: ResBlocks per head
    medusa_own_projection: bool = False  # medusa: each head its own projection (Medusa-1's), not the target's LM head
    eval_depth: int = 4                # depths of the validation chain
    init_layer: int | None = None      # copy this target decoder layer into the head's (-1 = the last)
    init_head: str | None = None       # start from this trained head's weights (a folder): more data, warm
    seed: int = 0
    save_every: int = 200              # steps between checkpoints
    eval_every: int = 0                # steps between validations + head snapshots (0 = at epoch ends only)
    log_every: int = 10
    stop_at_step: int | None = None    # stop (with a checkpoint) after this step; --resume goes on
    time_limit_s: float | None = None  # the same, once this much wall time has passed
    threads: int | None = None         # CPU threads; 1 can beat 2 on a 2-core machine someone else is using

    def __post_init__(self):
        if self.kind not in TRAIN_KINDS:
            raise UnsupportedModelError(f"Unknown head kind '{self.kind}': choose one of {', '.join(TRAIN_KINDS)}.")
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise ValueError(f"--draft-vocab must be a positive number of tokens, not {self.draft_vocab}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"Unknown objective '{self.objective}': choose one of {', '.join(OBJECTIVES)}.")
        if self.replay < 0 or (self.flattest is not None and not 0 < self.flattest <= 1):
            raise ValueError(f"--replay must be >= 0 and --flattest in (0, 1], not {self.replay} and {self.flattest}")
        if self.medusa_heads < 1 or self.medusa_layers < (0 if self.medusa_own_projection else 1):
            raise ValueError("Medusa heads need --medusa-heads >= 1 and, sharing the model's LM head, --medusa-layers >= 1.")
        if self.amp not in ("fp32", "bf16"):
            raise ValueError(f"--amp must be fp32 or bf16, not {self.amp}")
        if self.epochs < 1 or self.steps < 1 or self.batch_tokens < 2:
            raise ValueError(f"bad training config {self}")

    @property
    def reg_weight(self) -> float:
        return self.w_reg if self.w_reg is not None else (1.0 if self.kind == "eagle1" else 0.0)

    @property
    def cls_weight(self) -> float:
        return self.w_cls if self.w_cls is not None else (0.1 if self.kind == "eagle1" else 1.0)

    @property
    def loss_weights(self) -> LossWeights:
        return LossWeights(self.reg_weight, self.cls_weight, self.ttt_decay, self.objective, self.replay)

    @property
    def steps(self) -> int:
        return self.ttt_steps if self.ttt_steps is not None else (1 if self.kind == "eagle1" else 5)


@dataclass(frozen=True)
class Run:
    """What every step needs besides the config."""

    device: torch.device
    amp: torch.dtype | None          # autocast dtype where the target computes in 16 bits (validation: as served)
    noise_amp: float                 # a of U(-a, a)
    vocab: DraftVocab                # the columns the head is scored on
    train_amp: torch.dtype | None    # the training steps' autocast dtype: bf16 with --amp bf16 (a CPU), else amp


@dataclass
class Progress:
    """Where training stands; saved in the checkpoint."""

    step: int = 0
    epoch: int = 0
    batch: int = 0              # batches of this epoch done
    positions: int = 0          # depth-0 loss positions trained on
    seconds: float = 0.0        # training time, evaluation excluded, over all resumes
    history: list = field(default_factory=list)   # validation results


@dataclass(frozen=True)
class Trainee:
    """What `fit` trains: the module, its loss on a batch, its held-out numbers, and how a snapshot is saved."""
    module: nn.Module
    loss: Callable[[Batch, torch.Generator], tuple[torch.Tensor, dict]]
    evaluate: Callable[[FeatureSet], dict]
    save: Callable[[Path], None]


def eagle_trainee(head: EagleHead, cfg: TrainConfig, run: Run) -> Trainee:
    def loss(batch: Batch, rng: torch.Generator) -> tuple[torch.Tensor, dict]:
        return losses(head, unroll(head, batch, cfg.steps, run.noise_amp, rng), batch, cfg.loss_weights, run.vocab)
    return Trainee(head, loss, lambda valset: evaluate(head, valset, cfg, run), lambda out: save_head(head, out))


def new_run(target: Target, cfg: TrainConfig, noise_amp: float, vocab: DraftVocab) -> Run:
    """Autocast where the target computes in 16 bits; the training steps also in bf16 where asked (--amp bf16),
    while validation keeps the precision the head is served in, so its numbers compare across runs."""
    if cfg.amp == "bf16" and target.device.type != "cpu":
        raise ValueError("--amp bf16 is for a CPU target; on a GPU the head trains in the target's own dtype.")
    amp = None if target.dtype == torch.float32 else target.dtype
    return Run(target.device, amp, noise_amp, vocab, torch.bfloat16 if cfg.amp == "bf16" else amp)


def autocast(run: Run, training: bool = False):
    dtype = run.train_amp if training else run.amp
    return torch.autocast(run.device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


def train_step(trainee: Trainee, opt: torch.optim.Optimizer, batch: Batch, cfg: TrainConfig, run: Run,
               lr: float, rng: torch.Generator) -> dict:
    trainee.module.train()
    for group in opt.param_groups:
        group["lr"] = lr
    with autocast(run, training=True):
        loss, stats = trainee.loss(batch, rng)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trainee.module.parameters(), cfg.grad_clip)
    opt.step()
    return stats


def lr_at(cfg: TrainConfig, step: int, total: int) -> float:
    """Linear warm-up to lr, then cosine from lr to lr * final_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    done = min(1.0, (step - cfg.warmup_steps) / max(1, total - 1 - cfg.warmup_steps))
    return cfg.lr * (cfg.final_lr_ratio + (1 - cfg.final_lr_ratio) * 0.5 * (1 + math.cos(math.pi * done)))


# ---------------------------------------------------------------- validation

@torch.no_grad()
def evaluate(head: EagleHead, valset: FeatureSet, cfg: TrainConfig, run: Run) -> dict:
    """Depth-0 loss and the chain numbers of `chain_hits`: alpha_d = matched_d / reached_d."""
    head.eval()
    depth = max(cfg.eval_depth, 1)
    reached, matched, top5, loss_sum, n0 = [0] * depth, [0] * depth, 0, 0.0, 0
    for seqs in length_batches(valset.lengths, cfg.batch_tokens, None):
        batch = make_batch(valset, seqs, run.device)
        with autocast(run):
            outs = unroll(head, batch, depth, 0.0, None)
            loss, stats = losses(head, outs[:1], batch, cfg.loss_weights, run.vocab)
            r, m, t = chain_hits(head, outs, batch, run.vocab)
        loss_sum, n0 = loss_sum + stats["loss"] * stats["positions"], n0 + stats["positions"]
        reached, matched, top5 = [a + b for a, b in zip(reached, r)], [a + b for a, b in zip(matched, m)], top5 + t
    alphas = [m / r if r else 0.0 for m, r in zip(matched, reached)]
    tau = 1 + sum(math.prod(alphas[: k + 1]) for k in range(depth))
    return {"loss": loss_sum / max(n0, 1), "acc0": alphas[0], "top5_0": top5 / max(reached[0], 1),
            "alphas": [round(a, 4) for a in alphas], "tau_chain": tau, "positions": reached[0]}


# ---------------------------------------------------------------- checkpoints

def result_config(cfg: TrainConfig) -> dict:
    """The fields a resumed run must share with the checkpoint (all but run control)."""
    return {k: v for k, v in asdict(cfg).items() if k not in RUN_CONTROL}


def save_checkpoint(path: Path, head: nn.Module, opt, rng: torch.Generator, progress: Progress,
                    cfg: TrainConfig, data_id: list[str]) -> None:
    state = {"head": head.state_dict(), "optimizer": opt.state_dict(), "noise_rng": rng.get_state(),
             "progress": asdict(progress), "config": result_config(cfg), "data": data_id}
    with written_whole(path) as tmp:  # a kill during the save keeps the previous checkpoint
        torch.save(state, tmp)


def load_checkpoint(path: Path, head: nn.Module, opt, rng: torch.Generator, cfg: TrainConfig,
                    data_id: list[str]) -> Progress:
    state = torch.load(path, map_location="cpu", weights_only=True)
    saved = state["config"]
    changed = sorted(k for k, v in result_config(cfg).items() if saved.get(k) != v)
    if changed:
        raise AerieError(f"--resume needs the settings of the checkpoint in {path.parent}; these differ: "
                         f"{', '.join(f'{k} (was {saved.get(k)})' for k in changed)}.")
    if state["data"] != data_id:
        raise AerieError(f"The training data differ from those of the checkpoint in {path.parent}; "
                         "resume with the same answers and --max-tokens, or start a new --out.")
    head.load_state_dict(state["head"])
    opt.load_state_dict(state["optimizer"])
    rng.set_state(state["noise_rng"])
    return Progress(**state["progress"])


# ---------------------------------------------------------------- the loop

def fit(trainee: Trainee, trainset: FeatureSet, valset: FeatureSet, cfg: TrainConfig, run: Run, out: Path,
        resume: bool, data_id: list[str], deadline: float | None) -> tuple[Progress, bool]:
    """Train to the end of the last epoch, or until a stop condition; returns (progress, finished)."""
    head = trainee.module
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    rng = torch.Generator().manual_seed(cfg.seed)
    progress = load_checkpoint(out / CHECKPOINT, head, opt, rng, cfg, data_id) if resume else Progress()
    plan = [length_batches(trainset.lengths, cfg.batch_tokens, torch.Generator().manual_seed(cfg.seed * 1000 + e))
            for e in range(cfg.epochs)]
    total = sum(map(len, plan))
    save = lambda: save_checkpoint(out / CHECKPOINT, head, opt, rng, progress, cfg, data_id)  # noqa: E731
    bar = tqdm(total=total, initial=progress.step, unit="step", desc="train", dynamic_ncols=True)
    window: list[dict] = []
    while progress.epoch < cfg.epochs:
        batches = plan[progress.epoch]
        while progress.batch < len(batches):
            t0 = time.perf_counter()
            batch = make_batch(trainset, batches[progress.batch], run.device)
            stats = train_step(trainee, opt, batch, cfg, run, lr_at(cfg, progress.step, total), rng)
            progress.step, progress.batch = progress.step + 1, progress.batch + 1
            progress.positions += stats["positions"]
            progress.seconds += time.perf_counter() - t0
            window.append(stats)
            bar.update(1)
            if progress.step % cfg.log_every == 0:
                log(out, progress, mean_stats(window), bar)
                window = []
            if cfg.eval_every and progress.step % cfg.eval_every == 0:
                validate(trainee, valset, out, progress)
            stop = progress.step == cfg.stop_at_step or (deadline is not None and time.time() > deadline)
            if stop or progress.step % cfg.save_every == 0:
                save()
            if stop:
                bar.close()
                return progress, False
        progress.epoch, progress.batch = progress.epoch + 1, 0
        if not (cfg.eval_every and progress.step % cfg.eval_every == 0):  # else just validated
            validate(trainee, valset, out, progress)
        save()
    bar.close()
    return progress, True


def mean_stats(window: list[dict]) -> dict:
    return {k: sum(s[k] for s in window) / len(window) for k in window[0]}


def log(out: Path, progress: Progress, record: dict, bar: tqdm | None = None) -> None:
    record = {"step": progress.step, "epoch": progress.epoch, "train_positions": progress.positions,
              "train_s": round(progress.seconds, 1), **{k: round(v, 5) if isinstance(v, float) else v
                                                         for k, v in record.items()}}
    with open(out / "log.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    if bar is not None:
        bar.set_postfix(loss=f"{record.get('loss', 0):.3f}", acc0=f"{record.get('acc0', 0):.3f}")


def validate(trainee: Trainee, valset: FeatureSet, out: Path, progress: Progress) -> dict:
    """Held-out numbers, logged and kept in the history; the head is snapshotted for `launch.py bench`."""
    result = trainee.evaluate(valset)
    progress.history.append({"step": progress.step, "train_positions": progress.positions, **result})
    log(out, progress, {"val": result})
    tqdm.write(json.dumps({"val_step": progress.step, "epoch": progress.epoch, **result}))
    trainee.save(out / "snapshots" / f"step-{progress.step:06d}")
    return result


def train(target: Target, data: DataConfig, cfg: TrainConfig, out: Path, resume: bool = False) -> dict:
    """The whole stage: data -> features -> training -> DIR/model.safetensors + config.json. Returns the summary."""
    t_start = time.time()
    deadline = start_run(target, cfg, out, resume, t_start)
    train_convs, val_convs, dropped = conversations(target, data)
    head = new_head(target.model, cfg.kind, cfg.draft_vocab, cfg.init_layer, cfg.seed, [c.answer_ids for c in train_convs],
                    cfg.fc_norm)
    # On resume the checkpoint holds the warm-started weights; checked before the capture's minutes.
    gained_norms = warm_start(head, target.model, cfg.init_head) if cfg.init_head and not resume else False
    V, answers = head.config.vocab_size, [c.answer_ids for c in train_convs]
    kept = load_draft_vocab(cfg.init_head, V) if cfg.init_head else None
    vocab = draft_vocab(head, answers, kept, cfg.draft_vocab)
    narrow = narrow_vocab(vocab.ids, load_draft_vocab(cfg.init_head, V, narrow=True) if cfg.init_head else None, answers, V)
    layers = head.feature_layers(target.model.config.get_text_config().num_hidden_layers)
    folder = data.features_dir or out / "features"
    train_paths, cap_train = capture(target, train_convs, layers, data, folder, "train")
    val_paths, cap_val = capture(target, val_convs, layers, data, folder, "val")
    trainset, valset = training_sets(train_paths, val_paths, cfg.flattest)
    rms = float(trainset.features[:100_000].float().pow(2).mean().sqrt())  # feature scale, for the noise
    if gained_norms:
        embedded = target.model.get_input_embeddings()(trainset.tokens[:100_000].to(target.device))
        start_fc_norm(head, (float(embedded.float().pow(2).mean().sqrt()), rms))
    run = new_run(target, cfg, cfg.noise * rms, vocab)
    progress, finished = fit(eagle_trainee(head, cfg, run), trainset, valset, cfg, run, out, resume,
                             [p.stem for p in train_paths], deadline)
    save_head(head, out)
    if vocab.ids is not None:  # eagle1 over a big vocabulary: the tokens it trained (and drafts) on
        save_draft_vocab(out, vocab.ids.cpu(), None if narrow is None else narrow.cpu())
    summary = {"out": str(out), "kind": cfg.kind, "draft_vocab": cfg.draft_vocab if vocab.ids is None else len(vocab.ids),
               "narrow_vocab": None if narrow is None else len(narrow),
               "objective": cfg.objective, "replay": cfg.replay, "flattest": cfg.flattest,
               "fc_norm": cfg.fc_norm, "amp": cfg.amp, "capture_linear": data.linear, "finished": finished, "dropped_benchmark_prompts": dropped,
               "train_conversations": len(train_convs), **run_numbers(trainset, valset, cap_train, cap_val, progress),
               "wall_s": round(time.time() - t_start, 1)}
    (out / "train.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def start_run(target: Target, cfg: TrainConfig, out: Path, resume: bool, t_start: float) -> float | None:
    """The output folder checked against --resume, the threads set, the target frozen; -> the deadline."""
    out.mkdir(parents=True, exist_ok=True)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if (out / CHECKPOINT).exists() != resume:
        raise AerieError(f"{out} already has a training checkpoint; pass --resume to continue it, or pick a new --out."
                         if resume is False else f"--resume: {out} has no {CHECKPOINT} to continue from.")
    target.model.requires_grad_(False)
    return t_start + cfg.time_limit_s if cfg.time_limit_s else None


def conversations(target: Target, data: DataConfig) -> tuple[list, list, int]:
    """The answers to train on and the held-apart ones; -> (train, val, benchmark prompts dropped)."""
    convs, dropped = load_conversations(data, target.model.config.get_text_config().vocab_size, target.context_len)
    train_convs, val_convs = split(convs, data)
    if not train_convs or not val_convs:
        raise TrainDataError(f"Too few conversations ({len(convs)}) to hold out a validation split; add answers.")
    return train_convs, val_convs, dropped


def run_numbers(trainset, valset, cap_train: dict, cap_val: dict, progress) -> dict:
    """What train.json records of the data, the feature capture and the optimisation."""
    cap_pos, cap_s = cap_train["positions"] + cap_val["positions"], cap_train["seconds"] + cap_val["seconds"]
    return {"train_sequences": len(trainset), "train_answer_tokens": trainset.answer_tokens, "val_answer_tokens": valset.answer_tokens,
            "capture_positions": cap_pos, "capture_s": round(cap_s, 1),
            "capture_pos_per_s": round(cap_pos / cap_s, 1) if cap_pos else None, "epochs": progress.epoch,
            "steps": progress.step, "train_positions": progress.positions, "train_s": round(progress.seconds, 1),
            "train_pos_per_s": round(progress.positions / max(progress.seconds, 1e-9), 1),
            "val": progress.history[-1] if progress.history else None}
