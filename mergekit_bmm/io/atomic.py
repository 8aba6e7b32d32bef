"""Atomic file writes: readers see the old content or the new, never a mix.

Every file the plugin writes that another process (or a resumed run) may read goes
through :func:`replacing`: the content is written to a temporary file in the same folder
and renamed over the target. Temporary files get the permissions an ordinary ``open``
would give (``0666`` minus the umask), not ``mkstemp``'s private ``0600``.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any


@lru_cache(maxsize=1)
def _file_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


@contextmanager
def replacing(path: str | Path, fsync: bool = True) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; when the block succeeds it replaces ``path``.

    Write the new content to the yielded path (any writer: ``save_file``, ``savefig``...).
    On an exception the temporary file is removed and ``path`` is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(descriptor)
    temporary = Path(name)
    try:
        yield temporary
        os.chmod(temporary, _file_mode())
        if fsync:
            with open(temporary, "rb") as handle:
                os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    with replacing(path) as temporary:
        temporary.write_text(text, encoding="utf-8")


def atomic_write_json(path: str | Path, data: Any, allow_nan: bool = False) -> None:
    """``data`` as indented JSON (NaN refused unless ``allow_nan``: JSON has none)."""
    atomic_write_text(path, json.dumps(data, indent=2, allow_nan=allow_nan) + "\n")
