"""Classification tasks scored through fixed linear heads on an encoder's pooled features.

The paper's vision track scores every merged encoder with the same per-task heads; this
module is the one place that does so, so the search, the benchmark and the calibration
tools score exactly alike. File formats (shared contract):

- a **head** is a safetensors file with ``weight`` (float32 ``[classes, hidden]``) and
  ``bias`` (float32 ``[classes]``) and metadata ``pooling`` (``mean`` | ``cls``) and
  ``labels`` (a JSON list of class names); logits = ``pooled @ weight.T + bias``;
- a **task data file** is JSONL with ``text`` (str) and ``label`` (int index into the
  head's labels) per line, and optionally ``split`` (train / validation / test).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from mergekit_bmm.errors import ConfigError

POOLINGS = ("mean", "cls")


class ClassificationTask(BaseModel):
    """One task of a classification evaluator (``evaluator.tasks[]`` in a search config)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    head: Path
    data: Path
    split: str | None = Field(default=None, description="use only lines whose `split` is this; None = all")
    limit: int | None = Field(default=None, ge=1, description="first N examples of the split")
    text_field: str = "text"
    label_field: str = "label"


@dataclass(frozen=True)
class Head:
    """A fixed linear classifier over pooled encoder features."""

    weight: torch.Tensor  # [classes, hidden], float32
    bias: torch.Tensor  # [classes], float32
    pooling: Literal["mean", "cls"]
    labels: tuple[str, ...]

    @property
    def num_classes(self) -> int:
        return self.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1]

    def logits(self, pooled: torch.Tensor) -> torch.Tensor:
        return pooled.float() @ self.weight.T + self.bias


def save_head(
    path: str | Path,
    weight: torch.Tensor,
    bias: torch.Tensor,
    labels: Sequence[str],
    pooling: str = "mean",
) -> Path:
    """Write a head file (float32 tensors plus ``pooling``/``labels`` metadata)."""
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
    path = Path(path)
    save_file(
        {"weight": weight, "bias": bias},
        str(path),
        metadata={"pooling": pooling, "labels": json.dumps([str(label) for label in labels])},
    )
    return path


def load_head(path: str | Path) -> Head:
    """Read and check a head file; a malformed one raises a one-line ``ConfigError``."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"head file {path} does not exist; check the task's `head:` path")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            keys = set(handle.keys())
            if not {"weight", "bias"} <= keys:
                raise ConfigError(
                    f"head {path} holds {sorted(keys)}; a head needs tensors `weight` and `bias`"
                )
            weight = handle.get_tensor("weight").to(torch.float32)
            bias = handle.get_tensor("bias").to(torch.float32)
    except ConfigError:
        raise
    except Exception as error:
        raise ConfigError(f"head {path} is not a readable safetensors file: {error}") from error
    pooling = metadata.get("pooling", "mean")
    if pooling not in POOLINGS:
        raise ConfigError(f"head {path}: metadata pooling={pooling!r}; use one of {POOLINGS}")
    try:
        labels = tuple(str(x) for x in json.loads(metadata["labels"]))
    except (KeyError, ValueError, TypeError):
        labels = tuple(str(i) for i in range(weight.shape[0] if weight.ndim == 2 else 0))
    if weight.ndim != 2 or bias.shape != (weight.shape[0],) or len(labels) != weight.shape[0]:
        raise ConfigError(
            f"head {path}: weight {tuple(weight.shape)}, bias {tuple(bias.shape)}, {len(labels)} labels; "
            "expected weight [classes, hidden], bias [classes] and one label per class"
        )
    if not (torch.isfinite(weight).all() and torch.isfinite(bias).all()):
        raise ConfigError(f"head {path} contains NaN or Inf; refit it")
    return Head(weight=weight, bias=bias, pooling=pooling, labels=labels)


def load_examples(task: ClassificationTask | dict[str, Any]) -> tuple[list[str], list[int]]:
    """Texts and integer labels of a task's split (file order; the first ``limit``)."""
    task = ClassificationTask.model_validate(task)
    if not task.data.is_file():
        raise ConfigError(f"task {task.name}: data file {task.data} does not exist")
    texts: list[str] = []
    labels: list[int] = []
    with open(task.data, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as error:
                raise ConfigError(
                    f"task {task.name}: {task.data} line {number} is not JSON: {error}"
                ) from error
            if task.split is not None and record.get("split") != task.split:
                continue
            text, label = record.get(task.text_field), record.get(task.label_field)
            if not isinstance(text, str) or isinstance(label, bool) or not isinstance(label, int):
                raise ConfigError(
                    f"task {task.name}: {task.data} line {number} needs a string `{task.text_field}` and an "
                    f"integer `{task.label_field}`"
                )
            texts.append(text)
            labels.append(label)
            if task.limit is not None and len(texts) >= task.limit:
                break
    if not texts:
        where = f" with split={task.split!r}" if task.split is not None else ""
        raise ConfigError(f"task {task.name}: no examples{where} in {task.data}")
    return texts, labels


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: str = "mean") -> torch.Tensor:
    """Mean over non-padding tokens, or the first token (``cls``), in float32."""
    hidden = hidden.float()
    if pooling == "cls":
        return hidden[:, 0]
    mask = attention_mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)


@torch.no_grad()
def pooled_features(
    model: torch.nn.Module,
    tokenizer: Any,
    texts: Sequence[str],
    max_length: int = 128,
    batch_size: int = 32,
    pooling: str = "mean",
    progress: str | None = None,
) -> torch.Tensor:
    """``[N, hidden]`` pooled last hidden states, in the order of ``texts``.

    Texts are batched by token length so that little time goes into padding; the result
    does not depend on the batching (each row only sees its own tokens).
    """
    from tqdm.auto import tqdm

    was_training = model.training
    model.eval()
    lengths = [
        len(ids) for ids in tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]
    ]
    order = sorted(range(len(texts)), key=lambda i: lengths[i])
    device = next(model.parameters()).device
    out: torch.Tensor | None = None
    batches = range(0, len(order), batch_size)
    for start in tqdm(batches, desc=progress, disable=progress is None, leave=False):
        rows = order[start : start + batch_size]
        encoded = tokenizer(
            [texts[i] for i in rows],
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        ).to(device)
        if not _accepts_token_types(model):
            encoded.pop("token_type_ids", None)
        hidden = model(**encoded).last_hidden_state
        pooled = pool(hidden, encoded["attention_mask"], pooling).cpu()
        if out is None:
            out = torch.empty(len(texts), pooled.shape[1], dtype=torch.float32)
        out[torch.tensor(rows)] = pooled
    model.train(was_training)
    assert out is not None
    return out


def _accepts_token_types(model: torch.nn.Module) -> bool:
    return getattr(model.config, "type_vocab_size", 0) > 0


def task_logits(
    model: torch.nn.Module,
    tokenizer: Any,
    task: ClassificationTask | dict[str, Any],
    max_length: int = 128,
    batch_size: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits [N, C], labels [N])`` of an already loaded encoder (``AutoModel``) on a task."""
    task = ClassificationTask.model_validate(task)
    head = load_head(task.head)
    texts, labels = load_examples(task)
    bad = [label for label in labels if not 0 <= label < head.num_classes]
    if bad:
        raise ConfigError(
            f"task {task.name}: label {bad[0]} in {task.data} is outside the head's "
            f"{head.num_classes} classes ({task.head})"
        )
    hidden_size = getattr(model.config, "hidden_size", head.hidden_size)
    if hidden_size != head.hidden_size:
        raise ConfigError(
            f"task {task.name}: head {task.head} expects hidden size {head.hidden_size}, "
            f"the model has {hidden_size}; use the head fitted for this encoder"
        )
    features = pooled_features(model, tokenizer, texts, max_length, batch_size, head.pooling)
    return head.logits(features), torch.tensor(labels, dtype=torch.long)


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean of ``argmax(logits) == labels``."""
    return float((logits.argmax(dim=-1) == labels).float().mean())
