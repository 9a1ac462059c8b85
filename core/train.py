"""Training an EAGLE draft head by self-distillation (research/eagle.md 7, research/calibration.md).

Capture the target once (core/train_data.py), then per batch: unroll the head over every position
at once, take the loss, step AdamW. Unroll step j is drafting depth j: row t reads (f_t, x_{t+1})
at step 0 and (its own step j-1 output, x_{t+1+j}) after, at RoPE position t+j, and predicts
x_{t+2+j}. EAGLE-1 is the one-step case; EAGLE-3's training-time test (eagle.md 7.2) the many-step.

Loss at row t, step j, where p = t+1+j must be an answer position:
  EAGLE-1: w_reg * SmoothL1(out, f_p) + w_cls * CE(teacher_p, softmax(lm_head(out)))   w = 1.0, 0.1
  EAGLE-3: CE(teacher_p restricted to the draft vocabulary, softmax(lm_head(norm(out))))
  total:   sum_j decay^j * loss_j                                                       decay 0.8
The teacher is the target's top-K distribution at p, renormalised (calibration.md 1).

Validation runs the same unroll without noise and counts, per depth d, the rows whose draft
matched the target's argmax at every depth < d: alpha_d = P(match at d | matched before), and the
chain's mean accepted length tau = 1 + sum_k prod_{d<=k} alpha_d (alpha_0 is the top-1 proxy).

Resume is exact: the LR is a function of the step, batch order of (seed, epoch), and the
checkpoint holds head, optimizer, noise RNG and position in the epoch.
"""

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import DynamicCache

from core.train_data import (Batch, DataConfig, FeatureSet, TrainDataError, capture, length_batches, load_conversations,
                             load_features, make_batch, split)
from models.errors import AerieError, UnsupportedModelError
from models.head_checkpoint import head_config_for_target, save_head
from models.heads import KINDS, EagleHead, build_head
from models.target import Target

CHECKPOINT = "checkpoint.pt"
RUN_CONTROL = ("save_every", "eval_every", "log_every", "stop_at_step", "time_limit_s")  # may change on resume


@dataclass(frozen=True)
class TrainConfig:
    kind: str = "eagle1"
    draft_vocab: int | None = None     # eagle3: keep the most frequent answer tokens (EAGLE-3 d2t); None = all
    epochs: int = 1
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
    eval_depth: int = 4                # depths of the validation chain
    init_layer: int | None = None      # copy this target decoder layer into the head's (-1 = the last)
    seed: int = 0
    save_every: int = 200              # steps between checkpoints
    eval_every: int = 0                # steps between validations + head snapshots (0 = at epoch ends only)
    log_every: int = 10
    stop_at_step: int | None = None    # stop (with a checkpoint) after this step; --resume goes on
    time_limit_s: float | None = None  # the same, once this much wall time has passed

    def __post_init__(self):
        if self.kind not in KINDS:
            raise UnsupportedModelError(f"Unknown head kind '{self.kind}': choose one of {', '.join(KINDS)}.")
        if self.kind == "eagle1" and self.draft_vocab is not None:
            raise UnsupportedModelError("A reduced draft vocabulary needs an EAGLE-3 head (--kind eagle3); "
                                        "EAGLE-1 heads use the target's own LM head.")
        if self.epochs < 1 or self.steps < 1 or self.batch_tokens < 2:
            raise ValueError(f"bad training config {self}")

    @property
    def reg_weight(self) -> float:
        return self.w_reg if self.w_reg is not None else (1.0 if self.kind == "eagle1" else 0.0)

    @property
    def cls_weight(self) -> float:
        return self.w_cls if self.w_cls is not None else (0.1 if self.kind == "eagle1" else 1.0)

    @property
    def steps(self) -> int:
        return self.ttt_steps if self.ttt_steps is not None else (1 if self.kind == "eagle1" else 5)


@dataclass(frozen=True)
class Run:
    """What every step needs besides the config."""

    device: torch.device
    amp: torch.dtype | None          # autocast dtype where the target computes in 16 bits
    noise_amp: float                 # a of U(-a, a)
    draft_index: torch.Tensor | None  # (V,) target id -> draft index, -1 outside; None = identity


@dataclass
class Progress:
    """Where training stands; saved in the checkpoint."""

    step: int = 0
    epoch: int = 0
    batch: int = 0              # batches of this epoch done
    positions: int = 0          # depth-0 loss positions trained on
    seconds: float = 0.0        # training time, evaluation excluded, over all resumes
    history: list = field(default_factory=list)   # validation results


# ---------------------------------------------------------------- head

def new_head(target: Target, cfg: TrainConfig, answers: list[tuple[int, ...]]) -> EagleHead:
    model = target.model
    torch.manual_seed(cfg.seed)
    config = head_config_for_target(model.config, cfg.kind, draft_vocab_size=cfg.draft_vocab)
    head = build_head(config, model.get_input_embeddings(), model.get_output_embeddings())
    with torch.no_grad():
        if cfg.kind == "eagle3":
            init_draft_vocab(head, model, answers)
        if cfg.init_layer is not None:
            init_from_layer(head, model.get_decoder().layers[cfg.init_layer])
    return head.to(target.device)


def init_draft_vocab(head: EagleHead, model, answers: list[tuple[int, ...]]) -> None:
    """EAGLE-3 `scandata`: the Vd most frequent answer tokens, ascending; draft i is target i + d2t[i].
    The draft LM head and final norm start as the target's own (its rows for those tokens)."""
    V, Vd = head.config.vocab_size, head.config.draft_vocab_size
    counts = torch.bincount(torch.tensor([t for a in answers for t in a]), minlength=V)
    used = torch.argsort(-counts, stable=True)[:Vd].sort().values   # ties: the lower id
    head.d2t.copy_(used - torch.arange(Vd))
    head.t2d.copy_(torch.zeros(V, dtype=torch.bool).index_fill_(0, used, True))
    head.lm_head.weight.copy_(model.get_output_embeddings().weight[used].float())
    if (norm := getattr(model.get_decoder(), "norm", None)) is not None:
        head.norm.weight.copy_(norm.weight.float())


def init_from_layer(head: EagleHead, layer) -> None:
    """Start the head's decoder layer from a target layer (issue 4: data efficiency). EAGLE-1's layer
    has no input norm, so the norm's gain g is folded into q/k/v: (x * g) W^T = x (W diag g)^T.
    EAGLE-3's q/k/v read [norm(emb), norm(h)]: the target weights go to the feature half."""
    dst = head.layers[0] if head.config.kind == "eagle1" else head.midlayer
    gain = layer.input_layernorm.weight.float()
    for name in ("q_proj", "k_proj", "v_proj"):
        w = getattr(layer.self_attn, name).weight.float()
        if head.config.kind == "eagle1":
            getattr(dst.self_attn, name).weight.copy_(w * gain)
        else:
            getattr(dst.self_attn, name).weight[:, head.config.hidden_size:].copy_(w)
    for name in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "post_attention_layernorm"):
        dst.get_submodule(name).weight.copy_(layer.get_submodule(name).weight.float())
    if head.config.kind == "eagle3":
        dst.input_layernorm.weight.copy_(gain)
        dst.hidden_norm.weight.copy_(gain)


def draft_index(head: EagleHead) -> torch.Tensor | None:
    c = head.config
    if c.draft_vocab_size == c.vocab_size:
        return None
    index = torch.full((c.vocab_size,), -1, dtype=torch.long, device=head.d2t.device)
    return index.index_copy_(0, head.to_target_ids(torch.arange(c.draft_vocab_size, device=index.device)),
                             torch.arange(c.draft_vocab_size, device=index.device))


# ---------------------------------------------------------------- unroll and loss

def ahead(x: torch.Tensor, s: int) -> torch.Tensor:
    """Row t -> x[:, t + s] for the T-1 rows t; zero (False) past the end."""
    return torch.cat([x[:, s:], torch.zeros_like(x[:, : s - 1])], dim=1)


def ttt_mask(W: int, j: int, device) -> torch.Tensor:
    """(1, 1, W, (j+1)W) additive mask of unroll step j. Row t sees the step-0 keys at <= t (the
    committed pairs) and, of each later step, only its own row: its ancestors at depths 1..j."""
    rows, cols = torch.arange(W, device=device)[:, None], torch.arange(W, device=device)[None]
    allow = torch.cat([cols <= rows] + [cols == rows] * j, dim=1)
    return torch.zeros(allow.shape, device=device).masked_fill(~allow, torch.finfo(torch.float32).min)[None, None]


def unroll(head: EagleHead, batch: Batch, steps: int, noise_amp: float, rng: torch.Generator | None) -> list[torch.Tensor]:
    """Head outputs (B, T-1, H) of each step."""
    W = batch.tokens.shape[1] - 1
    x = batch.features[:, :W]                                           # (B, W, F) f_t
    if noise_amp > 0:
        x = x + ((torch.rand(x.shape, generator=rng) * 2 - 1) * noise_amp).to(x.device)
    cache, outs = DynamicCache(), []
    for j in range(steps):
        positions = torch.arange(j, W + j, device=x.device)[None]       # (1, W)
        x = head(x, ahead(batch.tokens, 1 + j), positions, ttt_mask(W, j, x.device), cache)
        outs.append(x)
    return outs


def token_loss(head: EagleHead, hidden: torch.Tensor, ids: torch.Tensor, logits: torch.Tensor,
               index: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden (M, H), teacher top-K ids/logits (M, K) -> per-row CE (M,), kept rows (M,), top-1 hit (M,).
    CE = logsumexp(z) - sum_k p_k z[id_k]; p is the teacher renormalised over the ids in the draft
    vocabulary, and a row whose teacher argmax is outside it is not kept (EAGLE-3)."""
    z = head.draft_logits(hidden).float()                                # (M, Vd)
    cols = ids if index is None else index[ids]                          # (M, K) draft columns, -1 outside
    inside = cols >= 0
    p = torch.where(inside[:, :1], logits.masked_fill(~inside, -math.inf).softmax(-1), 0.0)
    ce = z.logsumexp(-1) - (p * z.gather(-1, cols.clamp(min=0))).sum(-1)
    hit = head.to_target_ids(z.argmax(-1)) == ids[:, 0]
    return ce, inside[:, 0], hit


def losses(head: EagleHead, outs: list[torch.Tensor], batch: Batch, cfg: TrainConfig,
           index: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
    total, stats = 0.0, {}
    for j, out in enumerate(outs):
        rows = ahead(batch.has_teacher, 1 + j)                           # (B, W): p = t+1+j is an answer position
        hidden = out[rows]                                               # (M, H)
        ce, kept, hit = token_loss(head, hidden, ahead(batch.teacher_ids, 1 + j)[rows],
                                   ahead(batch.teacher_logits, 1 + j)[rows], index)
        loss = cfg.cls_weight * ce[kept].mean()
        if cfg.reg_weight:
            reg = F.smooth_l1_loss(hidden, ahead(batch.features, 1 + j)[rows], reduction="none").mean(-1).mean()
            loss = loss + cfg.reg_weight * reg
            stats.setdefault("reg", reg.item())
        total = total + cfg.ttt_decay ** j * loss
        stats.setdefault("ce", ce[kept].mean().item())
        stats.setdefault("acc0", hit.float().mean().item())
        stats.setdefault("positions", int(rows.sum()))
    return total, stats | {"loss": float(total.detach())}


def autocast(run: Run):
    return torch.autocast(run.device.type, dtype=run.amp or torch.float32, enabled=run.amp is not None)


def train_step(head: EagleHead, opt: torch.optim.Optimizer, batch: Batch, cfg: TrainConfig, run: Run,
               lr: float, rng: torch.Generator) -> dict:
    head.train()
    for group in opt.param_groups:
        group["lr"] = lr
    with autocast(run):
        loss, stats = losses(head, unroll(head, batch, cfg.steps, run.noise_amp, rng), batch, cfg, run.draft_index)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
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
    head.eval()
    depth = max(cfg.eval_depth, 1)
    reach, match, loss_sum, top5, n0 = [0] * depth, [0] * depth, 0.0, 0, 0
    for seqs in length_batches(valset.lengths, cfg.batch_tokens, None):
        batch = make_batch(valset, seqs, run.device)
        with autocast(run):
            outs = unroll(head, batch, depth, 0.0, None)
            loss, stats = losses(head, outs[:1], batch, cfg, run.draft_index)
        loss_sum, n0 = loss_sum + float(loss) * stats["positions"], n0 + stats["positions"]
        alive = torch.ones_like(batch.has_teacher[:, 1:])                # (B, W) chain so far matched
        for j, out in enumerate(outs):
            alive &= ahead(batch.has_teacher, 1 + j)
            argmax = ahead(batch.teacher_ids, 1 + j)[alive][:, 0]        # (M,) the target's next token
            top = head.to_target_ids(head.draft_logits(out[alive]).float().topk(5, dim=-1).indices)  # (M, 5)
            hit = top[:, 0] == argmax
            reach[j], match[j] = reach[j] + len(hit), match[j] + int(hit.sum())
            top5 += int((top == argmax[:, None]).any(-1).sum()) if j == 0 else 0
            alive[alive.clone()] = hit
    alphas = [m / r if r else 0.0 for m, r in zip(match, reach)]
    tau = 1 + sum(math.prod(alphas[: k + 1]) for k in range(depth))
    return {"loss": loss_sum / max(n0, 1), "acc0": alphas[0], "top5_0": top5 / max(reach[0], 1),
            "alphas": [round(a, 4) for a in alphas], "tau_chain": tau, "positions": reach[0]}


# ---------------------------------------------------------------- checkpoints

def result_config(cfg: TrainConfig) -> dict:
    """The fields a resumed run must share with the checkpoint (all but run control)."""
    return {k: v for k, v in asdict(cfg).items() if k not in RUN_CONTROL}


def save_checkpoint(path: Path, head: EagleHead, opt, rng: torch.Generator, progress: Progress,
                    cfg: TrainConfig, data_id: list[str]) -> None:
    state = {"head": head.state_dict(), "optimizer": opt.state_dict(), "noise_rng": rng.get_state(),
             "progress": asdict(progress), "config": result_config(cfg), "data": data_id}
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic: a kill during the save keeps the previous checkpoint


def load_checkpoint(path: Path, head: EagleHead, opt, rng: torch.Generator, cfg: TrainConfig,
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

def fit(head: EagleHead, trainset: FeatureSet, valset: FeatureSet, cfg: TrainConfig, run: Run, out: Path,
        resume: bool, data_id: list[str], deadline: float | None) -> tuple[Progress, bool]:
    """Train to the end of the last epoch, or until a stop condition; returns (progress, finished)."""
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
            stats = train_step(head, opt, batch, cfg, run, lr_at(cfg, progress.step, total), rng)
            progress.step, progress.batch = progress.step + 1, progress.batch + 1
            progress.positions += stats["positions"]
            progress.seconds += time.perf_counter() - t0
            window.append(stats)
            bar.update(1)
            if len(window) == cfg.log_every:
                log(out, progress, mean_stats(window), bar)
                window = []
            if cfg.eval_every and progress.step % cfg.eval_every == 0:
                validate(head, valset, cfg, run, out, progress)
            stop = progress.step == cfg.stop_at_step or (deadline is not None and time.time() > deadline)
            if stop or progress.step % cfg.save_every == 0:
                save()
            if stop:
                bar.close()
                return progress, False
        progress.epoch, progress.batch = progress.epoch + 1, 0
        validate(head, valset, cfg, run, out, progress)
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


def validate(head: EagleHead, valset: FeatureSet, cfg: TrainConfig, run: Run, out: Path, progress: Progress) -> dict:
    """Held-out numbers, logged and kept in the history; the head is snapshotted for `launch.py bench`."""
    result = evaluate(head, valset, cfg, run)
    progress.history.append({"step": progress.step, "train_positions": progress.positions, **result})
    log(out, progress, {"val": result})
    tqdm.write(json.dumps({"val_step": progress.step, "epoch": progress.epoch, **result}))
    save_head(head, out / "snapshots" / f"step-{progress.step:06d}")
    return result


def train(target: Target, data: DataConfig, cfg: TrainConfig, out: Path, resume: bool = False) -> dict:
    """The whole stage: data -> features -> training -> DIR/model.safetensors + config.json. Returns the summary."""
    t_start = time.time()
    deadline = t_start + cfg.time_limit_s if cfg.time_limit_s else None
    out.mkdir(parents=True, exist_ok=True)
    if (out / CHECKPOINT).exists() != resume:
        raise AerieError(f"{out} already has a training checkpoint; pass --resume to continue it, or pick a new --out."
                         if resume is False else f"--resume: {out} has no {CHECKPOINT} to continue from.")
    target.model.requires_grad_(False)
    convs, dropped = load_conversations(data, target.model.config.get_text_config().vocab_size, target.context_len)
    train_convs, val_convs = split(convs, data)
    if not train_convs or not val_convs:
        raise TrainDataError(f"Too few conversations ({len(convs)}) to hold out a validation split; add answers.")
    head = new_head(target, cfg, [c.answer_ids for c in train_convs])
    layers = head.feature_layers(target.model.config.get_text_config().num_hidden_layers)
    folder = data.features_dir or out / "features"
    train_paths, cap_train = capture(target, train_convs, layers, data, folder, "train")
    val_paths, cap_val = capture(target, val_convs, layers, data, folder, "val")
    trainset, valset = load_features(train_paths), load_features(val_paths)
    rms = float(trainset.features[:100_000].float().pow(2).mean().sqrt())  # feature scale, for the noise
    run = Run(target.device, None if target.dtype == torch.float32 else target.dtype, cfg.noise * rms, draft_index(head))
    progress, finished = fit(head, trainset, valset, cfg, run, out, resume, [p.stem for p in train_paths], deadline)
    save_head(head, out)
    cap_pos, cap_s = cap_train["positions"] + cap_val["positions"], cap_train["seconds"] + cap_val["seconds"]
    summary = {
        "out": str(out), "kind": cfg.kind, "finished": finished, "dropped_benchmark_prompts": dropped,
        "train_conversations": len(train_convs), "train_answer_tokens": trainset.answer_tokens,
        "val_answer_tokens": valset.answer_tokens, "capture_positions": cap_pos, "capture_s": round(cap_s, 1),
        "capture_pos_per_s": round(cap_pos / cap_s, 1) if cap_pos else None, "epochs": progress.epoch,
        "steps": progress.step, "train_positions": progress.positions, "train_s": round(progress.seconds, 1),
        "train_pos_per_s": round(progress.positions / max(progress.seconds, 1e-9), 1),
        "val": progress.history[-1] if progress.history else None, "wall_s": round(time.time() - t_start, 1),
    }
    (out / "train.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
