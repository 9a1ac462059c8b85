"""Batched greedy generation with continuous batching: the answers for self-distillation.

B rows decode together, one token per row per step. A row that ends (EOS or its token cap) is
refilled at once with the next prompt, so no row-step is spent on a finished answer; when the
prompts run out, the last row moves into the hole and the batch shrinks. (transformers `generate`
steps a batch until its longest answer ends, a third of its row-steps wasted in calibration.md,
and concatenates its whole cache every step.)

The KV cache is preallocated, B rows x C slots per layer, and written in place. Each row has its
own length. One forward feeds T tokens to each of b rows at explicit positions, and a 4D additive
mask lets the token at (row, t) see exactly slots 0..position[row, t] of its own row:
    mask[r, 0, t, j] = 0 if j <= position[r, t] else -inf
so a right-padded prefill and a one-token decode step are the same forward with a different T.
The prompts' longest common prefix (the chat template's system block) is encoded once and its
K/V copied into every new row. Greedy output equals greedy decoding of each prompt alone, up to
the float rounding of batched matmuls.

Two CPU speedups are opt-in, for a model the caller owns (`core.train.distill.prepare` applies both):
- ROW_GROUPS attention (core/train/row_cache.py): rows are kept in bands, longest first, and each band
  attends only up to its own longest row instead of the batch's (with 8 bands 88% of the K/V
  slots read are real, against 54% for one padded call).
- OneDnnLinear (models/cpu_quant.py): torch's default fp32 GEMM (MKL) runs AVX2 code on AMD CPUs;
  oneDNN uses AVX-512.

Shapes: B cache rows, b rows fed by one forward, T tokens fed per row, C slots per row,
L attended slots, H kv heads, D head dim, F hidden, V vocab.
With a `Capture`, each answer also brings what head training needs (core/train/data.py), from
the same forwards: the feature f_p at every position and the top-K logits at every answer
position. An ended row is fed its last token once more for its own f and teacher row (one
row-step per answer), so no second, teacher-forced pass over the answers is needed.

The generator knows token ids only; core/train/distill.py adds prompts, the chat template and files.
"""

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import psutil
import torch

from core.train.row_cache import ROW_GROUPS, RowCache, bands, feed_mask

CPU_MAX_BATCH = 64          # decode row-tokens/s on 1 core here: 173/219/242/258/252/276 at B=16/32/48/64/96/128
GPU_MAX_BATCH = 256
KV_MEMORY_SHARE = 0.25      # of available RAM (CPU) or half of free VRAM (CUDA) for the KV slabs
PREFILL_TOKENS = 8192       # padded tokens per prefill forward (bounds the prefill's activations)
PAD_SHARE = 0.1             # right padding a prefill group may add to its tokens


@dataclass(frozen=True)
class Capture:
    """What to keep of each answer for head training (core/train/data.py's shard format)."""
    layers: tuple[int, ...]         # output_hidden_states indices concatenated into a feature
    topk: int                       # teacher logits kept per answer position


@dataclass(frozen=True)
class GenConfig:
    batch: int                      # B: rows decoding together
    max_new_tokens: int = 256       # the cap of a prompt given no cap of its own
    eos_ids: tuple[int, ...] = ()
    share_prefix: bool = True       # encode the prompts' common prefix once
    bands: int = 8                  # row bands attended separately, with ROW_GROUPS attention (see sink_holes)
    capture: Capture | None = None  # also return each answer's features and teacher logits


@dataclass(frozen=True)
class Answer:
    index: int                      # the prompt's position in the list given to `generate`
    answer_ids: tuple[int, ...]     # ends with an EOS id when the model finished, else cut at the cap
    features: torch.Tensor | None = None        # (P + A, F) fp16 f_p, with a Capture
    teacher_ids: torch.Tensor | None = None     # (A, K) int32 top-K of x_{p+1} at answer positions p
    teacher_logits: torch.Tensor | None = None  # (A, K) fp16, sorted: [:, 0] is the argmax


@dataclass
class GenStats:
    """Running totals: what the time went to."""
    answers: int = 0
    answer_tokens: int = 0
    decode_steps: int = 0
    row_steps: int = 0              # rows fed by decode steps: one answer token each, none wasted
    prefill_tokens: int = 0         # fed by prefills, right padding included
    prefill_s: float = 0.0
    closing_steps: int = 0          # rows fed their last answer token for its features (Capture only)
    decode_s: float = 0.0
    attended_slots: int = 0         # K/V slots decode steps read: rows x their band's longest row
    used_slots: int = 0             # of which inside their row: the rest is padding the mask hides


@dataclass
class Fed:
    """What a capturing forward returns besides the tokens."""
    features: torch.Tensor          # (b, T, F) fp16 f of every fed token
    teacher_ids: torch.Tensor       # (b, K) top-K after column `last` of each row
    teacher_logits: torch.Tensor    # (b, K) fp16


@dataclass
class Row:
    index: int
    prompt_len: int
    cap: int
    answer: list[int]
    features: list = field(default_factory=list)   # (n, F) pieces, positions 0.. in order (Capture)
    teacher: list = field(default_factory=list)    # (ids (K,), logits (K,)) per fed answer token
    closing: bool = False                          # ended; fed once more for its last features

    @property
    def position(self) -> int:      # where the newest token (not yet fed) goes
        return self.prompt_len + len(self.answer) - 1


def prefill_groups(lengths: list[int]) -> list[list[int]]:
    """Indices of `lengths` grouped for right-padded prefills: by increasing length, a group closes
    before its padding would pass PAD_SHARE of its tokens or its size PREFILL_TOKENS."""
    groups, group, tokens = [], [], 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        padded = lengths[i] * (len(group) + 1)  # sorted: the newest is the longest
        if group and (padded > PREFILL_TOKENS or padded > (1 + PAD_SHARE) * (tokens + lengths[i])):
            groups.append(group)
            group, tokens = [], 0
        group.append(i)
        tokens += lengths[i]
    return groups + [group] if group else groups


def common_prefix_len(prompts: Sequence[Sequence[int]]) -> int:
    first, n = prompts[0], min(len(p) for p in prompts)
    for p in prompts[1:]:
        n = next((i for i in range(n) if p[i] != first[i]), n)
    return n


class BatchGenerator:
    """Greedy answers for many prompts, B rows at a time. Owns its cache; the model is only read."""

    def __init__(self, model, cfg: GenConfig, capacity: int):
        self.model, self.cfg, self.capacity = model, cfg, capacity
        self.device = model.get_input_embeddings().weight.device
        self.dtype = model.get_input_embeddings().weight.dtype  # activations (and the mask) have it, quantized or not
        self.decoder, self.head = model.get_decoder(), model.get_output_embeddings()
        self.num_layers = model.config.get_text_config().num_hidden_layers
        self.cache = RowCache(self.num_layers, cfg.batch, capacity)
        self.banded = model.config._attn_implementation == ROW_GROUPS and cfg.bands > 1
        self.stats = GenStats()
        self.prefix_features = None  # (n, F) of the shared prefix, with a Capture

    @torch.inference_mode()
    def forward(self, rows: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, last: torch.Tensor,
                leading: int | None = None, groups: list | None = None) -> tuple[list[int], Fed | None]:
        """Feed ids (b, T) at positions (b, T) to cache rows (b,); return the greedy next token
        after column last[r] of each row, and with a Capture what it keeps. `groups` go to
        ROW_GROUPS attention."""
        self.cache.plan_feed(rows, positions, leading)
        mask = feed_mask(positions, self.cache.plan.length, self.dtype)
        extra = {"row_groups": groups} if groups else {}
        capture = self.cfg.capture
        inner = capture is not None and any(i != self.num_layers for i in capture.layers)  # else: the last state
        out = self.decoder(input_ids=ids, position_ids=positions, attention_mask=mask, cache=self.cache,
                           use_cache=True, output_hidden_states=inner, **extra)
        hidden = out.last_hidden_state[torch.arange(len(rows), device=self.device), last]  # (b, F)
        logits = self.head(hidden)  # (b, V)
        tokens = logits.argmax(-1).tolist()  # b ids: the one host sync per forward
        if capture is None:
            return tokens, None
        top = logits.float().topk(capture.topk, dim=-1)  # sorted: [:, 0] = argmax
        states = [out.last_hidden_state if i == self.num_layers else out.hidden_states[i] for i in capture.layers]
        features = torch.cat(states, dim=-1).half().cpu()
        return tokens, Fed(features, top.indices.int().cpu(), top.values.half().cpu())

    @torch.inference_mode()  # torch enters it around each resume of the generator
    def generate(self, prompts: Sequence[Sequence[int]], caps: Sequence[int] | None = None) -> Iterator[Answer]:
        """Greedy answers, yielded as they finish (not in prompt order)."""
        caps = list(caps) if caps is not None else [self.cfg.max_new_tokens] * len(prompts)
        fed = len if self.cfg.capture else (lambda p: len(p) - 1)  # without a Capture the last token is never fed
        for i, (p, cap) in enumerate(zip(prompts, caps, strict=True)):
            if not p or cap < 1 or fed(p) + cap > self.capacity:
                raise ValueError(f"prompt {i}: {len(p)} tokens + cap {cap} do not fit {self.capacity} cache slots")
        if not prompts:
            return
        prefix = self.encode_prefix(prompts)
        queue, slots = deque(range(len(prompts))), []  # slots[r]: the Row in cache row r, or None
        while queue or slots:
            yield from self.refill(slots, queue, prompts, caps, prefix)
            if slots:
                yield from self.decode_step(slots)

    def encode_prefix(self, prompts: Sequence[Sequence[int]]) -> int:
        """Encode the prompts' common prefix (at least one token of each prompt left to feed) once."""
        n = common_prefix_len(prompts) if self.cfg.share_prefix and len(prompts) > 1 else 0
        n = min(n, min(len(p) for p in prompts) - 1)
        if n > 0:
            positions = torch.arange(n, device=self.device)[None]  # (1, n)
            _, fed = self.forward(torch.zeros(1, dtype=torch.long, device=self.device),
                                  torch.tensor([list(prompts[0][:n])], device=self.device), positions,
                                  torch.tensor([n - 1], device=self.device))
            self.cache.save_prefix(0, n)
            self.prefix_features = fed.features[0] if fed else None
        return max(n, 0)

    def refill(self, slots: list, queue: deque, prompts, caps, prefix: int) -> Iterator[Answer]:
        """Put the next prompts into free rows; when none are left, close the holes instead."""
        while queue:
            self.sink_holes(slots)
            free = [r for r, row in enumerate(slots) if row is None] + list(range(len(slots), self.cfg.batch))
            if not free:
                break
            take = [queue.popleft() for _ in range(min(len(free), len(queue)))]
            take.sort(key=lambda i: -len(prompts[i]))  # the longest into the first rows: bands start ordered
            slots.extend([None] * (max(free[: len(take)]) + 1 - len(slots)))
            for group in prefill_groups([len(prompts[i]) - prefix for i in take]):
                rows, indices = [free[j] for j in group], [take[j] for j in group]
                suffixes = [prompts[i][prefix:] for i in indices]
                first, fed = self.prefill(rows, suffixes, prefix)
                for j, (r, i, token) in enumerate(zip(rows, indices, first)):
                    slots[r] = self.new_row(Row(i, len(prompts[i]), caps[i], [token]), fed, j, len(suffixes[j]))
                    if self.finished(slots[r]) and not slots[r].closing:
                        yield self.emit(slots[r])
                        slots[r] = None
        self.sink_holes(slots)
        while None in slots:  # no prompts left: move the last row into each hole, so the batch shrinks
            while slots and slots[-1] is None:
                slots.pop()
            if None in slots:
                hole = slots.index(None)
                self.move(slots, len(slots) - 1, hole)
                slots.pop()

    def new_row(self, row: Row, fed: Fed | None, j: int, fed_len: int) -> Row:
        """With a Capture, a new row starts with the features of its prompt (j: its place in the prefill)."""
        if fed is not None:
            row.features = [f for f in (self.prefix_features, fed.features[j, :fed_len]) if f is not None]
            row.closing = self.finished(row)
        return row

    def sink_holes(self, slots: list) -> None:
        """Move each hole to the last band: every later band gives its longest row to the band
        before it, one row copy per band. All rows grow one slot per step, so the bands stay
        ordered longest first, and each band's attention reads only up to its own longest row."""
        if not self.banded:
            return
        for hole in [r for r, row in enumerate(slots) if row is None]:
            for lo, hi in bands(len(slots), self.cfg.bands):
                rows = [r for r in range(lo, hi) if slots[r] is not None] if lo > hole else []
                if rows:
                    src = max(rows, key=lambda r: slots[r].position)
                    self.move(slots, src, hole)
                    hole = src

    def move(self, slots: list, src: int, dst: int) -> None:
        self.cache.move_row(src, dst, slots[src].position)
        slots[dst], slots[src] = slots[src], None

    def prefill(self, rows: list[int], suffixes: list[Sequence[int]], prefix: int) -> tuple[list[int], Fed | None]:
        """Feed each prompt after the shared prefix, right-padded (pads sit after a row's last
        token, so the mask keeps them out of its attention; its decode overwrites their slots)."""
        t0 = time.perf_counter()
        width = max(len(s) for s in suffixes)
        ids = torch.tensor([list(s) + [0] * (width - len(s)) for s in suffixes], device=self.device)  # (b, T)
        positions = (prefix + torch.arange(width, device=self.device))[None].expand(len(rows), -1)  # (b, T)
        row_ids = torch.tensor(rows, device=self.device)
        if prefix:
            self.cache.load_prefix(row_ids)
        first = self.forward(row_ids, ids, positions, torch.tensor([len(s) - 1 for s in suffixes], device=self.device))
        self.stats.prefill_tokens += ids.numel()
        self.stats.prefill_s += time.perf_counter() - t0
        return first

    def decode_step(self, slots: list[Row]) -> Iterator[Answer]:
        """Feed every row its newest token; the next tokens end rows at EOS or their cap."""
        t0 = time.perf_counter()
        n = len(slots)
        ids = torch.tensor([[row.answer[-1]] for row in slots], device=self.device)  # (n, 1)
        positions = torch.tensor([[row.position] for row in slots], device=self.device)  # (n, 1)
        rows = torch.arange(n, device=self.device)
        ends = [row.position + 1 for row in slots]  # slots each row attends to
        groups = [(lo, hi, max(ends[lo:hi])) for lo, hi in bands(n, self.cfg.bands)] if self.banded else [(0, n, max(ends))]
        tokens, fed = self.forward(rows, ids, positions, torch.zeros(n, dtype=torch.long, device=self.device),
                                   leading=n, groups=groups if self.banded else None)
        closing = sum(row.closing for row in slots)
        self.stats.decode_steps += 1
        self.stats.row_steps += n - closing
        self.stats.closing_steps += closing
        self.stats.attended_slots += sum((hi - lo) * length for lo, hi, length in groups)
        self.stats.used_slots += sum(ends)
        self.stats.decode_s += time.perf_counter() - t0
        for r, (row, token) in enumerate(zip(slots, tokens)):
            if fed is not None:  # f and teacher row of the answer token just fed
                row.features.append(fed.features[r])
                row.teacher.append((fed.teacher_ids[r], fed.teacher_logits[r]))
            if row.closing:  # its last token is in, features and all: done
                row.closing = False
            else:
                row.answer.append(token)
                row.closing = fed is not None and self.finished(row)
            if self.finished(row) and not row.closing:
                yield self.emit(row)
                slots[r] = None

    def finished(self, row: Row) -> bool:
        return row.answer[-1] in self.cfg.eos_ids or len(row.answer) >= row.cap

    def emit(self, row: Row) -> Answer:
        self.stats.answers += 1
        self.stats.answer_tokens += len(row.answer)
        if not row.teacher:
            return Answer(row.index, tuple(row.answer))
        ids, logits = zip(*row.teacher)
        return Answer(row.index, tuple(row.answer), torch.cat(row.features), torch.stack(ids), torch.stack(logits))


def choose_batch(model, capacity: int, device: torch.device) -> int:
    """Rows whose K/V fit KV_MEMORY_SHARE of available RAM (CPU) or twice that of free VRAM (CUDA),
    at most CPU_MAX_BATCH on CPU (compute-bound: per-row cost stops falling past ~48-64 rows while
    the first fill and the shrinking tail grow with B) and GPU_MAX_BATCH on CUDA (memory-bound:
    wider batches pay until the K/V budget)."""
    cfg = model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype_bytes = model.get_input_embeddings().weight.element_size()
    row_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * dtype_bytes * capacity
    if device.type == "cuda":
        budget, limit = 2 * KV_MEMORY_SHARE * torch.cuda.mem_get_info(device)[0], GPU_MAX_BATCH
    else:
        budget, limit = KV_MEMORY_SHARE * psutil.virtual_memory().available, CPU_MAX_BATCH
    return max(1, min(limit, int(budget // row_bytes)))
