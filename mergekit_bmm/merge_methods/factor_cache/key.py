"""What a cached factor depends on, written down as a key (the entries themselves: ``store.py``).

A key is canonical JSON with:

* the format, this package's and mergekit's versions, the tensor name;
* every input in order, with its role (base, expert, anchor), its name, and its content:
  for mergekit's model references the checkpoint fingerprint
  (:func:`~mergekit_bmm.io.fingerprint.model_fingerprint`) plus a hash of 16 evenly spaced
  runs of 256 elements of the tensor actually handed to the kernel (an in-place rewrite that
  mergekit's loader cache still serves stale, or an edit the file fingerprint's samples
  miss, is caught unless it leaves every sampled run unchanged); for plain ids (Python API)
  a hash of the whole tensor. Shape and dtype too: the recipe's ``dtype`` rounds the
  inputs before BMM sees them;
* the anchor: method, the parameters forwarded to it, ``anchor_seed`` (and the content of
  a statistics directory forwarded to it as ``stats``, for ``regmean``) — or which input is
  marked ``anchor: true``;
* for solved tensors: the Gram mode, the statistics' fingerprint (``activations``/``mix``),
  ε for ``mix`` (it changes ``G``), compute dtype, orientation and stored precision.

λ, ``lambda_mode`` and ``s`` are not in the key: they are applied to the factors.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from typing import Any

import torch
from mergekit.merge_methods.base import TensorEntry

from mergekit_bmm.io.fingerprint import file_fingerprint, reference_fingerprint
from mergekit_bmm.merge_methods.bmm_anchor import AnchorSource
from mergekit_bmm.merge_methods.bmm_parameters import BMMSettings
from mergekit_bmm.merge_methods.factor_cache.store import CACHE_FORMAT

SAMPLE_RUNS = 16
SAMPLE_RUN = 256


@lru_cache(maxsize=1)
def _versions() -> dict[str, str]:
    from mergekit_bmm.io.versions import versions

    return versions()


def _tensor_bytes(tensor: torch.Tensor):
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def content_digest(tensor: torch.Tensor) -> str:
    """Hash of every byte of ``tensor``."""
    return hashlib.sha256(_tensor_bytes(tensor)).hexdigest()[:32]


def sample_digest(tensor: torch.Tensor) -> str:
    """Hash of ``SAMPLE_RUNS`` evenly spaced runs of ``SAMPLE_RUN`` elements.

    Runs of consecutive elements touch a few pages of a memory-mapped checkpoint where
    single elements spread over the tensor would fault in every page of it.
    """
    flat = tensor.detach().reshape(-1)
    if flat.numel() > SAMPLE_RUNS * SAMPLE_RUN:
        starts = torch.linspace(0, flat.numel() - SAMPLE_RUN, SAMPLE_RUNS).long().tolist()
        flat = torch.cat([flat[start : start + SAMPLE_RUN] for start in starts])
    return hashlib.sha256(_tensor_bytes(flat)).hexdigest()[:32]


def input_identity(entry: TensorEntry, role: str) -> dict[str, Any]:
    identity = {
        "role": role,
        "id": str(entry.id),
        "shape": list(entry.tensor.shape),
        "dtype": str(entry.tensor.dtype),
    }
    fingerprint = reference_fingerprint(str(entry.id))  # a Hub id's snapshot, BASE+ADAPTER both
    if fingerprint:
        identity.update(fingerprint=fingerprint, sample=sample_digest(entry.tensor))
    else:
        identity["content"] = content_digest(entry.tensor)
    return identity


def stats_fingerprint(stats_dir: str | None) -> str:
    """Fingerprint of a statistics directory: its manifest and every Gram file."""
    if not stats_dir:
        return ""
    from mergekit_bmm.stats.hub import stats_directory
    from mergekit_bmm.stats.store import GRAM_DIR, MANIFEST

    directory = stats_directory(str(stats_dir))
    files = [directory / MANIFEST, *sorted((directory / GRAM_DIR).rglob("*.safetensors"))]
    stamp = []
    for path in files:
        try:
            status = path.stat()
        except OSError:
            continue
        stamp.append((str(path), status.st_size, status.st_mtime_ns))
    return _stats_fingerprint(tuple(stamp))


@lru_cache(maxsize=64)
def _stats_fingerprint(stamp: tuple[tuple[str, int, int], ...]) -> str:
    digest = hashlib.sha256()
    for path, _, _ in stamp:
        digest.update(file_fingerprint(path).encode())
    return "sha256:" + digest.hexdigest()[:32]


def _inputs(source: AnchorSource) -> list[dict[str, Any]]:
    identities = [input_identity(source.group.base, "base")]
    identities += [input_identity(entry, "expert") for entry in source.tasks]
    if source.anchor_entry is not None:
        identities.append(input_identity(source.anchor_entry, "anchor"))
    return identities


def _dump(description: dict[str, Any]) -> str:
    return json.dumps(description, sort_keys=True, separators=(",", ":"))


def _common(settings: BMMSettings, source: AnchorSource) -> dict[str, Any]:
    anchor = source.dependencies()
    forwarded_stats = anchor.get("parameters", {}).get("stats")
    if isinstance(forwarded_stats, str):  # an anchor that reads Grams (regmean): their content too
        anchor["stats_fingerprint"] = stats_fingerprint(forwarded_stats)
    return {
        "format": CACHE_FORMAT,
        "versions": _versions(),
        "tensor": source.group.metadata.name or "",
        "inputs": _inputs(source),
        "anchor": anchor,
        "compute_dtype": str(settings.compute_dtype),
    }


def anchor_key(settings: BMMSettings, source: AnchorSource) -> str:
    """Key of an anchor result (tensors BMM does not solve)."""
    return _dump({**_common(settings, source), "kind": "anchor"})


def factor_key(settings: BMMSettings, source: AnchorSource, transpose: bool) -> str:
    """Key of a solved tensor's eigen factors."""
    description = _common(settings, source)
    description.update(
        kind="factors",
        gram=settings.gram,
        stats=stats_fingerprint(settings.stats) if settings.gram != "data_free" else None,
        epsilon=settings.epsilon if settings.gram == "mix" else None,
        transpose=transpose,
        precision=str(settings.cache_dtype) if settings.cache_dtype is not None else "auto",
    )
    if settings.task_balance != "none":  # caches filled before task balance keep their keys
        description["balance"] = settings.task_balance
    if settings.gram_sharing != "weight" and settings.gram != "activations":  # and before gram sharing
        description["gram_sharing"] = settings.gram_sharing
    return _dump(description)


def with_route(key: str, route: str) -> str:
    """``key`` for factors computed by another route (``low_rank``: from LoRA factors), so that the
    two routes' entries, equal only to rounding, are never mixed."""
    description = json.loads(key)
    description["route"] = route
    return _dump(description)


def gram_key(gram: torch.Tensor, rank: int | None) -> str:
    """What one Gram's eigendecomposition depends on: its exact content (so weights with the
    same ``G`` can share it), the rank kept, and the versions that compute it."""
    description = {
        "format": CACHE_FORMAT,
        "kind": "basis",
        "versions": _versions(),
        "torch": torch.__version__,
        "gram": content_digest(gram),
        "shape": list(gram.shape),
        "dtype": str(gram.dtype),
        "rank": rank,
    }
    return _dump(description)
