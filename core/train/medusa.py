"""`launch.py train --kind medusa`: Medusa-1 heads on a frozen target, self-distilled from the same
answers and captured features as an EAGLE-1 head (the target's last layer output; core/train/data.py).

Head k at row t reads f_t and is scored on the teacher row t+k+1, the target's distribution of x_{t+k+2}
(models/medusa.py), over the draft vocabulary: the EAGLE-1 head's own when one is given (the two then
draft from the same tokens), else the most frequent answer tokens. By default the heads share the
target's LM head rows for it as their projection (frozen, not saved: EAGLE-1's trick); with
`medusa_own_projection` each head trains its own copy (Medusa-1's, 15x the weights). The loss is losses.teacher_loss per
head (cross-entropy to the teacher by default, or LK's), weighted decay^k as Medusa's paper weighs
farther heads less. Validation reports each head's top-1 agreement with the target's argmax and the
chain's mean accepted length tau = 1 + sum_k prod_{d<=k} alpha_d, alpha_d = P(head d right | heads < d right).

Shapes: B rows, T padded length, W = T-1 rows scored, H width, K heads, M selected rows, Vd draft vocabulary.
"""

import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from core.train.data import (Batch, DataConfig, FeatureSet, TrainDataError, capture, length_batches, make_batch,
                             training_sets)
from core.train.loop import Run, TrainConfig, Trainee, autocast, conversations, fit, new_run, run_numbers, start_run
from core.train.losses import DraftVocab, EAGLE1_DRAFT_VOCAB, ahead, frequent_vocab, teacher_loss, weighted_mean
from models.head_checkpoint import load_draft_vocab
from models.heads import feature_layers
from models.medusa import MedusaHeads, new_medusa, save_medusa
from models.target import Target

MEDUSA_DECAY = 0.8   # head k's loss weighs 0.8^k (Medusa-1's lambda_k)


def logits_of(heads: MedusaHeads, k: int, x: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """Head k's draft logits (..., Vd) for features x (..., H); `projection` (Vd, H): the shared LM head rows."""
    out = heads.heads[k](x)
    return F.linear(out, projection) if heads.config.shared else out


def medusa_losses(heads: MedusaHeads, batch: Batch, vocab: DraftVocab, projection: torch.Tensor,
                  objective: str) -> tuple[torch.Tensor, dict]:
    total, stats = 0.0, {}
    for k in range(heads.config.num_heads):
        rows = ahead(batch.has_teacher, 1 + k)                           # (B, W): x_{t+k+2} is an answer token
        z = logits_of(heads, k, batch.features[:, :-1][rows], projection)   # (M, Vd), from f_t
        ids, logits = ahead(batch.teacher_ids, 1 + k)[rows], ahead(batch.teacher_logits, 1 + k)[rows]
        loss, kept = teacher_loss(z.float(), ids, logits, vocab.index, objective)
        loss = weighted_mean(loss, kept.float())
        total = total + MEDUSA_DECAY ** k * loss
        stats[f"head{k}"] = loss.item()
        stats.setdefault("positions", int(rows.sum()))
    return total, stats | {"loss": float(total.detach())}


@torch.no_grad()
def medusa_evaluate(heads: MedusaHeads, valset: FeatureSet, vocab: DraftVocab, projection: torch.Tensor,
                    cfg: TrainConfig, run: Run) -> dict:
    """Per head: reached (every shallower head right) and matched, as `loop.evaluate`'s chain numbers."""
    heads.eval()
    K = heads.config.num_heads
    reached, matched, hits, rows_seen = [0] * K, [0] * K, [0] * K, [0] * K
    for seqs in length_batches(valset.lengths, cfg.batch_tokens, None):
        batch = make_batch(valset, seqs, run.device)
        alive = torch.ones_like(batch.has_teacher[:, 1:])                # (B, W) the chain is right so far
        for k in range(K):
            with autocast(run):
                guess = logits_of(heads, k, batch.features[:, :-1], projection).argmax(-1)   # (B, W)
            rows = ahead(batch.has_teacher, 1 + k)
            right = vocab.to_target(guess) == ahead(batch.teacher_ids, 1 + k)[..., 0]      # (B, W)
            hits[k], rows_seen[k] = hits[k] + int((right & rows).sum()), rows_seen[k] + int(rows.sum())
            alive &= rows
            reached[k], matched[k] = reached[k] + int(alive.sum()), matched[k] + int((alive & right).sum())
            alive &= right
    alphas = [m / r if r else 0.0 for m, r in zip(matched, reached)]
    return {"acc": [round(h / max(n, 1), 4) for h, n in zip(hits, rows_seen)], "alphas": [round(a, 4) for a in alphas],
            "tau_chain": 1 + sum(math.prod(alphas[: k + 1]) for k in range(K)), "positions": rows_seen[0]}


def medusa_vocab(lm_head: torch.Tensor, answers: list[tuple[int, ...]], eagle_head: str | None) -> DraftVocab:
    """The EAGLE-1 head's draft vocabulary if one is named (it must have one where the vocabulary is
    bigger than EAGLE1_DRAFT_VOCAB; its narrow rows where it names some: Medusa drafts on a CPU too),
    else the most frequent answer tokens (losses.frequent_vocab)."""
    kept = load_draft_vocab(eagle_head, lm_head.shape[0], narrow=True) if eagle_head else None
    if eagle_head and kept is None and lm_head.shape[0] > EAGLE1_DRAFT_VOCAB:
        raise TrainDataError(f"--head {eagle_head} has no draft vocabulary (draft_vocab.safetensors) for the Medusa heads "
                             "to share; name an EAGLE-1 head folder that has one, or --head none for the frequent answer tokens.")
    return frequent_vocab(lm_head, answers, kept)


def medusa_trainee(heads: MedusaHeads, vocab: DraftVocab, projection: torch.Tensor, cfg: TrainConfig, run: Run,
                   base_model: str) -> Trainee:
    return Trainee(heads, lambda batch, rng: medusa_losses(heads, batch, vocab, projection, cfg.objective),
                   lambda valset: medusa_evaluate(heads, valset, vocab, projection, cfg, run),
                   lambda out: save_medusa(heads, out, None if vocab.ids is None else vocab.ids.cpu(), base_model))


def train_medusa(target: Target, data: DataConfig, cfg: TrainConfig, out: Path, resume: bool = False,
                 eagle_head: str | None = None) -> dict:
    """answers -> features of the target's last layer -> K heads -> DIR/medusa_lm_head.safetensors + config.json."""
    t_start = time.time()
    deadline = start_run(target, cfg, out, resume, t_start)
    train_convs, val_convs, dropped = conversations(target, data)
    model = target.model
    lm_head = model.get_output_embeddings().weight.detach().float()                 # (V, H)
    vocab = medusa_vocab(lm_head, [c.answer_ids for c in train_convs], eagle_head)
    projection = lm_head if vocab.weight is None else vocab.weight                 # (Vd, H)
    torch.manual_seed(cfg.seed)
    heads = new_medusa(cfg.medusa_heads, cfg.medusa_layers, projection, shared=not cfg.medusa_own_projection)
    layers = feature_layers("eagle1", model.config.get_text_config().num_hidden_layers)  # the last layer, normed
    folder = data.features_dir or out / "features"
    train_paths, cap_train = capture(target, train_convs, layers, data, folder, "train")
    val_paths, cap_val = capture(target, val_convs, layers, data, folder, "val")
    trainset, valset = training_sets(train_paths, val_paths, cfg.flattest)
    run = new_run(target, cfg, 0.0, vocab)
    base = str(model.config.name_or_path)
    trainee = medusa_trainee(heads, vocab, projection, cfg, run, base)
    progress, finished = fit(trainee, trainset, valset, cfg, run, out, resume, [p.stem for p in train_paths], deadline)
    trainee.save(out)
    summary = {"out": str(out), "kind": "medusa", "heads": cfg.medusa_heads, "layers": cfg.medusa_layers,
               "own_projection": cfg.medusa_own_projection,
               "objective": cfg.objective, "amp": cfg.amp, "draft_vocab_from": eagle_head, "capture_linear": data.linear,
               "finished": finished, "dropped_benchmark_prompts": dropped, "train_conversations": len(train_convs),
               **run_numbers(trainset, valset, cap_train, cap_val, progress), "wall_s": round(time.time() - t_start, 1)}
    (out / "train.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
