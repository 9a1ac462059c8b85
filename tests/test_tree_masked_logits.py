"""DESIGN invariant 2: tree-masked target logits equal sequential-decoding logits along every path.

A tiny random Llama runs through transformers' public interface only: a prefill into a
preallocated cache (core/runtime/kv.py), then ONE forward over a tree's tokens with the 4D mask
`additive_mask` builds from its ancestor mask and position ids past_len + depth. The reference
decodes each root-to-leaf path token by token from a fresh prefill in a plain `DynamicCache`. Then
the commit invariant: after `keep_rows(cache, past_len, acceptance.nodes)` the cache continues
exactly like a fresh prefill of the prompt plus the accepted tokens. Both of transformers'
attention backends (sdpa, eager) are checked; they read the whole buffer, so masks span it.
"""

from collections.abc import Iterator

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicCache

from transformers.cache_utils import Cache

from core.runtime.kv import keep_rows, static_cache
from core.runtime.kv import additive_mask
from core.spec.tree import DraftTree, chain_tree, make_tree, root_only
from core.spec.verify import Acceptance, accept_greedy

VOCAB = 256
ATOL = 1e-4
CAPACITY = 64  # cache rows: the longest prompt (37) plus the largest tree (16) and one more token


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request) -> Iterator[LlamaForCausalLM]:
    # One thread: this model's matmuls are tiny, and on a shared 2-core machine a second thread
    # makes them ~10x slower through contention. Restored afterwards.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )
    model = LlamaForCausalLM(config).eval().float()
    model.set_attn_implementation(request.param)
    yield model
    torch.set_num_threads(threads)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _shapes(seed: int) -> dict[str, DraftTree]:
    gen = torch.Generator().manual_seed(seed)
    random_parents = [-1] + [int(torch.randint(i, (1,), generator=gen)) for i in range(1, 16)]
    return {
        "root_only": root_only(_tokens(1, seed)[0]),
        "chain": chain_tree(*_tokens(1, seed), _tokens(5, seed + 1)),
        "wide": make_tree(_tokens(9, seed), [-1] + [0] * 8),
        "mixed": make_tree(_tokens(7, seed), [-1, 0, 0, 1, 1, 2, 3]),
        "random16": make_tree(_tokens(16, seed), random_parents),
    }


@torch.no_grad()
def _feed(model: LlamaForCausalLM, cache: Cache, tokens: torch.Tensor, visible: torch.Tensor, past_len: int,
          depth: torch.Tensor) -> torch.Tensor:
    """tokens (T,) at positions past_len + depth, each seeing the prefix and its `visible` (T, T) -> (T, V)."""
    out = model(input_ids=tokens[None], attention_mask=additive_mask(visible, past_len, torch.float32, width=CAPACITY),
                position_ids=(past_len + depth)[None], cache=cache, use_cache=True)
    return out.logits[0]


def _prefill(model: LlamaForCausalLM, prompt: list[int]) -> Cache:
    c = model.config
    cache = static_cache(c.num_hidden_layers, CAPACITY, c.num_key_value_heads, c.hidden_size // c.num_attention_heads,
                         torch.float32, torch.device("cpu"))
    n = len(prompt)
    _feed(model, cache, torch.tensor(prompt), torch.ones(n, n, dtype=torch.bool).tril(), 0, torch.arange(n))
    return cache


def _verify(model: LlamaForCausalLM, cache: Cache, tree: DraftTree, past_len: int) -> torch.Tensor:
    """One target forward over the whole tree -> (N, V) logits."""
    return _feed(model, cache, tree.tokens, tree.ancestor_mask, past_len, tree.depth)


@torch.no_grad()
def _sequential(model: LlamaForCausalLM, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Plain decoding: prefill the prompt, then feed tokens one at a time -> (len(tokens), V)."""
    cache = DynamicCache()
    model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
    return torch.cat([model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True).logits[0] for t in tokens])


@torch.no_grad()
def _fresh_next_logits(model: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([tokens])).logits[0, -1]


@pytest.mark.parametrize("prompt_len", [1, 37])
@pytest.mark.parametrize("shape", ["root_only", "chain", "wide", "mixed", "random16"])
def test_tree_logits_equal_sequential_logits_on_every_path(model, prompt_len, shape):
    prompt, tree = _tokens(prompt_len, 7), _shapes(11)[shape]
    cache = _prefill(model, prompt)
    tree_logits = _verify(model, cache, tree, prompt_len)
    assert tree_logits.shape == (tree.size, VOCAB) and cache.get_seq_length() == prompt_len + tree.size
    for row in tree.paths.tolist():
        path = [node for node in row if node >= 0]
        expected = _sequential(model, prompt, tree.tokens[path].tolist())
        torch.testing.assert_close(tree_logits[path], expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("prompt_len", [1, 37])
@pytest.mark.parametrize("shape", ["chain", "wide", "mixed", "random16"])
def test_keep_commits_a_path_like_a_fresh_prefill(model, prompt_len, shape):
    prompt, tree = _tokens(prompt_len, 3), _shapes(5)[shape]
    for row in tree.paths.tolist():
        path = [node for node in row if node >= 0]
        cache = _prefill(model, prompt)
        _verify(model, cache, tree, prompt_len)
        keep_rows(cache, prompt_len, torch.tensor(path))
        assert cache.get_seq_length() == prompt_len + len(path)
        committed = prompt + tree.tokens[path].tolist()
        nxt = _tokens(1, len(path))[0]
        got = _feed(model, cache, torch.tensor([nxt]), torch.ones(1, 1, dtype=torch.bool), len(committed), torch.zeros(1, dtype=torch.long))[-1]
        torch.testing.assert_close(got, _fresh_next_logits(model, committed + [nxt]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("prompt_len", [1, 37])
def test_greedy_round_accepts_the_target_chain_and_commits_it(model, prompt_len):
    """A tree whose main branch is the target's own greedy continuation: verify, accept, keep, go on."""
    prompt = _tokens(prompt_len, 21)
    root, greedy = _tokens(1, 22)[0], []
    for _ in range(4):  # the target's greedy continuation of prompt + root
        greedy.append(int(_sequential(model, prompt, [root, *greedy])[-1].argmax()))
    decoys = [(t + 1) % VOCAB for t in greedy]
    # 0 -> 1 -> 3 -> 5 -> 7 is the greedy chain; 2, 4, 6 are wrong siblings, 8 hangs off a decoy
    tree = make_tree([root, greedy[0], decoys[0], greedy[1], decoys[1], greedy[2], decoys[2], greedy[3], 9],
                     [-1, 0, 0, 1, 1, 3, 3, 5, 2])
    cache = _prefill(model, prompt)
    acc: Acceptance = accept_greedy(tree, _verify(model, cache, tree, prompt_len))
    assert acc.nodes.tolist() == [0, 1, 3, 5, 7] and acc.new_tokens[:-1] == greedy
    keep_rows(cache, prompt_len, acc.nodes)
    bonus = acc.new_tokens[-1]
    assert bonus == int(_fresh_next_logits(model, prompt + [root, *greedy]).argmax())
    got = _feed(model, cache, torch.tensor([bonus]), torch.ones(1, 1, dtype=torch.bool), prompt_len + len(acc.nodes),
                torch.zeros(1, dtype=torch.long))[-1]
    torch.testing.assert_close(got, _fresh_next_logits(model, prompt + [root, *greedy, bonus]), atol=ATOL, rtol=0)
