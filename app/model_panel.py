"""The Model panel: pick a target (a Hugging Face id or a local folder), an EAGLE head and the
quantization. Files not on disk download first, with progress and a Cancel button; the switch
then reports the memory the old model freed and the new one took, as measured by the service."""

import html
import threading
import time
from collections.abc import Iterator
from typing import Any

import gradio as gr

from app.answers import strategy_label
from app.handlers import Cancels, SettingsError, header, report, session_key, shown_label, toast
from core.config import QUANTS, ModelChoice
from core.service.contract import ChatServiceApi
POLL_S = 0.5
GIB = 2**30


def parse_choice(model: Any, head: Any, quant: Any) -> ModelChoice:
    """The panel's fields as a ModelChoice. An empty model is the embedded default; the head box
    takes a Hub id, a folder, `default` or empty (the model's own head, if Aerie ships one), or
    `none` (no head: prompt lookup)."""
    if quant not in QUANTS:
        raise SettingsError(f"Quantization must be one of {', '.join(QUANTS)}, got {quant!r}.")
    model = str(model or "").strip() or None
    head = str(head or "").strip()
    head = None if head.lower() in ("", "default") else ("" if head.lower() == "none" else head)
    return ModelChoice(model=model, quant=quant, head=head)


def progress_line(source: str, progress: Any) -> str:
    if progress.total:
        return (f"Downloading {html.escape(source)}: {progress.done / GIB:.2f} of {progress.total / GIB:.2f} GiB "
                f"({progress.fraction:.0%})")
    return f"Downloading {html.escape(source)}: {progress.done / GIB:.2f} GiB so far"


def switched_line(r: Any) -> str:
    return (f"Loaded {html.escape(shown_label(r.label))}. Switching freed {r.freed / GIB:.2f} GiB; the new model holds "
            f"{r.used / GIB:.2f} GiB ({'GPU allocator' if r.device.startswith('cuda') else 'process memory'}, "
            "measured).")


def model_status(label: str) -> str:
    return f"Current: {html.escape(shown_label(label))}"


def begin_load() -> tuple:
    """Unqueued first step: (Load, Cancel) -> Cancel replaces Load while the switch runs."""
    return gr.update(visible=False), gr.update(visible=True)


def cancel_load(loads: Cancels, request: gr.Request | None = None) -> str:
    return "Cancelling…" if loads.cancel(session_key(request)) else gr.skip()


def _fetch(service: ChatServiceApi, choice: ModelChoice, cancel: threading.Event) -> Iterator[str]:
    """Run the service's download in a thread, yielding a progress line every POLL_S seconds."""
    latest, failure = {"line": "Checking the Hugging Face Hub…"}, []

    def work():
        try:
            service.fetch(choice, lambda source, p: latest.update(line=progress_line(source, p)), cancel.is_set)
        except Exception as exc:  # noqa: BLE001 - re-raised in the page's thread below
            failure.append(exc)

    thread = threading.Thread(target=work, name="aerie-download", daemon=True)
    thread.start()
    while thread.is_alive():
        yield latest["line"]
        thread.join(POLL_S)
    if failure:
        raise failure[0]


def load_model(service: ChatServiceApi, loads: Cancels, model: Any, head: Any, quant: Any, system_prompt: str,
               request: gr.Request | None = None) -> Iterator[tuple[str, str, str]]:
    """Fetch, then switch; yields (header, status, system prompt). On any failure the page keeps
    the current model's header and a toast explains (a mismatched head names both sizes)."""
    key, old_default = session_key(request), service.default_system_prompt
    cancel = loads.start(key)
    try:
        choice = parse_choice(model, head, quant)
        for line in _fetch(service, choice, cancel):
            yield gr.skip(), line, gr.skip()
        if cancel.is_set():
            raise SettingsError("Cancelled.")
        yield gr.skip(), f"Loading {html.escape(choice.model or 'the embedded model')}…", gr.skip()
        t0 = time.perf_counter()
        switched = service.load_model(choice)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a toast; unexpected ones are logged
        report(exc, "load the model")
        yield header(service.label), model_status(service.label), system_prompt
        return
    finally:
        loads.finish(key, cancel)
    toast("info", f"Loaded {shown_label(switched.label)} in {time.perf_counter() - t0:.1f} s")
    prompt = service.default_system_prompt if system_prompt == old_default else system_prompt
    yield header(switched.label), switched_line(switched), prompt


AUTO = "auto"   # the drafter choice that leaves it to the tuner


def drafter_choices(drafters: tuple[str, ...]) -> list[tuple[str, str]]:
    """The Drafter dropdown: the tuner's choice, then every drafter the model has, by its label."""
    return [("auto (the tuner decides)", AUTO), *((strategy_label(name), name) for name in drafters)]


def pin_drafter(service: ChatServiceApi, choice: Any) -> str:
    """Pin the drafter chosen in the dropdown (or hand the choice back to the tuner); -> the status line."""
    try:
        plan = service.pin(None if choice in (None, AUTO) else str(choice))
    except Exception as exc:  # noqa: BLE001 - a toast, and the model's status as it was
        report(exc, "pin the drafter")
        return model_status(service.label)
    return model_status(service.label) + f"<br>Drafter: {html.escape(plan)}"
