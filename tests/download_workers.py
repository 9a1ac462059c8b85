"""Stand-ins for models/download.py's child (huggingface_hub's snapshot download), in a module of
their own that imports only the standard library: the download's child is a spawned interpreter
that imports the module its worker lives in, and test_model_panel.py's imports (gradio, torch)
took ~10 s of each download test there."""

import time
from pathlib import Path

GIB = 2**30


def slow_worker(repo_id, hub, patterns, results):
    """Lists 4 MB, then writes 1 MB per 0.2 s into blobs/ and finishes."""
    blobs = Path(hub) / ("models--" + repo_id.replace("/", "--")) / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    results.put(("total", 4 * 2**20))
    for i in range(4):
        (blobs / f"part{i}.incomplete").write_bytes(b"x" * 2**20)
        time.sleep(0.2)
    snap = blobs.parent / "snapshots" / "abc"
    snap.mkdir(parents=True, exist_ok=True)
    results.put(("done", str(snap)))


def failing_worker(repo_id, hub, patterns, results):
    results.put(("error", "RepositoryNotFoundError: 404"))


def hanging_worker(repo_id, hub, patterns, results):
    results.put(("total", 10 * GIB))
    time.sleep(60)
