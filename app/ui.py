"""The chat page: layout and event wiring only. What each event does lives in app/handlers.py and,
for the saved chats, in app/chats.py.

launch.py builds the service and the chat store, then:
    demo = build_ui(service, defaults, store=store)
    demo.launch(server_name="127.0.0.1", inbrowser=True, **launch_options())
(Gradio 6 takes `css` and `theme` in launch(), not in Blocks().)
"""

import inspect
import json
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gradio as gr

from app import chats, compare, handlers, model_panel, monitor, race, saved_settings
from app.page_scripts import CHATS_ID, CONFIRM_DELETE, DRAW_SENT, DRAW_SENT_ID, SHOW_SENT, chats_inert, in_page
from app.private import private_temp_dir
from app.store import ChatStore
from core.config import SamplingConfig
from core.service.contract import ChatServiceApi

CSS_PATH = Path(__file__).resolve().parent.parent / "assets" / "style.css"
ENGINE = "engine"  # one concurrency group: one answer or model load at a time, across all tabs
MONITOR_S = 2.0    # seconds between monitor refreshes
# Gradio's queue looks for new events every millisecond when it has none to start (Queue.sleep_when_free,
# no public setting): a thousand wake-ups a second of a thread that takes the GIL between the
# engine's kernels. An engine on the worker beside such an asyncio loop, 2-core Zen 4, 8 MT-bench
# prompts x 128 tokens x 2, alternated: 151.0 tok/s beside a 1 ms poll, 161.7 at 5 ms, 155.9 at
# 10 ms, 158.5 at 50 ms. An event now waits up to 5 ms longer to start.
QUEUE_POLL_S = 0.005
# Gradio's copies of exported chats: every minute, those older than ten minutes are deleted (a
# download follows its export within seconds), and all of them when the server stops.
EXPORT_CACHE = (60, 600)
# No loading status on an event's outputs, for every event but a model's load (which shows its
# progress). Gradio keeps the status it gives each output of an event (and each input: that part
# is its own), and from then on every status message of every event snapshots each such
# component's props (`structuredClone`; 6,100 -> 4,300 clones a 128-token answer with this) and
# redraws its hidden tracker. And a status shown even for the milliseconds of New chat mounts
# Gradio's loader, whose spring animation then runs ~3 s more at 60 frames a second (it stops
# only between moves), beside the answer sent next.
QUIET = {"show_progress": "hidden", "show_progress_on": []}


@dataclass(frozen=True)
class UiDefaults:
    """The page's starting values; launch.py fills them from the command line."""

    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_strings: tuple[str, ...] = ()
    model: str = ""      # prefilled in the Model box, e.g. the model that launch.py loaded
    quant: str = "nf4"   # one of model_panel.QUANTS
    head: str = ""       # prefilled in the head box; empty = the model's default head


def launch_options() -> dict[str, Any]:
    """The launch() keywords that style the page: css from assets/, a theme with system fonts
    (the default themes fetch Google fonts, which an offline desktop cannot reach); and no run
    history. Gradio 6 keeps every call's inputs and outputs in the browser's localStorage
    (`gradio:run-history:v2:...`): a copy of every chat outside Aerie's store, which deleting the
    chat leaves behind, rewritten whole at each answer (51 KB after six short answers), which made
    each page answer slower than the one before (Chromium's storage process 6 -> 42 ms an answer
    over 32 answers, the page's speed 0.94 -> 0.82 of the API's). False also deletes what it kept."""
    theme = gr.themes.Soft(
        primary_hue="sky",
        neutral_hue="slate",
        font=("ui-sans-serif", "system-ui", "sans-serif"),
        font_mono=("ui-monospace", "SFMono-Regular", "monospace"),
    )
    return {"css": CSS_PATH.read_text(encoding="utf-8"), "theme": theme, "run_history": False}


def bind(fn: Callable, *deps: Any, **named: Any) -> Callable:
    """functools.partial(fn, *deps, **named) as a plain function: Gradio reads the type hints
    that ask for a gr.Request only from plain functions, and a partial object hides them."""
    if inspect.isgeneratorfunction(fn):
        def bound(*args):
            yield from fn(*deps, *args, **named)
    else:
        def bound(*args):
            return fn(*deps, *args, **named)
    params = [p for p in list(inspect.signature(fn).parameters.values())[len(deps):] if p.name not in named]
    hints = typing.get_type_hints(fn)
    bound.__signature__ = inspect.Signature(params)
    bound.__annotations__ = {p.name: hints[p.name] for p in params if p.name in hints}
    bound.__name__ = bound.__qualname__ = fn.__name__
    bound.__doc__ = fn.__doc__
    return bound


def _as_defaults(defaults: UiDefaults | Mapping[str, Any] | None) -> UiDefaults:
    if defaults is None:
        return UiDefaults()
    return defaults if isinstance(defaults, UiDefaults) else UiDefaults(**defaults)


def _settings_panel(service: ChatServiceApi, d: UiDefaults) -> list[gr.Component]:
    """System prompt and sampling controls, in the order handlers.respond takes them."""
    s = d.sampling
    with gr.Accordion("Settings", open=True):
        system = gr.Textbox(lambda: service.default_system_prompt, label="System prompt", lines=3, max_lines=12)
        temperature = gr.Slider(0, 2, value=s.temperature, step=0.05, label="Temperature", info="0 = greedy")
        top_p = gr.Slider(0.01, 1, value=s.top_p, step=0.01, label="Top-p")
        top_k = gr.Slider(0, max(200, s.top_k), value=s.top_k, step=1, label="Top-k", info="0 = no limit")
        max_new = gr.Slider(1, max(4096, s.max_new_tokens), value=s.max_new_tokens, step=1, label="Max new tokens")
        seed = gr.Number(-1 if s.seed is None else s.seed, precision=0, label="Seed", info="-1 or blank = random")
        stops = gr.Textbox(", ".join(x.replace("\n", "\\n") for x in d.stop_strings), label="Stop strings",
                           placeholder="comma or newline separated; \\n = newline", lines=1, max_lines=4)
    return [system, temperature, top_p, top_k, seed, max_new, stops]


def _wire_saved_settings(demo: gr.Blocks, settings: list[gr.Component]) -> None:
    """The sampling settings (all but the system prompt) survive a reload: kept in the browser on
    each change, put back on page load (app/saved_settings.py). `.change`, not `.input`: a slider's
    number box reports an edit only as a change."""
    fields = settings[1:]
    kept = gr.BrowserState({}, storage_key=saved_settings.STORAGE_KEY, secret=saved_settings.STORAGE_KEY)
    defaults = {name: c.value for name, c in zip(saved_settings.FIELDS, fields)}
    limits = {name: (getattr(c, "minimum", None), getattr(c, "maximum", None))
              for name, c in zip(saved_settings.FIELDS, fields)}
    private = {"queue": False, "api_visibility": "private", **QUIET}
    demo.load(bind(saved_settings.restore, limits), inputs=kept, outputs=fields, **private)
    gr.on([c.change for c in fields], bind(saved_settings.remember, defaults), inputs=fields, outputs=kept, **private)


def _model_panel(service: ChatServiceApi, d: UiDefaults) -> SimpleNamespace:
    """Target, head and quantization (app/model_panel.py)."""
    with gr.Accordion("Model", open=False):
        model = gr.Textbox(d.model, label="Model", placeholder="Hugging Face id or local folder; empty = embedded")
        head = gr.Textbox(d.head, label="EAGLE head", placeholder="default",
                          info="A SafeAILab head's Hub id or a folder (one Aerie trained works too); "
                               "empty or 'default' = the model's shipped head, 'none' = prompt lookup")
        quant = gr.Dropdown(list(model_panel.QUANTS), value=d.quant, label="Quantization",
                            info="nf4 = 4-bit (bitsandbytes, CUDA); int4/int8 = small weights on a CPU; "
                                 "none = unquantized (bf16 on a GPU, fp32 on a CPU)")
        drafter = gr.Dropdown(model_panel.drafter_choices(service.drafters), value=model_panel.AUTO, label="Drafter",
                              info="Who drafts: the tuner's choice, or one drafter for every answer (Race drafters "
                                   "shows which is fastest here)", elem_id="aerie-drafter")
        with gr.Row():
            load = gr.Button("Load model", variant="secondary")
            cancel = gr.Button("Cancel", variant="stop", visible=False)
        status = gr.Markdown(lambda: model_panel.model_status(service.label), elem_classes="aerie-muted",
                             elem_id="aerie-model-status")
    drafter.change(bind(model_panel.pin_drafter, service), inputs=drafter, outputs=status, api_name="pin_drafter",
                   concurrency_id=ENGINE, concurrency_limit=1, show_progress="minimal")
    return SimpleNamespace(model=model, head=head, quant=quant, drafter=drafter, load=load, cancel_load=cancel,
                           status=status)


def _chat_panel() -> SimpleNamespace:
    # Each message its own bubble and Copy button: grouped, an answer's Copy also copied the
    # statistics row under it.
    chatbot = gr.Chatbot(label="Chat", show_label=False, elem_id="aerie-chat", height="65vh",
                         placeholder="Ask anything. Answers stream as they are written.",
                         buttons=["copy", "copy_all"], feedback_options=None, group_consecutive_messages=False)
    stats = gr.Markdown("", label="Stats", elem_id="aerie-stats")
    with gr.Row(elem_id="aerie-input", equal_height=True):
        textbox = gr.Textbox(show_label=False, placeholder="Message Aerie (Enter sends, Shift+Enter: new line)",
                             lines=1, max_lines=10, scale=8, autofocus=True, container=False)
        send = gr.Button("Send", variant="primary", scale=1, min_width=90)
        stop = gr.Button("Stop", variant="stop", scale=1, min_width=90, visible=False)
        regen = gr.Button("Regenerate", scale=1, min_width=110)
        ab = gr.Button("A/B vs plain", scale=1, min_width=140, elem_id="aerie-ab")
        racing = gr.Button("Race drafters", scale=1, min_width=140, elem_id="aerie-race")
    highlight = gr.Checkbox(False, label="Highlight drafted tokens", container=False, elem_id="aerie-highlight",
                            info="Marks the text of draft tokens the model accepted (shows answers as raw text)")
    draw_sent = gr.Button("Draw the sent message", visible="hidden", elem_id=DRAW_SENT_ID)  # DRAW_SENT clicks it
    answered = gr.Number(visible="hidden", elem_id="aerie-answered")  # chats.answered: its change unlocks the page
    return SimpleNamespace(chatbot=chatbot, stats=stats, textbox=textbox, send=send, stop=stop,
                           regen=regen, ab=ab, race=racing, highlight=highlight, draw_sent=draw_sent, answered=answered)


def _chats_panel() -> SimpleNamespace:
    """The saved chats, newest first, and what can be done with the one shown (app/chats.py);
    filled on page load."""
    with gr.Accordion("Chats", open=True):
        with gr.Row():
            new = gr.Button("New chat", size="sm", scale=2, min_width=80)
            delete = gr.Button("Delete", size="sm", variant="stop", scale=1, min_width=60)
        find = gr.Textbox(show_label=False, placeholder="Find a chat", max_lines=1, container=False,
                          elem_id="aerie-find")
        chat_list = gr.Radio([], value=None, show_label=False, container=False, elem_id=CHATS_ID)
        with gr.Row(equal_height=True):
            title = gr.Textbox(show_label=False, placeholder="Title of this chat", max_lines=1, scale=3,
                               container=False)
            rename = gr.Button("Rename", size="sm", scale=1, min_width=70)
        with gr.Row():
            export_json = gr.Button("Export .json", size="sm", min_width=80)
            export_md = gr.Button("Export .md", size="sm", min_width=80)
        exported = gr.File(label="Exported chat", visible=False, interactive=False)
    return SimpleNamespace(list=chat_list, find=find, finds=chats.Finds(), new=new, title=title, rename=rename,
                           export_json=export_json, export_md=export_md, delete=delete, exported=exported,
                           lock=[new, delete])  # the order of chats.controls; the list is made inert


def _wire_chats(demo: gr.Blocks, store: ChatStore, exports: Path, p: SimpleNamespace, answers: list) -> None:
    """The Chats panel's events, exports written under `exports`; `answers` are the respond and
    regenerate events, which save into the chat shown and lock the panel while they run."""
    c, private = p.chats, {"api_visibility": "private", **QUIET}
    view = [c.list, p.chatbot, p.stats, c.title, c.exported]  # the order of a chats view
    # Unqueued: a click on New chat or a message sent right after the page opens must not be
    # overwritten by this opening view arriving late from the queue.
    demo.load(bind(chats.open_latest, store), inputs=p.highlight, outputs=view, queue=False, **private)
    c.list.input(bind(chats.switch, store), inputs=[c.list, p.highlight], outputs=view, **private)
    # The chatbot's trash button starts a new chat too: the cleared one stays in the list.
    gr.on([c.new.click, p.chatbot.clear], bind(chats.new_chat, store), outputs=view, **private)
    # The list holds the most recent chats (chats.LISTED); Find lists others, as each key is typed.
    c.find.input(bind(chats.find, store, c.finds), inputs=[c.find, c.list], outputs=c.list, trigger_mode="always_last",
                 **private)
    gr.on([c.rename.click, c.title.submit], bind(chats.rename, store, finds=c.finds), inputs=[c.list, c.title],
          outputs=[c.list, c.title], **private)
    c.delete.click(bind(chats.delete, store, finds=c.finds), inputs=[c.list, p.highlight], outputs=view,
                   js=CONFIRM_DELETE, **private)
    c.export_json.click(bind(chats.export, store, exports, "json"), inputs=c.list, outputs=c.exported, **private)
    c.export_md.click(bind(chats.export, store, exports, "markdown"), inputs=c.list, outputs=c.exported, **private)
    # The monitor's timer pauses while an answer streams: each refresh redraws its panel beside the
    # engine (on the 2-core Xeon ~0.1 s of the browser's CPU a tick, a tenth of a 128-token answer's).
    locked = chats.controls("answering") + (gr.update(active=False),)
    idle = chats.controls("idle") + (gr.update(active=True),)
    # Send's locks come with the drawing of its message: listeners of one event run one after
    # another in the page, and Enter's first is respond, whose stream lasts the whole answer.
    gr.on([p.draw_sent.click, p.regen.click, p.ab.click, p.race.click], outputs=[*c.lock, p.monitor],
          **in_page(locked, effect=chats_inert(True)))
    respond, regenerate, ab, raced = answers
    unlock = in_page(idle, effect=chats_inert(False))
    p.answered.change(outputs=[*c.lock, p.monitor], **unlock)  # respond's and regenerate's last update
    for answer in (respond, regenerate):
        answer.failure(outputs=[*c.lock, p.monitor], **unlock)
    for answer in (ab, raced):
        answer.then(outputs=[*c.lock, p.monitor], **unlock)
    p.chatbot.clear(outputs=[*c.lock, p.monitor], **unlock)  # Clear cancels the answer
    # Queued behind a running answer: the chat is redrawn from the store once it is saved.
    p.highlight.change(bind(chats.redraw, store), inputs=[c.list, p.highlight], outputs=p.chatbot,
                       concurrency_id=ENGINE, concurrency_limit=1, **private)


def _wire(service: ChatServiceApi, store: ChatStore, cancels: handlers.Cancels, p: SimpleNamespace) -> list:
    """The chat and model events; returns the answer events (respond, regenerate, A/B, race)."""
    lock = [p.textbox, p.send, p.stop, p.regen, p.load, p.ab, p.race]  # the order of handlers.controls
    # No progress indicator on an answer: its timer redraws the page while the engine decodes (plain
    # decoding of 128 tokens, updates every 0.5 s, AMX Xeon: 1.63 s in the page against 0.77 through
    # the API with it, 0.80 against 0.67 without). The streaming text, Stop and the stats line show it runs.
    # No status on any output (QUIET): each of the event's queue messages set one on every output,
    # whose hidden trackers still ran timers; 4 prompts x 64 tokens x 2 in the page, 2-core Zen 4:
    # Chromium's CPU per answer 204 -> 148 ms, the server's 806 -> 686.
    answer = {"outputs": [p.chatbot, p.stats, p.chats.list, p.chats.title], "concurrency_id": ENGINE,
              "concurrency_limit": 1, **QUIET}
    # Respond and regenerate end with a new `answered` value, whose change unlocks the page at once
    # (chats.answered); a Send pressed before their completion reaches the page waits for it
    # (always_last) instead of being dropped. Every output an update leaves as it is costs Gradio
    # a component built from it (~0.4 ms of the server's GIL each), so the controls are not outputs.
    saved = {**answer, "outputs": [*answer["outputs"], p.answered], "trigger_mode": "always_last"}

    locking, unlock = in_page(handlers.controls("answering")), in_page(handlers.controls("idle"))
    p.answered.change(outputs=lock, **unlock)  # the Chats panel and the monitor: _wire_chats
    p.draw_sent.click(inputs=[p.textbox, p.chatbot], outputs=[p.chatbot, p.stats, *lock], fn=None,
                      js=SHOW_SENT % json.dumps(list(handlers.controls("answering", clear_textbox=True))),
                      queue=False, api_visibility="private")
    respond = gr.on([p.textbox.submit, p.send.click], bind(chats.respond, store, service, cancels, finds=p.chats.finds),
                    inputs=[p.chats.list, p.textbox, p.chatbot, *p.settings, p.highlight], js=DRAW_SENT,
                    api_name="respond", **saved)
    respond.failure(outputs=lock, **unlock)
    regenerate = p.regen.click(outputs=lock, **locking).then(
        bind(chats.regenerate, store, service, cancels, finds=p.chats.finds),
        inputs=[p.chats.list, p.chatbot, *p.settings, p.highlight],
        api_name="regenerate", **saved)
    regenerate.failure(outputs=lock, **unlock)
    ab = p.ab.click(outputs=lock, **locking).then(
        bind(compare.compare, store, service, cancels), inputs=[p.chats.list, p.highlight],
        api_name="ab", **{**answer, "outputs": [p.chatbot, p.stats]})
    ab.then(outputs=lock, **unlock)
    raced = p.race.click(outputs=lock, **locking).then(
        bind(race.race, store, service, cancels), inputs=[p.chats.list, p.highlight],
        api_name="race", **{**answer, "outputs": [p.chatbot, p.stats]})
    raced.then(outputs=lock, **unlock)
    p.stop.click(bind(handlers.stop, cancels), api_name="stop", queue=False)
    # The chatbot's own trash button: stop the answer too, and drop its remaining updates.
    p.chatbot.clear(bind(handlers.clear, cancels), outputs=[p.chatbot, p.stats, *lock],
                    cancels=[respond, regenerate, ab, raced], api_name="clear", queue=False)
    _wire_load(service, p)
    return [respond, regenerate, ab, raced]


def _wire_load(service: ChatServiceApi, p: SimpleNamespace) -> None:
    """Load model: the chat's controls locked while it loads, Cancel shown instead of Load."""
    quick = {"queue": False, "api_visibility": "private"}
    system = p.settings[0]
    buttons = [p.textbox, p.send, p.stop, p.regen, p.ab, p.race, p.load, p.cancel_load]

    def loading():
        locked = handlers.controls("loading")
        return (*locked[:4], *locked[5:], *model_panel.begin_load())

    def loaded():
        idle = handlers.controls("idle")
        return (*idle[:4], *idle[5:], gr.update(visible=True, interactive=True), gr.update(visible=False))

    p.load.click(loading, outputs=buttons, **quick
                 ).then(bind(model_panel.load_model, service, p.loads), inputs=[p.model, p.head, p.quant, system],
                        outputs=[p.header, p.status, system], api_name="load_model",
                        concurrency_id=ENGINE, concurrency_limit=1
                 ).then(loaded, outputs=buttons, **quick
                 ).then(lambda: gr.update(choices=model_panel.drafter_choices(service.drafters), value=model_panel.AUTO),
                        outputs=p.drafter, **quick)
    p.cancel_load.click(bind(model_panel.cancel_load, p.loads), outputs=p.status, **quick)


def _monitor_panel() -> SimpleNamespace:
    """Memory by role per GPU and in RAM, the tuner's choice, and speed per answer (app/monitor.py)."""
    with gr.Accordion("Monitor", open=True):
        tuning = gr.Markdown("", elem_id="aerie-tuning", elem_classes="aerie-muted")
        memory = gr.HTML("", elem_id="aerie-memory")
        plot = gr.HTML("", elem_id="aerie-plot")
    return SimpleNamespace(tuning=tuning, memory=memory, plot=plot, timer=gr.Timer(MONITOR_S))


def _wire_monitor(demo: gr.Blocks, service: ChatServiceApi, store: ChatStore, m: SimpleNamespace, chat_list) -> None:
    """Refresh on load and every MONITOR_S seconds, idle or answering: unqueued, so it never waits
    behind an answer. The plot follows the chat selected in `chat_list`."""
    outputs, refresh = [m.memory, m.plot, m.tuning], bind(monitor.refresh, service, store)
    demo.load(refresh, inputs=chat_list, outputs=outputs, queue=False, api_visibility="private", **QUIET)
    m.timer.tick(refresh, inputs=chat_list, outputs=outputs, queue=False, api_visibility="private", **QUIET)


def build_ui(service: ChatServiceApi, defaults: UiDefaults | Mapping[str, Any] | None = None, *,
             store: ChatStore, exports: Path | None = None) -> gr.Blocks:
    """The chat page for `service` (see app/handlers.py for what it must offer), with the chats
    saved in `store`, queued so that one answer or model load runs at a time. Exports are written
    under `exports`, a private folder (default: a new one, removed at exit)."""
    d = _as_defaults(defaults)
    cancels = handlers.Cancels()
    exports = exports if exports is not None else private_temp_dir("aerie-exports-")
    with gr.Blocks(title="Aerie", fill_height=True, analytics_enabled=False, delete_cache=EXPORT_CACHE) as demo:
        with gr.Sidebar(label="Aerie", open=True, width=340):
            saved = _chats_panel()
            settings = _settings_panel(service, d)
            model = _model_panel(service, d)
            gauges = _monitor_panel()
        with gr.Column(elem_id="aerie-main"):
            header = gr.Markdown(handlers.header(service.label), elem_id="aerie-header")
            page = SimpleNamespace(**vars(_chat_panel()), **vars(model), header=header, settings=settings,
                                   loads=handlers.Cancels(), chats=saved, monitor=gauges.timer)
        _wire_chats(demo, store, exports, page, _wire(service, store, cancels, page))
        _wire_monitor(demo, service, store, gauges, saved.list)
        _wire_saved_settings(demo, settings)
        # The model shown as the page opens (another may have loaded since the page was built).
        demo.load(lambda: handlers.header(service.label), outputs=header, queue=False, api_visibility="private",
                  **QUIET)
    demo.queue(default_concurrency_limit=1)
    demo._queue.sleep_when_free = QUEUE_POLL_S  # tests/test_ui_handlers.py checks the attribute is Gradio's
    return demo
