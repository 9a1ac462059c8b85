"""Head training: on a tiny random Llama that answers its own prompts greedily, a few dozen steps
lower the loss, the saved head loads back and drafts losslessly with accepted length > 1, and an
interrupted run resumed from its checkpoint ends exactly where an uninterrupted one does."""

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from core.config import SamplingConfig, TreeConfig
from core.spec.eagle import EagleDrafter
from core.engine import Engine
from core.train.loop import TrainConfig, conversations, train
from core.train.data import (Batch, DataConfig, TrainDataError, flattest, load_features, sequence_entropies,
                             training_sets, write_shard)
from core.train.losses import (DraftVocab, LossWeights, ahead, column_index, losses as head_losses, new_head,
                               token_loss, ttt_mask, unroll)
from models.head_checkpoint import load_draft_vocab, load_head
from tests.conftest import tiny_llama, tiny_target

CFG = TrainConfig(epochs=8, lr=3e-3, warmup_steps=5, batch_tokens=200, log_every=4, save_every=1000)


def run(engine, prompt, max_new=32):
    steps = list(engine.generate(prompt, SamplingConfig(max_new_tokens=max_new)))
    return [t for s in steps for t in s.new_ids], len(steps)


@pytest.fixture(scope="module")
def model():
    """A tiny Llama with sharp next-token distributions (a random one's are near uniform, which
    leaves the soft token loss nothing to learn below the teacher's entropy of ~ln 256)."""
    model = tiny_llama(seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    return model


@pytest.fixture(scope="module")
def answers(model, tmp_path_factory):
    """24 distill lines: random prompts, the tiny model's own greedy answers."""
    path = tmp_path_factory.mktemp("distill") / "greedy.jsonl"
    gen, engine, lines = torch.Generator().manual_seed(0), Engine(tiny_target(model)), []
    for i in range(24):
        prompt = torch.randint(3, 256, (int(torch.randint(6, 14, (1,), generator=gen)),), generator=gen).tolist()
        lines.append(json.dumps({"prompt": f"prompt {i}", "prompt_ids": prompt, "answer_ids": run(engine, prompt)[0]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def data(answers, tmp_path, **kw):
    return DataConfig(answers=(answers,), val_fraction=0.2, shard_size=8, features_dir=tmp_path / "features", **kw)


def losses(out):
    return [r["loss"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in r]


def checkpoint_head(out):
    return torch.load(out / "checkpoint.pt", weights_only=True)["head"]


@pytest.mark.parametrize("cfg", [CFG, replace(CFG, init_layer=-1),
                                 replace(CFG, kind="eagle3", draft_vocab=160, ttt_steps=3), replace(CFG, amp="bf16")],
                         ids=["eagle1", "init", "eagle3", "bf16"])
def test_training_lowers_the_loss_and_the_head_drafts_losslessly(model, answers, tmp_path, cfg):
    summary = train(tiny_target(model), data(answers, tmp_path), cfg, tmp_path / "head")
    assert summary["amp"] == cfg.amp
    curve = losses(tmp_path / "head")
    assert curve[-1] < 0.7 * curve[0], curve
    assert summary["finished"] and summary["val"]["acc0"] > 0.2 and summary["train_positions"] > 0
    head = load_head(str(tmp_path / "head"), model.config, model.get_input_embeddings(), model.get_output_embeddings())
    prompt = json.loads(answers.read_text().splitlines()[0])["prompt_ids"]
    plain, _ = run(Engine(tiny_target(model)), prompt)
    drafted, rounds = run(Engine(tiny_target(model), EagleDrafter(head, 2, TreeConfig(3, 4, 12))), prompt)
    assert drafted == plain
    assert len(drafted) / rounds > 1.3  # mean accepted length on a training prompt


def test_eagle1_trains_on_the_draft_vocabulary_it_drafts_from(model, answers, tmp_path, monkeypatch):
    """An EAGLE-1 head over a big vocabulary is scored on the frequent answer tokens it will draft
    from (saved beside it), and drafts losslessly from them."""
    monkeypatch.setattr("core.train.losses.EAGLE1_DRAFT_VOCAB", 96)
    summary = train(tiny_target(model), data(answers, tmp_path), CFG, tmp_path / "head")
    assert summary["finished"] and summary["val"]["acc0"] > 0.2
    head = load_head(str(tmp_path / "head"), model.config, model.get_input_embeddings(), model.get_output_embeddings())
    vocab = load_draft_vocab(str(tmp_path / "head"), 256)
    train_convs = [json.loads(line) for line in answers.read_text().splitlines()]
    counted = Counter(t for c in train_convs for t in c["answer_ids"])
    assert len(vocab) == 96 and counted.most_common(1)[0][0] in vocab.tolist()
    prompt = train_convs[0]["prompt_ids"]
    plain, _ = run(Engine(tiny_target(model)), prompt)
    drafted, rounds = run(Engine(tiny_target(model), EagleDrafter(head, 2, TreeConfig(3, 4, 12), vocab)), prompt)
    assert drafted == plain and len(drafted) / rounds > 1.3
    # Warm-started on other answers (a third as many: other frequent tokens), it keeps the vocabulary it learned.
    monkeypatch.setattr("core.train.losses.EAGLE1_DRAFT_VOCAB", 48)
    train(tiny_target(model), data(answers, tmp_path, max_tokens=200), replace(CFG, epochs=1, init_head=str(tmp_path / "head")),
          tmp_path / "warm")
    assert torch.equal(load_draft_vocab(str(tmp_path / "warm"), 256), vocab)
    # --draft-vocab widens it: every token it learned, then the most frequent of its training answers not among them.
    monkeypatch.setattr("core.train.losses.EAGLE1_DRAFT_VOCAB", 96)
    few = data(answers, tmp_path, max_tokens=200)
    wide = train(tiny_target(model), few, replace(CFG, epochs=1, init_head=str(tmp_path / "head"), draft_vocab=120),
                 tmp_path / "wide")
    widened = load_draft_vocab(str(tmp_path / "wide"), 256)
    assert wide["draft_vocab"] == 120 and len(widened) == 120 and set(vocab.tolist()) <= set(widened.tolist())
    # ... and names the rows it drafted from before as its narrow ones (a CPU's).
    assert wide["narrow_vocab"] == 96 and torch.equal(load_draft_vocab(str(tmp_path / "wide"), 256, narrow=True), vocab)
    narrow = load_draft_vocab(str(tmp_path / "warm"), 256, narrow=True)   # 96 rows where 48 is the default: 48 named narrow
    assert len(narrow) == 48 and set(narrow.tolist()) <= set(vocab.tolist())
    added = set(widened.tolist()) - set(vocab.tolist())
    counted = Counter(t for c in conversations(tiny_target(model), few)[0] for t in c.answer_ids)
    left = [counted[t] for t in range(256) if t not in vocab.tolist() and t not in added]
    assert min(counted[t] for t in added) >= max(left) and max(counted[t] for t in added) > 0
    with pytest.raises(ValueError, match="below the 96 tokens"):
        train(tiny_target(model), data(answers, tmp_path, max_tokens=200),
              replace(CFG, epochs=1, init_head=str(tmp_path / "head"), draft_vocab=50), tmp_path / "narrow")
    assert not (tmp_path / "narrow" / "model.safetensors").exists()


def test_draft_vocabulary_scores_only_its_columns(model):
    head = new_head(model, "eagle1", None, None, 0, [])
    ids = torch.tensor([3, 5, 7, 200])
    vocab = DraftVocab(column_index(ids, 256), ids, model.lm_head.weight[ids])
    hidden = torch.randn(6, 64)
    torch.testing.assert_close(vocab.logits(head, hidden), head.draft_logits(hidden)[:, ids])
    assert vocab.to_target(torch.tensor([0, 3]), head).tolist() == [3, 200]
    teacher_ids = torch.tensor([[5, 3], [4, 7], [200, 1], [7, 5], [3, 4], [6, 9]])    # rows 1, 5: argmax outside
    ce, kept, _ = token_loss(head, hidden, teacher_ids, torch.zeros(6, 2), vocab, "ce")
    assert kept.tolist() == [True, False, True, True, True, False]
    z = vocab.logits(head, hidden)
    assert torch.allclose(ce[0], z[0].logsumexp(-1) - 0.5 * (z[0, 1] + z[0, 0]))     # p = (1/2, 1/2) over 5 and 3
    assert torch.allclose(ce[2], z[2].logsumexp(-1) - z[2, 3])                      # 1 is outside: all mass on 200


def test_lk_is_minus_log_acceptance_and_its_greedy_limit_is_the_argmax_ce(model):
    """alpha = sum_v min(p_v, q_v): a teacher on q's own top-4, renormalised, has p_k >= q_k there, so
    alpha is q's mass on those 4; a near one-hot teacher makes lk the greedy (hard-label) loss."""
    head, vocab = new_head(model, "eagle1", None, None, 0, []), DraftVocab(None, None, None)
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    q = head.draft_logits(hidden).float().softmax(-1)                                  # (5, 256)
    top = q.topk(4, dim=-1)
    lk, kept, hit = token_loss(head, hidden, top.indices, top.values.log(), vocab, "lk")
    assert kept.all() and hit.all()
    torch.testing.assert_close(lk, -top.values.sum(-1).log())
    greedy, _, _ = token_loss(head, hidden, top.indices, top.values.log(), vocab, "lk-greedy")
    torch.testing.assert_close(greedy, -top.values[:, 0].log())
    sharp = torch.tensor([[0.0, -80.0, -80.0, -80.0]]).expand(5, 4)
    torch.testing.assert_close(token_loss(head, hidden, top.indices, sharp, vocab, "lk")[0], greedy)
    assert (greedy >= lk).all()                                                       # q(argmax) <= alpha
    with pytest.raises(ValueError, match="objective"):
        token_loss(head, hidden, top.indices, sharp, vocab, "kl2")


def test_replay_weighs_the_rows_the_heads_chain_reaches_and_gets_wrong(model):
    """Step 0: every row is reached, a miss weighs 1 + r. Step 1: only rows whose step-0 draft hit."""
    head, vocab = new_head(model, "eagle1", None, None, 0, []), DraftVocab(None, None, None)
    gen = torch.Generator().manual_seed(4)
    outs = [torch.randn(2, 9, 64, generator=gen) for _ in range(2)]                   # (B, W, H) per step
    tokens = torch.randint(0, 256, (2, 10), generator=gen)
    has = torch.zeros(2, 10, dtype=torch.bool)
    has[:, 3:] = True
    ids = torch.randint(0, 256, (2, 10, 3), generator=gen)
    ids[0, 4:7, 0] = head.draft_logits(outs[0][0, 3:6]).argmax(-1)                    # rows 3-5 hit at step 0
    batch = Batch(tokens, torch.zeros(2, 10, 64), ids, torch.randn(2, 10, 3, generator=gen), has)
    w = LossWeights(0.0, 1.0, 0.5, "ce", replay=2.0)
    total, _ = head_losses(head, outs, batch, w, vocab)
    expected, reached = 0.0, torch.ones(2, 9, dtype=torch.bool)
    for j in range(2):
        rows = ahead(has, 1 + j)                                                       # p = t+1+j is an answer
        ce, kept, hit = token_loss(head, outs[j][rows], ahead(ids, 1 + j)[rows], ahead(batch.teacher_logits, 1 + j)[rows],
                                   vocab, "ce")
        weight = kept * (1 + 2.0 * (reached[rows] & ~hit))
        expected = expected + 0.5 ** j * (ce * weight).sum() / weight.sum()
        if j == 0:
            assert hit.sum() >= 3 and weight.max() == 3.0
        reached = reached & rows
        reached[rows] &= hit
    torch.testing.assert_close(total, expected)
    plain, _ = head_losses(head, outs, batch, replace(w, replay=0.0), vocab)
    assert not torch.isclose(plain, total)


def write_shards(folder: Path, logits: torch.Tensor, split_at: int, lengths=(3, 3, 3), prompts=(1, 1, 1)) -> list[Path]:
    """Three sequences (`lengths` tokens, the first `prompts` of them prompt) with the teacher's `logits`
    (one row per answer position, K), in two shards: sequences [0, split_at) and [split_at, 3)."""
    starts = [sum(n - p for n, p in zip(lengths[:s], prompts[:s])) for s in range(4)]
    paths = []
    for n, seqs in enumerate((range(0, split_at), range(split_at, 3))):
        rows = [r for s in seqs for r in range(starts[s], starts[s + 1])]
        tensors = {"tokens": torch.tensor([10 * s + t for s in seqs for t in range(lengths[s])], dtype=torch.int32),
                   "lengths": torch.tensor([lengths[s] for s in seqs]), "prompt_lens": torch.tensor([prompts[s] for s in seqs]),
                   "features": torch.tensor([[s + t / 10] * 4 for s in seqs for t in range(lengths[s])]).half(),
                   "teacher_ids": torch.arange(len(rows) * 3, dtype=torch.int32).view(-1, 3) + 100 * n,
                   "teacher_logits": logits[rows].half()}
        paths.append(folder / f"{n}.safetensors")
        write_shard(paths[-1], tensors, (29,), "test")
    return paths


@pytest.mark.parametrize("chunk", [1 << 20, 1])
@pytest.mark.parametrize("split_at", [1, 2])
def test_flattest_keeps_the_answers_the_target_is_least_sure_of(chunk, split_at, monkeypatch, tmp_path):
    """Three answers of 2 positions: sharp, uniform and in between; the flattest two are 1 and 2,
    however the entropies are chunked and the sequences sharded."""
    monkeypatch.setattr("core.train.data.ENTROPY_ROWS", chunk)
    logits = torch.tensor([[9.0, 0, 0], [9, 0, 0], [0, 0, 0], [0, 0, 0], [1, 0, 0], [2, 0, 0]])
    entropy = sequence_entropies(write_shards(tmp_path, logits, split_at))
    assert flattest(entropy, 2 / 3) == [1, 2] and flattest(entropy, 1 / 3) == [1] and flattest(entropy, 1.0) == [0, 1, 2]


def test_training_sets_hold_only_the_flattest_training_sequences(tmp_path):
    """What both trainers (EAGLE, Medusa) load with --flattest: the train set cut, the val set whole."""
    logits = torch.tensor([[9.0, 0, 0], [9, 0, 0], [0, 0, 0], [0, 0, 0], [1, 0, 0], [2, 0, 0]])
    paths = write_shards(tmp_path, logits, split_at=1)
    (train, val), whole = training_sets(paths, paths, 2 / 3), load_features(paths)
    assert len(val) == 3 and torch.equal(train.tokens, whole.tokens[3:])   # sequences 1 and 2
    assert training_sets(paths, paths, None)[0].answer_tokens == 6


@pytest.mark.parametrize("keep", [[0, 2], [1], [2], [1, 2], [0, 1, 2]])
def test_load_features_of_kept_sequences_equals_the_whole_set_cut(keep, tmp_path):
    """Sequences of 3, 2 and 4 tokens, the second all prompt (no answer position); a shard may keep none."""
    paths = write_shards(tmp_path, torch.randn(5, 3), split_at=2, lengths=(3, 2, 4), prompts=(1, 2, 1))
    whole, part = load_features(paths), load_features(paths, keep)
    tokens = torch.cat([torch.arange(whole.starts[s], whole.starts[s + 1]) for s in keep])
    teacher = torch.cat([torch.arange(whole.tstarts[s], whole.tstarts[s + 1]) for s in keep])
    assert torch.equal(part.tokens, whole.tokens[tokens]) and torch.equal(part.features, whole.features[tokens])
    assert torch.equal(part.teacher_ids, whole.teacher_ids[teacher])
    assert torch.equal(part.teacher_logits, whole.teacher_logits[teacher])
    assert torch.equal(part.prompt_lens, whole.prompt_lens[keep]) and torch.equal(part.lengths, whole.lengths[keep])
    assert torch.equal(part.tstarts[-1], torch.tensor(len(teacher)))


@pytest.mark.parametrize("keep", [[], [2, 1], [1, 1], [3], [-1, 0]])
def test_load_features_refuses_a_selection_it_would_not_load_as_asked(keep, tmp_path):
    with pytest.raises(TrainDataError, match="sorted, unique"):
        load_features(write_shards(tmp_path, torch.randn(6, 3), split_at=1), keep)


def test_resume_continues_exactly(model, answers, tmp_path):
    cfg = replace(CFG, epochs=2, save_every=3)
    whole_run = train(tiny_target(model), data(answers, tmp_path), cfg, tmp_path / "whole")
    stopped = train(tiny_target(model), data(answers, tmp_path), replace(cfg, stop_at_step=5), tmp_path / "part")
    assert not stopped["finished"] and stopped["steps"] == 5
    with pytest.raises(Exception, match="--resume"):
        train(tiny_target(model), data(answers, tmp_path), cfg, tmp_path / "part")
    with pytest.raises(Exception, match="lr"):
        train(tiny_target(model), data(answers, tmp_path), replace(cfg, lr=1e-3), tmp_path / "part", resume=True)
    resumed = train(tiny_target(model), data(answers, tmp_path), cfg, tmp_path / "part", resume=True)
    assert resumed["finished"] and resumed["steps"] > 5
    whole, part = checkpoint_head(tmp_path / "whole"), checkpoint_head(tmp_path / "part")
    assert all(torch.equal(whole[k], part[k]) for k in whole)
    assert resumed["val"] == whole_run["val"]


def test_warm_start_continues_from_a_trained_head(model, answers, tmp_path):
    short = replace(CFG, epochs=2)
    first = train(tiny_target(model), data(answers, tmp_path), short, tmp_path / "first")
    warm = train(tiny_target(model), data(answers, tmp_path), replace(short, init_head=str(tmp_path / "first")),
                 tmp_path / "warm")
    cold_start, warm_start = losses(tmp_path / "first")[0], losses(tmp_path / "warm")[0]
    assert warm_start < 0.8 * cold_start  # it starts where the first run ended, not from random weights
    assert warm["val"]["loss"] <= first["val"]["loss"] * 1.05
    with pytest.raises(Exception, match="another shape"):
        train(tiny_target(model), data(answers, tmp_path),
              replace(short, kind="eagle3", draft_vocab=160, init_head=str(tmp_path / "first")), tmp_path / "bad")


def test_fc_norm_head_warm_starts_from_one_without_and_drafts_losslessly(model, answers, tmp_path):
    """EAGLE-3.1's fc_norm on an EAGLE-1 head: warm-started from a head without it, the gains start at
    the inputs' RMS (its first loss near where that head ended), it saves its fc_norm.{0,1} keys,
    loads back as such and drafts exactly the target's greedy text; a head with it cannot seed one without."""
    short = replace(CFG, epochs=2)
    train(tiny_target(model), data(answers, tmp_path), short, tmp_path / "plain")
    normed = replace(short, fc_norm=True, init_head=str(tmp_path / "plain"))
    train(tiny_target(model), data(answers, tmp_path), normed, tmp_path / "normed")
    assert losses(tmp_path / "normed")[0] < 0.8 * losses(tmp_path / "plain")[0]
    head = load_head(str(tmp_path / "normed"), model.config, model.get_input_embeddings(), model.get_output_embeddings())
    assert head.config.fc_norm and {"fc_norm.0.weight", "fc_norm.1.weight"} <= set(head.state_dict())
    prompt = json.loads(answers.read_text().splitlines()[0])["prompt_ids"]
    plain, _ = run(Engine(tiny_target(model)), prompt)
    drafted, _ = run(Engine(tiny_target(model), EagleDrafter(head, 2, TreeConfig(2, 2, 6))), prompt)
    assert drafted == plain
    with pytest.raises(Exception, match="another shape"):
        train(tiny_target(model), data(answers, tmp_path), replace(short, init_head=str(tmp_path / "normed")), tmp_path / "bad")


def test_features_are_reused_and_match_the_engine(model, answers, tmp_path):
    from core.train.data import capture, load_conversations, load_features

    cfg = data(answers, tmp_path)
    convs, _ = load_conversations(cfg, 256, 512)
    paths, first = capture(tiny_target(model), convs[:10], (2,), cfg, tmp_path / "f", "t")
    again, second = capture(tiny_target(model), convs[:10], (2,), cfg, tmp_path / "f", "t")
    assert paths == again and first["captured_shards"] == 2 and second["captured_shards"] == 0
    fs = load_features(paths)
    ids = torch.tensor([convs[3].ids])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    a, z = int(fs.starts[3]), int(fs.starts[4])
    torch.testing.assert_close(fs.features[a:z].float(), out.hidden_states[2][0], atol=2e-3, rtol=2e-3)
    P = len(convs[3].prompt_ids)
    teacher = fs.teacher_ids[int(fs.tstarts[3]): int(fs.tstarts[4]), 0]
    assert teacher.tolist() == out.logits[0, P:].argmax(-1).tolist()  # greedy answers: argmax = next token
    assert teacher[:-1].tolist() == list(convs[3].answer_ids[1:])


@pytest.mark.skipif(not hasattr(torch.ops.mkldnn, "_linear_pointwise"), reason="this torch has no oneDNN linear")
def test_capture_on_onednn_matmuls_is_its_own_signature_and_leaves_the_model_as_it_was(model, answers, tmp_path):
    """A capture on oneDNN fp32 matmuls writes shards apart from torch's (another digest and
    signature: an earlier capture's numbers are not mixed in), close to them, and leaves the target's
    nn.Linears in place for training."""
    from core.train.data import capture, load_conversations, load_features

    convs, _ = load_conversations(data(answers, tmp_path), 256, 512)
    target = tiny_target(model)
    default, _ = capture(target, convs[:10], (2,), data(answers, tmp_path), tmp_path / "f", "t")
    onednn, stats = capture(target, convs[:10], (2,), data(answers, tmp_path, linear="fp32"), tmp_path / "f", "t")
    assert stats["captured_shards"] == 2 and stats["reused"] == 0 and set(default).isdisjoint(onednn)
    assert isinstance(model.lm_head, torch.nn.Linear) and isinstance(model.model.layers[0].mlp.up_proj, torch.nn.Linear)
    a, b = load_features(default), load_features(onednn)
    torch.testing.assert_close(b.features.float(), a.features.float(), atol=2e-3, rtol=2e-3)
    assert torch.equal(a.teacher_ids[:, 0], b.teacher_ids[:, 0])


def test_benchmark_prompts_are_dropped_and_bad_input_is_refused(answers, tmp_path):
    from core.train.data import load_conversations

    convs, dropped = load_conversations(data(answers, tmp_path, exclude_prompts=("prompt 1", "prompt 2")), 256, 512)
    assert dropped == 2 and len(convs) == 22
    with pytest.raises(TrainDataError, match="vocabulary"):
        load_conversations(data(answers, tmp_path), 100, 512)
    with pytest.raises(ValueError, match="positive"):
        TrainConfig(kind="eagle1", draft_vocab=0)


def test_ttt_mask_sees_the_committed_prefix_and_its_own_ancestors():
    allowed = ttt_mask(3, 2, "cpu")[0, 0] == 0
    assert allowed.tolist() == [[1, 0, 0, 1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 1, 0, 0, 1]]


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_unroll_step_j_is_the_drafters_depth_j(model, kind):
    """Row t of unroll step j == the EagleDrafter's output for the chain x_{t+2..t+1+j} from start t."""
    head = new_head(model, kind, None, None, 0, [])
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i] for i in head.feature_layers(2)], dim=-1)     # (1, 20, F)
        zeros = torch.zeros(1, 20, 1)
        outs = unroll(head, Batch(ids, features, zeros.long(), zeros, zeros.bool()), 3, 0.0, None)
        t, drafter = 9, EagleDrafter(head, 2, TreeConfig(2, 1, 4))
        out = drafter.catch_up(features[0, : t + 1], ids[0, 1: t + 2].tolist())[0][None]   # pairs (f_s, x_{s+1}), s <= t
        torch.testing.assert_close(out[0], outs[0][0, t])
        for j in (1, 2):
            out, _ = drafter.feed_frontier(ids[0, t + 1 + j: t + 2 + j], out, torch.ones(1, j, dtype=torch.bool), j - 1)
            torch.testing.assert_close(out[0], outs[j][0, t])


def test_a_wide_draft_vocabulary_names_the_rows_a_cpu_drafts_from(monkeypatch):
    """narrow_vocab: a warm start's narrow rows where they are few enough, else the most frequent
    answer tokens among the vocabulary's own; none where they would be all of it."""
    from core.train.losses import narrow_vocab

    monkeypatch.setattr("core.train.losses.EAGLE1_DRAFT_VOCAB", 2)
    ids, answers = torch.tensor([1, 3, 5, 7]), [(7, 7, 5, 9, 9, 9), (5, 7, 1)]
    assert narrow_vocab(ids, torch.tensor([1, 3]), answers, 10).tolist() == [1, 3]
    assert sorted(narrow_vocab(ids, None, answers, 10).tolist()) == [5, 7]     # 9 is frequent but not drafted from
    assert sorted(narrow_vocab(ids, ids[:3], answers, 10).tolist()) == [5, 7]  # a warm start's 3 rows: too many
    assert narrow_vocab(torch.tensor([5, 7]), None, answers, 10) is None and narrow_vocab(None, None, answers, 10) is None
