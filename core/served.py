"""`launch.py bench --serve`: the bench's prompts through a live Aerie server's OpenAI API, so the
gap between the engine's speed and a served answer's is measured on every bench run.

Each answer is asked for greedily with the bench's token budget and streamed, as a client reads
it; its speed is wall clock, from sending the request to the stream's end, against the server's
own count of the tokens. The bench's `eagle` is the tuner's shape, so the served one is left to
the server's tuner; plain and prompt lookup are asked for by name (Aerie's "aerie" request field,
app/api_request.py). Answers must be the bench's text: the same greedy decoding, served.
"""

import json
import queue
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

from core.errors import AerieError
from core.config import TUNED

# bench strategy -> the "aerie.strategy" to ask for; None: the server's tuner chooses
SERVED = {"plain": "plain", "prompt_lookup": "prompt_lookup", "eagle": None}
READY = "Aerie: ready at "  # launch.py's line once it serves


@dataclass(frozen=True)
class ServedAnswer:
    text: str
    tokens: int          # the server's usage.completion_tokens
    seconds: float       # wall clock: request sent to the stream's [DONE]
    server_s: float      # the server's own time for the answer (aerie.elapsed_s: prompt to last token)
    strategy: str        # the drafter the server decoded with
    speedup: float | None  # the speedup over plain the page shows for it (aerie.speedup, ReplyStats.speedup)
    tuning: str = ""       # the tuner's choice for it and why (aerie.tuning)


@dataclass
class ServedTally:
    """One strategy's served answers, summed."""
    tokens: int = 0
    seconds: float = 0.0
    server_s: float = 0.0
    answers: int = 0
    same_text: int = 0   # answers whose text is the bench's for the same prompt
    strategies: Counter = field(default_factory=Counter)
    shown: list[float] = field(default_factory=list)  # each answer's shown speedup, where it had one
    ab: list[tuple[float, float]] = field(default_factory=list)  # the page's A/B: (measured, shown) per answer
    ab_identical: int = 0                                         # A/Bs whose plain text was the answer's

    def add(self, answer: ServedAnswer, same: bool) -> None:
        self.tokens, self.seconds = self.tokens + answer.tokens, self.seconds + answer.seconds
        self.server_s, self.answers = self.server_s + answer.server_s, self.answers + 1
        self.same_text += int(same)
        self.strategies[answer.strategy] += 1
        self.shown += [answer.speedup] if answer.speedup is not None else []

    def add_ab(self, measured: float | None, shown: float | None, identical: bool | None) -> None:
        """The page's A/B of the answer just added, against the speedup the page showed for it."""
        if measured is not None and shown is not None:
            self.ab.append((measured, shown))
        self.ab_identical += int(bool(identical))

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def ab_entry(self) -> dict | None:
        """Issue 17 pt 4's check: the mean speedup the page's A/B measured (tokens per second after
        the first token, plain decoding run right after) against the mean it showed, same answers."""
        if not self.ab:
            return None
        measured, shown = (sum(x) / len(self.ab) for x in zip(*self.ab))
        return {"measured": round(measured, 3), "shown": round(shown, 3), "shown_over_measured": round(shown / measured, 3),
                "answers": len(self.ab), "identical_text": f"{self.ab_identical}/{self.answers}"}

    def entry(self, bench_tok_s: float) -> dict:
        """The JSON line's `served`: wall-clock tok/s and its ratio to the bench's; the server's
        own tok/s tells time inside the service from time in the stream and the client. The mean
        speedup the page showed is to be held against the bench's measured speedup_vs_plain."""
        return {"tok_s": round(self.tok_s, 2), "vs_bench": round(self.tok_s / bench_tok_s, 3) if bench_tok_s else None,
                "server_tok_s": round(self.tokens / self.server_s, 2) if self.server_s > 0 else None,
                "same_text": f"{self.same_text}/{self.answers}", "strategies_used": dict(self.strategies),
                "shown_speedup": round(sum(self.shown) / len(self.shown), 3) if self.shown else None,
                **({"ab": self.ab_entry()} if self.ab else {})}


class ServedClient:
    """Asks a running Aerie server at `base_url` (http://host:port) for answers."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 600.0):
        self.url, self.api_key, self.timeout_s = base_url.rstrip("/") + "/v1/chat/completions", api_key, timeout_s

    def answer(self, text: str, max_new: int, strategy: str | None) -> ServedAnswer:
        return self._ask([{"role": "user", "content": text}], max_new, strategy)

    def evict(self) -> None:
        """Leave another prompt in the server's cache: it reuses the longest cached prefix of a
        prompt, so an answer asked again would skip the prefill the bench's own runs pay (plain's
        served answer paid it, eagle's after it did not: ~0.1 s of a 0.8 s answer, 2-core Zen 4)."""
        self._ask([{"role": "system", "content": "-"}, {"role": "user", "content": "-"}], 1, "plain")

    def _ask(self, messages: list[dict], max_new: int, strategy: str | None) -> ServedAnswer:
        body = {"model": "aerie", "messages": messages, "temperature": 0,
                "max_tokens": max_new, "stream": True, "stream_options": {"include_usage": True},
                **({"aerie": {"strategy": strategy}} if strategy else {})}
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})}
        request = urllib.request.Request(self.url, json.dumps(body).encode(), headers)
        pieces, usage, stats = [], None, None
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                for event in sse_events(response):
                    if "error" in event:
                        raise AerieError(f"The server at {self.url} failed mid-answer: {event['error']['message']}")
                    pieces += [c["delta"].get("content") or "" for c in event["choices"]]
                    usage, stats = event.get("usage") or usage, event.get("aerie") or stats
        except urllib.error.HTTPError as e:
            raise AerieError(f"The server at {self.url} answered {e.code}: {e.read().decode(errors='replace')}") from e
        seconds = time.perf_counter() - t0
        if usage is None or stats is None:
            raise AerieError(f"The server at {self.url} ended a stream without its usage or statistics.")
        return ServedAnswer("".join(pieces), usage["completion_tokens"], seconds, stats["elapsed_s"], stats["strategy"],
                            stats["speedup"], stats["tuning"])


def sse_events(lines):
    """The JSON data of each server-sent event until [DONE]."""
    for raw in lines:
        line = raw.decode().strip()
        if line == "data: [DONE]":
            return
        if line.startswith("data: "):
            yield json.loads(line[len("data: "):])


class Server:
    """A `launch.py --no-browser` subprocess, from its start until it prints READY and TUNED (its
    graphs compiled, its tuner planning: what the bench measures); then its output is drained
    (kept for an error message) so a full pipe never stalls it."""

    def __init__(self, command: list[str], timeout_s: float = 900.0, echo=print):
        self.process = subprocess.Popen(command, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: queue.SimpleQueue = queue.SimpleQueue()
        self.tail: list[str] = []
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.process.stdout], daemon=True).start()
        self.url = self._wait(timeout_s, echo)

    def _wait(self, timeout_s: float, echo) -> str:
        deadline, url = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                continue
            self.tail = (self.tail + [line])[-40:]
            echo(f"  server: {line.rstrip()}")
            if line.startswith(READY):
                url = line[len(READY):].split()[0]
            if line.startswith(TUNED):
                return url
        self.stop()
        raise AerieError("The Aerie server did not start:\n" + "".join(self.tail))

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
