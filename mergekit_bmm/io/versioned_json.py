"""JSON documents that name their format and version: one writer, one reader.

The statistics manifest, the merge record and the search summary are read by other
commands (and later versions of this one). Each is a pydantic model with ``format`` and
``format_version`` fields; :func:`read_versioned` refuses a file of another format or
version, or one that does not validate, with one line that names the file and the way
out (``remedy``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from mergekit_bmm.errors import BMMError, ConfigError
from mergekit_bmm.io.atomic import atomic_write_text

Document = TypeVar("Document", bound=BaseModel)


def write_versioned(path: str | Path, document: BaseModel) -> Path:
    """Write ``document`` atomically as indented JSON."""
    path = Path(path)
    atomic_write_text(path, document.model_dump_json(indent=2) + "\n")
    return path


def read_versioned(
    path: str | Path,
    model: type[Document],
    remedy: str,
    error: type[BMMError] = ConfigError,
    label: str = "a document of",
    older_versions: tuple[int, ...] = (),
) -> Document:
    """Read and validate ``path``; ``FileNotFoundError`` propagates so callers can say why it matters.

    ``label`` names what the file holds in the refusal (e.g. "statistics");
    ``older_versions`` are earlier versions the model still validates (its readers branch on
    ``format_version``).
    """
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as problem:
        raise error(f"{path} is not valid JSON ({problem}); {remedy}") from None
    if not isinstance(raw, dict):
        raise error(f"{path} does not hold a JSON object; {remedy}")
    fields = model.model_fields
    expected = (fields["format"].default, fields["format_version"].default)
    found = (raw.get("format"), raw.get("format_version"))
    if found != expected and (found[0] != expected[0] or found[1] not in older_versions):
        raise error(
            f"{path} holds {label} format {found[0]!r} version {found[1]!r}; this mergekit-bmm reads "
            f"{expected[0]!r} version {expected[1]}: {remedy}"
        )
    try:
        return model.model_validate(raw)
    except ValidationError as problem:
        detail = problem.errors()[0]
        where = ".".join(str(item) for item in detail["loc"])
        raise error(f"{path} is malformed (`{where}`: {detail['msg']}); {remedy}") from None
