"""One long-lived thread for all of a process's torch work: loading and warming a model up, the
latency profile, every generation step, model switches.

Why one thread: torch's CPU kernels run on OpenMP, and OpenMP gives every OS thread that enters
a parallel region a team of its own. The app used to load and compile on the main thread, then
answer on whichever thread the server lent it (a fresh thread per API request, a pool thread per
Gradio step), so two or more teams shared the cores. Measured on the 2-core Xeon of issue 17, the
same engine decoding plainly: 52.7 / 54.7 tok/s on the thread that warmed it up, 40.8 / 37.0 on a
fresh thread, 43.1 / 44.0 with each step on a pool thread. Callers hand work over here and read
results back through a queue, which costs microseconds per step.

`call` runs one function and waits for it. `stream` runs a generator here and hands its items
over as they come. Before the next item the worker waits up to HANDOFF_S for the reader to come
back for more: the reader's Python per item (a chunk's JSON, the socket write, the page's update)
needs the GIL, and otherwise it took it at the start of the next round, inside the engine's timed
draft. Served plainly on the 2-core Zen 4 (4 prompts x 2, the API, two server starts each), the
drafter's 0.09 ms per round grew to 0.42 ms and the page's speedup read 0.93-0.96x for plain
decoding itself; with the hand-off it reads 0.97-0.98x, at the same or better tokens/s (126-155
against 103-142). A reader slower than HANDOFF_S (a busy page, a slow socket) still overlaps the
next round. Jobs run one at a time, in order.

`close` ends the thread, and with it the OpenMP team its parallel regions made. An idle team still
counts: with more OpenMP threads alive than cores, libgomp spins only briefly before sleeping
between parallel regions, so every region of every other thread pays futex wake-ups. On the 2-core
EPYC a tiny model's steps on the main thread ran 12 ms before and 28 ms after a finished stream on
a worker whose thread stayed alive (the same as OMP_WAIT_POLICY=PASSIVE throughout: 29 ms).
"""

import logging
import queue
import threading
from concurrent.futures import Future, wait
from typing import Callable, Generator, Iterator, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
_END = object()  # a stream's last item: its generator has been closed on the worker
HANDOFF_S = 0.001   # the most a round waits for the reader of the last item (module docstring)


class Worker:
    def __init__(self, name: str = "aerie-torch"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def here(self) -> bool:
        """Whether the caller is the worker itself (then work runs inline: waiting would deadlock)."""
        return threading.current_thread() is self._thread

    def _serve(self) -> None:
        while True:
            fn, future = self._jobs.get()
            if fn is None:   # close()
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, who re-raises it
                future.set_exception(exc)

    def close(self, timeout_s: float = 60.0) -> None:
        """End the thread once the jobs queued so far have run (module docstring); later jobs are refused."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put((None, None))
        if not self.here:
            self._thread.join(timeout_s)

    def submit(self, fn: Callable[[], T]) -> Future:
        if self._closed:
            raise RuntimeError("this torch worker was closed")
        future: Future = Future()
        self._jobs.put((fn, future))
        return future

    def call(self, fn: Callable[[], T]) -> T:
        """fn() run on the worker; its result, or its exception raised here."""
        return fn() if self.here else self.submit(fn).result()

    def post(self, fn: Callable[[], object]) -> None:
        """fn() run on the worker after the jobs queued so far (here: now), without waiting for it;
        a failure is logged, as nobody waits to be told."""
        if self.here:
            fn()
            return
        self.submit(fn).add_done_callback(_log_failure)

    def stream(self, items: Callable[[], Generator[T, None, None]]) -> Iterator[T]:
        """The items of `items()`, made and advanced on the worker. Closing this early stops the
        worker's generator after the item it is on (it is closed there, so its `finally` runs on
        the worker) and returns once it has: whatever it held is free again."""
        if self.here:
            yield from items()
            return
        out: queue.SimpleQueue = queue.SimpleQueue()
        stop, reading = threading.Event(), threading.Event()
        job = self.submit(lambda: _pump(items, out, stop, reading))
        finished = False
        try:
            while True:
                reading.set()
                if (item := out.get()) is _END:
                    break
                yield item
            finished = True
            job.result()  # raises what the generator raised
        finally:
            stop.set()
            wait([job])
            if not finished and job.exception() is not None:
                log.error("A stream's work failed after its reader had left", exc_info=job.exception())


def _log_failure(job: Future) -> None:
    if job.exception() is not None:
        log.error("Work posted to the torch worker failed", exc_info=job.exception())


def _pump(items: Callable[[], Generator[T, None, None]], out: queue.SimpleQueue, stop: threading.Event,
          reading: threading.Event) -> None:
    """On the worker: run the generator, putting each item in `out` until it ends or `stop` is set,
    and before the next item waiting up to HANDOFF_S for the reader to come back for more."""
    try:
        source = items()
        try:
            for item in source:
                reading.clear()
                out.put(item)
                if stop.is_set():
                    break
                reading.wait(HANDOFF_S)
        finally:
            source.close()
    finally:
        out.put(_END)  # also after a failure: the reader must not wait for ever
