"""What a local model folder says about itself: its architecture, depth and tensor names.

Everything is read through the libraries that own the formats: the configuration through
``transformers.AutoConfig`` (which also knows each architecture's own key for the layer
count, e.g. GPT-2's ``n_layer``), tensor names from the safetensors headers alone.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from mergekit_bmm.errors import ConfigError


def model_dir(reference: str | Path) -> Path:
    """The folder of a mergekit model reference (``path+lora`` names the base folder)."""
    return Path(str(reference).split("+", 1)[0])


def local_model_dir(reference: str | Path) -> Path:
    """:func:`model_dir`, with a Hub id (``ORG/NAME`` or ``ORG/NAME@REVISION``) resolved to its
    snapshot in huggingface_hub's cache (fetched first when missing and online)."""
    from mergekit_bmm.io.hub_models import is_hub_id, model_folder

    folder = model_dir(reference)
    if folder.exists():
        return folder
    repo_id, _, revision = str(folder).partition("@")
    return model_folder(repo_id, revision or None) if is_hub_id(repo_id) else folder


@lru_cache(maxsize=64)
def _config(path: str, stamp: int) -> Any:
    from transformers import AutoConfig, PretrainedConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError):
        # An architecture this transformers does not know: its raw config.json still names it.
        raw, _ = PretrainedConfig.get_config_dict(path, local_files_only=True)
        return PretrainedConfig(**raw)


def model_config(reference: str | Path) -> Any:
    """The folder's (or Hub id's) configuration; a one-line error if it has none."""
    folder = local_model_dir(reference)
    path = folder / "config.json"
    try:
        stamp = path.stat().st_mtime_ns
        return _config(str(folder), stamp)
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"cannot read {path} ({type(error).__name__}): a model must be a local folder with a "
            "config.json, or a Hub id"
        ) from None


def model_config_of(reference: Any) -> Any | None:
    """The configuration of a model folder, Hub id or mergekit ModelReference; None if unreadable
    (a LoRA expert's ``BASE+ADAPTER``: the base's)."""
    path = getattr(getattr(reference, "model", None), "path", reference)
    if not isinstance(path, (str, Path)):
        return None
    try:
        return model_config(str(path).split("+", 1)[0])
    except Exception:  # not a folder, or a Hub id not in the cache: the caller treats it as unknown
        return None


def model_type_of(reference: Any) -> str | None:
    """``model_type`` of a model folder or Hub id (or a mergekit ModelReference); None if unknown.

    A Hub id's ``config.json`` is read through huggingface_hub: the cache first, the Hub only
    when that misses and the process is online. The storage layout of some weights depends on
    this answer, so it is never guessed from tensor names.
    """
    model = getattr(reference, "model", None)
    path = getattr(model, "path", reference)
    if not isinstance(path, (str, Path)):
        return None
    if (model_dir(path) / "config.json").is_file():
        try:
            return getattr(model_config(path), "model_type", None) or None
        except ConfigError:
            return None
    from mergekit_bmm.io.hub_ids import looks_like_repo_id

    repo_id = str(path).split("+", 1)[0]
    if not looks_like_repo_id(repo_id) or Path(repo_id).exists():
        return None
    return _hub_model_type(repo_id, getattr(model, "revision", None))


@lru_cache(maxsize=64)
def _hub_model_type(repo_id: str, revision: str | None) -> str | None:
    from huggingface_hub import constants, hf_hub_download

    for local_only in (True, False):
        if not local_only and constants.HF_HUB_OFFLINE:
            break
        try:
            path = hf_hub_download(repo_id, "config.json", revision=revision, local_files_only=local_only)
        except Exception:  # not cached, not reachable, no such repo: the layout stays unknown
            continue
        try:
            return json.loads(Path(path).read_text(encoding="utf-8")).get("model_type") or None
        except (OSError, ValueError):
            return None
    return None


def num_layers_of(reference: str | Path) -> int:
    """The number of transformer layers of a local model folder."""
    config = model_config(reference)
    for candidate in (config, getattr(config, "text_config", None)):
        layers = getattr(candidate, "num_hidden_layers", None)
        if isinstance(layers, int):
            return layers
    raise ConfigError(
        f"{local_model_dir(reference) / 'config.json'} does not say how many layers the model has"
    )


def weight_names_of(reference: str | Path) -> list[str]:
    """Tensor names of a checkpoint, local or by Hub id (safetensors headers only)."""
    from safetensors import safe_open

    directory = local_model_dir(reference)
    names: list[str] = []
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            names.extend(handle.keys())
    if not names:
        raise ConfigError(f"no .safetensors weights in {directory}")
    return names


def weight_shapes_of(reference: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a local checkpoint (safetensors headers only). Kept per shard
    file, size and modification time: the merge asks once for every weight that reads a shared
    input, and a rewritten shard is read again."""
    paths = sorted(local_model_dir(reference).glob("*.safetensors"))
    shards = tuple(
        (str(path), stat.st_size, stat.st_mtime_ns) for path, stat in ((p, p.stat()) for p in paths)
    )
    return dict(_header_shapes(shards))


@lru_cache(maxsize=8)
def _header_shapes(shards: tuple[tuple[str, int, int], ...]) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path, _size, _stamp in shards:
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def merge_names_of(reference: str | Path) -> list[str]:
    """Every name a merge of this checkpoint may read a tensor under: the checkpoint's own, then
    transformers' layout names it lacks (mergekit converts a checkpoint saved under older names, or
    with per-expert weights, on load). Filters written for a recipe must match either."""
    names = weight_names_of(reference)
    known = set(names)
    return names + [name for name in layout_shapes_of(reference) if name not in known]


def layout_shapes_of(reference: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes as transformers lays the model out, which are the names mergekit
    merges where a checkpoint was saved under older names or with per-expert weights (mergekit
    converts them on load); empty where transformers cannot build the model."""
    folder = local_model_dir(reference)
    path = folder / "config.json"
    try:
        return _layout_shapes(str(folder), path.stat().st_mtime_ns)
    except OSError:
        return {}


@lru_cache(maxsize=8)
def _layout_shapes(path: str, stamp: int) -> dict[str, tuple[int, ...]]:
    import torch
    import transformers

    config = _config(path, stamp)
    try:
        model_class = getattr(transformers, (config.architectures or [""])[0])
        with torch.device("meta"):
            model = model_class._from_config(config)
    except Exception:  # an architecture this transformers cannot build: the checkpoint's names only
        return {}
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
