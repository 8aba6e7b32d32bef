"""Models named by Hub id, resolved through huggingface_hub's cache: the cache first, a download
(with huggingface_hub's progress bars) only when it misses and the process is online.

Every command that reads a model folder (the search, statistics, sampling, alignment, and the
``bmm`` merges mergekit runs) goes through :func:`model_folder`, so a Hub id works wherever a local
folder does, and ``HF_HUB_OFFLINE=1`` works from the cache. The snapshot folder's name is the
resolved commit (:func:`snapshot_commit`), which records and cards keep beside the id.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

from mergekit_bmm.errors import ConfigError
from mergekit_bmm.io.hub_ids import looks_like_repo_id

# What a merge, a search or a statistics run reads from a model repo (no pickles, no code).
MODEL_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def is_hub_id(reference: str | Path) -> bool:
    """Whether ``reference`` names a Hub repo rather than a local path (nothing there locally)."""
    text = str(reference)
    return looks_like_repo_id(text) and not Path(text).expanduser().exists()


def _why(error: Exception) -> str:
    return (" ".join(str(error).split()) or type(error).__name__)[:200]


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


@lru_cache(maxsize=128)
def _cached(repo_id: str, revision: str | None) -> Path | None:
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except Exception:  # not in the cache (or only part of it)
        return None
    # A snapshot holding only config.json (read for a model type) is not the model.
    has_weights = any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))
    return folder if has_weights else None


def cached_folder(reference: str | Path, revision: str | None = None) -> Path | None:
    """A Hub id's snapshot folder when the cache holds it (None otherwise, and for local paths)."""
    return _cached(str(reference), revision) if is_hub_id(reference) else None


def model_folder(reference: str | Path, revision: str | None = None) -> Path:
    """The local folder of a model: a folder as is; a Hub id's snapshot in the cache (fetched when
    it is not there and the process is online). Offline and not cached: one line naming the id and
    the command that fetches it."""
    text = str(reference)
    if not is_hub_id(text):
        return Path(text).expanduser()
    cached = _cached(text, revision)
    if cached is not None:
        return cached
    named = f"{text}@{revision}" if revision else text
    fetch = f"hf download {text}" + (f" --revision {revision}" if revision else "")
    if _offline():
        raise ConfigError(
            f"model {named} is not in the Hugging Face cache and HF_HUB_OFFLINE is set; fetch it on a "
            f"machine with a network (`{fetch}`, into the same HF_HOME), or unset HF_HUB_OFFLINE"
        )
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(text, revision=revision, allow_patterns=MODEL_PATTERNS))
    except Exception as error:
        raise ConfigError(
            f"model {named}: cannot fetch it from the Hub ({_why(error)}); check the id and revision, "
            f"or fetch it with `{fetch}`"
        ) from None
    _cached.cache_clear()
    return folder


def snapshot_commit(folder: str | Path) -> str:
    """The commit a Hub snapshot folder holds ('' for any other folder)."""
    name = Path(folder).name
    parent = Path(folder).parent
    return name if _COMMIT.match(name) and parent.name == "snapshots" else ""


def hub_commit(reference: str) -> str:
    """The commit a reference's Hub id resolves to in the cache (its base's for ``BASE+ADAPTER``;
    '' for local folders and ids not cached)."""
    repo_id, _, revision = str(reference).split("+", 1)[0].partition("@")
    folder = cached_folder(repo_id, revision or None)
    return snapshot_commit(folder) if folder is not None else ""
