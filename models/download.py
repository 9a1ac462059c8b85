"""Downloads from the Hugging Face Hub that show progress and can be cancelled.

`huggingface_hub.snapshot_download` has neither a byte-level callback nor a way to stop, so it runs
in a child process: progress is the bytes on disk under the repo's cache folder (finished blobs
plus `.incomplete` parts) against the file sizes the Hub lists, and cancelling terminates the
child. A partial file stays as `.incomplete`; the next download resumes it. Model and head files
share one cache, `cache_dir/hub`, which the loaders read (models/target.py, head_checkpoint.py).
"""

import multiprocessing
from dataclasses import dataclass
from pathlib import Path
from queue import Empty
from typing import Callable

from models.errors import ModelLoadError

MODEL_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
HEAD_PATTERNS = ["config.json", "*.safetensors", "*.safetensors.index.json"]


@dataclass(frozen=True)
class Progress:
    done: int                   # bytes on disk so far
    total: int | None           # bytes the Hub lists for the matching files; None while unknown

    @property
    def fraction(self) -> float | None:
        return min(self.done / self.total, 1.0) if self.total else None


def hub_cache(cache_dir: Path) -> Path:
    return Path(cache_dir) / "hub"


def repo_folder(cache_dir: Path, repo_id: str) -> Path:
    """huggingface_hub's layout: hub/models--org--name/{blobs,snapshots,refs}."""
    return hub_cache(cache_dir) / ("models--" + repo_id.replace("/", "--"))


def bytes_on_disk(folder: Path) -> int:
    blobs = folder / "blobs"
    return sum(f.stat().st_size for f in blobs.iterdir() if f.is_file()) if blobs.is_dir() else 0


def snapshot(repo_id: str, cache_dir: str, patterns: list[str], results) -> None:
    """The child's work: list sizes, then download; reports ("total", n), then ("done", path) or ("error", text)."""
    from fnmatch import fnmatch

    from huggingface_hub import HfApi, snapshot_download

    try:
        info = HfApi().model_info(repo_id, files_metadata=True)
        sizes = [s.size or 0 for s in info.siblings or [] if any(fnmatch(s.rfilename, p) for p in patterns)]
        results.put(("total", sum(sizes)))
        results.put(("done", snapshot_download(repo_id, allow_patterns=patterns, cache_dir=cache_dir)))
    except Exception as e:  # noqa: BLE001 - crosses a process boundary as text; the parent raises ModelLoadError
        results.put(("error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))


class Download:
    """One repo's files into `cache_dir/hub`. `worker(repo_id, cache_dir, patterns, results)` runs in
    the child (tests pass their own); `poll_s` is how often `run` reports progress."""

    def __init__(self, repo_id: str, cache_dir: Path, patterns: list[str], worker: Callable = snapshot,
                 poll_s: float = 0.5):
        self.repo_id, self.cache_dir, self.poll_s = repo_id, Path(cache_dir), poll_s
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch, no threads inherited
        self.results = ctx.Queue()
        self.process = ctx.Process(target=worker, args=(repo_id, str(hub_cache(cache_dir)), patterns, self.results),
                                   daemon=True)
        self.total: int | None = None

    def run(self, report: Callable[[Progress], None], cancelled: Callable[[], bool]) -> Path:
        """Download, calling `report` every poll; -> the snapshot folder. Raises ModelLoadError on
        failure or when `cancelled()` turns true (the child is then terminated)."""
        self.process.start()
        folder = repo_folder(self.cache_dir, self.repo_id)
        try:
            while True:
                if cancelled():
                    raise ModelLoadError(f"Cancelled the download of {self.repo_id}; what arrived is kept for next time.")
                message = self._next()
                if message is not None:
                    kind, value = message
                    if kind == "done":
                        report(Progress(bytes_on_disk(folder), self.total))
                        return Path(value)
                    if kind == "error":
                        raise ModelLoadError(f"Could not download {self.repo_id} from Hugging Face ({value}); "
                                             "check the id and your connection, or pass a local folder.")
                    self.total = int(value)
                elif not self.process.is_alive():
                    raise ModelLoadError(f"The download of {self.repo_id} stopped unexpectedly (exit code {self.process.exitcode}).")
                report(Progress(bytes_on_disk(folder), self.total))
        finally:
            if self.process.is_alive():
                self.process.terminate()
            self.process.join(timeout=5)

    def _next(self):
        try:
            return self.results.get(timeout=self.poll_s)
        except Empty:
            return None
