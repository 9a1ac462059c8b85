"""Training data for EAGLE heads: distilled answers -> target features on disk -> padded batches.

Three stages, each resumable:
  1. load: distill jsonl lines {prompt_ids, answer_ids} (../shared/distill/SOURCES.md) become
     `Conversation`s; a hash of the prompt holds out a fixed ~2% for validation.
  2. capture: one teacher-forced target pass over prompt + answer gives the head's input feature f_p
     at every position p and the target's top-K next-token logits at the answer positions. Shards
     of fp16 safetensors are named by a digest of what went in, so a rerun reuses what exists.
     A conversation already in any shard of the folder with the head's layers is copied from there
     instead of captured again: the shards `launch.py generate --features` kept while answering
     (named gen-*, grouped as answers finished, holding any set of layers), and an earlier run's,
     whose grouping moves when answers are added in the middle of the file list.
  3. batches: sequences pooled, bucketed by length and right-padded to at most `batch_tokens`.

Positions: a sequence x_0..x_{L-1} is the prompt (P tokens) then the answer (A = L - P tokens).
f_p is the target feature after reading x_0..x_p; teacher row p (P <= p < L) is the target's
distribution of x_{p+1}, kept as its top-K logits. Shapes: N positions, S sequences, M = sum A,
F feature width, K teacher top-k, B batch rows, T padded length.

This module knows nothing about heads or losses; of the target it uses the decoder and lm_head.
"""

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from core.files import written_whole
from core.runtime.cpu_linear import onednn_linears
from core.train.answers import AnswerStoreError, is_store, read_answers
from models.errors import AerieError
from models.target import Target

PREFIX_CHARS = 60  # a prompt whose first 60 characters match a benchmark prompt's is dropped
GENERATED = "gen-"  # name prefix of shards written by the generator
TEACHER_TOPK = 64   # teacher logits kept per answer position


class TrainDataError(AerieError):
    """The answers cannot be used for training (missing, malformed, or made for another model)."""


@dataclass(frozen=True)
class Conversation:
    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]

    @property
    def ids(self) -> tuple[int, ...]:
        return self.prompt_ids + self.answer_ids


@dataclass(frozen=True)
class DataConfig:
    answers: tuple[Path, ...]             # distill jsonl files, or folders of them
    max_tokens: int | None = None         # cap on training answer tokens (None = all)
    val_fraction: float = 0.02            # share of conversations held out, by prompt hash
    val_tokens: int = 16_000              # cap on validation answer tokens
    split_seed: int = 0                   # salt of the hash split; fixed so runs share one val set
    exclude_prompts: tuple[str, ...] = ()  # benchmark prompts: never train on them
    exclude_ids: frozenset = frozenset()   # the same, chat-templated to token ids (stores keep no text)
    features_dir: Path | None = None      # shard folder (None = OUT/features); may be shared by runs
    shard_size: int = 64                  # conversations per shard
    capture_tokens: int = 4096            # padded tokens per target forward during capture
    teacher_topk: int = TEACHER_TOPK
    linear: str = "default"               # capture's matmuls: a OneDnnLinear kind (core/runtime/cpu_linear.py)


def answer_rows(paths: tuple[Path, ...]) -> Iterator[tuple[str, dict]]:
    """(where, a distill line's dict) from each path: a distill jsonl, an answer store
    (core/train/answers.py), or a folder of either."""
    for path in map(Path, paths):
        if is_store(path):
            yield from read_answers(path)
        elif path.is_dir():
            for f in sorted(path.glob("*.jsonl")):
                yield from answer_rows((f,))
            for store in sorted(d for d in path.iterdir() if is_store(d)):
                yield from answer_rows((store,))
        elif path.is_file():
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if line.strip():
                    try:
                        yield f"{path}:{n}", json.loads(line)
                    except json.JSONDecodeError as err:
                        raise TrainDataError(f"{path}:{n} is not a distill line with prompt_ids and answer_ids ({err}).") from err
        else:
            raise TrainDataError(f"The answers file {path} does not exist.")


def load_conversations(cfg: DataConfig, vocab_size: int, context_len: int) -> tuple[list[Conversation], int]:
    """All usable conversations in file order, and how many were dropped as benchmark prompts
    (by text where a line has it, by its prompt's token ids in `cfg.exclude_ids`)."""
    banned = {t.strip()[:PREFIX_CHARS] for t in cfg.exclude_prompts}
    out, dropped, seen = [], 0, 0
    try:
        for where, row in answer_rows(cfg.answers):
            seen += 1
            try:
                conv = Conversation(tuple(map(int, row["prompt_ids"])), tuple(map(int, row["answer_ids"])))
            except (KeyError, TypeError, ValueError) as err:
                raise TrainDataError(f"{where} is not a distill line with prompt_ids and answer_ids ({err}).") from err
            if str(row.get("prompt", "")).strip()[:PREFIX_CHARS] in banned or conv.prompt_ids in cfg.exclude_ids:
                dropped += 1
                continue
            if max(conv.ids) >= vocab_size or min(conv.ids) < 0:
                raise TrainDataError(f"{where} has token ids outside this model's vocabulary of {vocab_size}; "
                                     "were these answers made by another model?")
            if conv.prompt_ids and conv.answer_ids and len(conv.ids) <= context_len:
                out.append(conv)
    except AnswerStoreError as err:
        raise TrainDataError(str(err)) from err
    if not seen:
        raise TrainDataError(f"No answers found in {', '.join(map(str, cfg.answers))}; pass distill jsonl files "
                             "or answer stores.")
    return out, dropped


def split(convs: list[Conversation], cfg: DataConfig) -> tuple[list[Conversation], list[Conversation]]:
    """(train, val). A conversation is held out when hash(seed, prompt) falls below val_fraction, so
    the split does not move when data is added or capped; then each side is capped in file order."""
    def held_out(c: Conversation) -> bool:
        digest = hashlib.sha1(f"{cfg.split_seed}:{c.prompt_ids}".encode()).digest()
        return int.from_bytes(digest[:8], "little") < cfg.val_fraction * 2**64

    val = [c for c in convs if held_out(c)]
    train = [c for c in convs if not held_out(c)]
    return take_tokens(train, cfg.max_tokens), take_tokens(val, cfg.val_tokens)


def take_tokens(convs: list[Conversation], limit: int | None) -> list[Conversation]:
    out, total = [], 0
    for c in convs:
        if limit is not None and total >= limit:
            break
        out.append(c)
        total += len(c.answer_ids)
    return out


# ---------------------------------------------------------------- capture

@torch.inference_mode()
def forward_batch(target: Target, convs: list[Conversation], layers: tuple[int, ...], topk: int) -> list[dict]:
    """One padded target pass. Right padding needs no mask: causal attention never looks right."""
    T = max(len(c.ids) for c in convs)
    ids = torch.zeros(len(convs), T, dtype=torch.long)
    for b, c in enumerate(convs):
        ids[b, : len(c.ids)] = torch.tensor(c.ids)
    out = target.model.get_decoder()(input_ids=ids.to(target.device), output_hidden_states=True, use_cache=False)
    features = torch.cat([out.hidden_states[i] for i in layers], dim=-1)              # (B, T, F)
    lm_head = target.model.get_output_embeddings()
    rows = []
    for b, c in enumerate(convs):
        P, L = len(c.prompt_ids), len(c.ids)
        logits = lm_head(out.last_hidden_state[b, P:L]).float()                       # (A, V): x_{p+1} | x_<=p
        top = logits.topk(topk, dim=-1)                                                # sorted: [..., 0] = argmax
        rows.append({"features": features[b, :L].half().cpu(), "teacher_logits": top.values.half().cpu(),
                     "teacher_ids": top.indices.int().cpu()})
    return rows


def capture_shard(target: Target, convs: list[Conversation], layers: tuple[int, ...], cfg: DataConfig,
                  captured: "Captured") -> tuple[dict, int]:
    """Tensors of one shard, sequences in the given order, and how many positions came from `captured`.
    The others are captured now, batched shortest-first within the shard."""
    rows = {i: r for i, c in enumerate(convs) if (r := captured.rows(c)) is not None}
    reused = sum(len(convs[i].ids) for i in rows)
    todo = [i for i in range(len(convs)) if i not in rows]
    lengths = torch.tensor([len(convs[i].ids) for i in todo])
    for batch in length_batches(lengths, cfg.capture_tokens, None, pool=max(len(todo), 1)):  # none when todo is empty
        found = forward_batch(target, [convs[todo[b]] for b in batch], layers, cfg.teacher_topk)
        rows |= {todo[b]: r for b, r in zip(batch, found)}
    return shard_tensors(convs, [rows[i] for i in range(len(convs))]), reused


def shard_tensors(convs: list[Conversation], rows: list[dict]) -> dict:
    """The shard format: rows[s] holds features (L, F), teacher_ids and teacher_logits (A, K) of convs[s]."""
    return {
        "tokens": torch.tensor([t for c in convs for t in c.ids], dtype=torch.int32),                  # (N,)
        "lengths": torch.tensor([len(c.ids) for c in convs]),                                          # (S,)
        "prompt_lens": torch.tensor([len(c.prompt_ids) for c in convs]),                               # (S,)
        **{k: torch.cat([r[k] for r in rows]) for k in ("features", "teacher_logits", "teacher_ids")},  # (N, F), (M, K)
    }


def write_shard(path: Path, tensors: dict, layers: tuple[int, ...], signature: str) -> None:
    with written_whole(path) as tmp:  # a killed capture leaves no half shard under the final name
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
                  metadata={"layers": json.dumps(list(layers)), "signature": signature})


def signature(target: Target, topk: int, linear: str) -> str:
    """Which target, matmul kind and teacher size a shard's numbers come from (its layers are beside it)."""
    return json.dumps([target.name, target.quant, str(target.dtype), topk] + ([linear] if linear != "default" else []))


def shard_digest(convs: list[Conversation], target: Target, layers: tuple[int, ...], topk: int, linear: str) -> str:
    key = json.dumps([target.name, target.quant, str(target.dtype), layers, topk, [c.ids for c in convs],
                      [len(c.prompt_ids) for c in convs]] + ([linear] if linear != "default" else []))
    return hashlib.sha1(key.encode()).hexdigest()[:20]


def conversation_key(prompt_ids, answer_ids) -> bytes:
    return hashlib.sha1(json.dumps([list(prompt_ids), list(answer_ids)]).encode()).digest()


class Captured:
    """The shards in a folder with `signature` and every one of `layers` (the generator's gen-* and
    earlier captures): conversation -> its rows, the feature columns of `layers` picked out of the shard's."""

    def __init__(self, folder: Path, signature: str, layers: tuple[int, ...]):
        self.where: dict[bytes, tuple[Path, torch.Tensor, int, int, int, int]] = {}  # key -> (shard, cols, a, z, ta, tz)
        for path in sorted(folder.glob("*.safetensors")):
            with safe_open(str(path), "pt") as f:
                meta = f.metadata()
                have = json.loads(meta.get("layers", "[]"))
                if meta.get("signature") != signature or not set(layers) <= set(have):
                    continue
                width = f.get_slice("features").get_shape()[1] // len(have)
                cols = torch.cat([torch.arange(have.index(i) * width, (have.index(i) + 1) * width) for i in layers])
                tokens = f.get_tensor("tokens").tolist()
                lengths, prompt_lens = f.get_tensor("lengths").tolist(), f.get_tensor("prompt_lens").tolist()
            a = ta = 0
            for L, P in zip(lengths, prompt_lens):
                self.where[conversation_key(tokens[a: a + P], tokens[a + P: a + L])] = (path, cols, a, a + L, ta, ta + L - P)
                a, ta = a + L, ta + L - P

    def rows(self, conv: Conversation) -> dict | None:
        hit = self.where.get(conversation_key(conv.prompt_ids, conv.answer_ids))
        if hit is None:
            return None
        path, cols, a, z, ta, tz = hit
        with safe_open(str(path), "pt") as f:
            return {"features": f.get_slice("features")[a:z][:, cols], "teacher_logits": f.get_slice("teacher_logits")[ta:tz],
                    "teacher_ids": f.get_slice("teacher_ids")[ta:tz]}


def capture(target: Target, convs: list[Conversation], layers: tuple[int, ...], cfg: DataConfig,
            folder: Path, label: str) -> tuple[list[Path], dict]:
    """Shards for `convs` under `folder`, captured now unless already there. Returns (paths, stats)."""
    folder.mkdir(parents=True, exist_ok=True)
    chunks = [convs[i: i + cfg.shard_size] for i in range(0, len(convs), cfg.shard_size)]
    paths = [folder / f"{shard_digest(c, target, layers, cfg.teacher_topk, cfg.linear)}.safetensors" for c in chunks]
    todo = [(c, p) for c, p in zip(chunks, paths) if not p.is_file()]
    sign = signature(target, cfg.teacher_topk, cfg.linear)
    captured = Captured(folder, sign, layers) if todo else None
    positions, reused, t0 = 0, 0, time.perf_counter()
    bar = tqdm(total=sum(len(x.ids) for c, _ in todo for x in c), unit="pos", desc=f"capture {label}",
               disable=not todo, dynamic_ncols=True)
    with onednn_linears(target.model, cfg.capture_tokens, cfg.linear):
        for chunk, path in todo:
            tensors, found = capture_shard(target, chunk, layers, cfg, captured)
            write_shard(path, tensors, layers, sign)
            reused += found
            positions += len(tensors["tokens"]) - found
            bar.update(len(tensors["tokens"]))
    bar.close()
    seconds = time.perf_counter() - t0
    return paths, {"shards": len(paths), "captured_shards": len(todo), "positions": positions,
                   "reused": reused, "seconds": seconds}


# ---------------------------------------------------------------- in memory

@dataclass(frozen=True)
class FeatureSet:
    """All shards of one split, concatenated. Sequence s spans tokens[starts[s]:starts[s+1]] and
    teacher rows [tstarts[s]:tstarts[s+1]], which are its positions P..L-1."""

    tokens: torch.Tensor          # (N,) int64
    features: torch.Tensor        # (N, F) fp16
    starts: torch.Tensor          # (S+1,)
    prompt_lens: torch.Tensor     # (S,)
    tstarts: torch.Tensor         # (S+1,)
    teacher_ids: torch.Tensor     # (M, K) int32
    teacher_logits: torch.Tensor  # (M, K) fp16

    def __len__(self) -> int:
        return len(self.prompt_lens)

    @property
    def lengths(self) -> torch.Tensor:
        return self.starts[1:] - self.starts[:-1]

    @property
    def answer_tokens(self) -> int:
        return int(self.tstarts[-1])


# A shard's tensors by what a row is: a sequence, an answer position (a teacher row) or a token.
ROW_KINDS = {"lengths": "sequence", "prompt_lens": "sequence", "teacher_ids": "teacher", "teacher_logits": "teacher",
             "tokens": "token", "features": "token"}


def shard_rows(lengths: torch.Tensor, prompt_lens: torch.Tensor, kept: torch.Tensor) -> dict[str, torch.Tensor | slice]:
    """Row indices, by ROW_KINDS' kind, of a shard's `kept` sequences ((S,) bool); all rows as a slice."""
    if bool(kept.all()):
        return dict.fromkeys(("sequence", "teacher", "token"), slice(None))

    def ranges(sizes: torch.Tensor) -> torch.Tensor:
        starts = sizes.cumsum(0) - sizes
        return torch.cat([torch.arange(int(a), int(a + n)) for a, n in zip(starts[kept], sizes[kept])] or
                         [torch.zeros(0, dtype=torch.long)])
    return {"sequence": kept.nonzero().flatten(), "teacher": ranges(lengths - prompt_lens), "token": ranges(lengths)}


def kept_mask(keep: list[int] | None, total: int) -> torch.Tensor:
    """(total,) bool of the sequences `keep` names: sorted, unique, in range and not empty, as
    `flattest` gives them (anything else would load another set than the one asked for)."""
    if keep is None:
        return torch.ones(total, dtype=torch.bool)
    if not keep or keep != sorted(set(keep)) or keep[0] < 0 or keep[-1] >= total:
        raise TrainDataError(f"sequences to load must be sorted, unique and in [0, {total}): {keep[:5]}...")
    mask = torch.zeros(total, dtype=torch.bool)
    mask[torch.tensor(keep)] = True
    return mask


def load_features(paths: list[Path], keep: list[int] | None = None) -> FeatureSet:
    """The shards' sequences, or only those in `keep` (indices over all shards in order), copied into
    one buffer per tensor sized before any is read: reading whole shards and concatenating would hold
    every tensor twice at the peak; with `keep`, each shard is cut as it is read, so the others'
    rows are held one shard at a time."""
    sizes = []
    for p in paths:
        with safe_open(str(p), "pt") as f:
            sizes.append((f.get_tensor("lengths"), f.get_tensor("prompt_lens")))
    lengths, prompt_lens = (torch.cat(t) for t in zip(*sizes))                               # (S,) over all shards
    mask = kept_mask(keep, len(lengths))
    totals = {"sequence": int(mask.sum()), "teacher": int((lengths - prompt_lens)[mask].sum()),
              "token": int(lengths[mask].sum())}
    kept = mask.split([len(n) for n, _ in sizes])
    plans = [shard_rows(n, prompts, k) for (n, prompts), k in zip(sizes, kept)]
    cat, filled = {}, {}
    for p, rows in zip(paths, plans):
        with safe_open(str(p), "pt") as f:
            for k in f.keys():
                part = f.get_tensor(k)[rows[ROW_KINDS[k]]]
                if k not in cat:
                    cat[k], filled[k] = torch.empty((totals[ROW_KINDS[k]], *part.shape[1:]), dtype=part.dtype), 0
                cat[k][filled[k]: filled[k] + len(part)] = part
                filled[k] += len(part)
    lengths, prompt_lens = cat["lengths"], cat["prompt_lens"]
    zero = torch.zeros(1, dtype=torch.long)
    return FeatureSet(tokens=cat["tokens"].long(), features=cat["features"], starts=torch.cat([zero, lengths.cumsum(0)]),
                      prompt_lens=prompt_lens, tstarts=torch.cat([zero, (lengths - prompt_lens).cumsum(0)]),
                      teacher_ids=cat["teacher_ids"], teacher_logits=cat["teacher_logits"])


ENTROPY_ROWS = 1 << 20   # teacher rows per chunk: all at once, the fp32 temporaries added 1.46 GB to the peak at 2.07M rows (0.73 chunked)


def row_entropy(logits: torch.Tensor) -> torch.Tensor:
    """(m, K) top-K logits -> (m,) entropy of their softmax."""
    logp = logits.float().log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def sequence_entropies(paths: list[Path]) -> torch.Tensor:
    """(S,) each sequence's mean entropy H = -sum_k p_k log p_k of the target's top-K next-token
    distribution over its answer positions, read shard by shard (teacher logits only)."""
    means = []
    for p in paths:
        with safe_open(str(p), "pt") as f:
            logits, lengths, prompt_lens = (f.get_tensor(k) for k in ("teacher_logits", "lengths", "prompt_lens"))
        answers = lengths - prompt_lens                                                       # (S,)
        entropy = torch.cat([row_entropy(part) for part in logits.split(ENTROPY_ROWS)])        # (M,)
        # a sequence's sum of entropies: the difference of the running sum at its first and last rows
        bounds = torch.cat([answers.new_zeros(1), answers.cumsum(0)])                         # (S+1,)
        sums = torch.cat([torch.zeros(1), entropy.cumsum(0)])[bounds]
        means.append((sums[1:] - sums[:-1]) / answers.clamp(min=1))
    return torch.cat(means)


def flattest(mean_entropy: torch.Tensor, share: float) -> list[int]:
    """The `share` of sequences whose answer positions the target is least sure of (highest mean
    entropy; flatness data selection, arXiv 2601.18902), ascending indices. Where the target is
    sure, the head already agrees."""
    keep = max(1, round(share * len(mean_entropy)))
    return sorted(torch.argsort(-mean_entropy, stable=True)[:keep].tolist())


def training_sets(train_paths: list[Path], val_paths: list[Path], flattest_share: float | None) -> tuple[FeatureSet, FeatureSet]:
    """The train and validation sets; with `flattest_share` (--flattest) the train set holds only
    its flattest sequences, chosen before loading, so the rest of the features never fill memory."""
    keep = flattest(sequence_entropies(train_paths), flattest_share) if flattest_share else None
    return load_features(train_paths, keep), load_features(val_paths)


@dataclass(frozen=True)
class Batch:
    tokens: torch.Tensor          # (B, T) x_p, 0 past a sequence's end
    features: torch.Tensor        # (B, T, F) float32 f_p
    teacher_ids: torch.Tensor     # (B, T, K) teacher row p, 0 where none
    teacher_logits: torch.Tensor  # (B, T, K) float32
    has_teacher: torch.Tensor     # (B, T) bool: P <= p < L, an answer position

    @property
    def positions(self) -> int:
        return int(self.has_teacher.sum())


def make_batch(fs: FeatureSet, seqs: list[int], device: torch.device) -> Batch:
    T, K = int(fs.lengths[seqs].max()), fs.teacher_ids.shape[1]
    B = len(seqs)
    tokens, has = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.bool)
    features = torch.zeros(B, T, fs.features.shape[1])
    tids, tlogits = torch.zeros(B, T, K, dtype=torch.long), torch.zeros(B, T, K)
    for b, s in enumerate(seqs):
        a, z, P = int(fs.starts[s]), int(fs.starts[s + 1]), int(fs.prompt_lens[s])
        L = z - a
        tokens[b, :L], features[b, :L] = fs.tokens[a:z], fs.features[a:z].float()
        rows = slice(int(fs.tstarts[s]), int(fs.tstarts[s + 1]))
        tids[b, P:L], tlogits[b, P:L], has[b, P:L] = fs.teacher_ids[rows].long(), fs.teacher_logits[rows].float(), True
    return Batch(*(t.to(device) for t in (tokens, features, tids, tlogits, has)))


def length_batches(lengths: torch.Tensor, batch_tokens: int, generator: torch.Generator | None,
                   pool: int = 256) -> list[list[int]]:
    """Sequence indices in batches of at most `batch_tokens` padded tokens. With a generator: pools of
    `pool` random sequences are sorted by length and cut (little padding), and the batches shuffled."""
    order = torch.randperm(len(lengths), generator=generator).tolist() if generator else list(range(len(lengths)))
    batches = []
    for i in range(0, len(order), pool):
        group = sorted(order[i: i + pool], key=lambda s: int(lengths[s]))
        current: list[int] = []
        for s in group:
            if current and (len(current) + 1) * int(lengths[s]) > batch_tokens:
                batches.append(current)
                current = []
            current.append(s)
        batches.append(current)
    if generator is not None:
        batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
    return batches
