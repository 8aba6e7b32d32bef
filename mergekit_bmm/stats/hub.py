"""Experts, calibration data and statistics on the Hugging Face Hub, through huggingface_hub's cache.

Everything is fetched with ``snapshot_download``, so a second use reads the local cache and
``HF_HUB_OFFLINE=1`` works from it; the snapshot folder's name is the resolved commit, which
is what the manifest records. Statistics are fetched as data only: the manifest, safetensors
part files and the card — nothing that could be unpickled or imported is even downloaded.

References: a recipe's ``stats: hf://ORG/NAME[@REV]`` (a model repo, as the Hub's own
``hf://`` paths mean) or ``hf://datasets/ORG/NAME[@REV]``; a ``stats.yml`` expert or data
set by plain id (``ORG/NAME``) with an optional revision.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from mergekit_bmm.errors import ConfigError, StatisticsError
from mergekit_bmm.io.hub_ids import looks_like_repo_id
from mergekit_bmm.io.hub_models import cached_folder, model_folder, snapshot_commit
from mergekit_bmm.io.lora_experts import dense_model, is_lora_reference

HF_PREFIX = "hf://"
STATS_PATTERNS = ["manifest.json", "*.safetensors", "README.md"]
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class HubReference:
    """A repo on the Hub: id, requested revision (None: the default branch) and type."""

    repo_id: str
    revision: str | None = None
    repo_type: str = "model"

    def __str__(self) -> str:
        kind = "datasets/" if self.repo_type == "dataset" else ""
        return f"{HF_PREFIX}{kind}{self.repo_id}" + (f"@{self.revision}" if self.revision else "")


def parse_hf_reference(text: str) -> HubReference | None:
    """``hf://[datasets/]ORG/NAME[@REV]`` as a reference; None for anything else (a local path)."""
    if not text.startswith(HF_PREFIX):
        return None
    rest = text[len(HF_PREFIX) :]
    repo_type = "model"
    for prefix, kind in (("datasets/", "dataset"), ("models/", "model")):
        if rest.startswith(prefix):
            rest, repo_type = rest[len(prefix) :], kind
    repo_id, _, revision = rest.partition("@")
    if not looks_like_repo_id(repo_id) or "/" not in repo_id or (_ and not revision):
        raise ConfigError(
            f"stats {text!r} is not a Hub reference; write hf://ORG/NAME or hf://ORG/NAME@REVISION"
        )
    return HubReference(repo_id, revision or None, repo_type)


def _fetch(reference: HubReference, patterns: list[str]) -> Path:
    from huggingface_hub import snapshot_download

    return Path(
        snapshot_download(
            reference.repo_id,
            repo_type=reference.repo_type,
            revision=reference.revision,
            allow_patterns=patterns,
        )
    )


def _why(error: Exception) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text[:200]


@lru_cache(maxsize=32)
def stats_directory(reference: str) -> Path:
    """The local folder of a recipe's ``stats:`` value (a Hub reference is fetched once)."""
    hub = parse_hf_reference(str(reference))
    if hub is None:
        return Path(reference)
    try:
        return _fetch(hub, STATS_PATTERNS)
    except Exception as error:
        raise StatisticsError(
            f"stats {reference}: cannot fetch it from the Hub ({_why(error)}); check the id and revision "
            "(offline, huggingface_hub's cache must hold it)"
        ) from None


@dataclass(frozen=True)
class ResolvedModel:
    """An expert as collected: the folder read, and its Hub id and commit when it came from the Hub."""

    path: Path
    repo_id: str = ""
    revision: str = ""


def resolve_model(model: str, revision: str | None = None) -> ResolvedModel:
    """A local folder as is; a Hub id from the cache, downloaded (weights, config, tokenizer) when
    it is not there and the process is online (:func:`mergekit_bmm.io.hub_models.model_folder`)."""
    folder = Path(model).expanduser()
    if folder.is_dir():
        return ResolvedModel(folder)
    if is_lora_reference(model):  # BASE+ADAPTER: read from its merged copy
        return ResolvedModel(dense_model(model))
    if not looks_like_repo_id(model):
        raise ConfigError(f"model {model} is neither a local folder nor a Hub repo id (ORG/NAME)")
    path = model_folder(model, revision)
    return ResolvedModel(path, model, snapshot_commit(path))


def cached_model_folder(model: str, revision: str | None = None) -> Path | None:
    """The local copy of a Hub expert in huggingface_hub's cache (None if there is none)."""
    return cached_folder(model, revision)


def fetch_dataset(name: str, revision: str | None = None) -> tuple[Path, str]:
    """A Hub data set's snapshot folder in the cache, and the commit it holds."""
    try:
        folder = _fetch(HubReference(name, revision, "dataset"), ["*"])
    except Exception as error:
        named = f"{name}@{revision}" if revision else name
        raise ConfigError(
            f"data {named} is no local file or folder, and fetching it as a Hub data set failed "
            f"({_why(error)}); check the path, or the name and revision (offline, huggingface_hub's cache "
            "must hold it)"
        ) from None
    return folder, folder.name if _COMMIT.match(folder.name) else ""


def load_hub_dataset(folder: Path, name: str, config: str | None, split: str | None):
    """A fetched Hub data set through ``datasets.load_dataset`` (config and split as on the Hub)."""
    try:
        import datasets
    except ImportError:  # pragma: no cover - lm-eval depends on it
        raise ConfigError(f"data {name} is a Hub data set, which needs `pip install datasets`") from None
    try:
        loaded = datasets.load_dataset(str(folder), config, split=split)
    except Exception as error:
        raise ConfigError(
            f"data {name}: datasets.load_dataset failed ({_why(error)}); check `data_config:` and `split:`"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        if len(loaded) != 1:
            raise ConfigError(f"data {name} has the splits {', '.join(loaded)}; choose one with `split:`")
        loaded = next(iter(loaded.values()))
    return loaded
