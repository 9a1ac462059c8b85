"""An answer as the page keeps it, and how the chat shows it.

In a chat (a list of {"role", "content"} records) an answer is
    {"role": "assistant", "content": its plain text, "meta": {...}}
The text is all that goes back to the model and into exports. "meta" is saved with it
(app/store.py) and holds what the page shows around it:
    stats    the answer's final ReplyStats, as a dict
    finish   how it ended: eos, stop, length, cancelled (Stop), or interrupted (the page was
             closed or reloaded mid-answer, see `interrupted`)
    drafted  [start, end) character ranges of the text that accepted draft tokens wrote
    request  the system prompt, sampling settings and stop strings it was asked with (for A/B)
    ab       its comparison with plain decoding (app/compare.py), once asked for
    race     its question asked again of every drafter at temperature 0 (app/race.py), once asked for

The Chatbot shows each such answer followed by a collapsed row with its statistics, then its A/B
comparison. Both are Gradio "thought" rows (metadata with a title): drawn as accordions in
bubbles of their own under the answer, and dropped by `handlers.normalise_history` from what the
model sees.
"""

import html
import re
from dataclasses import asdict, dataclass, fields

from core.config import STRATEGY_LABELS, ReplyEvent, ReplyStats, SamplingConfig

INTERRUPTED = "interrupted"
FINISH_LABELS = {"stop": "stop string", "length": "max tokens reached", "cancelled": "stopped", "error": "failed",
                 INTERRUPTED: "interrupted"}
# Highlighting draws the answer as escaped text on one line (newlines as <br>): Markdown would
# break a <mark> that spans two paragraphs or sits in a code block, and a one-line HTML block is
# passed through Markdown untouched. Gradio's sanitiser keeps <div>, <mark>, <br> and class.
SPANS_CLASS, DRAFTED_CLASS = "aerie-spans", "aerie-drafted"
_OPEN, _CLOSE = f'<div class="{SPANS_CLASS}">', "</div>"
STATS_FIELDS = {f.name for f in fields(ReplyStats)}


@dataclass(frozen=True)
class Request:
    """What an answer was asked with, so that A/B can ask again exactly so."""

    system_prompt: str
    sampling: SamplingConfig
    stops: tuple[str, ...]

    def as_dict(self) -> dict:
        return {"system_prompt": self.system_prompt, "sampling": asdict(self.sampling), "stops": list(self.stops)}

    @classmethod
    def from_dict(cls, d: dict) -> "Request":
        return cls(d["system_prompt"], SamplingConfig(**d["sampling"]), tuple(d["stops"]))


@dataclass(frozen=True)
class Answer:
    """An answer while it streams: its text, which parts of it were drafted, its latest stats."""

    text: str = ""
    drafted: tuple[tuple[int, int], ...] = ()  # [start, end) ranges of `text`, in order, never touching
    stats: ReplyStats | None = None
    finish: str | None = None

    def add(self, event: ReplyEvent) -> "Answer":
        ranges, at = list(self.drafted), len(self.text)
        for piece, drafted in event.pieces:
            if drafted and ranges and ranges[-1][1] == at:
                ranges[-1] = (ranges[-1][0], at + len(piece))
            elif drafted:
                ranges.append((at, at + len(piece)))
            at += len(piece)
        return Answer(self.text + event.delta, tuple(ranges), event.stats, event.finish or self.finish)

    def record(self, request: Request) -> dict:
        meta = {"stats": asdict(self.stats) if self.stats else None, "finish": self.finish,
                "drafted": [list(r) for r in self.drafted], "request": request.as_dict()}
        return {"role": "assistant", "content": self.text, "meta": meta}


def strategy_label(name: str) -> str:
    """A drafter's name for people; a name this version does not know is shown as it is."""
    return STRATEGY_LABELS.get(name, name)


def finished(chat: list[dict]) -> bool:
    """Whether `chat` ends with an answer that has ended (its finish reason is known)."""
    last = chat[-1] if chat else {}
    return last.get("role") == "assistant" and bool((last.get("meta") or {}).get("finish"))


def interrupted(chat: list[dict]) -> list[dict]:
    """`chat` with its last answer marked INTERRUPTED if it had not ended: the page went away
    while it streamed, and without a finish reason a reopened chat would show it as complete."""
    last = chat[-1] if chat else {}
    if last.get("role") != "assistant" or not last.get("meta") or finished(chat):
        return chat
    return [*chat[:-1], {**last, "meta": {**last["meta"], "finish": INTERRUPTED}}]


def stats_of(meta: dict) -> ReplyStats | None:
    """The stored stats; fields this version does not know (or no longer has) are left out."""
    d = meta.get("stats")
    return None if d is None else ReplyStats(**{k: v for k, v in d.items() if k in STATS_FIELDS})


def format_stats(stats: ReplyStats, finish: str | None = None) -> str:
    """One compact Markdown line: tokens, speed, mean accepted length, acceptance, strategy."""
    rate = "—" if stats.accept_rate is None else f"{stats.accept_rate:.0%}"
    headline = _headline(stats)
    parts = [*headline[:3], f"acceptance **{rate}**", *headline[3:]]
    if FINISH_LABELS.get(finish or ""):
        parts.append(FINISH_LABELS[finish])
    return " · ".join(parts)


def _headline(stats: ReplyStats) -> list[str]:
    speedup = "—" if stats.speedup is None else f"{stats.speedup:.2f}×"
    return [f"**{stats.new_tokens}** token{'' if stats.new_tokens == 1 else 's'}",
            f"**{stats.tok_s:.1f}** tok/s",
            f"accepted length **{stats.accept_len:.2f}**",
            f"speedup **{speedup}** vs plain",
            strategy_label(stats.strategy)]


# ---------------------------------------------------------------- drawing a chat


def escaped(text: str) -> str:
    """Text as one line of HTML that shows it as written: Gradio's cleandoc would expand tabs."""
    return html.escape(text, quote=False).replace("\t", "&#9;").replace("\r", "&#13;").replace("\n", "<br>")


def highlighted(text: str, drafted) -> str:
    """The answer with the text of accepted draft tokens in <mark>s."""
    parts, at = [], 0
    for start, end in drafted:
        parts += [escaped(text[at:start]), f'<mark class="{DRAFTED_CLASS}">{escaped(text[start:end])}</mark>']
        at = end
    parts.append(escaped(text[at:]))
    return _OPEN + "".join(parts) + _CLOSE


def plain_text(shown: str) -> str:
    """An answer's text from what the chat shows: `highlighted` undone, anything else as is."""
    if not (shown.startswith(_OPEN) and shown.endswith(_CLOSE)):
        return shown
    inner = re.sub(f'<mark class="{DRAFTED_CLASS}">|</mark>', "", shown[len(_OPEN):-len(_CLOSE)])
    return html.unescape(inner.replace("<br>", "\n"))


def verbatim(text: str) -> dict:
    """A message's text as the Chatbot draws it unchanged: a text part, not a str, which Gradio
    passes through `inspect.cleandoc` (an answer whose lines after the first were all indented, a
    JSON object cut off by the token limit, lost that indentation in the page)."""
    return {"type": "text", "text": text}


def view(chat: list[dict], highlight: bool = False, streaming: bool = False) -> list[dict]:
    """What the Chatbot shows for `chat`: every answer with meta is followed by its stats row
    and, once compared, its A/B row; with `highlight`, answers show their drafted text marked.
    While the last answer is `streaming` its stats row waits for its end: the stats line under the
    chat shows the same numbers live, and redrawing the row with every update cost the page (8
    MT-bench answers x 128 tokens, one server, alternated twice, 2-core Zen 4: Chromium's CPU 268
    -> 226 ms an answer, Enter to Send 1.05 -> 0.96 s)."""
    shown = []
    for at, message in enumerate(chat):
        meta = message.get("meta") if message["role"] == "assistant" else None
        if not meta:
            shown.append({"role": message["role"], "content": verbatim(message["content"])})
            continue
        text = message["content"]
        shown.append({"role": "assistant", "content": verbatim(highlighted(text, meta["drafted"]) if highlight else text)})
        if not (streaming and at == len(chat) - 1):
            shown.append(stats_row(meta, text))
        if meta.get("ab"):
            shown.append(ab_row(meta, text))
        if meta.get("race"):
            shown.append(race_row(meta["race"]))
    return shown


def thought(title: str, body: str, status: str | None = "done") -> dict:
    """A row Gradio draws as an accordion titled `title`: "done" starts closed, None open. Not
    "pending": its spinner repaints the page beside the engine (an A/B's plain run in Chromium,
    2-core Zen 4: 1.44x the ms per token of the meter's plain rounds with it, 1.23x without)."""
    metadata = {"title": title} if status is None else {"title": title, "status": status}
    return {"role": "assistant", "content": body, "metadata": metadata}


def stats_row(meta: dict, text: str) -> dict:
    """The collapsed line under an answer: the headline numbers; opened, the rest."""
    stats = stats_of(meta)
    if stats is None:
        return thought("No statistics", "This answer ended before its first token.")
    finish = FINISH_LABELS.get(meta.get("finish") or "")
    drafted = sum(end - start for start, end in meta["drafted"])
    rate = "—" if stats.accept_rate is None else f"{stats.accept_rate:.0%}"
    lines = [f"Acceptance **{rate}**: {stats.accepted} of {stats.drafted} drafted positions accepted; "
             f"drafted tokens wrote {drafted / max(len(text), 1):.0%} of the text.",
             f"Wall time {stats.elapsed_s:.2f} s · {stats.target_steps} target forwards · "
             f"prompt {stats.prompt_tokens} tokens."]
    if stats.tuning:
        lines.append(f"Tuner: {html.escape(stats.tuning, quote=False)}")
    if meta.get("finish") == INTERRUPTED:
        lines.append("Interrupted: the page was closed, reloaded or cleared while this answer was written.")
    return thought(" · ".join([*_headline(stats), *([finish] if finish else [])]), "\n\n".join(lines))


# ---------------------------------------------------------------- A/B with plain decoding


def ab_speedup(spec: ReplyStats, plain: ReplyStats) -> float | None:
    """The ratio of the two measured speeds after the first token. The prefill before it is the
    same work in both, but the plain run finds the prompt in the cache the first run left: counted,
    it would flatter plain decoding by the prompt's reading (MT-bench, 128 tokens, 2-core Zen 4:
    ~0.1 s of a ~0.8 s answer)."""
    return spec.decode_tok_s / plain.decode_tok_s if spec.decode_tok_s > 0 and plain.decode_tok_s > 0 else None


def first_difference(a: str, b: str) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def ab_verdict(meta: dict, text: str) -> str:
    """The A/B headline: the speed ratio, and whether the texts match (greedy) or need not."""
    ab, spec = meta["ab"], stats_of(meta)
    ratio = ab_speedup(spec, stats_of(ab))
    speed = "—" if ratio is None else f"{ratio:.2f}×"
    if not ab["greedy"]:
        return f"A/B vs plain decoding: **{speed}** the speed · sampling: texts differ by design"
    return f"A/B vs plain decoding: **{speed}** the speed · identical text: **{'yes' if ab['text'] == text else 'no'}**"


def ab_row(meta: dict, text: str) -> dict:
    """Both runs side by side, what the texts say, and the plain answer folded away."""
    ab, spec = meta["ab"], stats_of(meta)
    plain = stats_of(ab)
    name = strategy_label(spec.strategy)
    table = ["| | this answer (" + name + ") | plain decoding |", "|---|---:|---:|",
             f"| tokens | {spec.new_tokens} | {plain.new_tokens} |",
             f"| first token after | {spec.prefill_s:.2f} s | {plain.prefill_s:.2f} s |",
             f"| tok/s after it | {spec.decode_tok_s:.1f} | {plain.decode_tok_s:.1f} |",
             f"| wall time | {spec.elapsed_s:.2f} s | {plain.elapsed_s:.2f} s |"]
    ratio = ab_speedup(spec, plain)
    speed = (f"Speedup **{ratio:.2f}×**: {spec.decode_tok_s:.1f} ÷ {plain.decode_tok_s:.1f} tok/s, each measured "
             "from the first token to the last. The first token needs the prompt read, the same work for both, "
             "but the plain run found it in the cache the first one left." if ratio
             else "No speedup to show: a run made one token or none.")
    where = first_difference(text, ab["text"])
    if not ab["greedy"]:
        same = ("Sampling (temperature above 0): each run draws its own tokens, so the texts differ by "
                "design; only the speeds compare.")
    elif where is None:
        same = "Identical text: **yes**. Greedy decoding: speculation must not change the answer, and it did not."
    else:
        same = (f"Identical text: **no**: only the first {where} characters agree. Speculation is exact in exact "
                "arithmetic; verifying many tokens at once can round differently from one at a time "
                "and flip a near-tie between two tokens.")
    folded = f"<details><summary>Plain decoding's answer</summary>{_OPEN}{escaped(ab['text'])}{_CLOSE}</details>"
    return thought(ab_verdict(meta, text), "\n".join(table) + "\n\n" + speed + "\n\n" + same + "\n\n" + folded, None)


def running_line(what: str, answer: Answer) -> str:
    """The stats line while a rerun (A/B, a race's drafter) streams: what runs, then its numbers.
    The chat is left as it is until the rerun ends: a redraw of it as an A/B started (the chat
    with a row for the plain run) cost that run ~0.3 s of a 1.1 s answer in Chromium (2-core Zen 4,
    8 MT-bench prompts: its ms per token 1.27-1.29x the same prompt's plain answer through the API
    right after, 1.00x without the redraw)."""
    return f"{what}: " + (format_stats(answer.stats) if answer.stats else "…")


def ab_record(plain: Answer, request: Request) -> dict:
    """What meta["ab"] keeps of the plain run."""
    return {"stats": asdict(plain.stats), "text": plain.text, "finish": plain.finish,
            "greedy": request.sampling.greedy}


# ---------------------------------------------------------------- the race of every drafter

BAR = 24   # characters of the fastest run's bar


def race_record(runs: list[tuple[str, Answer]]) -> dict:
    """What meta["race"] keeps: per drafter (plain first) its stats, how it ended, and whether its
    text is plain decoding's (greedy: it must be), else where it first differs."""
    plain = runs[0][1].text
    return {"runs": [{"strategy": name, "stats": asdict(run.stats) if run.stats else None, "finish": run.finish,
                      "difference": first_difference(run.text, plain)} for name, run in runs]}


def race_table(runs: list[dict]) -> str:
    """The runs as a Markdown table with a bar per speed: tok/s from the prompt to the last token."""
    speeds = [stats_of(run).tok_s if run["stats"] else 0.0 for run in runs]
    fastest, plain = max(speeds) or 1.0, speeds[0] or None
    lines = ["| drafter | speed | tok/s | × plain | accepted length | identical text |", "|---|---|---:|---:|---:|---|"]
    for run, speed in zip(runs, speeds):
        stats = stats_of(run) if run["stats"] else None
        bar = "█" * max(1, round(BAR * speed / fastest)) if speed else ""
        same = "yes" if run["difference"] is None else f"no (from character {run['difference']})"
        ratio = f"{speed / plain:.2f}×" if plain else "—"
        lines.append(f"| {strategy_label(run['strategy'])} | `{bar}` | {speed:.1f} | {ratio} | "
                     f"{stats.accept_len if stats else 0:.2f} | {same} |")
    return "\n".join(lines)


def race_row(race: dict) -> dict:
    """The race under the answer: the winner in the title, every drafter's speed in the body."""
    runs = race["runs"]
    speeds = {run["strategy"]: stats_of(run).tok_s for run in runs if run["stats"]}
    best = max(speeds, key=speeds.get) if speeds else "plain"
    plain = speeds.get("plain") or None
    ratio = f" ({speeds[best] / plain:.2f}× plain)" if plain and best in speeds else ""
    same = all(run["difference"] is None for run in runs)
    title = (f"Race of {len(runs)} drafters: fastest {strategy_label(best)}{ratio} · identical text: "
             f"{'all' if same else 'no'}")
    note = ("Each drafter answered the same question at temperature 0, one after another on this machine. "
            + ("Every text is plain decoding's, as speculation promises." if same else
               "A text that differs parted at a near-tie: verifying many tokens at once can round differently."))
    return thought(title, race_table(runs) + "\n\n" + note)


