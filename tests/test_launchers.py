"""The double-click launchers in launchers/: each starts launch.py from the checkout it lives in.

The Linux and macOS ones are run here with a stand-in `python3` on PATH that records where it was
started and with what; the Windows one is checked as text (CI has no cmd.exe)."""

import ctypes.util
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAUNCHERS = ROOT / "launchers"


@pytest.fixture
def fake_checkout(tmp_path):
    """A checkout whose folder name has a space, with the launchers and a `python3` stand-in that
    writes its working directory and arguments to a file."""
    checkout = tmp_path / "my aerie"
    shutil.copytree(LAUNCHERS, checkout / "launchers")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "python3.out"
    stub = bin_dir / "python3"
    stub.write_text(f'#!/bin/sh\nprintf "%s\\n" "$PWD" "$@" > "{record}"\n')
    stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return checkout, env, record


def desktop_exec(path: Path) -> list[str]:
    """The Exec line of a .desktop file as the argv a launcher runs (Desktop Entry spec 1.5:
    string escapes first, then double-quoted arguments in which \\ escapes " ` $ and \\),
    with %k, the file's own path, filled in."""
    line = next(v for k, _, v in (ln.partition("=") for ln in path.read_text().splitlines()) if k == "Exec")
    line = line.replace("\\\\", "\\")
    argv, word, quoted, i = [], "", False, 0
    while i < len(line):
        c = line[i]
        if quoted and c == "\\" and line[i + 1] in '"`$\\':
            word, i = word + line[i + 1], i + 2
            continue
        if c == '"':
            quoted = not quoted
        elif c == " " and not quoted:
            argv, word = argv + [word] if word else argv, ""
        else:
            word += c
        i += 1
    argv.append(word)
    return [str(path) if a == "%k" else a for a in argv]


def recorded(record: Path) -> list[str]:
    deadline = time.monotonic() + 10
    while not record.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return record.read_text().splitlines()


def test_linux_desktop_entry_runs_launch_py_from_its_checkout(fake_checkout):
    checkout, env, record = fake_checkout
    entry = checkout / "launchers" / "Aerie.desktop"
    text = entry.read_text()
    assert "[Desktop Entry]" in text and "Type=Application" in text and "Terminal=true" in text
    assert os.access(LAUNCHERS / "Aerie.desktop", os.X_OK)  # file managers launch only executable entries
    subprocess.run(desktop_exec(entry), env=env, check=True, timeout=30)
    assert recorded(record) == [str(checkout), "launch.py"]


def test_linux_desktop_entry_through_glib(fake_checkout, monkeypatch):
    """As GNOME's file manager opens it: GLib's own parser and launcher."""
    library = ctypes.util.find_library("gio-2.0")
    if library is None:
        pytest.skip("no GLib here")
    checkout, env, record = fake_checkout
    entry = checkout / "launchers" / "Aerie.desktop"
    entry.write_text(entry.read_text().replace("Terminal=true", "Terminal=false"))  # no terminal emulator in CI
    gio = ctypes.CDLL(library)
    gio.g_desktop_app_info_new_from_filename.restype = ctypes.c_void_p
    gio.g_desktop_app_info_new_from_filename.argtypes = [ctypes.c_char_p]
    gio.g_app_info_launch.argtypes = [ctypes.c_void_p] * 4
    info = gio.g_desktop_app_info_new_from_filename(str(entry).encode())
    assert info, "GLib could not parse the desktop entry"
    monkeypatch.setenv("PATH", env["PATH"])  # the launched command inherits this process's environment
    assert gio.g_app_info_launch(info, None, None, None)
    assert recorded(record) == [str(checkout), "launch.py"]


def test_macos_command_runs_launch_py_from_its_checkout(fake_checkout):
    checkout, env, record = fake_checkout
    command = checkout / "launchers" / "Aerie.command"
    assert command.read_text().startswith("#!/bin/bash\n")
    assert os.access(LAUNCHERS / "Aerie.command", os.X_OK)  # Finder runs it only when executable
    subprocess.run([str(command)], env=env, cwd="/", check=True, timeout=30)
    assert recorded(record) == [str(checkout), "launch.py"]


def test_windows_batch_file_runs_launch_py_from_its_checkout():
    raw = (LAUNCHERS / "Aerie.bat").read_bytes()
    assert raw.count(b"\r\n") == raw.count(b"\n")  # cmd.exe misreads labels in LF-only batch files
    text = raw.decode("ascii").replace("\r\n", "\n")
    assert text.startswith("@echo off\n")
    assert 'cd /d "%~dp0.."' in text                              # the checkout: the folder above launchers\
    assert "py -3 launch.py %*" in text and "python launch.py %*" in text  # the py launcher, else python
    failed = text.index(":failed")
    assert "goto failed" in text[:failed] and "pause" in text[failed:]    # an error stays on screen
