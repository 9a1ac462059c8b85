"""The Model panel (app/model_panel.py), cancellable downloads (models/download.py) and model
switching in the service (core/service/chat.py, core/service/switching.py), without a network: the download's
child process runs a stand-in worker that writes blobs the way huggingface_hub does."""

import time
from types import SimpleNamespace

import gradio as gr
import pytest
import torch

from app import model_panel
from app.handlers import Cancels, header
from core.service.chat import ChatService
from core.config import ModelChoice
from core.errors import HeadMismatchError, ModelLoadError
from core.service.switching import SwitchReport, fetch, is_hub_id
from models.download import Download, Progress, repo_folder
from tests.download_workers import failing_worker, hanging_worker, slow_worker

GIB = 2**30


def test_download_reports_progress_and_returns_the_snapshot(tmp_path):
    seen = []
    path = Download("org/model", tmp_path, ["*.json"], slow_worker, poll_s=0.05).run(seen.append, lambda: False)
    assert path.name == "abc" and seen[-1] == Progress(4 * 2**20, 4 * 2**20) and seen[-1].fraction == 1.0
    assert any(0 < p.done < 4 * 2**20 for p in seen)  # intermediate progress was reported
    assert [p.done for p in seen] == sorted(p.done for p in seen)


def test_download_cancel_stops_the_child(tmp_path):
    download = Download("org/big", tmp_path, ["*"], hanging_worker, poll_s=0.05)
    t0 = time.perf_counter()
    with pytest.raises(ModelLoadError, match="Cancelled the download of org/big"):
        download.run(lambda p: None, lambda: time.perf_counter() - t0 > 1.0)
    assert not download.process.is_alive() and time.perf_counter() - t0 < 10


def test_download_failure_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="Could not download org/none .*404.*local folder"):
        Download("org/none", tmp_path, ["*"], failing_worker, poll_s=0.05).run(lambda p: None, lambda: False)


def test_fetch_downloads_only_hub_ids(tmp_path):
    (tmp_path / "local").mkdir()
    assert is_hub_id("org/model") and not is_hub_id(str(tmp_path / "local")) and not is_hub_id(None)
    assert not is_hub_id("random") and not is_hub_id("")
    seen = []
    fetch(ModelChoice(str(tmp_path / "local"), "none", "org/head"), tmp_path, lambda s, p: seen.append(s),
          lambda: False, worker=slow_worker)
    assert set(seen) == {"org/head"} and repo_folder(tmp_path, "org/head").is_dir()


# ---------------------------------------------------------------- switching in the service


class FakeEngine:
    def __init__(self, name):
        self.target = SimpleNamespace(device=torch.device("cpu"), label=f"{name} · cpu · fp32", name=name)
        self.drafter = SimpleNamespace(name="eagle")


def fake_loader(choice):
    if choice.head == "bad/head":
        raise HeadMismatchError("The head expects hidden size 4096; the target has 576.")
    return SimpleNamespace(engine=FakeEngine(choice.model or "embedded"), tuner=None, pending=None)


def test_switch_reports_memory_and_a_failed_switch_restores_the_old_model(monkeypatch):
    import core.service.chat as chat_module
    readings = iter([5 * GIB, 2 * GIB, 3 * GIB])  # before, after freeing, after loading
    monkeypatch.setattr(chat_module, "process_bytes", lambda device: next(readings))
    monkeypatch.setattr(chat_module, "release", lambda device: next(readings))
    service = ChatService(FakeEngine("old"), fake_loader, choice=ModelChoice("old", "none", None))
    report = service.load_model(ModelChoice("new", "none", None))
    assert report == SwitchReport("new · cpu · fp32 · eagle", "cpu", 3 * GIB, GIB)
    readings = iter([3 * GIB, 2 * GIB])
    with pytest.raises(HeadMismatchError, match="hidden size 4096.*previous model is loaded again"):
        service.load_model(ModelChoice("other", "none", "bad/head"))
    assert service.engine.target.name == "new" and service.choice.model == "new"


def test_an_unexpected_load_error_still_brings_the_old_model_back(monkeypatch):
    import core.service.chat as chat_module
    monkeypatch.setattr(chat_module, "process_bytes", lambda device: GIB)
    monkeypatch.setattr(chat_module, "release", lambda device: GIB)

    def loader(choice):
        if choice.model == "broken":
            raise RuntimeError("SafetensorError: invalid header\nmore detail")
        return SimpleNamespace(engine=FakeEngine(choice.model), tuner=None, pending=None)

    service = ChatService(FakeEngine("old"), loader, choice=ModelChoice("old", "none", None))
    with pytest.raises(ModelLoadError, match=r"RuntimeError: SafetensorError: invalid header\)\. The previous model"):
        service.load_model(ModelChoice("broken", "none", None))
    assert service.engine.target.name == "old"


def test_preflight_refuses_before_anything_is_freed(embedded_dir, cache_dir):
    from core.service.switching import preflight
    from models.target import LoadSpec

    loads = []
    service = ChatService(FakeEngine("old"), lambda c: loads.append(c), choice=ModelChoice("old", "none", None),
                          preflight=lambda c: preflight(LoadSpec(c.model, "none", "cpu", cache_dir), c.head))
    with pytest.raises(ModelLoadError, match="neither a local folder"):
        service.load_model(ModelChoice("./no-such-model-here", "none", None))
    with pytest.raises(ModelLoadError, match="head folder /no/such/head does not exist"):
        service.load_model(ModelChoice(None, "none", "/no/such/head"))
    assert loads == [] and service.engine.target.name == "old"


# ---------------------------------------------------------------- the panel


class PanelService:
    def __init__(self, download_s=0.0, fail=None):
        self.label, self.default_system_prompt = "old · cpu · fp32 · eagle", "I am old."
        self.download_s, self.fail, self.fetched = download_s, fail, []

    def fetch(self, choice, report, cancelled):
        self.fetched.append(choice)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < self.download_s:
            if cancelled():
                raise ModelLoadError(f"Cancelled the download of {choice.model}; what arrived is kept for next time.")
            report(choice.model, Progress(int((time.perf_counter() - t0) / self.download_s * GIB), GIB))
            time.sleep(0.05)

    def load_model(self, choice):
        if self.fail:
            raise self.fail
        self.label, self.default_system_prompt = f"{choice.model} · cpu · {choice.quant} · eagle", "I am new."
        return SwitchReport(self.label, "cpu", 2 * GIB, GIB // 2)


@pytest.fixture
def toasts(monkeypatch):
    shown = []
    monkeypatch.setattr(gr, "Warning", lambda message, **kw: shown.append(("warning", message)))
    monkeypatch.setattr(gr, "Info", lambda message, **kw: shown.append(("info", message)))
    return shown


def test_parse_choice():
    assert model_panel.parse_choice(" org/M ", "", "nf4") == ModelChoice("org/M", "nf4", None)
    assert model_panel.parse_choice("", "none", "none") == ModelChoice(None, "none", "")
    assert model_panel.parse_choice("m", "yuhuili/EAGLE3", "none").head == "yuhuili/EAGLE3"
    with pytest.raises(Exception, match="Quantization"):
        model_panel.parse_choice("m", "", "int3")


def test_load_streams_download_progress_then_the_measured_switch(toasts, monkeypatch):
    monkeypatch.setattr(model_panel, "POLL_S", 0.05)
    service = PanelService(download_s=0.5)
    updates = list(model_panel.load_model(service, Cancels(), "org/New", "", "none", "I am old."))
    lines = [u[1] for u in updates]
    assert any("Downloading org/New" in line and "of 1.00 GiB" in line for line in lines)
    head, status, prompt = updates[-1]
    assert "org/New · cpu · none" in head and "freed 2.00 GiB" in status and "holds 0.50 GiB" in status
    assert prompt == "I am new." and toasts[-1][0] == "info"


def test_cancel_stops_the_download_and_keeps_the_model(toasts, monkeypatch):
    monkeypatch.setattr(model_panel, "POLL_S", 0.05)
    service, loads = PanelService(download_s=30), Cancels()
    request = SimpleNamespace(session_hash="s1")
    updates = model_panel.load_model(service, loads, "org/Huge", "", "nf4", "mine", request)
    next(updates)
    assert model_panel.cancel_load(loads, request) == "Cancelling…"
    rest = list(updates)
    assert rest[-1] == (header("old · cpu · fp32 · eagle"), model_panel.model_status(service.label), "mine")
    assert "Cancelled the download of org/Huge" in toasts[-1][1]


def test_a_mismatched_head_is_explained(toasts):
    service = PanelService(fail=HeadMismatchError("The head expects hidden size 4096; the target has 576."))
    *_, last = model_panel.load_model(service, Cancels(), "org/New", "bad/head", "none", "p")
    assert last[2] == "p" and "hidden size 4096" in toasts[-1][1] and toasts[-1][0] == "warning"


def test_the_drafter_dropdown_pins_and_unpins():
    from app import model_panel
    from tests.fakes import FakeService

    service = FakeService()
    assert model_panel.drafter_choices(service.drafters)[0] == ("auto (the tuner decides)", "auto")
    assert ("EAGLE head", "eagle") in model_panel.drafter_choices(service.drafters)
    line = model_panel.pin_drafter(service, "prompt_lookup")
    assert service.pinned == "prompt_lookup" and "Drafter: prompt_lookup decides" in line
    model_panel.pin_drafter(service, "auto")
    assert service.pinned is None
