"""`launch.py generate`: the target's greedy answers to training prompts, kept in an answer store.

Prompts are mix_v1 (../shared/prompts) shuffled as ../shared/distill did, answered with the chat
template by the batched generator (core/train/batch_gen.py) and stored as they finish as token ids
(core/train/answers.py: by default under data/answers/, committed, so they outlast the session's
machine), so a killed run resumes. With `features`, the generator also keeps
each answer's target features and teacher logits, written as gen-* shards that `launch.py train
--features` reads instead of capturing them again (core/train/data.py): one pass over the target
instead of two. A kill loses at most a shard's worth of features; train captures those itself.
"""

import hashlib
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from core.text import render_prompt
from core.train.answers import AnswerStore, file_sha256
from core.runtime.cpu_linear import LINEAR_KINDS, batched_linear_kind, use_onednn_linears
from models.cpu_quant import OneDnnLinear
from core.train.batch_gen import Answer, BatchGenerator, Capture, GenConfig, choose_batch
from core.train.row_cache import use_row_group_attention
from core.train.data import GENERATED, PREFIX_CHARS, TEACHER_TOPK, Conversation, shard_tensors, signature, write_shard
from models.heads import feature_layers
from models.target import Target

COMPARE_PROMPTS = 110       # compare_with_hf's default slice: ~106 prompts, about 5 min on one core
SHARD_ANSWERS = 64          # answers per generated feature shard

DISTILL_SEED = 1234  # ../shared/distill shuffled mix_v1 with random.Random(1234); so do we
# Shuffled mix_v1 indices the shipped answers used (matched by prompt text): greedy-200.jsonl took
# 0-840, greedy-256.jsonl 6000-9286. 9287 is the first index after both; 841-5999 are unused too.
FRESH_START = 9287


def shuffled_prompts(path: Path, start: int, limit: int | None) -> list[str]:
    texts = [json.loads(line)["prompt"] for line in path.read_text().split("\n") if line.strip()]
    random.Random(DISTILL_SEED).shuffle(texts)
    return texts[start: None if limit is None else start + limit]


def prompts_record(path: Path) -> dict:
    """Which prompts an answer store's indices refer to."""
    return {"file": path.name, "sha256": file_sha256(path), "shuffle_seed": DISTILL_SEED}


@dataclass
class FeatureShards:
    """Captured answers, written as gen-* shards of `SHARD_ANSWERS` in core/train/data.py's format."""
    folder: Path
    layers: tuple[int, ...]
    signature: str
    pending: list = field(default_factory=list)  # (Conversation, its rows)

    def add(self, prompt_ids: Sequence[int], answer: Answer) -> None:
        rows = {"features": answer.features, "teacher_ids": answer.teacher_ids, "teacher_logits": answer.teacher_logits}
        self.pending.append((Conversation(tuple(prompt_ids), answer.answer_ids), rows))
        if len(self.pending) >= SHARD_ANSWERS:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        convs, rows = map(list, zip(*self.pending))
        digest = hashlib.sha1(json.dumps([c.ids for c in convs]).encode()).hexdigest()[:20]
        self.folder.mkdir(parents=True, exist_ok=True)
        write_shard(self.folder / f"{GENERATED}{digest}.safetensors", shard_tensors(convs, rows), self.layers, self.signature)
        self.pending.clear()


def write_answers(generator: BatchGenerator, tokenizer, prompts: dict[int, str], store: AnswerStore, prompt_cap: int,
                  progress: bool = True, shards: FeatureShards | None = None) -> dict:
    """Answer every prompt (index -> text) not yet in `store` whose chat-templated form has <=
    prompt_cap tokens, storing each answer as it finishes (and, given `shards`, its features). Resumable."""
    done = store.answered()
    todo = [i for i in prompts if i not in done]
    rendered = {i: render_prompt(tokenizer, [{"role": "user", "content": prompts[i]}]) for i in todo}
    keep = [i for i in todo if len(rendered[i]) <= prompt_cap]
    tokens, t0 = 0, time.perf_counter()
    with tqdm(total=len(keep), unit="answer", disable=not progress, smoothing=0.05) as bar:
        try:
            for answer in generator.generate([rendered[i] for i in keep]):
                i = keep[answer.index]
                store.add(i, rendered[i], answer.answer_ids)
                if shards is not None:
                    shards.add(rendered[i], answer)
                tokens += len(answer.answer_ids)
                bar.update(1)
                bar.set_postfix_str(f"{tokens / (time.perf_counter() - t0):.0f} tok/s")
        finally:  # a stopped run keeps what finished (the features too, should the store refuse its last shard)
            try:
                store.flush()
            finally:
                if shards is not None:
                    shards.flush()
    seconds = time.perf_counter() - t0
    return {"already_answered": len(prompts) - len(todo), "over_prompt_cap": len(todo) - len(keep),
            "answered": len(keep), "answer_tokens": tokens, "seconds": round(seconds, 1),
            "tokens_per_s": round(tokens / max(seconds, 1e-9), 1)}


# ---------------------------------------------------------------- jobs: launch.py generate

@dataclass(frozen=True)
class GenerateJob:
    prompts: Path                   # jsonl with a "prompt" field, shuffled with DISTILL_SEED
    start: int = FRESH_START        # first shuffled index used
    limit: int | None = None        # shuffled prompts from `start` (None: all the rest)
    max_new_tokens: int = 256
    prompt_cap: int = 256           # prompts whose chat-templated form is longer are skipped
    batch: int | None = None        # None: choose_batch
    threads: int | None = None      # None: torch's default
    linear: str = "auto"            # a key of LINEAR_KINDS, or "auto": whichever times fastest
    features: Path | None = None    # keep features for training heads of `kinds` here (train --features)
    kinds: tuple[str, ...] = ("eagle1",)
    exclude: tuple[str, ...] = ()   # benchmark prompts: never answered for training (matched as train matches them)


def prepare(target: Target, job: GenerateJob) -> BatchGenerator:
    """A generator for the job. May swap the target's linear layers for oneDNN ones, in place."""
    if job.threads:
        torch.set_num_threads(job.threads)
    capacity = job.prompt_cap + job.max_new_tokens
    if capacity > target.context_len:
        raise ValueError(f"--prompt-cap + --max-new-tokens = {capacity} exceeds the model's context of {target.context_len}")
    batch = job.batch or choose_batch(target.model, capacity, target.device)
    kind = batched_linear_kind(target.model, job.linear, batch)
    if kind != "default":
        use_onednn_linears(target.model, batch, kind)
    use_row_group_attention(target.model)
    capture = Capture(capture_layers(target, job.kinds), TEACHER_TOPK) if job.features else None
    return BatchGenerator(target.model, GenConfig(batch, job.max_new_tokens, target.eos_ids, capture=capture), capacity)


def capture_layers(target: Target, kinds: tuple[str, ...]) -> tuple[int, ...]:
    """The layers heads of every kind in `kinds` read: one pass serves them all."""
    n = target.model.config.get_text_config().num_hidden_layers
    return tuple(sorted({i for kind in kinds for i in feature_layers(kind, n)}))


def linear_kind(gen: BatchGenerator) -> str:
    """The OneDnnLinear kind the generator's matmuls run as, or "default"."""
    return gen.head.kind if isinstance(gen.head, OneDnnLinear) else "default"


def describe(gen: BatchGenerator) -> dict:
    s = gen.stats
    kind = linear_kind(gen)
    linear = {k: name for name, k in LINEAR_KINDS.items()}.get(kind, kind)
    return {"batch": gen.cfg.batch, "linear": linear, "decode_steps": s.decode_steps,
            "rows_per_step": round(s.row_steps / max(s.decode_steps, 1), 1), "decode_s": round(s.decode_s, 1),
            "prefill_s": round(s.prefill_s, 1), "prefill_tokens": s.prefill_tokens,
            "attended_slots_used": round(s.used_slots / max(s.attended_slots, 1), 2)}


def distill(target: Target, job: GenerateJob, out: Path | None, answers_root: Path, budget: int | None = None) -> dict:
    """Store the target's greedy answers in `out`, or by default in answers_root/<store_name>
    (resumable; answers_root's files kept within `budget` bytes); a summary for the last line."""
    gen = prepare(target, job)
    banned = {t.strip()[:PREFIX_CHARS] for t in job.exclude}
    texts = {i: t for i, t in enumerate(shuffled_prompts(job.prompts, job.start, job.limit), job.start)
             if t.strip()[:PREFIX_CHARS] not in banned}
    capture = gen.cfg.capture  # set by prepare when job.features is given
    shards = (FeatureShards(job.features, capture.layers, signature(target, capture.topk, linear_kind(gen)))
              if capture else None)
    source = {"target": target_record(target, job, describe(gen)["linear"]), "prompts": prompts_record(job.prompts)}
    folder = out or answers_root / store_name(source["target"])
    limit = (answers_root, budget) if budget is not None and folder.resolve().is_relative_to(answers_root.resolve()) else None
    store = AnswerStore(folder, source, limit)
    summary = write_answers(gen, target.tokenizer, texts, store, job.prompt_cap, shards=shards)
    return {**summary, **describe(gen), "store": str(folder)}


def target_record(target: Target, job: GenerateJob, linear: str) -> dict:
    """What produced a store's answers: the model, its weights, the generator's matmuls, the caps."""
    return {"model": target.name.lower(), "quant": target.quant,
            "linear": linear, "decoding": "greedy", "max_new_tokens": job.max_new_tokens, "prompt_cap": job.prompt_cap}


def store_name(record: dict) -> str:
    """e.g. smollm2-135m-instruct-none-bf16: one store per model, weights and generator kernels."""
    return f"{record['model']}-{record['quant']}-{record['linear']}"


def compare_with_hf(target: Target, job: GenerateJob, hf_batch: int = 48) -> dict:
    """The job's prompts through transformers `generate` (left-padded batches of hf_batch) and then
    through the batched generator, in one process: answer tokens/s of each, and their ratio."""
    if job.threads:
        torch.set_num_threads(job.threads)
    texts = shuffled_prompts(job.prompts, job.start, job.limit or COMPARE_PROMPTS)
    rendered = [render_prompt(target.tokenizer, [{"role": "user", "content": t}]) for t in texts]
    prompts = [p for p in rendered if len(p) <= job.prompt_cap]
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else target.eos_ids[0]
    t0 = time.perf_counter()
    hf = hf_generate(target.model, prompts, job.max_new_tokens, hf_batch, target.eos_ids, pad)
    hf_s = time.perf_counter() - t0
    gen = prepare(target, job)  # after the baseline: it may convert the linears
    t0 = time.perf_counter()
    ours = {a.index: a.answer_ids for a in gen.generate(prompts)}
    ours_s = time.perf_counter() - t0
    hf_tokens, our_tokens = sum(map(len, hf)), sum(map(len, ours.values()))
    return {"prompts": len(prompts), "max_new_tokens": job.max_new_tokens, "threads": torch.get_num_threads(),
            "hf_generate": {"batch": hf_batch, "answer_tokens": hf_tokens, "seconds": round(hf_s, 1),
                            "tokens_per_s": round(hf_tokens / hf_s, 1)},
            "aerie": {"answer_tokens": our_tokens, "seconds": round(ours_s, 1),
                      "tokens_per_s": round(our_tokens / ours_s, 1), **describe(gen)},
            "speedup": round((our_tokens / ours_s) / (hf_tokens / hf_s), 2),
            "identical_answers": sum(ours[i] == hf[i] for i in range(len(prompts)))}


# ---------------------------------------------------------------- the baseline

@torch.inference_mode()
def hf_generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch: int,
                eos_ids: tuple[int, ...], pad_id: int) -> list[tuple[int, ...]]:
    """transformers `generate`, greedy, left-padded batches in prompt order; answers cut after EOS."""
    device, answers = next(model.parameters()).device, []
    for s in range(0, len(prompts), batch):
        group = prompts[s: s + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in group], device=device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=device)
        out = model.generate(input_ids=ids, attention_mask=attention, do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=list(eos_ids) or None, pad_token_id=pad_id)
        for row in out[:, width:].tolist():
            end = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
            answers.append(tuple(row[:end]))
    return answers
