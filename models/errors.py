"""Errors raised at Aerie's boundaries. Each carries one sentence a user can act on.

They live at the bottom layer (models/) so every layer above can raise and catch them;
`core.errors` re-exports them. No torch here: app/ imports this module.
"""


class AerieError(Exception):
    """Base class: the message is shown to the user as is (CLI: one line, UI: a toast)."""


class ModelLoadError(AerieError):
    """The model or head could not be found, downloaded or read."""


class UnsupportedModelError(AerieError):
    """The model exists but Aerie cannot run it (architecture, format, missing library)."""


class HeadMismatchError(AerieError):
    """The draft head does not fit the target (hidden size, vocabulary, layer count)."""


class ContextOverflowError(AerieError):
    """The prompt cannot fit in the model's context even after trimming old turns. With
    `answer_room`, a shorter answer would leave the prompt more room: `advice(setting)` says so in
    the caller's words (the page's "max new tokens", the API's max_tokens); str() is the page's."""

    def __init__(self, message: str, answer_room: bool = False):
        super().__init__(message)
        self.answer_room = answer_room

    def advice(self, setting: str) -> str:
        return f"{self.args[0]} Shorten it, or lower {setting}." if self.answer_room else self.args[0]

    def __str__(self) -> str:
        return self.advice("'max new tokens'")


class OutOfMemoryError(AerieError):
    """The device ran out of memory; the engine stays usable after it."""
