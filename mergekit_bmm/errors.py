"""Errors a user can act on, and how they are shown: one line, non-zero exit.

Every problem caused by the user's input (a recipe, a statistics directory, a search
config) raises a subclass of :class:`BMMError` whose message says what is wrong, where,
and how to fix it; bad input that a library detects first (PyYAML, pydantic, mergekit,
the Hub client, the OS) is turned into the same kind of line. Command-line entry points,
including the stock ``mergekit-yaml`` through the start-up hook, print one line instead
of a traceback; an error no check foresaw gets one line too, its traceback kept in a file
(docs/errors.md).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
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


class NonFiniteOutputError(BMMError, ArithmeticError):
    """A merged tensor came out NaN or Inf; it is refused instead of written."""


class PublishError(BMMError):
    """A folder cannot be published as it is (no card, changed weights, Hub refusal, ...)."""


SHOWN_CHARACTERS = 80
LINE_CHARACTERS = 1200


def shown(value: object, limit: int = SHOWN_CHARACTERS) -> str:
    """``repr(value)`` cut to a readable length: a message never echoes unbounded input."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[: limit - 20]}… ({len(text)} characters)"


def one_line(error: BaseException | str) -> str:
    """The user-facing line for an error: flattened to one line, and cut if a library's
    message echoes a huge value."""
    text = " ".join(str(error).split())
    if len(text) > LINE_CHARACTERS:
        text = f"{text[: LINE_CHARACTERS - 40]} … [{len(text) - LINE_CHARACTERS + 40} characters cut]"
    return f"mergekit-bmm: error: {text}"


def error_summary(error: BaseException, limit: int = 400) -> str:
    """``Type: message`` on one line, cut at ``limit`` characters: how a failed trial is recorded."""
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _find_bmm_error(error: BaseException | None) -> BMMError | None:
    """Our error, even when a library wrapped it (pydantic, mergekit's executor), or a
    library's report of bad input (:func:`_library_error`) turned into ours."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, BMMError):
            return error
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
        translated = _library_error(error)
        if translated is not None:
            return translated
        error = error.__cause__ or error.__context__
    return None


_SHAPES = re.compile(r"\((\d+(?:, \d+)*),?\)")
_MISSING_TENSOR = re.compile(r"Tensor (?P<tensor>\S+) required but not present in model (?P<model>\S+)")


def _size_mismatch(error: ValueError) -> TensorInputError:
    """mergekit's shape check in a line that names the tensor and the shapes. Its advice about
    vocabulary axes is kept for embeddings; elsewhere the models' hidden sizes were already found
    equal before the merge (:mod:`mergekit_bmm.recipes.preflight`), so a checkpoint disagrees
    with its own config or the inputs are not fine-tunes of one base."""
    text = " ".join(str(error).split())
    name = text.removeprefix("Tensor size mismatch for ").split(":", 1)[0]
    if any(part in name for part in ("embed", "lm_head", "wte", "word_embeddings")):
        return TensorInputError(text)
    shapes = sorted({tuple(int(n) for n in match.split(", ")) for match in _SHAPES.findall(text)})
    listed = " vs ".join(str(shape) for shape in shapes)
    return TensorInputError(
        f"tensor {name} has different shapes in the inputs ({listed}): a checkpoint does not match its "
        "config.json, or the models are not fine-tunes of one base model; check the model paths"
    )


def _library_error(error: BaseException) -> BMMError | None:
    """Bad input that mergekit, PyYAML, pydantic, the Hub client or the OS detected, as one line."""
    import yaml

    if isinstance(error, yaml.YAMLError):
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or " ".join(str(error).split())
        return ConfigError(f"the recipe is not valid YAML: {problem}{where}; fix the YAML")
    if type(error).__name__ == "ValidationError" and type(error).__module__.startswith("pydantic"):
        detail = error.errors()[0]
        where = ".".join(str(item) for item in detail["loc"])
        message = detail["msg"].removeprefix("Value error, ")
        title = getattr(error, "title", "")
        what = (
            "the recipe is not a valid mergekit recipe"
            if title == "MergeConfiguration"
            else f"invalid {title}"
        )
        if not where:
            return ConfigError(f"{what}: it must be a YAML mapping (merge_method, base_model, models, ...)")
        return ConfigError(f"{what}: `{where}`: {message} (got {shown(detail.get('input'))})")
    text = " ".join(str(error).split())
    if _raised_in(error, ("mergekit", "config.py")):  # mergekit's checks of the recipe itself
        return ConfigError(f"the recipe is not a valid mergekit recipe: {text}")
    if isinstance(error, RuntimeError) and text.startswith("Unimplemented merge method"):
        method = text.removeprefix("Unimplemented merge method").strip()
        return ConfigError(f"unknown merge_method {shown(method)}; see mergekit-yaml's list of methods")
    if isinstance(error, ValueError) and text.startswith("Tensor size mismatch"):
        return _size_mismatch(error)
    missing = _MISSING_TENSOR.search(text) if isinstance(error, RuntimeError) else None
    if missing is not None:
        return TensorInputError(
            f"mergekit's architecture definition requires tensor {missing['tensor']}, which "
            f"{missing['model']} does not hold; this is mergekit's limit, not bmm's (every merge method "
            "stops here): see docs/architectures.md for the architectures mergekit cannot read"
        )
    if isinstance(error, OSError) and "Repo id must be in the form" in text:
        name = text.rsplit(": '", 1)[-1].split("'", 1)[0] if ": '" in text else "a model path"
        return ConfigError(f"{shown(name)} is neither a local model folder nor a Hub repo id; fix the path")
    if isinstance(error, OSError) and error.filename and error.strerror:
        target = error.filename if error.filename2 is None else f"{error.filename} -> {error.filename2}"
        return ConfigError(f"{error.strerror}: {target}")
    return None


def _raised_in(error: BaseException, parts: tuple[str, ...]) -> bool:
    """Whether the innermost frame of ``error``'s traceback is the file ending in ``parts``."""
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    return frame is not None and Path(frame.tb_frame.f_code.co_filename).parts[-len(parts) :] == parts


TRACEBACK_ENV = "MERGEKIT_BMM_TRACEBACK"


def wants_traceback(verbose: bool = False) -> bool:
    """Whether the full traceback goes to the terminal (``-v`` or ``MERGEKIT_BMM_TRACEBACK=1``)."""
    return verbose or os.environ.get(TRACEBACK_ENV, "") not in ("", "0")


def unexpected_line(error: BaseException) -> str:
    """One line for an error no check foresaw; its full traceback is kept in a file."""
    import tempfile
    import time
    import traceback

    name = f"mergekit-bmm-traceback-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
    path = Path(tempfile.gettempdir()) / name
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    try:
        path.write_text(" ".join(sys.argv) + "\n\n" + text, encoding="utf-8")
        kept = f"the full traceback is in {path}"
    except OSError:
        kept = f"set {TRACEBACK_ENV}=1 to see the traceback"
    message = " ".join(str(error).split()) or "(no message)"
    return one_line(f"{type(error).__name__}: {message} — {kept} (or run with {TRACEBACK_ENV}=1)")


_previous_hook = None
# Whether the merge under way in this process uses one of the plugin's methods (None: no merge
# has started). Set by the merge wrapper; a merge of mergekit's own methods keeps mergekit's errors.
_merge_is_ours: bool | None = None


def merge_started(ours: bool) -> None:
    """Say whose merge this process runs, so a failure is shown as that merge's."""
    global _merge_is_ours
    _merge_is_ours = ours


def _raised_by_us(error: BaseException | None) -> bool:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, BMMError):
            return True
        error = error.__cause__ or error.__context__
    return False


def _excepthook(kind: type[BaseException], error: BaseException, traceback: TracebackType | None) -> None:
    if not issubclass(kind, Exception) or (_merge_is_ours is False and not _raised_by_us(error)):
        # a mergekit method's recipe failed in mergekit: its error, as mergekit shows it
        (_previous_hook or sys.__excepthook__)(kind, error, traceback)
        return
    ours = _find_bmm_error(error)
    if ours is None and wants_traceback(_verbose_argv()):
        (_previous_hook or sys.__excepthook__)(kind, error, traceback)
        return
    print(one_line(ours) if ours is not None else unexpected_line(error), file=sys.stderr)
    sys.stderr.flush()
    # sys.excepthook cannot choose the exit status (it is always 1), which is fine:
    # the point is a non-zero exit with a readable line.


def _verbose_argv() -> bool:
    """mergekit's ``-v`` (``-vv`` …) on the command line of a stock mergekit command."""
    return any(re.fullmatch(r"-v+|--verbose", argument) for argument in sys.argv[1:])


def install_excepthook() -> None:
    """Show errors as one line in a mergekit console command that did not catch them."""
    global _previous_hook
    if sys.excepthook is _excepthook:
        return
    _previous_hook = sys.excepthook
    sys.excepthook = _excepthook


def find_bmm_error(error: BaseException) -> BMMError | None:
    """Public wrapper used by our own command-line entry points."""
    return _find_bmm_error(error)


@contextmanager
def exit_on_bmm_error(verbose: bool = False, interrupted: str = "interrupted") -> Iterator[None]:
    """In a command: every error becomes one stderr line and a non-zero exit.

    Bad input (ours, or detected by a library) exits with its code (2); anything else
    exits 1 with its full traceback kept in a file, or printed with ``verbose`` (mergekit's
    ``-v``) or ``MERGEKIT_BMM_TRACEBACK=1``. Ctrl-C exits 130 with the line ``interrupted``.
    """
    try:
        yield
    except KeyboardInterrupt:
        print(f"mergekit-bmm: {interrupted}", file=sys.stderr)
        sys.exit(130)
    except Exception as error:
        ours = _find_bmm_error(error)
        if ours is None and wants_traceback(verbose):
            raise
        print(one_line(ours) if ours is not None else unexpected_line(error), file=sys.stderr)
        sys.stderr.flush()
        sys.exit(ours.exit_code if ours is not None else 1)


class SearchStopped(BMMError):
    """The search cannot go on (too many failed trials, an evaluator that is misconfigured)."""

    exit_code = 3


class OutputFolderError(BMMError):
    """``OUT_PATH`` holds something this run must not touch (another experiment, a running search)."""
