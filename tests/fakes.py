"""Stand-ins the tests share: a scripted chat service (for the page and the API), a fake NVML, a
drafter that knows the answer, and a few constants. Fixtures live in conftest.py."""

import random
import time
from types import SimpleNamespace

from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.api import api_routes
from core.config import ReplyEvent, ReplyStats, SamplingConfig
from core.text import coalesced
from core.spec.drafters import trie_tree
from core.spec.tree import Draft
from core.tune.budget import GIB

MULTIBYTE = "Grüße aus Köln! 東京タワー 🚀🦅 naïve café — ½ × π ≈ 1.57"

SETTINGS = ("You are kind.", 0.0, 1.0, 0, -1, 64, "")  # system prompt, temperature, top_p, top_k, seed, max new, stops


class FakeService:
    """Streams `words` one event each, checking the cancel flag between steps like the engine."""

    def __init__(self, words=("Hello", " there", ",", " friend", "."), fail_at=None, error=None,
                 delay=0.0, notice=None):
        self.words, self.fail_at, self.error, self.delay, self.notice = words, fail_at, error, delay, notice
        self.label = "Fake-1B · cpu · fp32 · plain decoding"
        self.default_system_prompt = "You are kind."
        self.drafters = ("plain", "prompt_lookup", "eagle")
        self.calls = []
        self.finish = None

    def pin(self, strategy):
        self.pinned = strategy
        return f"{strategy or 'the tuner'} decides"

    def reply(self, messages, system_prompt, sampling, stop_strings, cancel, strategy=None, every_s=0.0):
        """As the service streams: its events merged into at most one per every_s."""
        return coalesced(self.events(messages, system_prompt, sampling, stop_strings, cancel, strategy), every_s)

    def events(self, messages, system_prompt, sampling, stop_strings, cancel, strategy):
        self.calls.append(SimpleNamespace(messages=messages, system_prompt=system_prompt, sampling=sampling,
                                          stop_strings=stop_strings, cancel=cancel, strategy=strategy))
        for i, word in enumerate(self.words):
            if i == self.fail_at:
                raise self.error
            if cancel.is_set():
                self.finish = "cancelled"
                yield ReplyEvent("", self._stats(i), finish="cancelled")
                return
            time.sleep(self.delay)
            yield ReplyEvent(word, self._stats(i + 1), notice=self.notice if i == 0 else None)
        self.finish = "eos"
        yield ReplyEvent("", self._stats(len(self.words)), finish="eos")

    @staticmethod
    def _stats(n):
        return ReplyStats(new_tokens=n, elapsed_s=0.5 * max(n, 1), target_steps=n, drafted=2 * n,
                          accepted=n, strategy="eagle", prefill_s=0.5)   # a token each 0.5 s, the first with the prefill


def session(name="s1"):
    return SimpleNamespace(session_hash=name)


USER = [{"role": "user", "content": "Hi"}]
KEY = "sk-aerie-test"


class ApiFake(FakeService):
    model_name = "fake-1b"


def client(service=None, api_key=None, defaults=SamplingConfig()) -> TestClient:
    return TestClient(FastAPI(routes=api_routes(service or ApiFake(), api_key, defaults)))


class FakeNvml:
    """pynvml's surface as Aerie uses it, for cards of the given sizes (GiB) with `used` GiB taken."""

    class NVMLError(Exception):
        pass

    def __init__(self, cards, used=0.5, fail_init=False):
        self.cards, self.used, self.fail_init = cards, used, fail_init

    def nvmlInit(self):
        if self.fail_init:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlDeviceGetCount(self):
        return len(self.cards)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetMemoryInfo(self, i):
        total, used = int(self.cards[i] * GIB), int(self.used * GIB)
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetName(self, i):
        return f"Fake {self.cards[i]} GB".encode()


class OracleDrafter:
    """Random trees that sometimes contain the true greedy continuation (from a plain run), so
    rounds accept anything from nothing to a whole deep path."""

    name = "oracle"
    feature_layers = None

    def __init__(self, truth: list[int], seed: int, vocab: int = 256):
        self.truth, self.rng, self.vocab = truth, random.Random(seed), vocab

    def rewind(self, common: int) -> int:
        return common

    def memory_bytes(self, borrowed: set[int]) -> int:
        return 0

    def prime(self, context: list[int], fresh):
        return fresh

    def draft(self, context, fresh):
        branches = []
        for _ in range(self.rng.randint(0, 4)):
            depth = self.rng.randint(1, 6)
            pos = len(context)
            good = self.truth[pos:pos + depth] if self.rng.random() < 0.6 else []
            keep = self.rng.randint(0, len(good))
            branch = good[:keep] + [self.rng.randrange(self.vocab) for _ in range(depth - keep)]
            branches.append(branch)
        return Draft(trie_tree(context[-1], branches))


def run(engine, prompt, sampling) -> list[int]:
    """The tokens `engine` generates for `prompt`."""
    return [t for s in engine.generate(prompt, sampling) for t in s.new_ids]
