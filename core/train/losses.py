"""What an EAGLE head computes while it trains: its initialisation, the unroll and the losses.

Unroll step j is drafting depth j: row t reads (f_t, x_{t+1}) at step 0 and (its own step j-1
output, x_{t+1+j}) after, at RoPE position t+j, and predicts x_{t+2+j}. All rows run at once;
row t of step j attends to the step-0 pairs at <= t (what the head cache holds at inference) and
to its own rows of steps 1..j (its ancestors in the draft tree). EAGLE-1 is the one-step case,
EAGLE-3's training-time test (eagle.md 7.2) the many-step one.

Loss at row t, step j, where p = t+1+j must be an answer position:
  EAGLE-1: w_reg * SmoothL1(out, f_p) + w_cls * CE(teacher_p, softmax(lm_head_d(out)))   w = 1.0, 0.1
  EAGLE-3: CE(teacher_p, softmax(lm_head(norm(out))))
  total:   sum_j decay^j * loss_j                                                         decay 0.8
The token loss (`objective`) is CE to the teacher p (KL up to a constant), or LK's negative log
acceptance (Samarin et al. 2026, arXiv 2602.23881): alpha = sum_v min(p_v, q_v) is the chance that
speculative sampling accepts a draft from q, so loss = -log alpha. Under greedy decoding p is the
one-hot of the target's argmax and -log alpha = -log q(argmax p) ("lk-greedy", hard-label CE).
Replay (Draft-OPD's error positions, arXiv 2605.29343): a row that the head's own greedy chain
reaches (every shallower draft matched) and whose draft the target rejects weighs 1 + replay.
The teacher is the target's top-K distribution at p, restricted to the draft vocabulary and
renormalised (calibration.md 1); a row whose teacher argmax is outside it is not scored. Both
kinds draft from a vocabulary of frequent answer tokens: EAGLE-3 from its own d2t, EAGLE-1 from
the target LM head's rows lm_head_d for EAGLE1_DRAFT_VOCAB tokens (draft_vocab.safetensors), so
it trains on the logits it will draft with, at a sixth of the full LM head's cost.

Shapes: B rows, T padded length, W = T-1 head rows, H head width, F feature width, K teacher
top-k, M selected rows, V / Vd target / draft vocabulary. Knows nothing about files or the loop.
"""

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from core.train.data import Batch
from models.errors import HeadMismatchError
from models.head_checkpoint import load_head
from models.head_config import head_config_for_target
from models.heads import EagleHead, build_head


OBJECTIVES = ("ce", "lk", "lk-greedy")


@dataclass(frozen=True)
class LossWeights:
    reg: float     # feature regression (EAGLE-1)
    cls: float     # token loss
    decay: float   # step j of the unroll weighs decay^j
    objective: str = "ce"   # token loss: one of OBJECTIVES
    replay: float = 0.0     # extra weight of a row the head's chain reaches and the target rejects


def new_head(model, kind: str, draft_vocab: int | None, init_layer: int | None, seed: int,
             answers: list[tuple[int, ...]], fc_norm: bool = False) -> EagleHead:
    """A fresh fp32 head for the HF causal LM `model`, seeded; `answers` give EAGLE-3 its draft vocabulary."""
    torch.manual_seed(seed)
    # An EAGLE-1 head drafts through the target's LM head; its draft vocabulary is a choice of rows (draft_vocab()).
    own_vocab = draft_vocab if kind == "eagle3" else None
    config = head_config_for_target(model.config, kind, draft_vocab_size=own_vocab, fc_norm=fc_norm)
    head = build_head(config, model.get_input_embeddings(), model.get_output_embeddings())
    with torch.no_grad():
        if kind == "eagle3":
            init_draft_vocab(head, model, answers)
        if init_layer is not None:
            init_from_layer(head, model.get_decoder().layers[init_layer])
    return head.to(model.get_input_embeddings().weight.device)


def warm_start(head: EagleHead, model, source: str) -> bool:
    """Copy a trained head's weights into `head` (same kind and sizes, checked by the loader), to
    train it further on more data instead of from scratch. Returns whether `head` gained fc_norm,
    whose gains `start_fc_norm` then sets."""
    trained = load_head(source, model.config, model.get_input_embeddings(), model.get_output_embeddings())
    if replace(trained.config, fc_norm=head.config.fc_norm) != head.config or trained.config.fc_norm > head.config.fc_norm:
        raise HeadMismatchError(f"--init-from {source} is a {trained.config.kind} head of another shape than "
                                f"the {head.config.kind} head this run trains; pass the same --kind, --draft-vocab and --fc-norm.")
    missing, _ = head.load_state_dict(trained.state_dict(), strict=False)
    assert all(k.startswith("fc_norm.") for k in missing), missing
    return bool(missing)


@torch.no_grad()
def start_fc_norm(head: EagleHead, input_rms: tuple[float, float]) -> None:
    """Each fc_norm gain at its input's RMS over the data (embedding, feature): norm(x) = g x / rms(x)
    is then ~ x, so a warm head that gained the norms drafts as before."""
    for norm, rms in zip(head.fc_norm, input_rms):
        norm.weight.fill_(rms)


def answer_counts(answers: list[tuple[int, ...]], vocab_size: int) -> torch.Tensor:
    """(V,) how often each token occurs in the answers."""
    return torch.bincount(torch.tensor([t for a in answers for t in a], dtype=torch.long), minlength=vocab_size)


def frequent_tokens(answers: list[tuple[int, ...]], vocab_size: int, n: int,
                    kept: torch.Tensor | None = None) -> torch.Tensor:
    """`kept` (none by default) and the most frequent answer tokens not in it, n ids in all, ascending
    (ties: the lower id). A head keeps every token it drafted from: n below `kept`'s is an error."""
    kept = torch.zeros(0, dtype=torch.long) if kept is None else kept.cpu().long()
    if n < len(kept):
        raise ValueError(f"--draft-vocab {n} is below the {len(kept)} tokens the warm-started head drafts from.")
    if n == len(kept):   # no count needed: a warm start's own vocabulary, as it was
        return kept.sort().values
    ranked = torch.argsort(-answer_counts(answers, vocab_size), stable=True)
    fresh = ranked[~torch.isin(ranked, kept)][:n - len(kept)]
    return torch.cat([kept, fresh]).sort().values


def init_draft_vocab(head: EagleHead, model, answers: list[tuple[int, ...]]) -> None:
    """EAGLE-3 `scandata`: the Vd most frequent answer tokens, ascending; draft i is target i + d2t[i].
    The draft LM head and final norm start as the target's own (its rows for those tokens)."""
    V, Vd = head.config.vocab_size, head.config.draft_vocab_size
    used = frequent_tokens(answers, V, Vd)
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


EAGLE1_DRAFT_VOCAB = 8192  # frequent answer tokens an EAGLE-1 head drafts from (98% of answer tokens here)


@dataclass(frozen=True)
class DraftVocab:
    """The columns a head scores while training: its draft vocabulary."""
    index: torch.Tensor | None    # (V,) target id -> column, -1 outside; None = all V, in order
    ids: torch.Tensor | None      # (Vd,) eagle1: the target id of each column
    weight: torch.Tensor | None   # (Vd, H) eagle1: the target LM head's rows for them

    def logits(self, head: EagleHead, hidden: torch.Tensor) -> torch.Tensor:
        return head.draft_logits(hidden) if self.weight is None else F.linear(hidden.to(self.weight.dtype), self.weight)

    def to_target(self, cols: torch.Tensor, head: EagleHead | None = None) -> torch.Tensor:
        """Draft columns -> target ids: the kept ids, else the head's own map (EAGLE-3's d2t), else the same."""
        if self.ids is not None:
            return self.ids[cols]
        return cols if head is None else head.to_target_ids(cols)


def draft_vocab(head: EagleHead, answers: list[tuple[int, ...]], kept: torch.Tensor | None = None,
                size: int | None = None) -> DraftVocab:
    """EAGLE-3: its own d2t. EAGLE-1: `kept` (a warm start's own draft vocabulary: the head goes on
    drafting from the tokens it learned), widened to `size` with the next most frequent answer tokens,
    else the `size` (default EAGLE1_DRAFT_VOCAB) most frequent; the set is saved beside the head and
    drafted from at inference."""
    c = head.config
    if c.kind == "eagle1":
        return frequent_vocab(head.target.lm_head.weight, answers, kept, size)
    if c.draft_vocab_size == c.vocab_size:
        return DraftVocab(None, None, None)
    return DraftVocab(column_index(head.to_target_ids(torch.arange(c.draft_vocab_size, device=head.d2t.device)),
                                   c.vocab_size), None, None)


def frequent_vocab(lm_head: torch.Tensor, answers: list[tuple[int, ...]], kept: torch.Tensor | None = None,
                   size: int | None = None) -> DraftVocab:
    """Drafting through the target's LM head (V, H): over `kept` (a head's own draft vocabulary) and
    the most frequent answer tokens after it, `size` in all (default: `kept` alone, else
    EAGLE1_DRAFT_VOCAB; ascending ids), or the whole vocabulary where it is no bigger (then no
    columns are picked: index, ids and weight None)."""
    V = lm_head.shape[0]
    if size is None:
        size = EAGLE1_DRAFT_VOCAB if kept is None else len(kept)
    if kept is None and V <= size:
        return DraftVocab(None, None, None)
    ids = frequent_tokens(answers, V, size, kept).to(lm_head.device)
    return DraftVocab(column_index(ids, V), ids, lm_head[ids].detach())


def narrow_vocab(ids: torch.Tensor | None, kept_narrow: torch.Tensor | None, answers: list[tuple[int, ...]],
                 vocab_size: int) -> torch.Tensor | None:
    """The rows of a draft vocabulary `ids` (Vd,) a CPU drafts from (models/head_checkpoint.py): a warm
    start's narrow rows (`kept_narrow`: those it names, else its whole draft vocabulary) where they are
    no more than EAGLE1_DRAFT_VOCAB, else the EAGLE1_DRAFT_VOCAB most frequent answer tokens among `ids`;
    None where that is all of `ids`."""
    if ids is None:
        return None
    narrow = kept_narrow
    if narrow is None or len(narrow) > EAGLE1_DRAFT_VOCAB:
        counts = answer_counts(answers, vocab_size)[ids.cpu()]       # (Vd,)
        narrow = ids[torch.argsort(-counts, stable=True)[:EAGLE1_DRAFT_VOCAB].to(ids.device)]
    return narrow if len(narrow) < len(ids) else None


def column_index(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(Vd,) target ids -> (V,) their column, -1 for the rest."""
    index = torch.full((vocab_size,), -1, dtype=torch.long, device=ids.device)
    return index.index_copy_(0, ids, torch.arange(len(ids), device=ids.device))


# ---------------------------------------------------------------- unroll and loss

def ahead(x: torch.Tensor, s: int) -> torch.Tensor:
    """Row t -> x[:, t + s] for the W = T-1 rows t; zero (False) past the end."""
    W = x.shape[1] - 1
    shifted = x[:, s: s + W]
    return torch.cat([shifted, x.new_zeros(x.shape[0], W - shifted.shape[1], *x.shape[2:])], dim=1)


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
               vocab: DraftVocab, objective: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden (M, H), teacher top-K ids/logits (M, K) -> per-row loss (M,), kept rows (M,), top-1 hit (M,)."""
    z = vocab.logits(head, hidden).float()                               # (M, Vd)
    loss, kept = teacher_loss(z, ids, logits, vocab.index, objective)
    hit = vocab.to_target(z.argmax(-1), head) == ids[:, 0]
    return loss, kept, hit


def teacher_loss(z: torch.Tensor, ids: torch.Tensor, logits: torch.Tensor, index: torch.Tensor | None,
                 objective: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft logits z (M, Vd), teacher top-K ids/logits (M, K), `index` target id -> column (V,) or
    None (columns are target ids) -> per-row loss (M,), kept rows (M,).
    p is the teacher renormalised over the ids in the draft vocabulary; a row whose teacher argmax
    is outside it is not kept. log q = z - logsumexp(z) over the draft vocabulary.
      ce:        logsumexp(z) - sum_k p_k z[id_k]
      lk:        -log sum_k min(p_k, q[id_k])
      lk-greedy: logsumexp(z) - z[id_0]             (p one-hot on the target's argmax)"""
    cols = ids if index is None else index[ids]                          # (M, K) draft columns, -1 outside
    inside = cols >= 0
    p = torch.where(inside[:, :1], logits.masked_fill(~inside, -math.inf).softmax(-1), 0.0)
    lse, zk = z.logsumexp(-1), z.gather(-1, cols.clamp(min=0))           # (M,), (M, K)
    if objective == "ce":
        loss = lse - (p * zk).sum(-1)
    elif objective == "lk":
        alpha = torch.minimum(p, (zk - lse[:, None]).exp()).sum(-1)
        loss = -alpha.clamp(min=torch.finfo(torch.float32).tiny).log()
    elif objective == "lk-greedy":
        loss = lse - zk[:, 0]
    else:
        raise ValueError(f"unknown objective {objective!r}: one of {', '.join(OBJECTIVES)}")
    return loss, inside[:, 0]


def weighted_mean(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x * weight).sum() / weight.sum().clamp(min=1e-9)  # 0, not NaN, when nothing weighs


def losses(head: EagleHead, outs: list[torch.Tensor], batch: Batch, weights: LossWeights,
           vocab: DraftVocab) -> tuple[torch.Tensor, dict]:
    total, stats = 0.0, {}
    reached = torch.ones_like(batch.has_teacher[:, 1:])                  # (B, W) the head's chain matched so far
    for j, out in enumerate(outs):
        rows = ahead(batch.has_teacher, 1 + j)                           # (B, W): p = t+1+j is an answer position
        hidden = out[rows]                                               # (M, H)
        tok, kept, hit = token_loss(head, hidden, ahead(batch.teacher_ids, 1 + j)[rows],
                                    ahead(batch.teacher_logits, 1 + j)[rows], vocab, weights.objective)
        rejected = reached[rows] & ~hit                                  # (M,) an error a verify would expose
        tok = weighted_mean(tok, kept * (1 + weights.replay * rejected))
        loss = weights.cls * tok
        if weights.reg:
            reg = F.smooth_l1_loss(hidden, ahead(batch.features, 1 + j)[rows], reduction="none").mean(-1)
            reg = weighted_mean(reg, torch.ones_like(reg))
            loss = loss + weights.reg * reg
            stats.setdefault("reg", reg.item())
        total = total + weights.decay ** j * loss
        reached = reached & rows
        reached[rows] = reached[rows] & hit
        stats.setdefault("token", tok.item())
        stats.setdefault("acc0", hit.float().mean().item())
        stats.setdefault("positions", int(rows.sum()))
    return total, stats | {"loss": float(total.detach())}


def chain_hits(head: EagleHead, outs: list[torch.Tensor], batch: Batch, vocab: DraftVocab) -> tuple[list[int], list[int], int]:
    """Greedy chain drafting from every start t >= P-1, one entry per depth j: (reached, matched),
    where a start reaches depth j when depths < j matched and position t+1+j is an answer position;
    plus the starts whose target token is in the head's top-5 at depth 0."""
    alive = torch.ones_like(batch.has_teacher[:, 1:])                    # (B, W) chain matched so far
    reached, matched, top5 = [], [], 0
    for j, out in enumerate(outs):
        alive &= ahead(batch.has_teacher, 1 + j)
        argmax = ahead(batch.teacher_ids, 1 + j)[alive][:, 0]            # (M,) the target's next token
        top = vocab.to_target(vocab.logits(head, out[alive]).float().topk(5, dim=-1).indices, head)  # (M, 5)
        hit = top[:, 0] == argmax
        reached.append(len(hit))
        matched.append(int(hit.sum()))
        top5 += int((top == argmax[:, None]).any(-1).sum()) if j == 0 else 0
        alive[alive.clone()] = hit
    return reached, matched, top5
