"""Sampling settings kept across page reloads (app/saved_settings.py and its wiring in app/ui.py),
without a browser: the page's BrowserState is played by passing remember's result to restore."""

import gradio as gr
import pytest

from app import saved_settings
from app.store import ChatStore
from app.ui import UiDefaults, build_ui
from core.config import SamplingConfig
from tests.fakes import FakeService

DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": -1, "max_new_tokens": 512, "stop_text": ""}
LIMITS = {"temperature": (0, 2), "top_p": (0.01, 1), "top_k": (0, 200), "max_new_tokens": (1, 4096)}


def test_remember_keeps_only_what_differs_from_the_defaults():
    assert saved_settings.remember(DEFAULTS, 0.0, 1.0, 0, -1, 512, "") == {}
    assert saved_settings.remember(DEFAULTS, 0.7, 1.0, 40, None, 512, "END") == {
        "temperature": 0.7, "top_k": 40, "seed": None, "stop_text": "END"}


def test_restore_puts_back_what_was_kept_and_leaves_the_rest():
    kept = saved_settings.remember(DEFAULTS, 0.7, 0.9, 0, 7, 512, "\\n\\n")
    assert saved_settings.restore(LIMITS, kept) == (0.7, 0.9, gr.skip(), 7, gr.skip(), "\\n\\n")
    assert saved_settings.restore(LIMITS, {}) == (gr.skip(),) * 6  # nothing kept yet
    assert saved_settings.restore(LIMITS, None) == (gr.skip(),) * 6


@pytest.mark.parametrize("name, value", [
    ("temperature", 5.0), ("top_p", 0.0), ("top_k", "40"), ("max_new_tokens", True), ("max_new_tokens", 9000),
    ("seed", 1.5), ("seed", -2), ("stop_text", 3), ("temperature", float("nan")),
])
def test_restore_drops_values_a_field_would_refuse(name, value):
    """A slider refuses an out-of-range value on every later event, so such a value stays out."""
    assert saved_settings.restore(LIMITS, {name: value}) == (gr.skip(),) * 6


def test_the_page_keeps_sampling_settings_across_a_reload(tmp_path):
    defaults = UiDefaults(sampling=SamplingConfig(temperature=0.3, max_new_tokens=256), stop_strings=("\n",))
    demo = build_ui(FakeService(), defaults, store=ChatStore(tmp_path / "chats.sqlite3"))
    fns = {fn.name: fn for fn in demo.fns.values()}
    remember, restore = fns["remember"], fns["restore"]
    (kept,) = remember.outputs
    assert isinstance(kept, gr.BrowserState) and restore.inputs == [kept]
    assert kept.storage_key == saved_settings.STORAGE_KEY  # a later launch reads what this one wrote
    assert [label.label for label in restore.outputs] == ["Temperature", "Top-p", "Top-k", "Seed",
                                                          "Max new tokens", "Stop strings"]
    assert remember.inputs == restore.outputs
    assert {(demo.blocks[i].label, event) for i, event in remember.targets} == {
        (label, "change") for label in ["Temperature", "Top-p", "Top-k", "Seed", "Max new tokens", "Stop strings"]}
    # The user moves two settings; the page reloads and asks for them back.
    stored = remember.fn(0.3, 0.8, 0, 11, 256, "\\n")
    assert stored == {"top_p": 0.8, "seed": 11}  # the launch's defaults are not kept
    assert restore.fn(stored) == (gr.skip(), 0.8, gr.skip(), 11, gr.skip(), gr.skip())
