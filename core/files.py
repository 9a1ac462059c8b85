"""Files written whole or not at all: the data goes to a temporary file beside the target, which
is renamed over it once complete (a rename within a folder is atomic), so a kill mid-write never
leaves half a file under the real name. Caches, checkpoints, feature shards and answer stores."""

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
