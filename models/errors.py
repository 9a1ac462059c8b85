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
    """The prompt cannot fit in the model's context even after trimming old turns."""


class OutOfMemoryError(AerieError):
    """The device ran out of memory; the engine stays usable after it."""
