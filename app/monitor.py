"""The monitor panel: memory by role per GPU and in RAM, CPU load, the tuner's choice, and a small
plot of tokens/s and accepted length per answer of the chat shown. Plain HTML and SVG from the
service's numbers (a `core.tune.monitor.Snapshot`) and the stored answers' `ReplyStats`; a gr.Timer
refreshes it."""

import html
from collections.abc import Sequence
from typing import Any

from app.answers import stats_of
from app.chats import stored_chat
from core.config import ReplyStats
from core.service.contract import ChatServiceApi

GIB = 2**30
SEGMENTS = (("weights", "Weights", "#0284c7"), ("kv", "KV cache", "#22c55e"), ("draft", "Draft head", "#a855f7"),
            ("activations", "Tree & buffers", "#f59e0b"), ("others", "Other programs", "#94a3b8"))
PLOT_ANSWERS = 40  # the plot shows the latest answers


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n < 10 * GIB else f"{n / GIB:.1f} GiB"


def bar(parts: Sequence[tuple[str, int, str]], total: int) -> str:
    """A stacked bar; parts are (label, bytes, colour); what is left of total shows as free."""
    cells = "".join(
        f"<span style='width:{100 * n / total:.2f}%;background:{colour}' title='{html.escape(label)}: {gib(n)}'></span>"
        for label, n, colour in parts if n > 0)
    return f"<div class='aerie-bar'>{cells}</div>"


def legend(parts: Sequence[tuple[str, int, str]], free: int) -> str:
    items = [f"<span><i style='background:{c}'></i>{html.escape(label)} {gib(n)}</span>" for label, n, c in parts if n > 0]
    items.append(f"<span><i class='aerie-free'></i>Free {gib(free)}</span>")
    return f"<div class='aerie-legend'>{''.join(items)}</div>"


def gpu_block(g: Any) -> str:
    parts = [(label, getattr(g, key), colour) for key, label, colour in SEGMENTS]
    head = f"<b>GPU {g.index}</b> {html.escape(g.name)} · {gib(g.total)}"
    return f"<div class='aerie-mon'>{head}{bar(parts, g.total)}{legend(parts, g.free)}</div>"


def ram_block(s: Any) -> str:
    e = s.engine
    on_cpu = e.device == "cpu"
    ours = [("Weights", e.weights, SEGMENTS[0][2]), ("KV cache", e.kv, SEGMENTS[1][2]),
            ("Draft head", e.draft, SEGMENTS[2][2])] if on_cpu else []
    rest = max(s.process_rss - sum(n for _, n, _ in ours), 0)
    parts = ours + [("Aerie, other", rest, SEGMENTS[3][2]), ("Other programs", max(s.ram_used - s.process_rss, 0),
                                                           SEGMENTS[4][2])]
    head = f"<b>RAM</b> {gib(s.ram_total)} · CPU {s.cpu_percent:.0f}% of {s.cpu_count} cores"
    return f"<div class='aerie-mon'>{head}{bar(parts, s.ram_total)}{legend(parts, s.ram_total - s.ram_used)}</div>"


def memory_html(s: Any) -> str:
    blocks = [gpu_block(g) for g in s.gpus]
    if not s.gpus:
        blocks.append(f"<div class='aerie-muted'>No GPU: {html.escape(s.gpu_note or 'none found')}</div>")
    blocks.append(ram_block(s))
    return "".join(blocks)


def history_svg(answers: Sequence[ReplyStats], width: int = 300, height: int = 90) -> str:
    """Tokens/s (blue, left scale) and mean accepted length (green, right scale) per answer."""
    shown = list(answers)[-PLOT_ANSWERS:]
    if not shown:
        return "<div class='aerie-muted'>The plot fills in as answers arrive.</div>"
    series = [([a.tok_s for a in shown], "#0284c7", "tok/s"), ([a.accept_len for a in shown], "#22c55e", "accepted")]
    lines, labels = [], []
    for values, colour, name in series:
        top = max(max(values), 1e-9) * 1.1
        step = (width - 10) / max(len(values) - 1, 1)
        points = " ".join(f"{5 + i * step:.1f},{height - 14 - (height - 24) * v / top:.1f}" for i, v in enumerate(values))
        lines.append(f"<polyline fill='none' stroke='{colour}' stroke-width='2' points='{points}'/>")
        labels.append(f"<tspan fill='{colour}'>{name} {values[-1]:.2f} (max {max(values):.2f}) </tspan>")
    caption = f"<text x='5' y='{height - 2}' font-size='10'>{''.join(labels)}</text>"
    return (f"<svg class='aerie-plot' viewBox='0 0 {width} {height}' width='100%' role='img' "
            f"aria-label='tokens per second and accepted length per answer'>{''.join(lines)}{caption}</svg>")


def chat_answers(store: Any, chat_id: int | None) -> list[ReplyStats]:
    """The stats of the shown chat's answers, oldest first (app/answers.py keeps them in meta)."""
    if chat_id is None:
        return []
    rows = [m.get("meta") for m in stored_chat(store, chat_id) if m["role"] == "assistant"]
    return [s for s in (stats_of(meta) for meta in rows if meta) if s is not None and s.new_tokens]


def refresh(service: ChatServiceApi, store: Any, chat_id: int | None = None) -> tuple[str, str, str]:
    """(memory, plot of the shown chat, tuner line) for the panel; a failing reading is shown,
    never raised."""
    try:
        memory = memory_html(service.monitor())
        plot = history_svg(chat_answers(store, chat_id))
    except Exception as exc:  # noqa: BLE001 - a monitor must not break the page; the reason is shown
        memory = f"<div class='aerie-muted'>Monitor unavailable: {html.escape(type(exc).__name__)}: {html.escape(str(exc))}</div>"
        plot = ""
    tuning = service.tuning
    return memory, plot, f"**Tuner:** {html.escape(tuning)}" if tuning else ""
