"""Generated answers that last between sessions: compact token-id shards committed under data/.

Every session starts on a fresh machine, so answers `launch.py generate` leaves in a run folder are
lost with it. An `AnswerStore` keeps them as a folder of gzip'd JSON-lines shards, one line per
answer: {"index": i, "prompt_ids": [...], "answer_ids": [...]} (i: the prompt's place in the
shuffled prompt file), ~1.3 bytes per answer token. No features: `launch.py train` captures those
itself. The folder's `manifest.json` says which prompts (file, its sha256, the shuffle seed) and
which target (model, weights, the generator's matmul kind, token caps) produced every shard, and each
shard's sha256, so a reader can tell a torn or edited file. One folder holds one source: answers
of another target or other prompts go into another folder.

A shard is written whole (temporary file, then rename) every SHARD_ANSWERS answers and at the
end of a run, a stopped one included (`launch.py generate` turns SIGTERM into an exit), so only a
hard kill loses answers, at most the pending ones; a rerun skips every index already stored.
"""

import gzip
import hashlib
import json
from pathlib import Path
from typing import Iterator

from core.files import write_whole

FORMAT = "aerie-answers-1"
MANIFEST = "manifest.json"
SHARD_ANSWERS = 256
DATA_BUDGET = 40 * 2**20   # bytes under data/ in git: answers are kept, not hoarded


class AnswerStoreError(ValueError):
    """A store that cannot be written to or read as asked (another source, a damaged shard, full)."""


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_manifest(folder: Path) -> dict | None:
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:   # e.g. a merge conflict's markers: the file is in git
        raise AnswerStoreError(f"{path} is not valid JSON ({e}); restore it from git.") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not {"source", "shards"} <= manifest.keys():
        raise AnswerStoreError(f"{path} is not an {FORMAT} manifest with a source and shards.")
    return manifest


def is_store(folder: Path) -> bool:
    return (folder / MANIFEST).is_file()


def read_answers(folder: Path) -> Iterator[tuple[str, dict]]:
    """Every stored answer, shard by shard: (where, the line's dict). Raises on a shard whose
    bytes no longer match the manifest."""
    manifest = read_manifest(folder)
    if manifest is None:
        raise AnswerStoreError(f"{folder} has no {MANIFEST}: not an answer store.")
    for shard in manifest["shards"]:
        path = folder / shard["file"]
        data = path.read_bytes() if path.is_file() else None
        if data is None or hashlib.sha256(data).hexdigest() != shard["sha256"]:
            raise AnswerStoreError(f"{path} is missing or differs from its manifest entry (sha256).")
        for n, line in enumerate(gzip.decompress(data).decode().splitlines(), 1):
            yield f"{path}:{n}", json.loads(line)


class AnswerStore:
    def __init__(self, folder: Path, source: dict, budget: tuple[Path, int] | None = None):
        """source: {"target": {...}, "prompts": {...}}, what produced the answers (the manifest's
        own); budget: (a folder, bytes) that folder's files may not outgrow (DATA_BUDGET for data/)."""
        self.folder, self.source, self.budget = folder, source, budget
        manifest = read_manifest(folder)
        if manifest is not None and manifest["source"] != source:
            raise AnswerStoreError(f"{folder} holds answers of another source ({json.dumps(manifest['source'])}); "
                                   f"these would come from {json.dumps(source)}: write them elsewhere (--out).")
        self.shards: list[dict] = manifest["shards"] if manifest else []
        self.pending: list[dict] = []

    def answered(self) -> set[int]:
        """Prompt indices already stored."""
        return {row["index"] for _, row in read_answers(self.folder)} if self.shards else set()

    def add(self, index: int, prompt_ids, answer_ids) -> None:
        self.pending.append({"index": index, "prompt_ids": list(prompt_ids), "answer_ids": list(answer_ids)})
        if len(self.pending) >= SHARD_ANSWERS:
            self.flush()

    def flush(self) -> None:
        """Write the pending answers as one shard, then the manifest that lists it."""
        if not self.pending:
            return
        text = "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in self.pending)
        data = gzip.compress(text.encode(), compresslevel=9, mtime=0)   # mtime 0: the same answers, the same bytes
        self.check_budget(len(data))
        digest = hashlib.sha256(data).hexdigest()
        name = f"answers-{min(r['index'] for r in self.pending):06d}-{digest[:12]}.jsonl.gz"
        self.folder.mkdir(parents=True, exist_ok=True)
        write_whole(self.folder / name, data)
        shards = self.shards + [{"file": name, "answers": len(self.pending), "sha256": digest,
                                 "answer_tokens": sum(len(r["answer_ids"]) for r in self.pending)}]
        manifest = {"format": FORMAT, "source": self.source, "shards": shards,
                    "answers": sum(s["answers"] for s in shards), "answer_tokens": sum(s["answer_tokens"] for s in shards)}
        write_whole(self.folder / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
        # Only once the manifest lists the shard: an interrupt before this leaves the answers pending.
        self.shards, self.pending = shards, []

    def check_budget(self, more: int) -> None:
        if self.budget is None:
            return
        root, limit = self.budget
        used = sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.is_dir() else 0
        if used + more > limit:
            raise AnswerStoreError(f"{root} would hold {(used + more) / 2**20:.1f} MB, past its {limit / 2**20:.0f} MB "
                                   f"budget; {len(self.pending)} answers not kept: write more elsewhere (--out).")


def stores_of(root: Path, model: str) -> list[Path]:
    """The answer stores under `root` whose answers the model called `model` gave (by manifest,
    not by folder name: one model's name can begin another's)."""
    if not root.is_dir():
        return []
    return [d for d in sorted(root.iterdir())
            if is_store(d) and read_manifest(d)["source"]["target"]["model"] == model.lower()]
