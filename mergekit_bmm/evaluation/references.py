"""The experts' references: what each expert predicts on its own task's text, computed once per search.

Layout (format version 1)::

    references/
      manifest.json        # per task: the expert and base it was made with (fingerprints), the
                           # settings, the kind of output, and the base model's divergence
      <task>.safetensors   # token ids of every text, the expert's top-k log-probabilities, their
                           # indices and the rest's log-mass at every position

A causal LM's reference keeps the ``top_k`` most likely tokens and the mass left over at every
position (``k`` × 8 + 4 bytes a position: 0.5 KB at ``k`` 64, whatever the vocabulary), a class
distribution all of its classes. A task is used only when the expert's and the base's
fingerprints and every setting match what it was made with; otherwise it is computed again, with
a line saying why — a reference is never trusted for other experts. The token ids are the merged
model's input in every trial: they are checked to be what the base model's tokenizer makes of
the same text, so expert and merge are compared over one vocabulary.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from pydantic import BaseModel, Field

from mergekit_bmm.core.finite import all_finite
from mergekit_bmm.errors import ConfigError
from mergekit_bmm.evaluation.agreement_tasks import TextTask
from mergekit_bmm.evaluation.classification import Head, load_head, pad_token_id
from mergekit_bmm.evaluation.divergence import OBJECTIVES, Reference, divergence, reference_of
from mergekit_bmm.evaluation.predictions import kind_of, log_probs_per_text
from mergekit_bmm.io.atomic import replacing
from mergekit_bmm.io.fingerprint import reference_fingerprint
from mergekit_bmm.io.versioned_json import read_versioned, write_versioned
from mergekit_bmm.stats.samples import tokenize_samples

LOG = logging.getLogger("mergekit_bmm.search")

FORMAT_NAME = "mergekit-bmm-references"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class TaskReference(BaseModel):
    """One task's reference as recorded."""

    model: str
    fingerprint: str
    base_fingerprint: str
    settings: dict[str, Any]
    kind: str
    texts: int
    positions: int
    base_divergence: dict[str, float]  # objective -> the base model's mean divergence per text
    file: str


class ReferencesManifest(BaseModel):
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    tasks: dict[str, TaskReference] = Field(default_factory=dict)


@dataclass
class TaskData:
    """One task's reference in memory: the texts' token ids and the expert's predictions."""

    rows: list[list[int]]
    reference: Reference
    offsets: list[int]  # row i's positions are offsets[i]:offsets[i + 1]
    kind: str
    base_divergence: dict[str, float]
    head: Head | None

    def of_text(self, index: int) -> Reference:
        start, end = self.offsets[index], self.offsets[index + 1]
        return Reference(
            self.reference.top_log_probs[start:end],
            self.reference.top_index[start:end].long(),  # int32 in memory: 4 + 4 bytes a kept outcome
            self.reference.rest_log_prob[start:end],
        )


def _divergences(log_probs: torch.Tensor, reference: Reference) -> dict[str, float]:
    return {objective: float(divergence(log_probs, reference, objective).mean()) for objective in OBJECTIVES}


def _load_model(path: str, kind: str, dtype: str, device: str) -> Any:
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    from mergekit_bmm.evaluation.base import torch_dtype

    loader = {
        "causal_lm": AutoModelForCausalLM,
        "head": AutoModel,
        "classifier": AutoModelForSequenceClassification,
    }
    model = loader[kind].from_pretrained(path, dtype=torch_dtype(dtype))
    return model.to(device).eval()


def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _config(path: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


class References:
    """The references folder of one search (or one shared by several: it is locked while written)."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = Path(folder) if folder is not None else None
        self.loaded: dict[str, TaskData] = {}
        self.progress = True  # a bar while an expert's references are computed (off under --quiet)
        self.last_only = False  # causal LMs: the last position of each text only (`positions: last`)

    # ----------------------------------------------------------------- reading
    def _manifest(self, echo: Callable[[str], None]) -> ReferencesManifest:
        if self.folder is None or not (self.folder / MANIFEST).exists():
            if self.folder is not None and _has_files(self.folder):
                raise ConfigError(
                    f"references folder {self.folder} is not empty and holds no {MANIFEST}; give an empty "
                    "folder (or none: the search keeps them in OUT_PATH/references)"
                )
            return ReferencesManifest()
        try:
            return read_versioned(
                self.folder / MANIFEST, ReferencesManifest, "it is computed again", label="references"
            )
        except ConfigError as error:
            echo(f"{error}")
            return ReferencesManifest()

    @staticmethod
    def _differences(recorded: TaskReference, wanted: TaskReference) -> list[str]:
        changes = []
        for key in ("model", "fingerprint", "base_fingerprint", "kind"):
            if getattr(recorded, key) != getattr(wanted, key):
                changes.append(f"{key} {getattr(recorded, key) or '-'} vs {getattr(wanted, key) or '-'}")
        for key in sorted({*wanted.settings, *recorded.settings}):  # a setting on either side only
            if recorded.settings.get(key) != wanted.settings.get(key):
                changes.append(f"{key} {recorded.settings.get(key)!r} vs {wanted.settings.get(key)!r}")
        return changes

    def _read_task(self, name: str, recorded: TaskReference, head: Head | None) -> TaskData:
        from safetensors.torch import load_file

        assert self.folder is not None
        tensors = load_file(str(self.folder / recorded.file))
        ids, offsets = tensors["input_ids"].tolist(), tensors["text_offsets"].tolist()
        positions = tensors["position_offsets"].tolist()
        rows = [ids[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
        reference = Reference(
            tensors["top_log_probs"].float(), tensors["top_index"], tensors["rest_log_prob"].float()
        )
        if len(rows) != recorded.texts or reference.top_index.shape[0] != recorded.positions:
            raise ValueError(f"{len(rows)} texts and {reference.top_index.shape[0]} positions")
        if not all_finite(reference.top_log_probs):
            raise ValueError("non-finite log-probabilities")
        return TaskData(rows, reference, positions, recorded.kind, dict(recorded.base_divergence), head)

    # ----------------------------------------------------------------- writing
    def prepare(
        self,
        tasks: list[TextTask],
        base_model: str,
        top_k: int,
        batch_size: int,
        dtype: str,
        device: str,
        echo: Callable[[str], None] = LOG.info,
        positions: str = "all",
    ) -> dict[str, TaskData]:
        """Every task's reference: read where it matches, computed (and stored) where it does not."""
        self.last_only = positions == "last"
        if self.folder is None:
            return self._prepare(tasks, base_model, top_k, batch_size, dtype, device, echo)
        self.folder.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.folder / ".lock")):
            return self._prepare(tasks, base_model, top_k, batch_size, dtype, device, echo)

    def _prepare(self, tasks, base_model, top_k, batch_size, dtype, device, echo) -> dict[str, TaskData]:
        manifest = self._manifest(echo)
        base_path = str(_base_folder(base_model))
        base_fingerprint = reference_fingerprint(base_model)
        for task in tasks:
            head = load_head(task.head) if task.head else None
            wanted = TaskReference(
                model=task.model,
                fingerprint=task.plan.fingerprint,
                base_fingerprint=base_fingerprint,
                settings=task.identity(top_k, dtype, "last" if self.last_only else "all"),
                kind=kind_of(_config(str(task.plan.model.path)), head),
                texts=0,
                positions=0,
                base_divergence={},
                file=f"{task.name}.safetensors",
            )
            recorded = manifest.tasks.get(task.name)
            if recorded is not None:
                changes = self._differences(recorded, wanted)
                if not changes:
                    try:
                        self.loaded[task.name] = self._read_task(task.name, recorded, head)
                        continue
                    except Exception as error:  # noqa: BLE001  (a damaged file is made again)
                        echo(
                            f"references of task {task.name!r} are unreadable ({error}); computing them again"
                        )
                else:
                    echo(
                        f"references of task {task.name!r} were made for other inputs "
                        f"({'; '.join(changes[:3])}); computing them again"
                    )
            data, recorded = self._compute(
                task, wanted, head, base_path, top_k, batch_size, dtype, device, echo
            )
            self.loaded[task.name] = data
            if self.folder is not None:
                manifest.tasks[task.name] = recorded
                write_versioned(self.folder / MANIFEST, manifest)
        return self.loaded

    def _compute(self, task, wanted, head, base_path, top_k, batch_size, dtype, device, echo):
        from tqdm.auto import tqdm

        expert_path = str(task.plan.model.path)
        rows = _token_rows(task, expert_path, base_path)
        pad_id = pad_token_id(_tokenizer(base_path))
        order = list(range(len(rows)))
        echo(f"references: task {task.name!r}, {len(rows)} texts through expert {task.model} and the base")
        model = _load_model(expert_path, wanted.kind, dtype, device)
        parts: list[Reference] = [None] * len(rows)  # type: ignore[list-item]
        with tqdm(
            total=2 * len(rows), desc=f"references {task.name}", leave=False, disable=not self.progress
        ) as bar:
            for index, log_probs in log_probs_per_text(
                model, wanted.kind, rows, order, pad_id, batch_size, head, self.last_only
            ):
                parts[index] = reference_of(log_probs, top_k if wanted.kind == "causal_lm" else None)
                bar.update(1)
            del model
            base = _load_model(base_path, wanted.kind, dtype, device)
            sums = dict.fromkeys(OBJECTIVES, 0.0)
            for index, log_probs in log_probs_per_text(
                base, wanted.kind, rows, order, pad_id, batch_size, head, self.last_only
            ):
                for objective, value in _divergences(log_probs, parts[index]).items():
                    sums[objective] += value
                bar.update(1)
            del base
        offsets = [0]
        for part in parts:
            offsets.append(offsets[-1] + part.top_index.shape[0])
        reference = Reference(
            torch.cat([p.top_log_probs for p in parts]),
            torch.cat([p.top_index.to(torch.int32) for p in parts]),
            torch.cat([p.rest_log_prob for p in parts]),
        )
        recorded = wanted.model_copy(
            update={
                "texts": len(rows),
                "positions": offsets[-1],
                "base_divergence": {key: value / len(rows) for key, value in sums.items()},
            }
        )
        if self.folder is not None:
            _write_task(self.folder / recorded.file, rows, offsets, reference)
        return TaskData(rows, reference, offsets, wanted.kind, recorded.base_divergence, head), recorded


def _has_files(folder: Path) -> bool:
    """Whether a folder holds anything but hidden files (its lock)."""
    return folder.exists() and any(not item.name.startswith(".") for item in folder.iterdir())


def _base_folder(base_model: str) -> Path:
    from mergekit_bmm.io.lora_experts import dense_model

    return dense_model(base_model)


def _token_rows(task: TextTask, expert_path: str, base_path: str) -> list[list[int]]:
    """The texts as the base's tokenizer makes them, checked to be the expert's too."""
    chat, max_length = bool(task.plan.task.chat_template), int(task.plan.task.max_length or 512)
    rows = tokenize_samples(_tokenizer(base_path), task.samples, chat, max_length)
    if not rows:
        raise ConfigError(f"task {task.name!r}: its texts give no tokens; give non-empty text")
    expert_rows = tokenize_samples(_tokenizer(expert_path), task.samples, chat, max_length)
    if expert_rows != rows:
        first = next(
            (i for i, (a, b) in enumerate(zip(rows, expert_rows)) if a != b), min(len(rows), len(expert_rows))
        )
        raise ConfigError(
            f"task {task.name!r}: the tokenizer of expert {task.model} reads text {first + 1} differently "
            "from the merge's (the base model's); the agreement evaluator compares predictions token by "
            "token, so expert and base must share a tokenizer"
        )
    return rows


def _write_task(path: Path, rows: list[list[int]], offsets: list[int], reference: Reference) -> None:
    from safetensors.torch import save_file

    lengths = [0]
    for row in rows:
        lengths.append(lengths[-1] + len(row))
    tensors = {
        "input_ids": torch.tensor([token for row in rows for token in row], dtype=torch.int32),
        "text_offsets": torch.tensor(lengths, dtype=torch.int64),
        "position_offsets": torch.tensor(offsets, dtype=torch.int64),
        "top_log_probs": reference.top_log_probs.float().contiguous(),
        "top_index": reference.top_index.to(torch.int32).contiguous(),
        "rest_log_prob": reference.rest_log_prob.float().contiguous(),
    }
    with replacing(path) as temporary:
        save_file(tensors, str(temporary))
