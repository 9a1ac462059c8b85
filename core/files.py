"""Files written whole or not at all: the data goes to a temporary file beside the target, which
is renamed over it once complete (a rename within a folder is atomic), so a kill mid-write never
leaves half a file under the real name. Caches, checkpoints, feature shards and answer stores."""

import hashlib
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def written_whole(path: Path) -> Iterator[Path]:
    """Yields where to write; once the block ends without an error, that file becomes `path`."""
    tmp = path.with_name(path.name + ".tmp")
    yield tmp
    os.replace(tmp, path)


def write_whole(path: Path, data: bytes) -> None:
    with written_whole(path) as tmp:
        tmp.write_bytes(data)


def stored(folder: Path, key: dict, measure, encode, decode, check=None, announce: str | None = None):
    """The value stored under `key` in `folder` (a JSON file named by the key's digest), or
    `measure()` stored now; -> (value, whether it was stored). `encode`/`decode` turn the value into
    JSON and back; a file that fails to decode, or whose value `check` (value -> why it no longer
    holds, or None) rejects, is measured again, and the reason printed. `announce` is printed
    before measuring a key seen for the first time."""
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = folder / f"{digest}.json"
    if path.is_file():
        try:
            value = decode(json.loads(path.read_text())["value"])
            why = check(value) if check is not None else None
            if why is None:
                return value, True
            print(f"Aerie: measuring again: {why}.", flush=True)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            print(f"Aerie: measuring again: {path} is unreadable ({e}).", flush=True)
    elif announce:
        print(announce, flush=True)
    value = measure()
    folder.mkdir(parents=True, exist_ok=True)
    write_whole(path, json.dumps({"key": key, "value": encode(value)}, indent=1).encode())
    return value, False
