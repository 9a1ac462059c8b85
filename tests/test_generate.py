"""The continuously batched generator against greedy decoding of each prompt alone, on tiny random
Llamas built here; the distill file it writes; the prompt slice it takes from mix_v1."""

import importlib.util
import json
import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from core.runtime.cpu_linear import BATCHED_KINDS, fastest_batched_linear, use_onednn_linears
from models.cpu_quant import OneDnnLinear
from core.train.answers import SHARD_ANSWERS, AnswerStore, AnswerStoreError, read_answers, stores_of
from core.train.distill import FRESH_START, FeatureShards, hf_generate, shuffled_prompts, write_answers
from core.train.batch_gen import PAD_SHARE, BatchGenerator, Capture, GenConfig, choose_batch, prefill_groups
from core.train.row_cache import ROW_GROUPS, bands, use_row_group_attention
from core.train.data import signature
from tests.conftest import needs_onednn_bf16, tiny_llama, tiny_target

SHARED = Path(__file__).resolve().parent.parent.parent / "shared"
PREFIX = [11, 12, 13, 14, 15, 16]  # like a chat template's system block: shared by every prompt


def make_prompts(n: int, seed: int, prefix=PREFIX) -> list[list[int]]:
    rng = random.Random(seed)
    return [prefix + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


@torch.no_grad()
def greedy_alone(model, prompt: list[int], cap: int, eos: tuple[int, ...]) -> tuple[int, ...]:
    """The reference: one prompt, no cache, the whole sequence re-read for every token."""
    ids, out = list(prompt), []
    while len(out) < cap and not (out and out[-1] in eos):
        out.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        ids.append(out[-1])
    return tuple(out)


def reachable_eos(model, prompts) -> tuple[int, ...]:
    """A token greedy answers reach often: some answers end on it early, others hit their cap."""
    seen = Counter(t for p in prompts[:6] for t in greedy_alone(model, p, 12, ())[2:])
    return (seen.most_common(1)[0][0],)


ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@pytest.mark.parametrize("attn,share_prefix,onednn,batch", [
    ("sdpa", True, False, 4), ("sdpa", False, False, 4), ("eager", True, False, 4),
    (ROW_GROUPS, True, False, 5), (ROW_GROUPS, True, True, 7), (ROW_GROUPS, False, True, 16)])
def test_batched_greedy_equals_greedy_alone(attn, share_prefix, onednn, batch):
    if onednn and not ONEDNN:
        pytest.skip("this torch has no oneDNN linear")
    model = tiny_llama(seed=1)
    prompts = make_prompts(13, seed=2)
    eos = reachable_eos(model, prompts)
    caps = [random.Random(i).choice([1, 2, 5, 9, 17, 30]) for i in range(len(prompts))]
    expected = [greedy_alone(model, p, cap, eos) for p, cap in zip(prompts, caps)]
    if attn == ROW_GROUPS:
        use_row_group_attention(model)
    else:
        model.set_attn_implementation(attn)
    if onednn:
        use_onednn_linears(model, batch)
    gen = BatchGenerator(model, GenConfig(batch=batch, eos_ids=eos, share_prefix=share_prefix, bands=3), capacity=80)
    answers = list(gen.generate(prompts, caps))
    got = {a.index: a.answer_ids for a in answers}
    assert sorted(got) == list(range(len(prompts))) and len(answers) == len(prompts)
    assert [got[i] for i in range(len(prompts))] == expected
    assert any(e[-1] in eos for e in expected) and any(len(e) == c and e[-1] not in eos for e, c in zip(expected, caps))
    assert gen.stats.row_steps == sum(len(e) - 1 for e in expected)  # every decode row-step made a kept token
    assert gen.stats.answer_tokens == sum(map(len, expected))


def test_bands_keep_the_longest_rows_together():
    """With ROW_GROUPS attention a hole sinks to the last band, so each band attends to little padding."""
    model = tiny_llama(seed=8)
    use_row_group_attention(model)
    prompts = make_prompts(40, seed=9)
    gen = BatchGenerator(model, GenConfig(batch=12, max_new_tokens=24, bands=4), capacity=80)
    caps = [random.Random(i).randrange(4, 25) for i in range(len(prompts))]
    got = {a.index: a.answer_ids for a in gen.generate(prompts, caps)}
    assert [got[i] for i in range(len(prompts))] == [greedy_alone(model, p, c, ()) for p, c in zip(prompts, caps)]
    assert gen.stats.used_slots / gen.stats.attended_slots > 0.8
    assert bands(10, 4) == [(0, 2), (2, 5), (5, 8), (8, 10)] and bands(2, 4) == [(0, 1), (1, 2)]


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN linear")
def test_onednn_linear_is_the_same_linear():
    dense = torch.nn.Linear(64, 96)
    fast = OneDnnLinear(dense, rows=8)
    for shape in [(1, 64), (8, 1, 64), (3, 17, 64)]:
        x = torch.randn(shape)
        torch.testing.assert_close(fast(x), dense(x), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN linear")
@needs_onednn_bf16
def test_bf16x3_linear_keeps_the_weights_and_rounds_only_the_inputs():
    """The exact three-term split on bf16 dot products: dense's own weights applied to the inputs
    rounded to bf16 (only the order of fp32 sums differs), not dense on bf16-rounded weights."""
    dense = torch.nn.Linear(64, 96, bias=False)
    fast = OneDnnLinear(dense, rows=8, kind="bf16x3")
    x = torch.randn(3, 17, 64)
    rounded = x.bfloat16().float()
    expected = torch.nn.functional.linear(rounded, dense.weight)
    got = fast(x)
    assert got.dtype == torch.float32
    # The GEMM writes bf16, as the int4 kernel does: the exact result rounded once, except where the
    # order of the fp32 sums moves a value across a rounding boundary (rare). Rounded weights would
    # miss most of them.
    assert (got == expected.bfloat16().float()).float().mean() > 0.98
    rounded_weights = OneDnnLinear(dense, rows=8, kind="bf16")(x)
    assert (rounded_weights == expected.bfloat16().float()).float().mean() < 0.9


def test_more_rows_than_prompts_and_no_common_prefix():
    model = tiny_llama(seed=4)
    prompts = [[7], [200, 3, 9], [8, 8, 8, 8, 8, 8, 8, 8, 8]]
    gen = BatchGenerator(model, GenConfig(batch=16, max_new_tokens=12), capacity=24)
    got = {a.index: a.answer_ids for a in gen.generate(prompts)}
    assert [got[i] for i in range(3)] == [greedy_alone(model, p, 12, ()) for p in prompts]


def test_the_baseline_is_greedy_too():
    """hf_generate (left-padded transformers generate) is what the benchmark compares against."""
    model = tiny_llama(seed=5)
    prompts = make_prompts(7, seed=6)
    eos = reachable_eos(model, prompts)
    assert hf_generate(model, prompts, 15, 3, eos, pad_id=0) == [greedy_alone(model, p, 15, eos) for p in prompts]


def test_rejects_a_prompt_the_cache_cannot_hold():
    gen = BatchGenerator(tiny_llama(), GenConfig(batch=2, max_new_tokens=10), capacity=16)
    with pytest.raises(ValueError, match="prompt 1"):
        list(gen.generate([[1, 2], list(range(3, 11))]))


def test_prefill_groups_cover_every_prompt_with_little_padding():
    lengths = [random.Random(i).randrange(1, 200) for i in range(48)]
    groups = prefill_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(48))
    for g in groups:
        width, tokens = max(lengths[i] for i in g), sum(lengths[i] for i in g)
        assert len(g) == 1 or width * len(g) <= (1 + PAD_SHARE) * tokens


def test_batch_fits_memory(monkeypatch):
    model = tiny_llama()
    assert 1 <= choose_batch(model, 512, torch.device("cpu")) <= 64
    monkeypatch.setattr("core.train.batch_gen.psutil.virtual_memory", lambda: type("M", (), {"available": 4 * 2**20}))
    row_bytes = 2 * 2 * 2 * 16 * 4 * 512  # K and V x layers x kv heads x head dim x fp32 x slots
    assert choose_batch(model, 512, torch.device("cpu")) == 2**20 // row_bytes


class ByteTokenizer:
    """Enough of a tokenizer for render_prompt: a fixed template, one id per byte."""

    def apply_chat_template(self, chat, tokenize=False, add_generation_prompt=True):
        return "<s>" + "".join(f"{m['role']}:{m['content']}|" for m in chat) + "assistant:"

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())


SOURCE = {"target": {"model": "tiny", "quant": "none", "linear": "default"}, "prompts": {"file": "p.jsonl"}}


def test_write_answers_stores_token_ids_and_resumes(tmp_path):
    model = tiny_llama(seed=7)
    tok = ByteTokenizer()
    prompts = dict(enumerate(["hi", "what is two and two?", "x" * 90, "tell me a story", "ok"], 40))
    folder = tmp_path / "store"

    def generator():
        return BatchGenerator(model, GenConfig(batch=2, max_new_tokens=6), capacity=80)

    first = write_answers(generator(), tok, {i: prompts[i] for i in (40, 41)}, AnswerStore(folder, SOURCE), prompt_cap=70,
                          progress=False)
    assert first["answered"] == 2
    (folder / "answers-000099-torn.jsonl.gz.tmp").write_bytes(b"\x1f\x8b")  # a run killed mid-shard: never listed
    summary = write_answers(generator(), tok, prompts, AnswerStore(folder, SOURCE), prompt_cap=70, progress=False)
    assert summary == {**summary, "already_answered": 2, "over_prompt_cap": 1, "answered": 2}
    rows = [row for _, row in read_answers(folder)]
    assert sorted(r["index"] for r in rows) == [40, 41, 43, 44] and set(rows[0]) == {"index", "prompt_ids", "answer_ids"}
    for r in rows:
        assert r["prompt_ids"] == tok.encode(tok.apply_chat_template([{"role": "user", "content": prompts[r["index"]]}]))
        assert tuple(r["answer_ids"]) == greedy_alone(model, r["prompt_ids"], 6, ())
    again = write_answers(generator(), tok, prompts, AnswerStore(folder, SOURCE), prompt_cap=70, progress=False)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert again["answered"] == 0 and len(manifest["shards"]) == 2 and manifest["answers"] == 4
    assert manifest["answer_tokens"] == sum(len(r["answer_ids"]) for r in rows) and manifest["source"] == SOURCE


def test_an_answer_store_refuses_another_source_a_damaged_shard_and_a_full_budget(tmp_path):
    folder = tmp_path / "data" / "store"
    store = AnswerStore(folder, SOURCE)
    for i in range(SHARD_ANSWERS + 3):                    # one full shard written at once, then 3 at flush
        store.add(i, [1, 2, 3], [4, 5, i % 7])
    assert len(list(folder.glob("*.jsonl.gz"))) == 1
    store.flush()
    assert len(store.answered()) == SHARD_ANSWERS + 3
    other = {**SOURCE, "target": {**SOURCE["target"], "linear": "bf16"}}
    with pytest.raises(AnswerStoreError, match="another source"):
        AnswerStore(folder, other)
    small = AnswerStore(tmp_path / "data" / "other", other, budget=(tmp_path / "data", 1000))
    small.add(0, [1], [2])
    with pytest.raises(AnswerStoreError, match="budget"):
        small.flush()
    shard = next(folder.glob("*.jsonl.gz"))
    shard.write_bytes(shard.read_bytes()[:-1] + b"x")
    with pytest.raises(AnswerStoreError, match="differs from its manifest"):
        list(read_answers(folder))
    (folder / "manifest.json").write_text("<<<<<<< HEAD\n")               # a merge conflict in git
    with pytest.raises(AnswerStoreError, match="not valid JSON"):
        AnswerStore(folder, SOURCE)


def test_a_models_stores_are_found_by_their_manifest_not_a_name_prefix(tmp_path):
    for folder, model in (("tiny-none-bf16", "tiny"), ("tiny-instruct-none-bf16", "tiny-instruct"), ("tiny-x", "tiny")):
        store = AnswerStore(tmp_path / folder, {**SOURCE, "target": {**SOURCE["target"], "model": model}})
        store.add(0, [1], [2])
        store.flush()
    (tmp_path / "tiny-empty").mkdir()                                     # no manifest: not a store
    assert [p.name for p in stores_of(tmp_path, "Tiny")] == ["tiny-none-bf16", "tiny-x"]
    assert stores_of(tmp_path / "missing", "tiny") == []


def test_train_reads_answer_stores_and_drops_benchmark_prompts_by_their_ids(tmp_path):
    from core.train.data import DataConfig, TrainDataError, load_conversations

    store = AnswerStore(tmp_path / "store", SOURCE)
    store.add(0, [5, 6, 7], [8, 9])
    store.add(1, [5, 6, 1], [2, 3])
    store.flush()
    lines = tmp_path / "old.jsonl"
    lines.write_text(json.dumps({"prompt": "p", "prompt_ids": [9, 9], "answer_ids": [1]}) + "\n")
    convs, dropped = load_conversations(DataConfig(answers=(tmp_path,), exclude_ids=frozenset({(5, 6, 1)})), 256, 512)
    assert [c.ids for c in convs] == [(9, 9, 1), (5, 6, 7, 8, 9)] and dropped == 1
    (tmp_path / "store" / "manifest.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(TrainDataError, match="manifest"):
        load_conversations(DataConfig(answers=(tmp_path / "store",)), 256, 512)


@pytest.mark.skipif(not (SHARED / "distill").is_dir(), reason="needs ../shared/distill and ../shared/prompts")
def test_default_start_is_past_the_shipped_answers():
    texts = shuffled_prompts(SHARED / "prompts" / "mix_v1.jsonl", 0, None)
    where = {t: i for i, t in enumerate(texts)}
    used = [where[json.loads(line)["prompt"]] for f in sorted((SHARED / "distill").rglob("*.jsonl"))
            for line in f.read_text().split("\n") if line]
    assert used and max(used) == FRESH_START - 1
    assert shuffled_prompts(SHARED / "prompts" / "mix_v1.jsonl", FRESH_START, 3) == texts[FRESH_START:FRESH_START + 3]


def test_launch_generate_flags():
    spec = importlib.util.spec_from_file_location("aerie_launch", Path(__file__).resolve().parent.parent / "launch.py")
    launch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch)
    args = launch.parse_generate_args([])
    assert (args.start, args.limit, args.max_new_tokens, args.prompt_cap, args.batch, args.compare_hf) == \
        (None, None, 256, 256, None, None)
    assert args.prompts.name == "mix_v1.jsonl" and args.linear == "auto"
    assert launch.parse_generate_args(["--compare-hf", "--limit", "96"]).compare_hf == 48
    assert (args.features, args.kinds) == (None, ["eagle1"])
    keep = launch.parse_generate_args(["--features", "f", "--kinds", "eagle1", "eagle3"])
    assert (str(keep.features), keep.kinds) == ("f", ["eagle1", "eagle3"])
    assert str(launch.parse_generate_args(["--out", "answers"]).out) == "answers"
    with pytest.raises(SystemExit):
        launch.parse_generate_args(["--out", "answers.jsonl"])   # a store is a folder


@pytest.mark.parametrize("layers", [(2,), (0, 1, 2)])
def test_captured_answers_carry_the_teacher_forced_features(layers):
    """With a Capture each answer brings f_p at every position and the top-K at every answer
    position, equal to one teacher-forced pass over prompt + answer; the answers are unchanged."""
    model = tiny_llama(seed=5)
    prompts = make_prompts(9, seed=3)
    eos = reachable_eos(model, prompts)
    plain = BatchGenerator(model, GenConfig(batch=4, max_new_tokens=10, eos_ids=eos), capacity=64)
    capturing = BatchGenerator(model, GenConfig(batch=4, max_new_tokens=10, eos_ids=eos, capture=Capture(layers, 8)),
                               capacity=64)
    expected = {a.index: a.answer_ids for a in plain.generate(prompts)}
    answers = list(capturing.generate(prompts, caps=[1] + [10] * 8))  # a one-token answer closes at once
    assert {a.index: a.answer_ids for a in answers if a.index} == {i: v for i, v in expected.items() if i}
    assert capturing.stats.closing_steps == len(prompts)
    for a in answers:
        ids = torch.tensor([prompts[a.index] + list(a.answer_ids)])
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
        P = len(prompts[a.index])
        want = torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)                # (L, F)
        top = out.logits[0, P:].topk(8, dim=-1)                                            # (A, 8)
        assert a.features.shape == want.shape and a.teacher_ids.shape == (len(a.answer_ids), 8)
        torch.testing.assert_close(a.features.float(), want, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(a.teacher_logits.float(), top.values, atol=5e-3, rtol=2e-3)
        assert a.teacher_ids[:, 0].tolist() == top.indices[:, 0].tolist()
        assert a.teacher_ids[:-1, 0].tolist() == list(a.answer_ids[1:])  # greedy: the argmax is the next token


def test_train_takes_generated_features_instead_of_capturing(tmp_path):
    """`generate --features` shards stand in for train's own capture: nothing is captured again and
    the shards train assembles equal those a capture would write, for any subset of the kept layers."""
    from core.train.data import DataConfig, capture, load_conversations, load_features

    model, tok = tiny_llama(seed=7), ByteTokenizer()
    target = tiny_target(model)
    shards = FeatureShards(tmp_path / "gen", (1, 2), signature(target, 16, "default"))
    gen = BatchGenerator(model, GenConfig(batch=3, max_new_tokens=8, capture=Capture((1, 2), 16)), capacity=120)
    texts = [f"question {i}: " + "why" * (i % 5) for i in range(10)]
    write_answers(gen, tok, dict(enumerate(texts)), AnswerStore(tmp_path / "answers", SOURCE), prompt_cap=100,
                  progress=False, shards=shards)
    assert len(list((tmp_path / "gen").glob("gen-*.safetensors"))) == 1  # 10 answers: one flush at the end
    cfg = DataConfig(answers=(tmp_path / "answers",), shard_size=4, teacher_topk=16)
    convs, _ = load_conversations(cfg, 256, 512)
    for layers in [(2,), (1,), (1, 2)]:
        reused, stats = capture(target, convs, layers, cfg, tmp_path / "gen", f"{layers}")
        fresh, _ = capture(target, convs, layers, cfg, tmp_path / f"fresh{len(layers)}{layers[0]}", "t")
        assert stats["positions"] == 0 and stats["reused"] == sum(len(c.ids) for c in convs)
        a, b = load_features(reused), load_features(fresh)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.starts, b.starts) and torch.equal(a.tstarts, b.tstarts)
        torch.testing.assert_close(a.features.float(), b.features.float(), atol=2e-3, rtol=2e-3)
        assert torch.equal(a.teacher_ids[:, 0], b.teacher_ids[:, 0])
    other = capture(target, convs, (0, 2), cfg, tmp_path / "gen", "t")[1]  # layer 0 was not kept: capture
    assert other["reused"] == 0 and other["positions"] == stats["reused"]


def test_answers_added_mid_list_capture_only_the_new_conversations(tmp_path):
    """Shards group conversations by position, so answers added in the middle of the file list move
    every later shard's grouping; their rows are copied from the old shards, not captured again."""
    from core.train.data import Conversation, DataConfig, capture, load_features

    target = tiny_target(tiny_llama(seed=8))
    rng = torch.Generator().manual_seed(0)
    convs = [Conversation(tuple(torch.randint(3, 256, (5 + i,), generator=rng).tolist()),
                          tuple(torch.randint(3, 256, (4 + i % 3,), generator=rng).tolist())) for i in range(9)]
    cfg = DataConfig(answers=(), shard_size=4, teacher_topk=8)
    first, stats = capture(target, convs[:6], (2,), cfg, tmp_path, "first")
    assert stats["reused"] == 0
    grown = convs[:2] + convs[6:] + convs[2:6]       # three new conversations in the middle
    paths, stats = capture(target, grown, (2,), cfg, tmp_path, "grown")
    assert stats["positions"] == sum(len(c.ids) for c in convs[6:])
    assert stats["reused"] == sum(len(c.ids) for c in convs[:6])  # every old shard's grouping moved
    fresh, _ = capture(target, grown, (2,), cfg, tmp_path / "fresh", "fresh")
    a, b = load_features(paths), load_features(fresh)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.teacher_ids, b.teacher_ids)
    torch.testing.assert_close(a.features.float(), b.features.float(), atol=2e-3, rtol=2e-3)


def test_the_batched_linear_is_the_fastest_that_saves_a_tenth(monkeypatch):
    """Each kind must beat the best before it by 10%: timing noise never flips the choice."""
    model = tiny_llama(seed=1)
    assert fastest_batched_linear(model, 8) in ("default", *BATCHED_KINDS)
    timed = {"default": 1.0, "fp32": 0.95, "bf16x3": 0.5, "bf16": 0.46}
    monkeypatch.setattr("core.runtime.cpu_linear.linear_seconds", lambda model, rows, kinds: timed)
    assert fastest_batched_linear(model, 8) == "bf16x3"
    timed.update(bf16=0.3)
    assert fastest_batched_linear(model, 8) == "bf16"
    monkeypatch.setattr("core.runtime.cpu_linear.linear_seconds", lambda model, rows, kinds: {})   # no oneDNN
    assert fastest_batched_linear(model, 8) == "default"
