"""The target runner: every target forward the engine makes, for every strategy, plain included.

Four calls: `prefill` a prompt, `verify` a tree, `commit` the accepted rows, `reset` for a new chat.
The KV lives in one transformers `Cache` of `StaticLayer`s per runner, allocated once for the
whole context (capacity C = context + the largest bucket; on a CPU fp32 or fp64, see `exact`): a forward writes its N rows at [L, L+N) and a commit
moves the accepted rows to [L, L+a) and rewinds the cache's length counter. The runner keeps a
host mirror L of that length, so it never reads the device.

Verify sizes come in a few fixed buckets: a tree of n nodes is padded to the smallest bucket >= n
(beyond the largest, it goes in chunks of the largest), and with `compile` each bucket's forward
is one `torch.compile`d graph (a CUDA graph on GPUs), so every forward runs the same kernels.
Masks are built here, outside the graph, as additive (1, 1, Nb, Lk) tensors; the attention
function registered below reads only the first Lk cache rows. On CPU Lk is L+N rounded up to a
64-row block and a symbolic size in the graph, so attention costs what the chat's length costs
and no length recompiles; on CUDA Lk is the whole capacity, one shape per bucket for the graphs.
Padding rows see only themselves and are dropped at commit.
"""

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from core.config import PLANNED_CONTEXT
from core.runtime.graphs import Graph, GraphJob, compiled_all, graph_name, row_groups, rows_label
from core.runtime.kv import additive_mask, attended_rows, cache_bytes, keep_rows, key_blocks, set_length, static_cache
from models import attention
from models.cpu_quant import bf16_outputs
from models.quants import CPU_QUANTS
from models.target import Target

ATTENTION = "aerie_tree"
ROW_ATTENTION = "aerie_rows"
# Every size to 8 (past ~8 a tree stops paying on a 2-core CPU): a CPU's sizes from 2 on share one graph,
# T symbolic (core/runtime/graphs.py), so a size of its own costs no compile, and a 3-token tree no
# longer pays a padding row: ~1 ms, a fifth of a token, on the 2-core EPYC (compiled verify at 200
# tokens, ms at 2 / 3 / 4 rows: 4.89 / 5.89 / 7.02).
CPU_BUCKETS = tuple(range(1, 9))
CUDA_BUCKETS = (1, 4, 8, 16, 32, 48, 64)
PREFILL_CHUNK = 512


def tree_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention over the first Lk cache rows with GQA folded into the query axis.

    query (B, Hq, N, D); key, value (B, Hkv, C, D), the whole static buffer; attention_mask
    (B, 1, N, Lk) additive. Query head h reads KV head h // r (r = Hq / Hkv), so viewing the queries
    as (B, Hkv, r*N, D) lets one SDPA per KV head serve all r query heads, with no copy of K/V.
    It computes in the mask's dtype: a verify's is the cache's (fp64: `TargetRunner.exact`), a
    prefill's fp32 (`TargetRunner.prefill`).
    """
    if attention_mask is None or attention_mask.dim() != 4:  # a 2D-mask caller (e.g. generate()): plain SDPA
        return sdpa_attention_forward(module, query, key, value.to(key.dtype), attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)   # (bf16 values beside fp32 keys: kv.BlockedKVLayer)
    batch, q_heads, n, dim = query.shape
    kv_heads, lk = key.shape[1], attention_mask.shape[-1]
    r = q_heads // kv_heads
    dtype = attention_mask.dtype
    folded = query.reshape(batch, kv_heads, r * n, dim).to(dtype)           # (B, Hkv, r*N, D)
    mask = attention_mask.repeat(1, 1, r, 1) if r > 1 else attention_mask     # (B, 1, r*N, Lk)
    out = F.scaled_dot_product_attention(folded, key[:, :, :lk].to(dtype), value[:, :, :lk].to(dtype),
                                         attn_mask=mask, scale=scaling)
    return out.to(query.dtype).reshape(batch, q_heads, n, dim).transpose(1, 2).contiguous(), None  # (B, N, Hq, D)


def row_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """tree_attention on models/attention.py's kernel for up to MAX_ROWS query tokens (a verify, a
    short prefill chunk): each row alone in one fixed fp32 order over the cache (fp32 keys, values
    fp32 or bf16), so a tree's rows equal one token's bit for bit. key (1, Hkv, C/16 * D * 16): the
    cache's key blocks, flat (kv.BlockedKVLayer). Other calls (a 2D mask, more rows) keep fp32 SDPA."""
    blocks = key_blocks(key, query.shape[-1])                                             # (1, Hkv, C/16, D, 16)
    if attention_mask is None or attention_mask.dim() != 4 or query.shape[0] != 1 or query.shape[2] > attention.MAX_ROWS:
        # only the rows attention reads: a 4D mask's Lk (tree_attention), else the whole cache
        rows = attention_mask.shape[-1] if attention_mask is not None and attention_mask.dim() == 4 else value.shape[2]
        keys = attention.unblocked(blocks, rows)                                             # (1, Hkv, rows, D)
        return tree_attention(module, query, keys, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    _, q_heads, n, dim = query.shape
    kv_heads = key.shape[1]
    folded = query.reshape(kv_heads, q_heads // kv_heads * n, dim).float()                 # (Hkv, r*N, D)
    scale = scaling if scaling is not None else dim ** -0.5
    out = attention.attend(folded, blocks[0], value[0], attention_mask[0, 0], scale)            # (Hkv, r*N, D)
    return out.to(query.dtype).reshape(1, q_heads, n, dim).transpose(1, 2).contiguous(), None  # (1, N, Hq, D)


def register_attention() -> None:
    """Register both under their names (idempotent); with sdpa's mask function so a 2D mask stays causal."""
    for name, function in ((ATTENTION, tree_attention), (ROW_ATTENTION, row_attention)):
        AttentionInterface.register(name, function)
        AttentionMaskInterface.register(name, sdpa_mask)


@dataclass(frozen=True)
class RunnerConfig:
    compile: bool = True                 # one compiled graph per bucket; False = the eager reference path
    buckets: tuple[int, ...] | None = None   # None = the device's (CPU_BUCKETS / CUDA_BUCKETS)
    context: int = PLANNED_CONTEXT       # KV rows kept for the chat (capped at the model's context)
    # Exact attention on models/attention.py's kernel over an fp32 cache (V maybe bf16; the caller loaded it);
    # False: fp64 SDPA over an fp64 cache. Only where `exact` applies.
    row_attention: bool = False
    # A simulated slow target (bench --verify-delay-ms): every prefill and verify waits this long, the
    # same for any size, as an offloaded target's weight transfer would (plain decoding's too).
    verify_delay_ms: float = 0.0


@dataclass(frozen=True)
class Verified:
    logits: torch.Tensor | None          # (T, V) fp32 target logits after each row; None once kept (Engine: kept)
    features: torch.Tensor | None        # (T, F) the target features the drafter reads, else None
    side_next: torch.Tensor | None = None  # (R,) the target's argmax after each side row read (tree.SideRows)


class TargetRunner:
    def __init__(self, target: Target, config: RunnerConfig = RunnerConfig(),
                 feature_layers: tuple[int, ...] | None = None):
        self.target, self.feature_layers = target, feature_layers
        self.device, self.dtype = target.device, target.dtype
        cuda = self.device.type == "cuda"
        offloaded = bool(getattr(target.model, "hf_device_map", None)) and len(set(target.model.hf_device_map.values())) > 1
        self.buckets = tuple(sorted(config.buckets or (CUDA_BUCKETS if cuda else CPU_BUCKETS)))
        self.wants_graphs = config.compile and not offloaded  # accelerate's offload hooks move weights per call
        # ...so an offloaded target verifies a tree in one forward, however big (SpecExec's trees):
        # chunks of the largest bucket would each move every offloaded weight again.
        self.one_forward = offloaded
        self.delay_s = config.verify_delay_ms / 1000
        self.context_len = min(target.context_len, config.context)
        # Exact attention: with bf16 activations (the int4/int8 kernels) a tree's verify and one
        # token's would differ by fp32 summation order in attention, which the next bf16 rounding
        # turns into logit differences of up to 0.375 (measured): greedy texts would part at near-
        # ties. An fp64 KV cache makes attention's sums exact to fp32 rounding, so a tree's logits
        # equal sequential decoding's bit for bit (measured, contexts 20-300, trees of 2-8), for
        # twice the cache memory. The row kernel gets the same from an fp32 cache by computing each
        # row alone in one order (models/attention.py), 2-4x cheaper. CUDA keeps its dtype: a
        # near-tie there is logged (tie_margin).
        self.exact = self.device.type == "cpu" and target.quant in CPU_QUANTS
        text = target.model.config.get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.row_attention = self.exact and config.row_attention and attention.supports(head_dim)
        kv_dtype = torch.float32 if self.row_attention else torch.float64 if self.exact else self.dtype
        self.prefill_dtype = torch.float32 if self.exact else kv_dtype   # attention's, in `prefill`
        self.tie_margin = 0.5 if self.dtype != torch.float32 else 1e-3
        self.capacity = self.context_len + self.buckets[-1]
        register_attention()
        target.model.set_attn_implementation(ROW_ATTENTION if self.row_attention else ATTENTION)
        self.num_layers = text.num_hidden_layers
        # V in bf16 where it is a 4-bit or 8-bit kernel's bias-free output: those are bf16 values already.
        values = torch.bfloat16 if self.row_attention and bf16_outputs(target.model, "v_proj") else kv_dtype
        self.cache = static_cache(self.num_layers, self.capacity, text.num_key_value_heads, head_dim, kv_dtype, self.device,
                                  blocked_keys=self.row_attention, value_dtype=values)
        self.length = 0                  # L, the cache's length counter mirrored on the host
        self.ids: list[int] = []         # the token ids at cache rows [0, L) once committed
        self.verified_at = 0             # L before the last verify: where commit moves the kept rows
        self._graphs: dict[int, object] = {}  # bucket -> its graph, once adopted
        self.compile_s = 0.0

    # ------------------------------------------------------------------ the four calls

    @torch.inference_mode()
    def prefill(self, ids: list[int], start: int) -> Verified:
        """Feed `ids` at positions start.. after truncating the cache to `start`; -> the logits after
        the last token (1, V) and the features of every fed token.

        On a CPU int4/int8 target (`exact`) every row goes through the verify buckets' forwards, in
        chunks of the largest: their rows equal one token's bit for bit, so a prompt row's value no
        longer depends on where its chunk starts, and a greedy answer is a function of the prompt,
        not of what the cache held before. Fed in eager chunks, the linears' bf16 inputs turned the
        chunks' differing attention sums into logit differences of up to ~0.5 (a 68-token MT-bench
        prompt read whole, from row 3 after another chat, or token by token: three sets of logits),
        and through the API plain decoding and EAGLE, whose head makes the target re-read the prompt
        from a token earlier, gave different texts for 5 of 16 MT-bench prompts.

        Elsewhere all but the last token go in eager causal chunks, attention in fp32 (over an fp64
        cache where it is one), and the last alone, as a decode step is, so the same prompt asked
        again (its rows reused but the last) gives the same answer."""
        self.truncate(start)
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.exact:
            return self._prefill_in_buckets(ids)
        features, bulk = [], ids[:-1]
        for lo in range(0, len(bulk), PREFILL_CHUNK):
            chunk = bulk[lo: lo + PREFILL_CHUNK]
            length = self.length
            token_ids = torch.tensor([chunk], device=self.device)                                  # (1, T)
            positions = torch.arange(length, length + len(chunk), device=self.device)[None]        # (1, T)
            visible = torch.ones(len(chunk), len(chunk), dtype=torch.bool, device=self.device).tril()
            _, feats = self.forward(token_ids, positions, self.mask(visible, length, self.prefill_dtype))
            features.append(feats)
            self.length += len(chunk)
            self.ids += chunk
        last = self.verify(torch.tensor(ids[-1:]), torch.zeros(1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool))
        self.commit(torch.tensor([0]), ids[-1:])
        features.append(last.features)
        return Verified(last.logits, torch.cat(features) if self.feature_layers is not None else None)   # (1, V)

    def _prefill_in_buckets(self, ids: list[int]) -> Verified:
        """`prefill` on the verify buckets: chunks of the largest, each a chain seen whole, kept."""
        largest, features = self.buckets[-1], []
        for lo in range(0, len(ids), largest):
            chunk = ids[lo: lo + largest]
            n = len(chunk)
            hidden, feats = self._forward_rows(torch.tensor(chunk), torch.arange(n),
                                               torch.ones(n, n, dtype=torch.bool).tril())   # (n, H), (n, F)
            self.commit(torch.arange(n), chunk)
            features.append(feats)
        logits = self.target.model.get_output_embeddings()(hidden[-1:]).float()                  # (1, V)
        return Verified(logits, torch.cat(features) if self.feature_layers is not None else None)

    @torch.inference_mode()
    def verify(self, tokens: torch.Tensor, depth: torch.Tensor, visible: torch.Tensor,
               outputs: torch.Tensor | None = None) -> Verified:
        """tokens (n,) at positions L + depth (n,), visible (n, n) bool (a tree's ancestor mask):
        forwards of the smallest bucket that holds them (a tree beyond the largest bucket goes in
        chunks of it, each seeing the chunks before; in one forward where the target is offloaded);
        -> logits and features of the n rows, or of the rows `outputs` (k,) only, in that order (the
        LM head runs on those alone)."""
        if self.delay_s:
            time.sleep(self.delay_s)
        hidden, features = self._forward_rows(tokens, depth, visible)
        rows = slice(0, tokens.shape[0]) if outputs is None else outputs.to(self.device)
        logits = self.target.model.get_output_embeddings()(hidden[rows]).float()                    # (k, V)
        return Verified(logits, None if features is None else features[rows])

    def _forward_rows(self, tokens: torch.Tensor, depth: torch.Tensor,
                      visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """verify's forwards, uncommitted; -> hidden states (n, H) and features (n, F) or None."""
        n, length, largest = tokens.shape[0], self.length, self.buckets[-1]
        padded_n = n if n <= largest or self.one_forward else -(-n // largest) * largest
        padded_n = next((b for b in self.buckets if b >= padded_n), padded_n)
        if length + padded_n > self.capacity:
            raise ValueError(f"a {n}-token verify after {length} tokens overflows the {self.capacity}-row cache")
        if padded_n == n <= largest:
            # No padding and one forward: the inputs as they come, without the dozen host ops below
            # (~0.1 ms a round right after a verify has swept the caches; plain decoding +1.4%).
            # Fresh tensors made here, as dynamo's guards expect them (inference tensors).
            h, f = self.graph(n)(tokens.to(self.device).clone()[None], (depth.to(self.device) + length)[None],
                                 self.mask(visible.to(self.device), length))
            self.verified_at, self.length = length, length + n
            return h, f
        chunk = padded_n if self.one_forward else largest
        token_ids = torch.zeros(padded_n, dtype=torch.long, device=self.device)
        token_ids[:n] = tokens.to(self.device)
        positions = torch.full((padded_n,), length, dtype=torch.long, device=self.device)
        positions[:n] += depth.to(self.device)
        seen = torch.eye(padded_n, dtype=torch.bool, device=self.device)  # padding rows see only themselves
        seen[:n, :n] = visible.to(self.device)
        hidden, features = [], []
        for lo in range(0, padded_n, chunk):
            hi = min(lo + chunk, padded_n)
            # Fresh (1, b) tensors: a view into the longer buffer would have other strides, a new graph.
            h, f = self.graph(hi - lo)(token_ids[lo:hi].clone()[None], positions[lo:hi].clone()[None],
                                       self.mask(seen[lo:hi, :hi], length))
            hidden.append(h)
            features.append(f)
        self.verified_at, self.length = length, length + padded_n
        return torch.cat(hidden)[:n], None if self.feature_layers is None else torch.cat(features)[:n]  # cat copies

    @property
    def rows_left(self) -> int:
        """The most tree rows a verify can hold now, as `verify` pads them: the cache's free rows, in
        whole chunks of the largest bucket beyond it (the engine trims a bigger tree to them)."""
        free, largest = self.capacity - self.length, self.buckets[-1]
        return free if self.one_forward or free <= largest else free // largest * largest

    @torch.inference_mode()
    def side_forward(self, decoder, token_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                     at: int) -> torch.Tensor:
        """(1, T) ids at (1, T) positions through `decoder`, a view of the target's decoder over some
        of its layers (models/layer_view.py), its layers writing KV at rows [at, at+T) and reading
        what `mask` (1, 1, T, Lk) shows; -> logits (T, V). Nothing is committed: the cache's length
        goes back to L, and the next verify writes over those rows in every layer."""
        if at + token_ids.shape[1] > self.capacity:
            raise ValueError(f"a {token_ids.shape[1]}-token draft at row {at} overflows the {self.capacity}-row cache")
        set_length(self.cache, at)
        try:
            out = decoder(input_ids=token_ids, position_ids=positions, attention_mask=mask, cache=self.cache, use_cache=True)
        finally:
            set_length(self.cache, self.length)
        return self.target.model.get_output_embeddings()(out.last_hidden_state[0]).float()

    def commit(self, rows: torch.Tensor, tokens: list[int]) -> None:
        """Keep rows `rows` of the last verify (root first; their token ids `tokens`) at [L, L+a)."""
        start = self.verified_at
        keep_rows(self.cache, start, rows, written=self.length - start)
        self.ids = self.ids[:start] + list(tokens)
        self.length = start + len(rows)

    def truncate(self, length: int) -> None:
        """Forget every cached row at positions >= length."""
        self.length = min(self.length, length)
        self.ids = self.ids[: self.length]
        set_length(self.cache, self.length)

    def reset(self) -> None:
        self.truncate(0)

    # ------------------------------------------------------------------ graphs and masks

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor):
        """(1, T) ids and positions, (1, 1, T, Lk) mask -> final hidden states (T, H) and the
        requested features (T, F) or None. The function each bucket's graph compiles."""
        # Index num_layers is the final (normed) hidden state, which every forward returns; only
        # inner layers (EAGLE-3) need transformers' output capturing.
        inner = self.feature_layers is not None and any(i != self.num_layers for i in self.feature_layers)
        out = self.target.model.get_decoder()(input_ids=token_ids, position_ids=positions, attention_mask=mask,
                                               cache=self.cache, use_cache=True, output_hidden_states=inner)
        features = None
        if self.feature_layers is not None:
            states = [out.last_hidden_state if i == self.num_layers else out.hidden_states[i] for i in self.feature_layers]
            features = torch.cat([h[0] for h in states], dim=-1)
        return out.last_hidden_state[0], features

    def graph(self, size: int):
        """The forward for a bucket: its graph once one is adopted, else the eager forward. A graph
        is adopted only between rounds (`adopt`), so a round never mixes the two."""
        return self._graphs.get(size, self.forward)

    def adopt(self, sizes: tuple[int, ...], graph) -> None:
        """Run the buckets `sizes` on `graph` from the next verify on."""
        for size in sizes:
            self._graphs[size] = graph

    @property
    def compiled(self) -> bool:
        """Whether every bucket runs as a graph."""
        return all(size in self._graphs for size in self.buckets)

    @property
    def graph_sizes(self) -> tuple[int, ...]:
        """The buckets that run as graphs (all of them once compiled, some after a failed compile)."""
        return tuple(size for size in self.buckets if size in self._graphs)

    def graph_jobs(self, edges: tuple[int, ...] = ()) -> list[GraphJob]:
        """What a CPU precompiles (core/runtime/graphs.py): the forward of each group of buckets
        (`row_groups`: no group spans a row count in `edges`, where the linears switch kernels) on
        example inputs of its smallest; T and the mask's width stay symbolic. Tracing runs nothing."""
        jobs = []
        for rows in row_groups(self.buckets, edges):
            size = rows[0]
            visible = torch.ones(size, size, dtype=torch.bool, device=self.device).tril()
            args = (torch.zeros(1, size, dtype=torch.long, device=self.device),
                    torch.arange(size, device=self.device)[None], self.mask(visible, 0))
            jobs.append(GraphJob(graph_name("target", rows), f"the target's {rows_label(rows)}token verify", self.forward,
                                 args, lambda g, rows=rows: self.adopt(rows, g), rows))
        return jobs

    def warm_up(self, report=None) -> float:
        """Compile every bucket's graph here and now, on its first call (a chat's first rounds would
        otherwise pay it): how a GPU captures its CUDA graphs; -> seconds. Where torch cannot
        compile, say so and run the eager forward. A CPU's graphs are precompiled instead
        (`graph_jobs`: the factory loads them, a child compiles them), which runs the same code."""
        if not self.wants_graphs:
            return 0.0
        t0 = time.perf_counter()

        def every_bucket():
            for i, size in enumerate(self.buckets):
                if report is not None:
                    report(f"Compiling the target's forward for {size}-token trees ({i + 1}/{len(self.buckets)})")
                self.adopt((size,), Graph(self.forward, self.device))
                self.reset()
                self.verify(torch.zeros(size, dtype=torch.long), torch.arange(size),
                            torch.ones(size, size, dtype=torch.bool).tril())
        if not compiled_all(every_bucket, report or print):
            self._graphs = {}
        self.reset()
        self.compile_s = time.perf_counter() - t0
        return self.compile_s

    def mask(self, visible: torch.Tensor, length: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """visible (T, m) bool: which of the m rows written from L on each of T new rows sees ->
        additive (1, 1, T, Lk) in `dtype` (default the cache's), the dtype attention computes in:
        every row also sees the L committed rows; columns past L+m are blocked."""
        lk = attended_rows(length + visible.shape[1], self.capacity, self.device)
        return additive_mask(visible, length, dtype or self.cache.layers[0].keys.dtype, width=lk)

    def cache_bytes(self) -> int:
        return cache_bytes(self.cache)
