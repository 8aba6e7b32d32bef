"""The statistics directory: one file format, one writer, one reader.

Layout::

    STATS_DIR/
      manifest.json           # see StatsManifest
      grams/<task>.safetensors  # float32 (in, in) mean Grams, one per shared input

``G_t`` is the mean of ``x xᵀ`` over every non-padding token of task t's calibration
data, run through expert t (RegMean's convention: each task weighs equally). Modules
that read the same input (q/k/v; gate/up) share one stored Gram: ``modules`` maps every
weight name to the key it is stored under. ``tokens`` per task lets users rebuild the
sum form ``X_t X_tᵀ = tokens · G_t``.

Both data-assisted ``bmm`` and ``regmean`` read Grams only through
:func:`activation_grams_for`, which refuses statistics made for other models
(fingerprint mismatch), from an incompatible format version, lacking a module, or whose
Gram does not fit the weight (size, NaN/Inf). Weight names are matched exactly, or else
by their part from the layer stack on (``layers.3.mlp.up_proj.weight``) when exactly one
stored name has it: a ``BertForSequenceClassification`` checkpoint says
``bert.encoder.layer.0...`` where the encoder loaded for collection says ``encoder.layer.0...``.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, Field, PrivateAttr

from mergekit_bmm.core.module_map import layer_local_name
from mergekit_bmm.errors import StatisticsError
from mergekit_bmm.io.atomic import replacing
from mergekit_bmm.io.fingerprint import model_fingerprint, same_path
from mergekit_bmm.io.versioned_json import read_versioned, write_versioned

FORMAT_NAME = "mergekit-bmm-stats"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
GRAM_DIR = "grams"


class TaskStats(BaseModel):
    """One task's calibration run."""

    name: str
    model: str
    fingerprint: str = ""
    file: str
    samples: int = Field(ge=0)
    tokens: int = Field(ge=0)
    data: str = ""
    # What produced the file (data fingerprint, text field, lengths, forward dtype, ...):
    # a re-run skips the task only when these and the model's fingerprint still match.
    settings: dict[str, Any] = Field(default_factory=dict)


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

    def task_for_model(self, model: Hashable, stats_dir: Path) -> TaskStats:
        """The task whose expert is ``model`` (a path or mergekit ModelReference)."""
        path = _model_path(model)
        for task in self.tasks:
            if same_path(task.model, path):
                return task
        raise StatisticsError(
            f"statistics in {stats_dir} have no task for model {path} (they cover "
            + ", ".join(t.model for t in self.tasks)
            + "); collect them for this model with mergekit-bmm-stats"
        )


def _model_path(model: Hashable) -> str:
    inner = getattr(model, "model", None)
    return str(getattr(inner, "path", model))


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
        )
    except FileNotFoundError:
        raise StatisticsError(
            f"{stats_dir} is not a statistics directory (no {MANIFEST}); create it with mergekit-bmm-stats"
        ) from None


def load_manifest(stats_dir: str | Path) -> StatsManifest:
    directory = Path(stats_dir)
    try:
        status = (directory / MANIFEST).stat()
        stamp = (status.st_mtime_ns, status.st_size)
    except OSError:
        stamp = (0, 0)
    return _load_manifest(str(directory), stamp)


def _verified(stats_dir: str, task_name: str, model: str, recorded: str) -> None:
    # model_fingerprint caches by the weight files' size and mtime, so this stays cheap
    # per tensor and still notices a checkpoint rewritten since the last merge.
    actual = model_fingerprint(model)
    if recorded and actual and actual != recorded:
        raise StatisticsError(
            f"statistics in {stats_dir} for task {task_name!r} were made from a different "
            f"checkpoint than {model} (fingerprint {recorded} vs {actual}); re-run mergekit-bmm-stats"
        )


def activation_grams_for(
    stats_dir: str | Path,
    weight_name: str,
    models: Sequence[Hashable],
    d_in: int | None = None,
) -> list[torch.Tensor]:
    """Each model's activation Gram for the input of ``weight_name``, in model order.

    ``d_in`` (the weight's input size) is checked against each Gram's size when given.
    """
    directory = Path(stats_dir)
    manifest = load_manifest(directory)
    key = manifest.stored_key(weight_name)
    if key is None:
        raise StatisticsError(
            f"statistics in {directory} have no Gram for {weight_name}; they were collected for a "
            "different architecture or module set — re-run mergekit-bmm-stats"
        )
    grams = []
    for model in models:
        task = manifest.task_for_model(model, directory)
        _verified(str(directory), task.name, task.model, task.fingerprint)
        gram = read_gram(directory / GRAM_DIR / task.file, key, task.name)
        _check_gram(gram, directory, task.name, weight_name, d_in)
        grams.append(gram)
    return grams


def _check_gram(gram: torch.Tensor, directory: Path, task: str, weight_name: str, d_in: int | None) -> None:
    where = f"statistics in {directory}, task {task!r}, module {weight_name}"
    if gram.ndim != 2 or gram.shape[0] != gram.shape[1]:
        raise StatisticsError(f"{where}: the Gram has shape {tuple(gram.shape)}, not a square matrix")
    if d_in is not None and gram.shape[0] != d_in:
        raise StatisticsError(
            f"{where}: the Gram is {gram.shape[0]}x{gram.shape[1]} but the weight has {d_in} inputs; "
            "the statistics were made for a model of another size — re-run mergekit-bmm-stats"
        )
    if not bool(torch.isfinite(gram).all()):
        raise StatisticsError(f"{where}: the Gram contains NaN or Inf; re-run mergekit-bmm-stats")


def read_gram(path: Path, key: str, task_name: str = "") -> torch.Tensor:
    """One stored Gram, as float32 on the CPU."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            if key not in handle.keys():
                raise StatisticsError(
                    f"{path} lacks the Gram {key} of task {task_name!r}; re-run mergekit-bmm-stats"
                )
            return handle.get_tensor(key).to(torch.float32)
    except FileNotFoundError:
        raise StatisticsError(f"statistics file {path} is missing; re-run mergekit-bmm-stats") from None
    except StatisticsError:
        raise
    except Exception as error:  # safetensors reports a damaged file with its own error type
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise StatisticsError(
            f"statistics file {path} is unreadable ({first}); re-run mergekit-bmm-stats"
        ) from None


def write_grams(path: Path, grams: Mapping[str, torch.Tensor]) -> None:
    """Atomically write one task's Grams (float32, contiguous)."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().to(torch.float32).contiguous().cpu() for k, v in grams.items()}
    with replacing(path) as temporary:
        save_file(tensors, str(temporary))
