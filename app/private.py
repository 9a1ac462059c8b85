"""Files only the user may read: the chat store's folder and file, and the folder where exports
and Gradio's copies of them wait to be downloaded. Standard library only: launch.py calls
`private_temp_dir` before Gradio is imported, since Gradio reads GRADIO_TEMP_DIR then.

On Windows the modes below are no-ops (os.chmod there only sets read-only); a user's profile
folders are private by their ACLs.
"""

import atexit
import os
import shutil
import stat
import tempfile
from pathlib import Path

FOLDER_MODE = 0o700
FILE_MODE = 0o600


def private_folder(path: Path) -> Path:
    """`path` created if missing (0700) and narrowed to 0700 if it already exists wider."""
    path.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
    narrow(path, FOLDER_MODE)
    return path


def private_file(path: Path) -> Path:
    """`path` created empty if missing (0600, never readable by others even for an instant) and
    narrowed to 0600 if it already exists wider."""
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, FILE_MODE))
    narrow(path, FILE_MODE)
    return path


def narrow(path: Path, mode: int) -> None:
    """Take away every permission of `path` beyond `mode` (group and others, usually)."""
    current = stat.S_IMODE(path.stat().st_mode)
    if current & ~mode:
        os.chmod(path, current & mode)


def write_private(path: Path, text: str) -> Path:
    """`text` written to a new file at `path`, created 0600."""
    with os.fdopen(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, FILE_MODE), "w", encoding="utf-8") as f:
        f.write(text)
    return path


def private_temp_dir(prefix: str = "aerie-") -> Path:
    """A new 0700 temporary folder (mkdtemp makes it so), removed with all it holds when the
    process exits."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    # ignore_errors: at exit there is no one left to tell, and what stays is still private
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
