"""A just-loaded engine's graphs compiled by child processes while the chat answers eagerly.

Why a child: compiling is mostly Python (tracing, lowering), and Python runs one thread at a time.
Measured on the 2-core EPYC, a cold compile of one bucket on a thread of the app slowed the eager
forward beside it from 20 to 175 ms per token (102 ms with a 0.2 ms GIL switch interval, and the
compile itself took 91 instead of 59 s). A child process shares only the cores, and runs niced,
so the chat keeps most of them.

A child is `launch.py compile --graphs NAMES` with the chat's model arguments: it precompiles the
graphs named, those not stored yet, into the engine's graph folder (core/runtime/graphs.py) and
prints a line per graph; on two cores two children share the graphs (core/service/factory.py
COMPILE_CHILDREN). The service loads each between two rounds (`adopt_ready`), never mid-round;
plain decoding needs only the target's 1-token graph, which the first child compiles first. When
the last child exits, the service measures the latency profile on the compiled engine (or loads
it) and only then starts the tuner, so it never plans from eager numbers.
"""

import queue
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from core.runtime.graphs import Precompiled

STORED = "aerie-compiled "   # the child's line for each graph it stored: STORED + name + seconds


@dataclass(frozen=True)
class Pending:
    """What a warm-up needs: the staged engine (core/service/factory.py), the graphs it lacks and
    the children's commands, each compiling its share of them (`launch.py compile --graphs`). Made on
    the torch worker: a job's example inputs are tensors, and a tensor op on another thread (the
    app's main one) gives that thread an OpenMP team of its own, which halved the worker's speed
    for the life of the process (plain decoding 30-37 vs 63-81 tok/s)."""
    staged: object
    jobs: list
    commands: list[list[str]]


class Warmup:
    def __init__(self, pending: Pending, on_exit: Callable[["Warmup", int], None]):
        """Start the children; `on_exit(self, returncode)` is called from a reader thread once the
        last has ended, with the first failure's code (0 when every child succeeded)."""
        self.staged = pending.staged
        self.jobs = {job.name: job for job in pending.jobs}
        self.total, self.adopted = len(self.jobs), 0
        self.ready: queue.SimpleQueue = queue.SimpleQueue()   # names stored by a child, not adopted yet
        self.tail: deque = deque(maxlen=3)                     # the children's last other lines, for an error
        self.started = time.monotonic()
        self.procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
                      for command in pending.commands]
        self._running, self._codes, self._lock = len(self.procs), [], threading.Lock()
        for proc in self.procs:
            threading.Thread(target=self._read, args=(proc, on_exit), name="aerie-compile-reader", daemon=True).start()

    def _read(self, proc: subprocess.Popen, on_exit) -> None:
        for line in proc.stdout:
            if line.startswith(STORED):
                self.ready.put(line[len(STORED):].split()[0])
            elif line.strip():
                self.tail.append(line.strip())
                print(line.rstrip(), flush=True)  # the child's progress, in the app's terminal
        code = proc.wait()
        with self._lock:
            self._codes.append(code)
            self._running -= 1
            last = self._running == 0
        if last:
            on_exit(self, next((c for c in self._codes if c != 0), 0))

    def adopt_ready(self) -> int:
        """On the torch worker, between rounds: load and use each graph stored since; -> how many."""
        count = 0
        while True:
            try:
                name = self.ready.get_nowait()
            except queue.Empty:
                return count
            job = self.jobs[name]
            job.adopt(Precompiled(self.staged.graphs / name, job))
            self.adopted += 1
            count += 1

    @property
    def failure(self) -> str:
        """Why the child stopped early, in its own last words."""
        return " / ".join(self.tail)[-300:] or "no output"

    @property
    def status(self) -> str:
        """One line for the page: what is compiling and what it costs meanwhile."""
        elapsed = time.monotonic() - self.started
        return (f"compiling graph {min(self.adopted + 1, self.total)} of {self.total} ({elapsed:.0f} s so far; "
                "a first start takes a few minutes, later starts load them): until it finishes, answers decode "
                "plainly on the eager path, slower, and the tuner waits for the compiled speed")

    def stop(self) -> None:
        """End the children (a model switch, the app's exit) and wait for them."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            proc.wait(timeout=30)
