"""The user-facing error types, re-exported so app/ can catch them from core."""

from models.errors import (  # noqa: F401
    AerieError,
    ContextOverflowError,
    HeadMismatchError,
    ModelLoadError,
    OutOfMemoryError,
    UnsupportedModelError,
)


class StrategyUnavailableError(AerieError):
    """An answer asked for a drafter the loaded model does not have (EAGLE without a head)."""
