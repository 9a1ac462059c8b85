"""Sampling settings that survive a page reload: kept in the browser (a gr.BrowserState, i.e.
localStorage), written on each change, put back on page load (ui.py wires both).

Only what the user changed is kept: a value left at the page's default follows the defaults of
the next launch (launch.py's command line). The system prompt is not kept: it follows the loaded
model's own default (model_panel.load_model).
"""

import math
from collections.abc import Mapping
from typing import Any

import gradio as gr

# The Settings panel's fields after the system prompt, in the order of ui._settings_panel.
FIELDS = ("temperature", "top_p", "top_k", "seed", "max_new_tokens", "stop_text")
# A fixed key, so that a later launch reads what an earlier one wrote (a random one is Gradio's
# default). BrowserState encrypts with a secret the page itself receives, so ours is no secret:
# the values are only sampling settings.
STORAGE_KEY = "aerie-sampling-settings"
SEED_RANGE = (-1, 2**63 - 1)  # as handlers.parse_settings checks it


def remember(defaults: Mapping[str, Any], temperature: Any, top_p: Any, top_k: Any, seed: Any,
             max_new_tokens: Any, stop_text: Any) -> dict:
    """What the browser keeps: the fields whose value differs from the page's default."""
    values = dict(zip(FIELDS, (temperature, top_p, top_k, seed, max_new_tokens, stop_text)))
    return {name: value for name, value in values.items() if value != defaults.get(name)}


def _number_in(value: Any, low: float | None, high: float | None) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return (low is None or value >= low) and (high is None or value <= high)


def usable(name: str, value: Any, limits: Mapping[str, tuple[float | None, float | None]]) -> bool:
    """Whether a kept value can go back into its field: a slider refuses a value outside its
    range on every later event, and what the browser kept may come from another version."""
    if name == "stop_text":
        return isinstance(value, str)
    if name == "seed":
        return value is None or (_number_in(value, *SEED_RANGE) and value == int(value))
    return _number_in(value, *limits.get(name, (None, None)))


def restore(limits: Mapping[str, tuple[float | None, float | None]], saved: Any) -> tuple:
    """Page load: updates for FIELDS, the kept value where there is a usable one, else the field
    as it is. `limits` are the sliders' (minimum, maximum) by field name."""
    saved = saved if isinstance(saved, dict) else {}
    return tuple(saved[name] if name in saved and usable(name, saved[name], limits) else gr.skip()
                 for name in FIELDS)
