"""``type: classification``: accuracy of fixed linear heads on the merged encoder.

A *head* is a safetensors file with ``weight`` ``[classes, hidden]`` and ``bias``
``[classes]`` (float32) and metadata ``pooling`` (``mean`` over non-padding tokens, the
default, or ``cls``: the first token), ``labels`` (a JSON list of class names) and,
optionally, ``normalize: l2`` (pooled states are scaled to unit length first: a zero-shot
head of class-description embeddings scores ``scale · cos(z, e_c)``).
A *task data file* is JSONL with a text and an integer label per line, and optionally a
``split``. Logits are ``pooled @ weight.T + bias`` on the encoder's last hidden state.

Everything scores through :func:`pooled_encoded` and :meth:`Head.logits`: :func:`task_logits`
(the benchmark, the ensembles, your own code) and the search's evaluator, which tokenises
once and can score single examples; so they score exactly the same way.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from mergekit_bmm.errors import ConfigError, TensorInputError
from mergekit_bmm.evaluation.base import ModelLoading, TaskExamples, evaluate_folder
from mergekit_bmm.evaluation.config import ClassificationEvaluatorConfig, ClassificationTask

__all__ = [
    "ClassificationEvaluator",
    "ClassificationTask",
    "Head",
    "accuracy",
    "encode_texts",
    "load_examples",
    "load_head",
    "pool",
    "pooled_encoded",
    "pooled_features",
    "save_head",
    "task_logits",
]

POOLINGS = ("mean", "cls")
NORMALIZATIONS = ("none", "l2")

SUBSET_SEED = 0


@dataclass(frozen=True)
class Head:
    """A fixed linear classifier over pooled encoder states."""

    weight: torch.Tensor  # [classes, hidden], float32
    bias: torch.Tensor  # [classes], float32
    pooling: str
    labels: tuple[str, ...]
    normalize: str = "none"  # "l2": unit-length pooled states (cosine heads)

    @property
    def num_classes(self) -> int:
        return self.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1]

    def logits(self, pooled: torch.Tensor) -> torch.Tensor:
        """``pooled @ weight.T + bias`` in float32 (pooled scaled to unit length for ``l2``)."""
        pooled = pooled.float()
        if self.normalize == "l2":
            pooled = torch.nn.functional.normalize(pooled, dim=-1)
        return pooled @ self.weight.T + self.bias


def save_head(
    path: str | Path,
    weight: torch.Tensor,
    bias: torch.Tensor,
    labels: Sequence[str],
    pooling: str = "mean",
    normalize: str = "none",
) -> Path:
    """Write a head file (float32 tensors plus ``pooling``/``labels``/``normalize`` metadata)."""
    from safetensors.torch import save_file

    weight = torch.as_tensor(weight).detach().to(torch.float32).contiguous()
    bias = torch.as_tensor(bias).detach().to(torch.float32).contiguous()
    if weight.ndim != 2 or bias.shape != (weight.shape[0],) or len(labels) != weight.shape[0]:
        raise ConfigError(
            f"head {path}: weight {tuple(weight.shape)}, bias {tuple(bias.shape)} and {len(labels)} labels "
            "do not fit together; expected weight [classes, hidden], bias [classes], one label per class"
        )
    if pooling not in POOLINGS:
        raise ConfigError(f"head {path}: pooling {pooling!r} is not one of {POOLINGS}")
    if normalize not in NORMALIZATIONS:
        raise ConfigError(f"head {path}: normalize {normalize!r} is not one of {NORMALIZATIONS}")
    path = Path(path)
    metadata = {"pooling": pooling, "labels": json.dumps([str(label) for label in labels])}
    if normalize != "none":  # heads without the key read as before
        metadata["normalize"] = normalize
    save_file({"weight": weight, "bias": bias}, str(path), metadata=metadata)
    return path


def _stamp(path: str) -> int:
    """Modification time, so a rewritten file is read again."""
    try:
        return Path(path).stat().st_mtime_ns
    except OSError:
        return 0


def load_head(path: str) -> Head:
    """Read and check a head file."""
    return _load_head(str(path), _stamp(path))


@lru_cache(maxsize=64)
def _load_head(path: str, stamp: int) -> Head:
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except (OSError, Exception) as error:  # safetensors raises its own error types
        raise ConfigError(f"cannot read classification head {path}: {error}") from None
    if "weight" not in tensors or "bias" not in tensors:
        raise ConfigError(f"head {path} must hold tensors `weight` and `bias`; it has {sorted(tensors)}")
    weight, bias = tensors["weight"].float(), tensors["bias"].float()
    if weight.ndim != 2 or bias.shape != (weight.shape[0],):
        raise ConfigError(
            f"head {path}: weight must be [classes, hidden] and bias [classes]; got "
            f"{list(weight.shape)} and {list(bias.shape)}"
        )
    pooling = metadata.get("pooling", "mean")
    if pooling not in ("mean", "cls"):
        raise ConfigError(f"head {path}: metadata pooling must be 'mean' or 'cls'; got {pooling!r}")
    normalize = metadata.get("normalize", "none")
    if normalize not in NORMALIZATIONS:
        raise ConfigError(f"head {path}: metadata normalize must be 'none' or 'l2'; got {normalize!r}")
    try:
        labels = tuple(str(label) for label in json.loads(metadata.get("labels", "null")) or ())
    except ValueError:
        raise ConfigError(f"head {path}: metadata `labels` must be a JSON list of class names") from None
    if labels and len(labels) != weight.shape[0]:
        raise ConfigError(
            f"head {path} has {weight.shape[0]} classes but {len(labels)} labels in its metadata"
        )
    return Head(weight, bias, pooling, labels or tuple(str(i) for i in range(weight.shape[0])), normalize)


def _subset(count: int, limit: int | float | None) -> list[int]:
    """A fixed subset of ``limit`` indices (a count, or a fraction), in file order."""
    if limit is None:
        return list(range(count))
    size = math.ceil(limit * count) if isinstance(limit, float) else min(int(limit), count)
    return sorted(random.Random(SUBSET_SEED).sample(range(count), size))


def load_examples(
    task: ClassificationTask | dict[str, Any], num_classes: int | None = None
) -> tuple[list[str], torch.Tensor]:
    """Texts and labels of a task's data file (its split; its fixed ``limit`` subset)."""
    task = ClassificationTask.model_validate(task)
    texts, labels = _load_examples(
        task.data, _stamp(task.data), task.split, task.limit, task.text_field, task.label_field, num_classes
    )
    return list(texts), labels.clone()


@lru_cache(maxsize=64)
def _load_examples(
    path: str,
    stamp: int,
    split: str | None,
    limit: Any,
    text_field: str,
    label_field: str,
    num_classes: int | None,
) -> tuple[list[str], torch.Tensor]:
    texts, labels = [], []
    splits_seen: set[str] = set()
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise ConfigError(f"cannot read task data {path}: {error.strerror}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            if "split" in item:
                splits_seen.add(str(item["split"]))
            if split is not None and item.get("split") != split:
                continue
            text, label = item[text_field], item[label_field]
        except (ValueError, KeyError, TypeError) as error:
            raise ConfigError(
                f"{path} line {number}: expected a JSON object with `{text_field}` and "
                f"`{label_field}` ({error})"
            ) from None
        if isinstance(label, bool) or not isinstance(label, int):
            raise ConfigError(
                f"{path} line {number}: `{label_field}` must be a class index (int); got {label!r}"
            )
        if num_classes is not None and not 0 <= label < num_classes:
            raise ConfigError(
                f"{path} line {number}: label {label} is outside the head's {num_classes} classes"
            )
        texts.append(str(text))
        labels.append(label)
    if not texts:
        where = f" with split {split!r} (splits present: {sorted(splits_seen) or 'none'})" if split else ""
        raise ConfigError(f"task data {path} has no examples{where}")
    keep = _subset(len(texts), limit)
    return [texts[i] for i in keep], torch.tensor([labels[i] for i in keep], dtype=torch.long)


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str = "mean") -> torch.Tensor:
    """Mean over non-padding tokens, or the first token (``cls``), in float32."""
    hidden = hidden.float()
    if pooling == "cls":
        return hidden[:, 0]
    weights = mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)


def _last_hidden_state(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    outputs = model(**batch)
    hidden = getattr(outputs, "last_hidden_state", None)
    if hidden is None:  # models with a head: ask for the hidden states instead
        hidden = model(**batch, output_hidden_states=True).hidden_states[-1]
    return hidden


def encode_texts(tokenizer: Any, texts: Sequence[str], max_length: int) -> list[dict[str, list[int]]]:
    """Each text's token ids (and type ids), truncated to ``max_length``: tokenise once, pool often."""
    encoded = tokenizer(list(texts), truncation=True, max_length=max_length)
    keys = [key for key in ("input_ids", "token_type_ids") if key in encoded]
    return [{key: encoded[key][i] for key in keys} for i in range(len(texts))]


def pad_rows(rows: Sequence[dict[str, list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` (and ``token_type_ids``) of a batch."""
    width = max(len(row["input_ids"]) for row in rows)
    batch = {"input_ids": torch.full((len(rows), width), pad_id, dtype=torch.long)}
    batch["attention_mask"] = torch.zeros((len(rows), width), dtype=torch.long)
    if "token_type_ids" in rows[0]:
        batch["token_type_ids"] = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        length = len(row["input_ids"])
        batch["input_ids"][i, :length] = torch.tensor(row["input_ids"])
        batch["attention_mask"][i, :length] = 1
        if "token_type_ids" in batch:
            batch["token_type_ids"][i, :length] = torch.tensor(row["token_type_ids"])
    return batch


def pad_token_id(tokenizer: Any) -> int:
    """The id padding uses (the end-of-text or unknown token where the tokenizer has no pad token)."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id):
        if token_id is not None:
            return int(token_id)
    return 0


def length_batches(lengths: Sequence[int], batch_size: int, min_rows: int = 8) -> list[list[int]]:
    """Row indices in batches of similar length: sorted by length, a batch ends at ``batch_size``
    rows or, once it has ``min_rows``, where the next row is over 1.25 × its shortest.

    A few dozen rows of mixed length (one chunk of a staged evaluation) then cost about what
    they cost inside a whole sorted task, instead of all being padded to the longest (measured
    on MiniLM, 48 tokens: 64 random rows in one batch cost 1.4 × the whole task's rate per row).
    """
    batches: list[list[int]] = []
    current: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if current and (
            len(current) >= batch_size
            or (len(current) >= min_rows and lengths[index] > 1.25 * lengths[current[0]])
        ):
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


@torch.inference_mode()
def pooled_encoded(
    model: Any,
    rows: Sequence[dict[str, list[int]]],
    pad_id: int,
    batch_size: int = 32,
    pooling: str = "mean",
    progress: str | None = None,
) -> torch.Tensor:
    """``[N, hidden]`` pooled last hidden states (float32, CPU) of tokenised rows, in their order.

    Rows are batched by length (less padding) and padded on the right, so ``cls`` pooling
    reads the first real token. Each row only sees its own tokens, so the result does not
    depend on the batching.
    """
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    was_training = getattr(model, "training", False)
    model.eval()
    pooled: torch.Tensor | None = None
    try:
        batches = length_batches([len(row["input_ids"]) for row in rows], batch_size)
        for chunk in tqdm(batches, desc=progress, disable=progress is None, leave=False):
            batch = {k: v.to(device) for k, v in pad_rows([rows[i] for i in chunk], pad_id).items()}
            hidden = _last_hidden_state(model, batch)
            if pooled is None:
                pooled = torch.empty(len(rows), hidden.shape[-1])
            pooled[chunk] = pool(hidden, batch["attention_mask"], pooling).cpu()
    finally:
        model.train(was_training)
    assert pooled is not None
    return pooled


def pooled_features(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str],
    max_length: int = 128,
    batch_size: int = 32,
    pooling: str = "mean",
    progress: str | None = None,
) -> torch.Tensor:
    """``[N, hidden]`` pooled last hidden states (float32, CPU), in the order of ``texts``
    (:func:`encode_texts`, then :func:`pooled_encoded`)."""
    rows = encode_texts(tokenizer, texts, max_length)
    return pooled_encoded(model, rows, pad_token_id(tokenizer), batch_size, pooling, progress)


def task_logits(
    model: Any,
    tokenizer: Any,
    task: ClassificationTask | dict[str, Any],
    max_length: int = 128,
    batch_size: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[N, C]`` (float32, CPU) and labels ``[N]`` of a task on a loaded encoder.

    Examples are returned in data order (see :func:`pooled_features`).
    """
    task = ClassificationTask.model_validate(task)
    head = load_head(task.head)
    texts, labels = load_examples(task, head.weight.shape[0])
    hidden_size = getattr(getattr(model, "config", None), "hidden_size", head.hidden_size)
    if hidden_size != head.hidden_size:
        raise TensorInputError(
            f"head {task.head} expects hidden size {head.hidden_size} but the model's is "
            f"{hidden_size}; use the head made for this encoder"
        )
    features = pooled_features(model, tokenizer, texts, max_length, batch_size, head.pooling)
    return head.logits(features), labels


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean of argmax(logits) == labels."""
    return float((logits.argmax(dim=-1) == labels).double().mean())


class ClassificationEvaluator:
    """Scores every task's accuracy with its fixed head, on a folder or on a live encoder.

    Texts are tokenised once per tokenizer (a search's resident model keeps one) and single
    examples can be scored (:meth:`example_scorer`), so a search can score a trial on part
    of its examples first (:mod:`mergekit_bmm.search.fidelity`).
    """

    loading = ModelLoading("AutoModel", "float32")
    scores_examples = True  # accuracy is a per-example mean

    def __init__(self, config: ClassificationEvaluatorConfig, device: str) -> None:
        self.config = config
        self.device = device
        self.weights = {task.name: task.weight for task in config.tasks}
        self._data: dict[str, tuple[Head, list[str], torch.Tensor]] = {}
        for task in config.tasks:  # read and check heads and data now, not at trial 1
            head = load_head(task.head)
            texts, labels = load_examples(task, head.weight.shape[0])
            self._data[task.name] = (head, texts, labels)
        self._tokenizer: Any = None
        self._encoded: dict[str, list[dict[str, list[int]]]] = {}

    def evaluate(self, model_dir: Path) -> dict[str, float]:
        return evaluate_folder(self, model_dir, self.device)

    def evaluate_model(self, model: Any, tokenizer: Any) -> dict[str, float]:
        score = self.example_scorer(model, tokenizer)
        return {
            name: math.fsum(score(name, range(len(labels)))) / len(labels)
            for name, (_, _, labels) in self._data.items()
        }

    def examples(self) -> dict[str, TaskExamples]:
        """Each task's example count, stratified by label."""
        return {
            name: TaskExamples(len(data[2]), tuple(data[2].tolist())) for name, data in self._data.items()
        }

    def example_scorer(self, model: Any, tokenizer: Any):
        """``score(task, indices) -> [1.0 or 0.0 per example]``: whether the head gets each right."""
        self._check_hidden_size(model)
        if tokenizer is not self._tokenizer:
            self._tokenizer, self._encoded = tokenizer, {}
        pad_id = pad_token_id(tokenizer)

        def score(task: str, indices: Sequence[int]) -> list[float]:
            head, texts, labels = self._data[task]
            if task not in self._encoded:
                self._encoded[task] = encode_texts(tokenizer, texts, self.config.max_length)
            rows = [self._encoded[task][i] for i in indices]
            if not rows:
                return []
            pooled = pooled_encoded(model, rows, pad_id, self.config.batch_size, head.pooling)
            right = head.logits(pooled).argmax(dim=-1) == labels[list(indices)]
            return right.double().tolist()

        return score

    def _check_hidden_size(self, model: Any) -> None:
        hidden_size = getattr(getattr(model, "config", None), "hidden_size", None)
        for task in self.config.tasks:
            head = self._data[task.name][0]
            if hidden_size is not None and hidden_size != head.hidden_size:
                raise TensorInputError(
                    f"head {task.head} expects hidden size {head.hidden_size} but the model's is "
                    f"{hidden_size}; use the head made for this encoder"
                )
