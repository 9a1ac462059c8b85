"""Race: the last answer's question asked again of every drafter the model has, one after another,
at temperature 0, and their speeds side by side in a row under the answer.

Plain decoding runs first; every other drafter's text must then be plain's token for token (greedy
speculation is exact), and the row says whether it was. Each run asks what the answer was asked
(its system prompt, stop strings and token budget) with the temperature set to 0, through the
service's one-answer override (ChatService.reply's `strategy`): the tuner counts none of them as
its turn. The race goes into the answer's meta["race"] (app/answers.py draws it); Stop or a
failure leaves the chat as it was.
"""

from collections.abc import Iterator
from dataclasses import replace

import gradio as gr

from app import answers, handlers
from app.answers import Answer
from app.compare import begin, saved, streamed
from app.handlers import Cancels
from app.store import ChatStore
from core.service.contract import ChatServiceApi

ACTION = "race the drafters"


def race(store: ChatStore, service: ChatServiceApi, cancels: Cancels, chat_id: int | None, highlight: bool,
         request: gr.Request | None = None) -> Iterator[tuple]:
    """Yields (chatbot, stats line) while the drafters answer in turn, then the chat with the race."""
    rerun = begin(store, cancels, chat_id, highlight, request, "race")
    if rerun is None:
        yield gr.skip(), gr.skip()
        return
    chat, asked, cancel, shown = rerun.chat, rerun.asked, rerun.cancel, rerun.shown
    names = ("plain", *(name for name in service.drafters if name != "plain"))
    greedy = replace(asked.sampling, temperature=0.0)
    done: list[tuple[str, Answer]] = []

    def updates():
        for name in names:
            run = Answer()   # the chat is left as it is until the race ends (answers.running_line)
            for event in service.reply(handlers.service_messages(chat[:-1]), asked.system_prompt, greedy, asked.stops,
                                       cancel, strategy=name, every_s=handlers.SHOW_EVERY_S):
                run = run.add(event)
                if not cancels.discarded(cancel):
                    yield gr.skip(), answers.running_line(f"Race, {answers.strategy_label(name)} ({len(done) + 1} of "
                                                          f"{len(names)})", run)
            if run.finish in (None, "cancelled"):
                return
            done.append((name, run))
    outcome = yield from streamed(cancels, rerun, updates(), ACTION)
    if outcome == "cleared":
        return
    if outcome == "failed" or len(done) < len(names):
        if outcome != "failed":
            handlers.toast("info", "The race stopped before every drafter finished: nothing was saved.")
        yield shown, ""
        return
    chat = saved(store, chat_id, chat, "race", answers.race_record(done), "race")
    yield answers.view(chat, highlight), answers.race_row(chat[-1]["meta"]["race"])["metadata"]["title"]
