"""The chat service: what the app talks to. One answer or model load at a time, every step on the
torch worker thread; text in and out through core/text.py."""

import threading
import time
from pathlib import Path
from typing import Callable, Iterator, NoReturn

from core.config import DRAFTERS, TUNED, ModelChoice, ReplyEvent, SamplingConfig
from core.errors import AerieError, ModelLoadError, StrategyUnavailableError
from core.service.drafters import layer_skip_drafter
from core.service.factory import tune
from core.service.switching import SwitchReport, fetch, process_bytes, release
from core.service.warmup import Pending, Warmup
from core.service.worker import Worker
from core.spec.drafters import PlainDrafter
from core.text import IncrementalDetokenizer, StopMatcher, coalesced, fit_context, merge_spans, round_spans
from core.tune.monitor import Snapshot, snapshot
from core.tune.probe import Probe
from core.tune.turn import TurnLog


class ChatService:
    """What the UI talks to: messages in, `ReplyEvent`s out. `loader(ModelChoice)` returns a
    `core.service.factory.Loaded` (engine and tuner); launch.py supplies it so the service can switch
    models without knowing how they load. Without a tuner the engine's drafter is used as is."""

    def __init__(self, engine, loader: Callable | None = None, tuner=None, probe: Probe | None = None,
                 choice: ModelChoice = ModelChoice(), cache_dir: Path | None = None,
                 preflight: Callable[[ModelChoice], None] | None = None, worker: Worker | None = None,
                 pending: Pending | None = None):
        # Every torch call (answers, switches) runs on this one thread (core/service/worker.py says why);
        # launch.py passes the one that loaded `engine`.
        self.worker = worker or Worker()
        self.engine = engine
        self.cache_dir = cache_dir  # where Hub downloads go (cache_dir/hub), as the loader reads them
        self.preflight = preflight  # cheap checks of a ModelChoice before the current model is freed
        self.tuner = tuner
        self.loader = loader
        self.choice = choice  # what `engine` was loaded from, to reload it if a switch fails
        self.probe = probe or Probe(None)
        self.default_system_prompt = ""
        # One answer or model load at a time: the page and the HTTP API share this engine.
        self.busy = threading.Lock()
        self.warmup: Warmup | None = None   # a child compiling this engine's graphs; no tuner until it ends
        self.compile_note = ""              # why graphs are missing, once a warm-up failed
        self._plan = ""                     # `tuning`'s plan, worked out on the worker
        self.worker.call(self._replan)
        self._warm(pending)

    def _install(self, loaded) -> None:
        """Serve a just-loaded model (a `core.service.factory.Loaded`): its engine, its tuner's plan,
        and its warm-up if graphs are missing."""
        self.engine, self.tuner, self.compile_note = loaded.engine, loaded.tuner, ""
        self._replan()
        self._warm(loaded.pending)

    def _warm(self, pending: Pending | None) -> None:
        """Start compiling `pending`'s graphs in a child (core/service/warmup.py), if any are missing."""
        self.warmup = Warmup(pending, self._compiled) if pending is not None else None

    def _compiled(self, warmup: Warmup, returncode: int) -> None:
        """The child ended (on its reader thread): finish on the worker, after any answer running."""
        self.worker.submit(lambda: self._finish_warmup(warmup, returncode))

    def _finish_warmup(self, warmup: Warmup, returncode: int) -> None:
        """On the worker: adopt the last graphs, then time the compiled engine and start its tuner."""
        if warmup is not self.warmup:
            return  # the model was switched meanwhile
        warmup.adopt_ready()
        if returncode != 0:
            self.compile_note = f"Compiling stopped ({warmup.failure}); the missing graphs run eagerly."
            print(f"Aerie: {self.compile_note}", flush=True)
        self.tuner = tune(warmup.staged, self.probe).tuner
        self._replan()
        self.warmup = None
        print(f"{TUNED} after compiling {warmup.adopted} of {warmup.total} graphs in "
              f"{time.monotonic() - warmup.started:.0f} s: {self.tuning}", flush=True)

    def close(self) -> None:
        """Stop a compiling child (at the app's exit)."""
        if self.warmup is not None:
            self.warmup.stop()

    @property
    def label(self) -> str:
        return f"{self.engine.target.label} · {self.engine.drafter.name}"

    @property
    def model_name(self) -> str:
        return self.engine.target.name

    def fetch(self, choice: ModelChoice, report: Callable, cancelled: Callable[[], bool]) -> None:
        """Download the Hub files `choice` needs, reporting (source, Progress); cancellable."""
        if self.cache_dir is None:
            raise RuntimeError("this ChatService was built without a cache folder")
        fetch(choice, self.cache_dir, report, cancelled)

    def load_model(self, choice: ModelChoice) -> SwitchReport:
        """Free the current model, load `choice`, and measure both. On failure the previous model is
        loaded again and the error says so. Fetch Hub files first (`fetch`) to show progress."""
        if self.loader is None:
            raise RuntimeError("this ChatService was built without a model loader")
        with self.busy:
            return self.worker.call(lambda: self._switch(choice))

    def _switch(self, choice: ModelChoice) -> SwitchReport:
        """load_model's work, on the worker."""
        if self.preflight is not None:
            self.preflight(choice)  # a typo costs nothing: the current model is still loaded
        device = self.engine.target.device
        before = process_bytes(device)
        if self.warmup is not None:
            self.warmup.stop()
        self.engine = self.tuner = self.warmup = None  # drop every reference to the old model before loading
        freed_to = release(device)
        try:
            loaded = self.loader(choice)
        except Exception as e:  # noqa: BLE001 - whatever failed, the previous model must come back
            self._restore(e)
        self._install(loaded)
        self.choice = choice
        used = process_bytes(self.engine.target.device) - (freed_to if self.engine.target.device == device else 0)
        return SwitchReport(self.label, str(self.engine.target.device), max(before - freed_to, 0), max(used, 0))

    def _restore(self, error: Exception) -> NoReturn:
        """Load the previous model again after a failed switch, then raise `error` as a user-facing
        AerieError saying so (unexpected errors keep their type's name and first line)."""
        first = (str(error).strip().splitlines() or [""])[0][:200]
        message = str(error) if isinstance(error, AerieError) else f"Could not load the model ({type(error).__name__}: {first})."
        try:
            loaded = self.loader(self.choice)
        except Exception as again:  # noqa: BLE001 - reported with the first failure
            raise ModelLoadError(f"{message} Reloading the previous model failed too ({type(again).__name__}); "
                                 "restart Aerie.") from again
        self._install(loaded)
        kind = type(error) if isinstance(error, AerieError) else ModelLoadError
        raise kind(f"{message} The previous model is loaded again.") from error

    def reply(self, messages: list[dict], system_prompt: str, sampling: SamplingConfig,
              stop_strings: tuple[str, ...], cancel: threading.Event,
              strategy: str | None = None, every_s: float = 0.0) -> Iterator[ReplyEvent]:
        """Waits while another answer runs; a reply cancelled while waiting yields nothing.
        `strategy` (a drafter's name: "plain" for an A/B comparison) decodes this one answer that
        way instead of the tuner's choice; the tuner does not count it as a turn (so an A/B run
        cannot demote EAGLE) and plans the next answer as usual. With `every_s`, the rounds' events
        are merged on the worker into at most one per every_s seconds (core/text.py `coalesced`)."""
        while not self.busy.acquire(timeout=0.1):
            if cancel.is_set():
                return
        try:
            # Each step runs on the worker; closing this early returns once the worker has closed
            # the engine's generator, so the lock is released with the engine free.
            yield from self.worker.stream(
                lambda: coalesced(self._reply(messages, system_prompt, sampling, stop_strings, cancel, strategy), every_s))
        finally:
            # The plan for a new chat is worked out once the answer's end has reached its reader: the
            # tuner's search took 11-18 ms between an answer's last text and its end on the 2-core
            # Zen 4. Queued before the lock is free, so it runs before any later answer.
            self.worker.post(self._replan)
            # A generator may be closed from another thread than the one that started it:
            # a plain Lock, unlike an RLock, can be released there.
            self.busy.release()

    def _reply(self, messages: list[dict], system_prompt: str, sampling: SamplingConfig,
               stop_strings: tuple[str, ...], cancel: threading.Event,
               strategy: str | None) -> Iterator[ReplyEvent]:
        engine, tokenizer = self.engine, self.engine.target.tokenizer
        budget = engine.context_len - min(sampling.max_new_tokens, engine.context_len // 2)
        fitted = fit_context(tokenizer, messages, system_prompt, budget)
        notice = (f"Dropped the {fitted.dropped_turns} oldest turn(s) to fit the model's context."
                  if fitted.dropped_turns else None)
        detok, stops = IncrementalDetokenizer(tokenizer), StopMatcher(stop_strings)
        previous = engine.drafter
        log = self._start(len(fitted.ids), strategy)
        steps, t0 = engine.generate(fitted.ids, sampling, cancel, log.reference_every), time.perf_counter()
        try:
            for step in steps:
                if self.warmup is not None:  # between two rounds: graphs the child stored since
                    self.warmup.adopt_ready()
                stats = log.add(step, time.perf_counter() - t0)
                spans, hit_stop = stops.push_spans(round_spans(detok, step.new_ids, step.accepted))
                finish = "stop" if hit_stop else step.finish
                if finish and not hit_stop:
                    spans += stops.flush_spans()  # the answer ended: held-back text was not a stop string
                yield ReplyEvent.of(merge_spans(spans), stats, notice, finish)
                notice = None
                if finish:
                    return
            yield ReplyEvent.of(stops.flush_spans(), log.stats, notice, "cancelled")
        finally:
            steps.close()  # frees the engine now, not when the generator is collected
            if strategy is not None:
                engine.set_drafter(previous)  # an override lasts one answer
            log.end()

    def _start(self, prompt_len: int, strategy: str | None) -> TurnLog:
        """Set the engine up for one answer: the tuner's plan, the drafter `strategy` names (not
        counted as the tuner's turn), or while the graphs compile, plain decoding (the pinned
        strategy, if any)."""
        if strategy is None and self.warmup is None:
            return TurnLog.planned(self.engine, self.tuner, prompt_len)
        if strategy is None:
            self.warmup.adopt_ready()
            strategy, reason = self.warmup.staged.spec.pins.strategy or "plain", self.warmup.status
        else:
            reason = f"{strategy} for this answer, as asked (not the tuner's choice, not counted as its turn)"
        self.engine.set_drafter(self._drafter(strategy))
        return TurnLog.asked(self.engine, self.tuner, prompt_len, reason)

    @property
    def drafters(self) -> tuple[str, ...]:
        """Every drafter an answer may ask for (`reply`'s strategy), in core.config.DRAFTERS order:
        the loaded ones, and layer skip once a tuner has timed the machine (its skipped layers are
        measured on first use, about a minute on 2 cores, then cached)."""
        names = set(self._loaded_drafters())
        if self.tuner is not None and self.cache_dir is not None:
            names.add("layer_skip")
        return tuple(name for name in DRAFTERS if name in names)

    def pin(self, strategy: str | None) -> str:
        """Every answer from now on decodes with `strategy` (None: the tuner chooses again), until the
        model changes; -> the plan for a new chat. Waits for a running answer; a layer-skip drafter is
        built (measured) first if it must be."""
        if self.tuner is None:
            raise StrategyUnavailableError("The tuner starts once the model's graphs are compiled; pin a drafter then.")
        with self.busy:
            return self.worker.call(lambda: self._pin(strategy))

    def _pin(self, strategy: str | None) -> str:
        if strategy is not None:
            self._drafter(strategy)   # builds it if it must be; an unknown name is a clear error
        self.tuner.pin(strategy)
        self._replan()
        return self.tuning

    def _loaded_drafters(self) -> dict:
        drafters = dict(self.tuner.drafters if self.tuner else self.warmup.staged.drafters if self.warmup
                        else {"plain": PlainDrafter()})
        drafters.setdefault(self.engine.drafter.name, self.engine.drafter)
        return drafters

    def _drafter(self, strategy: str):
        """On the worker: the drafter `strategy` names; a layer-skip one is built on first use."""
        drafters = self._loaded_drafters()
        if strategy == "layer_skip" and strategy not in drafters and strategy in self.drafters:
            self.tuner.drafters["layer_skip"] = layer_skip_drafter(self.engine, self.tuner.profile, self.cache_dir)
            return self.tuner.drafters["layer_skip"]
        if strategy not in drafters:
            raise StrategyUnavailableError(f"This model cannot decode with '{strategy}'; it has {', '.join(self.drafters)}.")
        return drafters[strategy]

    def monitor(self) -> Snapshot:
        """Memory by role, RAM and CPU now; safe to call while an answer streams."""
        return snapshot(self.probe, self.engine)

    @property
    def tuning(self) -> str:
        """What the tuner would choose for a new short chat, and why (or what is compiling meanwhile).
        Any thread may ask (the page's monitor does): the plan is worked out on the worker after each
        turn (`_replan`), since torch ops on another thread would give it an OpenMP team of its own."""
        if self.warmup is not None:
            return self.warmup.status
        return "; ".join(filter(None, [self._plan, self.compile_note]))

    def _replan(self) -> None:
        """On the worker: the tuner's plan for a new short chat, for `tuning`."""
        self._plan = self.tuner.plan(self.tuner.profile.contexts[0]).reason if self.tuner else ""