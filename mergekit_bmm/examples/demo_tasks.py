"""The demo's world: four small classification tasks a tiny Llama can learn, and their scorer.

Each task reads a sequence of ten tokens from its own alphabet (``a0``…``a9`` for the first
task, ``b0``…``b9`` for the second, …) and asks one question about it; the answer is read by
a fixed per-task head from the mean of the model's last hidden states, as a vision merge
reads each task with its own classifier. The tasks pull the shared body in different
directions, so a merge of the four experts loses accuracy to interference.

:func:`score` and :func:`examples` are the ``type: python`` evaluator the demo's search uses
(per-example scores, so the search scores a trial on part of the validation set first).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

LENGTH = 10  # tokens per example (after <s>)
SPECIAL = ["<pad>", "<s>", "</s>"]
HEADS_FILE = "heads.safetensors"


@dataclass(frozen=True)
class Task:
    """One task: its alphabet's letter, the question, its classes and the rule that answers it."""

    name: str
    letter: str
    question: str
    classes: int
    rule: Callable[[Sequence[int]], int]


TASKS = (
    Task("first", "a", "which symbol comes first", 10, lambda x: x[0]),
    Task("second", "b", "which symbol comes second", 10, lambda x: x[1]),
    Task(
        "even",
        "c",
        "are most symbols even-numbered",
        2,
        lambda x: int(sum(v % 2 == 0 for v in x) > LENGTH / 2),
    ),
    Task("rising", "d", "is the first symbol above the last", 2, lambda x: int(x[0] > x[-1])),
)
BY_NAME = {task.name: task for task in TASKS}


def vocabulary() -> list[str]:
    return SPECIAL + [f"{task.letter}{digit}" for task in TASKS for digit in range(10)]


def build_tokenizer():
    """A word-level tokenizer over the four alphabets; it puts ``<s>`` in front of every text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = vocabulary()
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<pad>"
    )


def text_of(task: Task, symbols: Sequence[int]) -> str:
    return " ".join(f"{task.letter}{s}" for s in symbols)


def sample(task: Task, count: int, seed: int) -> list[dict]:
    """``count`` examples of ``task``: ``{"text", "label"}``, reproducible from ``seed``."""
    rng = random.Random(f"{task.name}-{seed}")
    rows = []
    for _ in range(count):
        symbols = [rng.randrange(10) for _ in range(LENGTH)]
        rows.append({"text": text_of(task, symbols), "label": task.rule(symbols)})
    return rows


def write_splits(folder: Path, sizes: dict[str, int]) -> None:
    """``<folder>/<split>/<task>.jsonl`` for every split (``{"validation": 200, "test": 1000}``)."""
    for offset, (split, count) in enumerate(sizes.items()):
        for task in TASKS:
            path = folder / split / f"{task.name}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            rows = sample(task, count, seed=1000 + offset)
            path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


@lru_cache(maxsize=16)
def _rows(data: str, split: str, task: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    path = Path(data) / split / f"{task}.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return tuple(row["text"] for row in rows), tuple(int(row["label"]) for row in rows)


@lru_cache(maxsize=4)
def load_heads(data: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(data) / HEADS_FILE))


def pooled(model, input_ids: torch.Tensor) -> torch.Tensor:
    """The mean of the last hidden states (every example has the same length: no padding)."""
    hidden = model.base_model(input_ids=input_ids).last_hidden_state
    return hidden.float().mean(dim=1)


def logits(model, tokenizer, task: str, texts: Sequence[str], heads: dict[str, torch.Tensor]) -> torch.Tensor:
    device = next(model.parameters()).device
    input_ids = tokenizer(list(texts), return_tensors="pt")["input_ids"].to(device)
    head = heads[task].to(device)
    return pooled(model, input_ids) @ head.T


def examples(data: str, split: str = "validation") -> dict[str, list[int]]:
    """Every task's labels (the search stratifies its cheap share by them)."""
    return {task.name: list(_rows(str(data), split, task.name)[1]) for task in TASKS}


def score(
    model, tokenizer, task: str, indices: Sequence[int], data: str, split: str = "validation"
) -> list[float]:
    """1.0 where the model (read by the task's head) gets the example right, else 0.0."""
    texts, labels = _rows(str(data), split, task)
    heads = load_heads(str(data))
    chosen = list(indices)
    with torch.inference_mode():
        predicted = logits(model, tokenizer, task, [texts[i] for i in chosen], heads).argmax(dim=-1).cpu()
    return [float(predicted[j] == labels[i]) for j, i in enumerate(chosen)]


def accuracy(model, tokenizer, data: str, split: str, tasks: Sequence[str] | None = None) -> dict[str, float]:
    """Per task, the share of ``split`` the model gets right."""
    found = {}
    for name in tasks or [task.name for task in TASKS]:
        count = len(_rows(str(data), split, name)[1])
        found[name] = sum(score(model, tokenizer, name, range(count), data, split)) / count
    return found
