"""The statistics directory: one file format, one writer, one reader.

Layout (format version 2)::

    STATS_DIR/
      manifest.json                         # see StatsManifest
      grams/<task>/part-00001.safetensors   # one file per collection pass: that pass's Grams,
                                            # each packed or as its token rows (gram_storage)
      README.md                             # the card, once published

Version 1 folders (``grams/<task>.safetensors``, full float32 matrices) are still read.

``G_t`` is the mean of ``x xᵀ`` over every non-padding token of task t's calibration
data, run through expert t (RegMean's convention: each task weighs equally). Modules
that read the same input (q/k/v; gate/up) share one stored Gram: ``modules`` maps every
weight name to the key it is stored under, and each task's ``parts`` maps a key to the
part file that holds it. ``tokens`` per task lets users rebuild the sum form
``X_t X_tᵀ = tokens · G_t``.

An expert ``e`` of a mixture-of-experts stack has its own Gram per task, stored as the mean over
the ``n_te`` tokens routed to it (``routed`` counts them, zero included). A merge reads it as
``(n_te / n_t) · mean``, i.e. ``X_te X_teᵀ / n_t``: the task's own loss restricted to the tokens
that reach the expert, so a task that rarely uses an expert weighs little in its regression,
and an expert no token reached has a zero Gram.

Both data-assisted ``bmm`` and ``regmean`` read Grams only through
:func:`activation_grams_for`. It matches each expert to its task by path or Hub id, or
else by the weights' fingerprint (statistics shared on the Hub serve a local copy of the
same expert), and refuses statistics made for other weights (fingerprint or Hub commit
mismatch), an incompatible format version, a missing module, or a Gram that does not fit
the weight (size, NaN/Inf). Weight names are matched exactly, or else
by their part from the layer stack on (``layers.3.mlp.up_proj.weight``) when exactly one
stored name has it: a ``BertForSequenceClassification`` checkpoint says
``bert.encoder.layer.0...`` where the encoder loaded for collection says ``encoder.layer.0...``.
A ``stats:`` value may be a Hub reference (``hf://ORG/NAME[@REV]``), fetched once
through huggingface_hub's cache (:mod:`mergekit_bmm.stats.hub`).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, Field, PrivateAttr, field_validator

from mergekit_bmm.core.finite import all_finite
from mergekit_bmm.core.module_map import layer_local_name
from mergekit_bmm.errors import StatisticsError
from mergekit_bmm.io.atomic import replacing
from mergekit_bmm.io.fingerprint import model_fingerprint, reference_fingerprint, same_path
from mergekit_bmm.io.versioned_json import read_versioned, write_versioned
from mergekit_bmm.stats import gram_storage
from mergekit_bmm.stats.hub import cached_model_folder, stats_directory

FORMAT_NAME = "mergekit-bmm-stats"
FORMAT_VERSION = 2
OLDER_VERSIONS = (1,)
MANIFEST = "manifest.json"
GRAM_DIR = "grams"
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def part_name(index: int) -> str:
    """The file of a task's ``index``-th collection pass (1-based)."""
    return f"part-{index:05d}.safetensors"


class TaskStats(BaseModel):
    """One task's calibration run."""

    name: str
    model: str
    fingerprint: str = ""
    # Version 2: the task's folder under grams/; version 1: its single file there.
    file: str
    samples: int = Field(ge=0)
    tokens: int = Field(ge=0)
    data: str = ""
    # What produced the file (data fingerprint, text field, lengths, forward dtype, ...):
    # a re-run skips the task only when these and the model's fingerprint still match.
    settings: dict[str, Any] = Field(default_factory=dict)
    revision: str = ""  # the expert's Hub commit, when it came from the Hub
    parts: dict[str, str] = Field(default_factory=dict)  # version 2: stored key -> part file
    passes: int = Field(default=0, ge=0)
    # mixture-of-experts slices (``<stack>[e]``) -> the task's tokens the router sent there
    routed: dict[str, int] = Field(default_factory=dict)

    def share(self, key: str) -> float | None:
        """The share of the task's tokens routed to expert slice ``key`` (None: not a slice)."""
        count = self.routed.get(key)
        return None if count is None else count / max(self.tokens, 1)

    @field_validator("file")
    @classmethod
    def _plain_file(cls, value: str) -> str:
        if not _PLAIN_NAME.match(value):
            raise ValueError(f"{value!r} is not a plain file name inside {GRAM_DIR}/")
        return value

    @field_validator("parts")
    @classmethod
    def _plain_parts(cls, value: dict[str, str]) -> dict[str, str]:
        for part in value.values():
            if not _PLAIN_NAME.match(part) or not part.endswith(".safetensors"):
                raise ValueError(f"{part!r} is not a plain .safetensors file name")
        return value

    def files(self) -> list[str]:
        """The task's files, relative to ``grams/``."""
        if not self.parts:
            return [self.file]
        return [f"{self.file}/{part}" for part in sorted(set(self.parts.values()))]


class StatsManifest(BaseModel):
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    package_version: str
    dtype: str = "float32"
    tasks: list[TaskStats]
    modules: dict[str, str]
    model_type: str = ""
    notes: dict[str, str] = Field(default_factory=dict)
    _by_local_name: dict[str, list[str]] | None = PrivateAttr(default=None)

    def stored_key(self, weight_name: str) -> str | None:
        """The key of the Gram that serves ``weight_name`` (None if there is none).

        Exact names first; otherwise the one stored name with the same part from the
        layer stack on (names that differ only in a prefix such as ``bert.``).
        """
        key = self.modules.get(weight_name)
        if key is not None:
            return key
        local = layer_local_name(weight_name)
        if local is None:
            return None
        if self._by_local_name is None:
            index: dict[str, list[str]] = {}
            for name in self.modules:
                name_local = layer_local_name(name)
                if name_local is not None:
                    index.setdefault(name_local, []).append(name)
            self._by_local_name = index
        candidates = self._by_local_name.get(local, [])
        return self.modules[candidates[0]] if len(candidates) == 1 else None

    def readers(self, key: str) -> int:
        """How many weights read the stored Gram ``key`` (q/k/v share one input's: 3)."""
        return list(self.modules.values()).count(key)

    def task_for_model(self, model: Hashable, stats_dir: Path) -> TaskStats:
        """The task whose expert is ``model`` (a path, Hub id or mergekit ModelReference).

        By path or id first; otherwise by the fingerprint of the model's weights, so that
        statistics collected from a Hub id serve a local copy of the same expert and the
        other way round. A task found by name must have been made from these weights.
        """
        path, revision = _model_reference(model)
        for task in self.tasks:
            if same_path(task.model, path):
                _check_same_weights(task, path, revision, stats_dir)
                return task
        fingerprint = _local_fingerprint(path, revision)
        for task in self.tasks:
            if fingerprint and task.fingerprint == fingerprint:
                return task
        raise StatisticsError(
            f"statistics in {stats_dir} have no task for model {path} (they cover "
            + ", ".join(t.model for t in self.tasks)
            + ", and no task was made from its weights); collect them for this model with mergekit-bmm-stats"
        )


def _model_reference(model: Hashable) -> tuple[str, str | None]:
    """(path, revision); a LoRA expert keeps its adapter (``BASE+ADAPTER``): each adapter of one
    base is its own task."""
    inner = getattr(model, "model", None)
    lora = getattr(model, "lora", None)
    if lora is not None:
        return str(model), None
    return str(getattr(inner, "path", model)), getattr(inner, "revision", None)


@lru_cache(maxsize=256)
def _hub_copy(path: str, revision: str | None) -> Path | None:
    return cached_model_folder(path, revision)


def _local_fingerprint(path: str, revision: str | None) -> str:
    """The fingerprint of a model's weights on this machine ("" when they are not here)."""
    if "+" in path:  # BASE+ADAPTER: both, as the task recorded them
        return reference_fingerprint(path)
    folder = Path(path).expanduser()
    if not folder.is_dir():
        folder = _hub_copy(path, revision)
    return model_fingerprint(folder) if folder is not None else ""


def _check_same_weights(task: TaskStats, path: str, revision: str | None, stats_dir: Path) -> None:
    # model_fingerprint caches by the weight files' size and mtime, so this stays cheap
    # per tensor and still notices a checkpoint rewritten since the last merge.
    copy = None if Path(path).expanduser().is_dir() else _hub_copy(path, revision)
    commit = copy.name if copy is not None else (revision or "")
    if task.revision and re.fullmatch(r"[0-9a-f]{40}", commit) and commit != task.revision:
        raise StatisticsError(
            f"statistics in {stats_dir} for task {task.name!r} were made from {task.model} at commit "
            f"{task.revision[:12]}, but the recipe uses commit {commit[:12]}; pin the recipe's model to "
            f"{task.model}@{task.revision} or re-run mergekit-bmm-stats"
        )
    actual = _local_fingerprint(path, revision)
    if task.fingerprint and actual and actual != task.fingerprint:
        raise StatisticsError(
            f"statistics in {stats_dir} for task {task.name!r} were made from a different "
            f"checkpoint than {path} (fingerprint {task.fingerprint} vs {actual}); re-run mergekit-bmm-stats"
        )


def write_manifest(stats_dir: str | Path, manifest: StatsManifest) -> None:
    write_versioned(Path(stats_dir) / MANIFEST, manifest)


@lru_cache(maxsize=16)
def _load_manifest(stats_dir: str, stamp: tuple[int, int]) -> StatsManifest:
    try:
        return read_versioned(
            Path(stats_dir) / MANIFEST,
            StatsManifest,
            "re-run mergekit-bmm-stats",
            StatisticsError,
            "statistics",
            older_versions=OLDER_VERSIONS,
        )
    except FileNotFoundError:
        raise StatisticsError(
            f"{stats_dir} is not a statistics directory (no {MANIFEST}); create it with mergekit-bmm-stats"
        ) from None


def load_manifest(stats_dir: str | Path) -> StatsManifest:
    """The manifest of a statistics directory or Hub reference (``hf://...``)."""
    directory = stats_directory(str(stats_dir))
    try:
        status = (directory / MANIFEST).stat()
        stamp = (status.st_mtime_ns, status.st_size)
    except OSError:
        stamp = (0, 0)
    return _load_manifest(str(directory), stamp)


def activation_grams_for(
    stats_dir: str | Path,
    weight_name: str,
    models: Sequence[Hashable],
    d_in: int | None = None,
) -> list[torch.Tensor]:
    """Each model's activation Gram for the input of ``weight_name``, in model order.

    ``stats_dir`` may be a folder or a Hub reference. ``d_in`` (the weight's input size) is
    checked against each Gram's size when given.
    """
    directory = stats_directory(str(stats_dir))
    manifest = load_manifest(directory)
    key = manifest.stored_key(weight_name)
    if key is None and weight_name.endswith("]"):
        raise StatisticsError(
            f"statistics in {stats_dir} have no Gram for the mixture-of-experts expert {weight_name}: they "
            "were collected before mergekit-bmm-stats recorded each expert's routed tokens (or for another "
            "architecture) — re-run mergekit-bmm-stats"
        )
    if key is None:
        raise StatisticsError(
            f"statistics in {stats_dir} have no Gram for {weight_name}; they were collected for a "
            "different architecture or module set — re-run mergekit-bmm-stats"
        )
    grams = []
    for model in models:
        task = manifest.task_for_model(model, Path(str(stats_dir)))
        share = task.share(key)
        if share == 0:  # no token of this task reached the expert
            size = d_in if d_in is not None else _slice_size(directory, manifest, key)
            grams.append(torch.zeros(size, size))
            continue
        gram = read_task_gram(directory, manifest, task, key, stats_dir)
        _check_gram(gram, stats_dir, task.name, weight_name, d_in)
        grams.append(gram if share is None else gram.double() * share)  # scaled without rounding
    return grams


def _slice_size(directory: Path, manifest: StatsManifest, key: str) -> int:
    """The input size of an expert slice, from a task that has its Gram."""
    for task in manifest.tasks:
        if task.routed.get(key):
            return read_task_gram(directory, manifest, task, key).shape[0]
    raise StatisticsError(f"statistics in {directory}: no task's tokens reached {key}; pass d_in")


def activation_tokens_for(
    stats_dir: str | Path, models: Sequence[Hashable], weight_name: str | None = None
) -> list[int]:
    """How many tokens each model's Grams average (every linear module sees every token; an expert
    slice of ``weight_name``, the tokens routed to it), in model order: the evidence for λ counts
    them as observations."""
    directory = stats_directory(str(stats_dir))
    manifest = load_manifest(directory)
    key = manifest.stored_key(weight_name) if weight_name is not None else None
    tasks = [manifest.task_for_model(model, Path(str(stats_dir))) for model in models]
    return [task.routed.get(key, task.tokens) if key is not None else task.tokens for task in tasks]


def read_task_gram(
    directory: Path, manifest: StatsManifest, task: TaskStats, key: str, label: str | Path = ""
) -> torch.Tensor:
    """One task's stored Gram ``key`` as a full float32 matrix on the CPU, from either format version."""
    if manifest.format_version == 1:
        return read_gram(directory / GRAM_DIR / task.file, key, task.name)
    part = task.parts.get(key)
    where = f"statistics in {label or directory}, task {task.name!r}"
    if part is None:
        raise StatisticsError(f"{where} lack the Gram {key}; re-run mergekit-bmm-stats")
    path = directory / GRAM_DIR / task.file / part
    read = lambda: gram_storage.read_part_gram(path, key, where)  # noqa: E731
    if manifest.readers(key) < 2:  # one weight reads it: nothing to keep
        return read()
    return _recent_grams.get(path, key, read)


class _RecentGrams:
    """The last Grams read, up to a byte budget: the weights that read one input (q, k, v; gate, up)
    are merged one after the other and share its stored Gram, which is then read and unpacked once.
    Keyed by the part file (with its size and time) and the key; each caller gets its own copy.
    A Gram only one weight reads (o_proj, down_proj) bypasses it: keeping it would only copy it."""

    BUDGET = 512 * 2**20

    def __init__(self) -> None:
        self._kept: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, path: Path, key: str, read: Callable[[], torch.Tensor]) -> torch.Tensor:
        try:
            status = path.stat()
            stamp = (str(path), status.st_size, status.st_mtime_ns, key)
        except OSError:
            return read()  # the reader names the missing file
        with self._lock:
            found = self._kept.get(stamp)
            if found is not None:
                self._kept.move_to_end(stamp)
                return found.clone()
        gram = read()
        size = gram.numel() * gram.element_size()
        with self._lock:
            if size <= self.BUDGET:
                self._kept[stamp] = gram
                while sum(g.numel() * g.element_size() for g in self._kept.values()) > self.BUDGET:
                    self._kept.popitem(last=False)
        return gram.clone()


_recent_grams = _RecentGrams()


def read_task_grams(stats_dir: str | Path, task_name: str) -> dict[str, torch.Tensor]:
    """Every stored Gram of one task, ``{stored key: float32 matrix}`` (for inspection and tests);
    expert slices as stored (the mean over their routed tokens), those no token reached left out."""
    directory = stats_directory(str(stats_dir))
    manifest = load_manifest(directory)
    task = next((t for t in manifest.tasks if t.name == task_name), None)
    if task is None:
        raise StatisticsError(f"statistics in {stats_dir} have no task {task_name!r}")
    keys = sorted(key for key in set(manifest.modules.values()) if task.routed.get(key, 1))
    return {key: read_task_gram(directory, manifest, task, key) for key in keys}


def _check_gram(
    gram: torch.Tensor, directory: str | Path, task: str, weight_name: str, d_in: int | None
) -> None:
    where = f"statistics in {directory}, task {task!r}, module {weight_name}"
    if gram.ndim != 2 or gram.shape[0] != gram.shape[1]:
        raise StatisticsError(f"{where}: the Gram has shape {tuple(gram.shape)}, not a square matrix")
    if d_in is not None and gram.shape[0] != d_in:
        raise StatisticsError(
            f"{where}: the Gram is {gram.shape[0]}x{gram.shape[1]} but the weight has {d_in} inputs; "
            "the statistics were made for a model of another size — re-run mergekit-bmm-stats"
        )
    if not all_finite(gram):
        raise StatisticsError(f"{where}: the Gram contains NaN or Inf; re-run mergekit-bmm-stats")


def read_gram(path: Path, key: str, task_name: str = "") -> torch.Tensor:
    """One Gram of a version 1 file, as float32 on the CPU."""
    with gram_storage.statistics_file(path) as handle:
        if key not in handle.keys():
            raise StatisticsError(
                f"{path} lacks the Gram {key} of task {task_name!r}; re-run mergekit-bmm-stats"
            )
        piece = handle.get_slice(key)
        shape = tuple(piece.get_shape())
        if len(shape) != 2 or shape[0] != shape[1] or piece.get_dtype() not in ("F32", "F64", "F16", "BF16"):
            raise StatisticsError(
                f"{path} holds Gram {key} of task {task_name!r} as {piece.get_dtype()} {shape}, "
                "not a square float matrix; re-run mergekit-bmm-stats"
            )
        return handle.get_tensor(key).to(torch.float32)


def write_part(stats_dir: str | Path, task_folder: str, index: int, grams: Mapping[str, Any]) -> str:
    """Atomically write a task's ``index``-th part (``{key: StoredGram}``); its file name."""
    name = part_name(index)
    gram_storage.write_part(Path(stats_dir) / GRAM_DIR / task_folder / name, grams)
    return name


def write_grams(path: Path, grams: Mapping[str, torch.Tensor]) -> None:
    """Atomically write one task's Grams in the version 1 layout (float32 full matrices)."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().to(torch.float32).contiguous().cpu() for k, v in grams.items()}
    with replacing(path) as temporary:
        save_file(tensors, str(temporary))
