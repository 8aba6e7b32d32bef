"""Errors a user can act on, and how they are shown: one line, non-zero exit.

Every problem caused by the user's input (a recipe, a statistics directory, a search
config) raises a subclass of :class:`BMMError` whose message says what is wrong, where,
and how to fix it. Command-line entry points, including the stock ``mergekit-yaml``
through the start-up hook, print such errors as a single line instead of a traceback.
"""

from __future__ import annotations

import sys
from types import TracebackType


class BMMError(Exception):
    """A problem with the user's input; the message is meant to be read as is."""

    exit_code = 2


class ConfigError(BMMError, ValueError):
    """A recipe or config value is invalid."""


class TensorInputError(BMMError, ValueError):
    """An input tensor is unusable (shape mismatch, NaN/Inf, ...)."""


class StatisticsError(BMMError, ValueError):
    """Activation statistics are missing, stale or incompatible."""


class PublishError(BMMError):
    """A folder cannot be published as it is (no card, changed weights, Hub refusal, ...)."""


def one_line(error: BaseException) -> str:
    """The user-facing line for an error: messages are flattened to one line."""
    text = " ".join(str(error).split())
    return f"mergekit-bmm: error: {text}"


def _find_bmm_error(error: BaseException | None) -> BMMError | None:
    """Our error, even when a library wrapped it (pydantic, mergekit's executor).

    mergekit's own check of input shapes runs before our kernel; its message already
    names the tensor and the shapes, so it is shown the same way.
    """
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, BMMError):
            return error
        if isinstance(error, ValueError) and str(error).startswith("Tensor size mismatch"):
            return TensorInputError(
                f"{error} The inputs are not fine-tunes of one architecture; check the model paths."
            )
        # pydantic's ValidationError keeps the original exception in its details.
        errors = getattr(error, "errors", None)
        if callable(errors):
            try:
                for detail in errors():
                    ctx_error = (detail.get("ctx") or {}).get("error")
                    if isinstance(ctx_error, BMMError):
                        return ctx_error
            except Exception:
                pass
        error = error.__cause__ or error.__context__
    return None


_previous_hook = None


def _excepthook(kind: type[BaseException], error: BaseException, traceback: TracebackType | None) -> None:
    ours = _find_bmm_error(error)
    if ours is None:
        (_previous_hook or sys.__excepthook__)(kind, error, traceback)
        return
    print(one_line(ours), file=sys.stderr)
    sys.stderr.flush()
    # sys.excepthook cannot choose the exit status (it is always 1), which is fine:
    # the point is a non-zero exit with a readable line.


def install_excepthook() -> None:
    """Show our errors as one line in any program that did not catch them."""
    global _previous_hook
    if sys.excepthook is _excepthook:
        return
    _previous_hook = sys.excepthook
    sys.excepthook = _excepthook


def find_bmm_error(error: BaseException) -> BMMError | None:
    """Public wrapper used by our own command-line entry points."""
    return _find_bmm_error(error)
