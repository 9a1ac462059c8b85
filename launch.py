#!/usr/bin/env python3
"""Aerie's launcher and only composition root.

    python3 launch.py [--model M] [--quant nf4|int4|int8|none] ...   set up on first run, then chat in the browser
    python3 launch.py test [pytest args]                    set up with the test extras, run the tests
    python3 launch.py bench [--head H] ...                  every decoding strategy on MT-bench prompts
    python3 launch.py train --out DIR [--model M] ...       train an EAGLE head by self-distillation
    python3 launch.py generate [--out DIR] ...              greedy answers for training, continuously batched
    python3 launch.py compile [--model M] ...               store a CPU model's compiled graphs (the app runs it itself)

Every command first runs setup_env.bootstrap, on any Python >= 3.10 with the standard library
only: it builds `.venv` next to this file, installs the dependencies listed in pyproject.toml (the
single source) plus the embedded model, and re-runs the command inside that environment. Later
starts skip straight to the app.
"""

import argparse
import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NoReturn

from cli import ROOT, default_head, default_medusa, parse_args, parse_generate_args, parse_train_args  # stdlib only
from setup_env import T0, bootstrap  # stdlib only

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")  # addresses that serve this machine only


# ---------------------------------------------------------------- commands (inside .venv)

def target_spec(args: argparse.Namespace, batched: bool = False):
    from models.target import LoadSpec

    return LoadSpec(model=args.model, quant=args.quant, device=args.device, cache_dir=args.cache_dir, batched=batched)


def engine_spec(args: argparse.Namespace, **overrides):
    from core.config import TreeConfig
    from core.service.spec import EngineSpec
    from core.spec.tree import MC_SIM_7B_63

    from core.tune.shapes import Pins

    head = args.head if args.head is not None else default_head(overrides.get("model", args.model))
    medusa = args.medusa if args.medusa is not None else default_medusa(overrides.get("model", args.model))
    shape = {k: v for k, v in (("depth", args.depth), ("top_k", args.top_k), ("total_tokens", args.total_tokens)) if v is not None}
    static = TreeConfig(choices=MC_SIM_7B_63) if args.static_tree else None
    tree = static or (TreeConfig(**shape) if shape else None)  # the first turn's tree; then the tuner's
    fields = dict(model=args.model, quant=args.quant, device=args.device, cache_dir=args.cache_dir, head=head, medusa=medusa,
                  allow_pickle=args.allow_pickle, strategy=getattr(args, "strategy", "auto"), tree=tree,
                  pins=Pins(static=static, **shape), vram_reserve_gb=args.vram_reserve, compile=not args.no_compile,
                  attention=args.attention, kernel_mix=args.kernel_mix, draft_rows=args.draft_rows,
                  verify_delay_ms=getattr(args, "verify_delay_ms", 0.0))
    merged = {**fields, **overrides}
    # "none": no EAGLE head or Medusa heads, not even the model's shipped ones (the compile child is told so too)
    return EngineSpec(**{**merged, **{k: None for k in ("head", "medusa") if merged[k] == "none"}})


def free_port(host: str, first: int) -> int:
    for port in range(first, first + 100):
        with socket.socket() as s:
            # As uvicorn binds: a port that only holds connections of a process that just exited
            # (TIME_WAIT) is free, so a quick restart keeps its address.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
                return port
            except OSError:
                continue
    raise SystemExit(f"Aerie: no free port in {first}-{first + 99} on {host}.")


def run_tests(argv: list[str]) -> int:
    return subprocess.run([sys.executable, "-m", "pytest", *argv], cwd=ROOT).returncode


def fail(message: object) -> NoReturn:
    print(f"Aerie: {message}", file=sys.stderr)
    sys.exit(2)


def api_key(host: str, given: str | None, environ: dict[str, str]) -> str | None:
    """The key the API asks for (--api-key, else $AERIE_API_KEY), or None: on this machine only
    it may be left out; served beyond it, the API would otherwise answer anyone on the network."""
    key = given if given is not None else environ.get("AERIE_API_KEY")
    if key is not None and not key.strip():
        raise ValueError("The API key is empty: give a real one with --api-key KEY or AERIE_API_KEY.")
    if key is None and host not in LOCAL_HOSTS:
        raise ValueError(f"--host {host} serves beyond this machine, so the API needs a key: give one with "
                         "--api-key KEY or the AERIE_API_KEY environment variable (or serve on --host 127.0.0.1).")
    return key


def run_app(args: argparse.Namespace) -> None:
    try:
        key = api_key(args.host, args.api_key, dict(os.environ))
    except ValueError as e:
        fail(e)  # before loading the model: a refused start should be quick
    from app.private import private_temp_dir

    private = private_temp_dir()  # 0700, removed at exit: exports and Gradio's copies of them
    os.environ.setdefault("GRADIO_TEMP_DIR", str(private / "gradio"))  # read when Gradio is imported
    from app.store import ChatStore, default_store_path
    from core.errors import AerieError

    try:
        store = ChatStore(args.chats or default_store_path())  # before the model: a store that cannot open fails fast
        service = chat_service(args)
    except AerieError as e:
        fail(e)
    atexit.register(service.close)  # a compiling child ends with the app
    serve(args, service, store, key, private)


def chat_service(args: argparse.Namespace):
    """The chat service on the model the arguments name, loaded on the torch worker thread, with a
    loader for the models the page switches to."""
    from core.config import ModelChoice
    from core.service.chat import ChatService
    from core.service.factory import load_for_chat
    from core.service.switching import preflight
    from core.service.worker import Worker
    from core.tune.probe import Probe, load_nvml

    probe = Probe(load_nvml())  # one NVML session for placement and the monitor

    def loader(choice: ModelChoice):
        # A head is made for one target: another model from the page gets its own default head,
        # and the command line's --strategy applies only to the model it named.
        same = choice.model == args.model
        head = choice.head if choice.head is not None else (args.head if same and args.head else default_head(choice.model))
        medusa = args.medusa if same and args.medusa else default_medusa(choice.model)
        return load_for_chat(engine_spec(args, model=choice.model, quant=choice.quant, head=head or None, medusa=medusa,
                                         strategy=args.strategy if same else "auto"), compile_command, probe)

    def check(choice: ModelChoice) -> None:
        preflight(target_spec(argparse.Namespace(**{**vars(args), "model": choice.model, "quant": choice.quant})),
                  choice.head)

    choice = ModelChoice(args.model, args.quant, args.head)
    check(choice)  # a head folder that is not there is told before minutes of loading
    worker = Worker()  # the thread for all torch work: it loads and warms up the model it will run
    loaded = worker.call(lambda: loader(choice))
    return ChatService(loaded.engine, loader, loaded.tuner, probe, choice, args.cache_dir, check, worker, loaded.pending)


def serve(args: argparse.Namespace, service, store, key: str | None, private: Path) -> None:
    """The page and the API on one port until Ctrl+C (or SIGTERM)."""
    from app.api import api_routes
    from app.downloads import delete_after_download
    from app.guard import guard
    from app.page_head import page_head
    from app.page_scripts import FRAME_THROTTLE
    from app.private import private_folder
    from app.ui import build_ui, launch_options
    from core.config import TUNED

    port = free_port(args.host, args.port)
    demo = build_ui(service, {"model": args.model or "", "quant": service.engine.target.quant,
                              "head": args.head or ""}, store=store, exports=private_folder(private / "exports"))
    # The OpenAI-compatible routes join Gradio's own FastAPI app: one server, one port, one guard
    # in front of both (app/guard.py: the Host, the Origin, the key).
    # An export is deleted once downloaded (app/downloads.py), behind the guard. The page's HTML
    # carries the script that keeps Gradio's status trackers from asking for 60 frames a second.
    app_kwargs = {"routes": api_routes(service, key),
                  "middleware": [guard(args.host, port, key, tuple(args.allow_origin)),
                                 delete_after_download(Path(os.environ["GRADIO_TEMP_DIR"]), private / "exports"),
                                 page_head(FRAME_THROTTLE)]}
    demo.launch(server_name=args.host, server_port=port, inbrowser=not args.no_browser, prevent_thread_lock=True,
                app_kwargs=app_kwargs, **launch_options())
    print(f"Aerie: ready at http://{args.host}:{port} in {time.time() - T0:.1f} s ({service.label}); "
          f"OpenAI-compatible API at http://{args.host}:{port}/v1{' (key required)' if key else ''}", flush=True)
    if service.warmup is None:
        print(f"{TUNED} at start: {service.tuning}", flush=True)
    # `kill` (SIGTERM) then stops the server as Ctrl+C does, and the exit removes the private folder.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    demo.block_thread()


def compile_command(spec, graphs: list[str]) -> list[str]:
    """`launch.py compile` for the model of an EngineSpec: a child that compiles the `graphs` named."""
    values = {"--model": spec.model, "--quant": spec.quant, "--device": spec.device, "--head": spec.head or "none",
              "--medusa": spec.medusa or "none",
              "--cache-dir": spec.cache_dir, "--strategy": spec.strategy, "--attention": spec.attention,
              "--draft-rows": spec.draft_rows}
    return [sys.executable, str(ROOT / "launch.py"), "compile", "--graphs", ",".join(graphs),
            *(str(x) for name, value in values.items() if value is not None for x in (name, value)),
            *(["--allow-pickle"] if spec.allow_pickle else []), *(["--kernel-mix"] if spec.kernel_mix else [])]


def run_compile(args: argparse.Namespace, graphs: set[str]) -> None:
    """Precompile the `graphs` named of the model the arguments name, those not stored yet, printing a
    line per graph stored (core/service/warmup.py reads them). Niced: the chat beside it comes first."""
    from core.errors import AerieError
    from core.runtime.graphs import COMPILE_ERRORS, build
    from core.service.factory import stage
    from core.service.warmup import STORED

    os.nice(10)
    parent = os.getppid()  # the app that started this: when it is gone, so is the reason to compile

    def exit_with_parent() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(1)
    threading.Thread(target=exit_with_parent, daemon=True).start()
    try:
        staged = stage(engine_spec(args, head=args.head or None), report=lambda line: print(line, flush=True))
        if staged.graphs is None:
            fail("this model runs without compiled graphs here (a GPU, --no-compile, or fp32 on oneDNN).")
        build([job for job in staged.missing() if job.name in graphs], staged.graphs,
              lambda line: print(f"Aerie: {line}", flush=True),
              lambda name, seconds: print(f"{STORED}{name} {seconds:.1f}", flush=True), adopt=False)
    except (AerieError, *COMPILE_ERRORS) as e:
        fail(f"compiling failed: {(str(e).strip().splitlines() or [type(e).__name__])[0][:200]}")


def run_bench(args: argparse.Namespace) -> None:
    from core.bench import bench, parse_trees
    from core.config import TreeConfig
    from core.errors import AerieError
    from core.served import ServedClient, Server
    from core.served_page import PageClient

    strategies = tuple(args.strategies.split(",")) if args.strategies else None
    if not args.prompts.is_file():
        fail(f"No prompt file at {args.prompts}.")
    try:
        trees = parse_trees(args.trees)
        if args.compare_default_tree:
            trees["eagle_default_tree"] = TreeConfig(depth=6, top_k=10, total_tokens=60)
        if args.page and not args.serve:
            fail("--page types the prompts into a live server's page: give --serve too.")
        # The bench's server keeps its chats apart: the page's prompts must not fill the user's chat list.
        chats = tempfile.TemporaryDirectory(prefix="aerie-bench-") if args.serve else None
        server = Server(server_command(args, Path(chats.name) / "chats.sqlite3")) if chats else None
        page = None
        try:
            page = PageClient(server.url) if args.page else None
            report = bench(engine_spec(args), args.prompts, args.limit, args.max_new_tokens, args.context, strategies,
                           trees, ServedClient(server.url) if server else None, page)
        finally:
            if page:
                page.close()
            if server:
                server.stop()
            if chats:
                chats.cleanup()
    except (AerieError, ValueError) as e:
        fail(e)
    print(json.dumps(report))


def server_command(args: argparse.Namespace, chats: Path) -> list[str]:
    """`launch.py` serving the model bench was asked for, on this machine only, for `bench --serve`,
    its chats saved in `chats`."""
    values = {"--model": args.model, "--quant": args.quant, "--device": args.device, "--head": args.head,
              "--medusa": args.medusa, "--depth": args.depth, "--top-k": args.top_k, "--total-tokens": args.total_tokens,
              "--cache-dir": args.cache_dir, "--vram-reserve": args.vram_reserve, "--attention": args.attention,
              "--draft-rows": args.draft_rows}
    flags = {"--allow-pickle": args.allow_pickle, "--static-tree": args.static_tree, "--no-compile": args.no_compile,
             "--kernel-mix": args.kernel_mix}
    return [sys.executable, str(ROOT / "launch.py"), "--no-browser", "--host", "127.0.0.1", "--chats", str(chats),
            *(str(x) for name, value in values.items() if value is not None for x in (name, value)),
            *(name for name, on in flags.items() if on)]


def run_train(args: argparse.Namespace) -> None:
    from core.errors import AerieError
    from core.train.loop import TrainConfig, train
    from core.train.medusa import train_medusa
    from core.text import render_prompt
    from core.runtime.cpu_linear import batched_linear_kind
    from core.train.data import DataConfig
    from models.target import load_target

    answers = args.answers or default_answers(args.model)
    if not answers:
        fail("--answers is needed with --model: pass distill jsonl files or answer stores (launch.py generate) "
             "of that model's answers.")
    exclude = benchmark_prompts()
    try:
        cfg = TrainConfig(kind=args.kind, draft_vocab=args.draft_vocab, epochs=args.epochs, lr=args.lr,
                          batch_tokens=args.batch_tokens, noise=args.noise, weight_decay=args.weight_decay, ttt_steps=args.ttt_steps,
                          objective=args.objective, replay=args.replay, flattest=args.flattest, fc_norm=args.fc_norm, amp=args.amp,
                          init_layer=args.init_from_target,
                          init_head=args.init_from, medusa_heads=args.medusa_heads, medusa_layers=args.medusa_layers,
                          medusa_own_projection=args.medusa_own_projection,
                          seed=args.seed, save_every=args.save_every, eval_every=args.eval_every, threads=args.threads,
                          time_limit_s=args.time_limit * 60 if args.time_limit else None)
        target = load_target(target_spec(args, batched=True))
        # Stores keep token ids only: the benchmark prompts are matched as the chat template renders them.
        exclude_ids = frozenset(tuple(render_prompt(target.tokenizer, [{"role": "user", "content": t}])) for t in exclude)
        data = DataConfig(answers=tuple(answers), max_tokens=args.max_tokens, val_tokens=args.val_tokens,
                          exclude_prompts=exclude, exclude_ids=exclude_ids, features_dir=args.features,
                          linear=batched_linear_kind(target.model, args.linear, DataConfig.capture_tokens))
        if cfg.kind == "medusa":
            head = args.head if args.head is not None else default_head(args.model)
            summary = train_medusa(target, data, cfg, args.out, args.resume, None if head == "none" else head)
        else:
            summary = train(target, data, cfg, args.out, resume=args.resume)
    except (AerieError, ValueError) as e:
        fail(e)
    print(json.dumps(summary))


def benchmark_prompts() -> tuple[str, ...]:
    """MT-bench's prompts, which the bench measures on: never generated for nor trained on."""
    from core.bench import load_prompts

    path = ROOT / "assets" / "bench" / "mt_bench.jsonl"
    return tuple(p.text for p in load_prompts(path, None)) if path.is_file() else ()


def default_answers(model: str | None) -> list[Path]:
    """What train reads without --answers: every answer store under data/answers made by this
    model, and for the embedded model the shipped distill files (where this checkout has them)."""
    from core.train.answers import stores_of
    from models.target import model_name

    shipped = ROOT.parent / "shared" / "distill" / model_name(None).lower()
    return ([shipped] if model is None and shipped.is_dir() else []) + stores_of(ROOT / "data" / "answers", model_name(model))


def run_generate(args: argparse.Namespace) -> None:
    from core.errors import AerieError
    from core.train.answers import DATA_BUDGET
    from core.train.distill import FRESH_START, GenerateJob, compare_with_hf, distill
    from models.target import load_target

    # A stop by SIGTERM (how a backgrounded run is stopped: it ignores SIGINT) unwinds like Ctrl-C,
    # so the answers not yet in a shard are written before the process ends.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    job = GenerateJob(prompts=args.prompts, start=FRESH_START if args.start is None else args.start, limit=args.limit,
                      max_new_tokens=args.max_new_tokens, prompt_cap=args.prompt_cap, batch=args.batch,
                      threads=args.threads, linear=args.linear, features=args.features, kinds=tuple(args.kinds),
                      exclude=benchmark_prompts())
    if not job.prompts.is_file():
        fail(f"No prompts file at {job.prompts}.")
    try:
        target = load_target(target_spec(args, batched=True))
        summary = (compare_with_hf(target, job, args.compare_hf) if args.compare_hf
                   else distill(target, job, args.out, ROOT / "data" / "answers", DATA_BUDGET))
    except (AerieError, ValueError) as e:
        fail(e)
    print(json.dumps(summary))


def keep_compiled_code(cache_dir: Path) -> None:
    """torch keeps compiled kernels in /tmp by default, which many systems empty at every boot:
    keep them beside the latency profiles instead, so only the first start compiles. Before torch loads."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir / "compiled"))


def main(argv: list[str]) -> None:
    bootstrap(argv)
    run_command(argv)


def run_command(argv: list[str]) -> None:
    """The command argv names, in this interpreter (main runs it inside .venv)."""
    if argv[:1] == ["test"]:
        sys.exit(run_tests(argv[1:]))
    if argv[:1] == ["bench"]:
        args = parse_args(argv[1:], bench=True)
        keep_compiled_code(args.cache_dir)
        run_bench(args)
        return
    if argv[:1] == ["compile"]:   # --graphs A,B first: the app's own child (core/service/warmup.py)
        if argv[1:2] != ["--graphs"] or len(argv) < 3:
            fail("launch.py compile --graphs NAME[,NAME...] [the app's model arguments]: the app runs it itself")
        args = parse_args(argv[3:])
        keep_compiled_code(args.cache_dir)
        run_compile(args, set(argv[2].split(",")))
        return
    if argv[:1] == ["train"]:
        run_train(parse_train_args(argv[1:]))
        return
    if argv[:1] == ["generate"]:
        run_generate(parse_generate_args(argv[1:]))
        return
    args = parse_args(argv)
    keep_compiled_code(args.cache_dir)
    run_app(args)


if __name__ == "__main__":
    main(sys.argv[1:])
