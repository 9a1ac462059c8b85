"""Shared fixtures: tiny random Llama targets built in the test, and the real embedded model."""

import os
import queue
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import gradio as gr
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from core.config import TUNED
from core.service.worker import Worker
from models.cpu_quant import onednn_runs
from models.embedded import embedded_model_dir
from models.head_config import head_config_for_target
from models.heads import build_head
from models.target import LoadSpec, Target, load_target
from tests.fakes import KEY

ROOT = Path(__file__).resolve().parent.parent
ROOT_ASSETS = ROOT / "assets"

# oneDNN refuses bf16 GEMMs on a CPU without AVX512-BF16-class hardware (AVX2 alone)
needs_onednn_bf16 = pytest.mark.skipif(not onednn_runs("bf16"), reason="oneDNN runs no bf16 GEMM on this CPU")


def tiny_llama(vocab_size: int = 256, seed: int = 0, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def tiny_target(model=None, tokenizer=None, eos_ids=(), context_len: int = 512) -> Target:
    model = model if model is not None else tiny_llama()
    return Target(model=model, tokenizer=tokenizer, name="tiny-llama", device=torch.device("cpu"), quant="none",
                  dtype=torch.float32, context_len=context_len, eos_ids=tuple(eos_ids))


def one_token_at_a_time(runner, ids: list[int]) -> torch.Tensor:
    """The logits (T, V) of `ids` verified and committed one at a time after the cached tokens."""
    rows = []
    for t in ids:
        rows.append(runner.verify(torch.tensor([t]), torch.zeros(1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool)).logits)
        runner.commit(torch.tensor([0]), [t])
    return torch.cat(rows)


def chain_at_once(runner, ids: list[int], past: int) -> torch.Tensor:
    """The logits (T, V) of `ids` verified as one chain-shaped tree after the first `past` cached tokens."""
    runner.truncate(past)
    n = len(ids)
    return runner.verify(torch.tensor(ids), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril()).logits


def random_head(model, kind: str, seed: int, draft_vocab: int | None = None):
    torch.manual_seed(seed)
    config = head_config_for_target(model.config, kind, draft_vocab_size=draft_vocab)
    head = build_head(config, model.get_input_embeddings(), model.get_output_embeddings()).eval()
    if kind == "eagle3" and draft_vocab:
        head.d2t.copy_(torch.randperm(model.config.vocab_size)[:draft_vocab].sort().values - torch.arange(draft_vocab))
    return head


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("aerie-cache")


@pytest.fixture(scope="session")
def embedded_dir(cache_dir) -> Path:
    """The embedded GGUF converted once per test session (about 20 s)."""
    return embedded_model_dir(cache_dir)


@pytest.fixture(scope="session")
def embedded_target(embedded_dir, cache_dir) -> Target:
    return load_target(LoadSpec(model=None, quant="none", device="cpu", cache_dir=cache_dir))


@pytest.fixture(scope="session")
def tokenizer(embedded_target):
    return embedded_target.tokenizer


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tokenizer) -> Path:
    """A tiny random Llama saved as a Hugging Face folder, with the embedded tokenizer."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    out = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def load_tuned_tiny(tiny_dir: Path, cache_dir: Path):
    """The tiny model with a random EAGLE head, pinned to EAGLE, tuned as the app does. Give each
    module its own cache folder: a profile saved by another module would be reused."""
    from core.service.factory import load_tuned
    from core.service.spec import EngineSpec

    return load_tuned(EngineSpec(model=str(tiny_dir), quant="none", device="cpu", cache_dir=cache_dir, compile=False,
                                 head="random", strategy="eagle"))


def guard_checked(graph):
    """graph.direct, asserting on every call that the cache entry dynamo would run for these
    arguments (the first whose guards pass) is the one the graph bound on its first call. Counts
    its calls (`.calls`)."""
    from core.runtime.graphs import compiled_code
    bound = graph.direct

    def call(*args):
        assert compiled_code(graph.fn, args).func.__code__ is bound.func.__code__, "dynamo would run other code"
        call.calls += 1
        return bound(*args)
    call.calls = 0
    return call


FIRST_STARTS: list[subprocess.Popen] = []   # the session's real first start (`first_start`), once started


def compiling_beside() -> bool:
    """Whether the first start's child is compiling now (its server has not printed TUNED yet)."""
    return any(proc.poll() is None and not proc.tuned.is_set() for proc in FIRST_STARTS)


def start_aerie(cache_dir: Path, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`launch.py --no-browser` in a subprocess; -> (process, base URL) once it says it is ready.
    Its later lines: `wait_for(proc, prefix)`; `proc.tuned` is set once it printed TUNED. It starts
    once the first start's child has compiled (tests that start one are marked `late`, so that is
    rarely a wait): on two threads, as the first start timed this CPU's kernels and stored them
    under a key that counts threads; a server on one thread beside the compile timed them all
    again, on one core (a minute of the suite)."""
    deadline = time.monotonic() + 600
    for proc in FIRST_STARTS:   # its event, not its line: first_start_tuned reads that
        while proc.poll() is None and not proc.tuned.wait(1) and time.monotonic() < deadline:
            pass
    env = dict(os.environ if env is None else env)
    proc = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "--no-browser", "--port", str(free_port()),
                             "--cache-dir", str(cache_dir), *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    proc.lines, proc.tuned = queue.Queue(), threading.Event()

    def read() -> None:
        for line in proc.stdout:
            if line.startswith(TUNED):
                proc.tuned.set()
            proc.lines.put(line)
    threading.Thread(target=read, daemon=True).start()
    return proc, wait_for(proc, "Aerie: ready at ").split()[3]


def wait_for(proc: subprocess.Popen, prefix: str, timeout_s: float = 600) -> str:
    """The next line of `start_aerie`'s process that starts with `prefix`."""
    deadline, seen = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            line = proc.lines.get(timeout=1)
        except queue.Empty:
            continue
        seen.append(line)
        if line.startswith(prefix):
            return line
    proc.kill()
    raise AssertionError(f"Aerie never printed {prefix!r}:\n" + "".join(seen[-40:]))


def pytest_collection_modifyitems(items):
    """The first start's graphs compile in a niced child for minutes (one core) while its test
    would only wait: its opening test runs first and the tests that need its graphs last, so the
    rest of the suite runs meanwhile."""
    def end(item) -> str | None:
        marker = item.get_closest_marker("first_start")
        return marker.args[0] if marker else None
    def late(item) -> bool:
        return item.get_closest_marker("late") is not None
    items[:] = ([i for i in items if end(i) == "open"]
                + [i for i in items if end(i) not in ("open", "close") and not late(i)]
                + [i for i in items if late(i)] + [i for i in items if end(i) == "close"])


@pytest.fixture(scope="session")
def first_start(embedded_dir, cache_dir) -> tuple[subprocess.Popen, str]:
    """A real Aerie started once on a cache with no graphs yet: (process, base URL)."""
    proc, url = start_aerie(cache_dir, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    FIRST_STARTS.append(proc)
    yield proc, url
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="session")
def keyed_aerie(embedded_dir, cache_dir, tmp_path_factory) -> str:
    """One real Aerie asking for an API key (`--no-compile`, an empty data folder), shared by the
    API's test and the page's: each boot costs the suite ~12-16 s, most of it imports. Its URL."""
    data = tmp_path_factory.mktemp("aerie-keyed-data")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "XDG_DATA_HOME": str(data), "AERIE_API_KEY": KEY}
    proc, url = start_aerie(cache_dir, "--no-compile", env=env)
    yield url
    proc.terminate()
    proc.wait(30)


THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def one_thread_beside_the_first_start():
    """While the first start's child compiles (niced, one core), each test runs torch on the other
    core only: with two threads, OpenMP's team waited on the thread the child displaced, and the
    compile-heavy tests took 1.3-1.6x as long (2-core Xeon)."""
    torch.set_num_threads(1 if compiling_beside() else THREADS)


@pytest.fixture(scope="module", autouse=True)
def workers_end_with_their_module():
    """The torch worker threads a test module makes (its ChatServices', its own) end with it: an
    idle one left alive kept its OpenMP team, and with more OpenMP threads than cores every later
    test's parallel regions waited on wake-ups (core/service/worker.py); SpecExec's chi-square
    test took 43-47 s after test_chat.py's module-scoped service and 17-19 s alone."""
    made = []
    start = Worker.__init__

    def tracked(worker, *args, **kwargs):
        start(worker, *args, **kwargs)
        made.append(worker)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Worker, "__init__", tracked)
        yield
    for worker in made:
        worker.close()


@pytest.fixture(scope="session")
def first_start_tuned(first_start) -> str:
    """The first start's line once its tuner starts: after its child stored every graph."""
    return wait_for(first_start[0], TUNED)


@pytest.fixture
def toasts(monkeypatch):
    shown = []
    monkeypatch.setattr(gr, "Warning", lambda message, **kw: shown.append(("warning", message, kw)))
    monkeypatch.setattr(gr, "Info", lambda message, **kw: shown.append(("info", message, kw)))
    return shown


@pytest.fixture
def every_event(monkeypatch):
    """The page shows every event of a streaming answer (app/handlers.py shows at most one per
    SHOW_EVERY_S): tests that step through a stream event by event."""
    monkeypatch.setattr("app.handlers.SHOW_EVERY_S", 0.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served_api(service):
    """A Gradio page with Aerie's API routes for `service` on a free local port, as launch.py
    serves them; -> its base URL."""
    import gradio as gr

    from app.api import api_routes
    with gr.Blocks() as demo:
        gr.Markdown("Aerie")
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True,
                app_kwargs={"routes": api_routes(service)})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        demo.close()
