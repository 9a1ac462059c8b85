"""What the app may ask of the chat service (core/service/chat.py `ChatService`), as a Protocol:
app/ types against this, tests pass fakes that have the same methods, and nothing here imports
torch (the app must not load it). Return types of torch-side modules are named for checkers only."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable, Iterator, Protocol

from core.config import ModelChoice, ReplyEvent, SamplingConfig

if TYPE_CHECKING:  # both import torch; a checker reads them, the app at run time does not
    from core.service.switching import SwitchReport
    from core.tune.monitor import Snapshot


class ChatServiceApi(Protocol):
    default_system_prompt: str

    @property
    def label(self) -> str: ...            # the loaded model, its device and weights, and the drafter

    @property
    def model_name(self) -> str: ...

    @property
    def tuning(self) -> str: ...           # what the tuner would choose for a new chat, and why

    @property
    def drafters(self) -> tuple[str, ...]: ...   # the drafters `reply(strategy=...)` can run, cheapest first

    def reply(self, messages: list[dict], system_prompt: str, sampling: SamplingConfig,
              stop_strings: tuple[str, ...], cancel: threading.Event,
              strategy: str | None = None, every_s: float = 0.0) -> Iterator[ReplyEvent]: ...   # core/text.py `coalesced`

    def pin(self, strategy: str | None) -> str: ...   # decode with this drafter from now on (None: the tuner's); -> the plan

    def fetch(self, choice: ModelChoice, report: Callable, cancelled: Callable[[], bool]) -> None: ...

    def load_model(self, choice: ModelChoice) -> SwitchReport: ...

    def monitor(self) -> Snapshot: ...
