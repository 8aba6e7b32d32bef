"""The demo's models, made locally and reproducibly: a tiny Llama pre-trained briefly, and one
expert per task fine-tuned from it.

The base learns the four alphabets as a language model (next-token prediction on random
sequences); it has never seen a question. Each task gets a fixed head (random unit rows, the
same for every model, like a zero-shot classifier), and its expert fine-tunes the transformer
body (embeddings and output layer frozen) to answer through that head.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from mergekit_bmm.examples.demo_tasks import (
    HEADS_FILE,
    LENGTH,
    TASKS,
    Task,
    build_tokenizer,
    pooled,
    vocabulary,
)
from mergekit_bmm.examples.tiny_models import tiny_config


@dataclass(frozen=True)
class DemoSize:
    """How big the demo is; :data:`FULL` is what ``mergekit-bmm-demo`` runs."""

    hidden: int = 64
    layers: int = 2
    pretrain_steps: int = 100
    finetune_steps: int = 200
    batch: int = 64
    validation: int = 200
    test: int = 1000
    budget: int = 12  # search trials
    grid: int = 4  # values tried when tuning Task Arithmetic's weight and TIES's density
    commands: bool = True  # merges and searches by their commands (False: in this process, same code)


FULL = DemoSize()
SMALL = DemoSize(
    hidden=32,
    pretrain_steps=10,
    finetune_steps=15,
    batch=16,
    validation=40,
    test=60,
    budget=3,
    grid=2,
    commands=False,
)
HEAD_NORM = 3.0


def _batch(task: Task, count: int, rng: random.Random, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (``<s>`` first) and labels of ``count`` fresh training sequences of ``task``."""
    rows = [[rng.randrange(10) for _ in range(LENGTH)] for _ in range(count)]
    ids = torch.tensor([[1] + [offset + s for s in row] for row in rows])
    return ids, torch.tensor([task.rule(row) for row in rows])


def _offsets() -> dict[str, int]:
    words = vocabulary()
    return {task.name: words.index(f"{task.letter}0") for task in TASKS}


def pretrain(size: DemoSize, seed: int = 0):
    """The base: a language model of the four alphabets (it sees sequences, never a question)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config("llama", len(vocabulary()), size.hidden, size.layers))
    rng, offsets = random.Random(seed), _offsets()
    optimiser = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in tqdm(range(size.pretrain_steps), desc="pre-training the base", leave=False):
        task = TASKS[rng.randrange(len(TASKS))]
        ids, _ = _batch(task, size.batch, rng, offsets[task.name])
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    return model.eval()


def task_heads(size: DemoSize, seed: int = 0) -> dict[str, torch.Tensor]:
    """One fixed head per task: ``classes × hidden`` random rows of norm :data:`HEAD_NORM`."""
    generator = torch.Generator().manual_seed(seed)
    heads = {}
    for task in TASKS:
        rows = torch.randn(task.classes, size.hidden, generator=generator)
        heads[task.name] = rows / rows.norm(dim=1, keepdim=True) * HEAD_NORM
    return heads


def finetune(base, task: Task, head: torch.Tensor, size: DemoSize, seed: int = 0):
    """An expert: the base's transformer layers trained on ``task`` through its fixed head."""
    model = copy.deepcopy(base).train()
    body = []
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".layers." in name)
        if parameter.requires_grad:
            body.append(parameter)
    optimiser = torch.optim.AdamW(body, lr=1e-3, weight_decay=0.0)
    rng, offset = random.Random(f"{task.name}-train-{seed}"), _offsets()[task.name]
    for _ in tqdm(range(size.finetune_steps), desc=f"fine-tuning the {task.name} expert", leave=False):
        ids, labels = _batch(task, size.batch, rng, offset)
        loss = torch.nn.functional.cross_entropy(pooled(model, ids) @ head.T, labels)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    return model.eval()


@dataclass(frozen=True)
class DemoModels:
    """Where the demo's data and models are."""

    data: Path
    base: Path
    experts: dict[str, Path]


def build(root: Path, size: DemoSize = FULL, seed: int = 0) -> DemoModels:
    """Data splits, heads, the base and one expert per task under ``root`` (deterministic)."""
    from safetensors.torch import save_file

    from mergekit_bmm.examples.demo_tasks import write_splits

    data, models = root / "data", root / "models"
    write_splits(data, {"validation": size.validation, "test": size.test})
    heads = task_heads(size, seed)
    save_file({name: head.contiguous() for name, head in heads.items()}, str(data / HEADS_FILE))
    tokenizer = build_tokenizer()
    base = pretrain(size, seed)
    paths = {"base": models / "base"}
    base.save_pretrained(paths["base"])
    tokenizer.save_pretrained(paths["base"])
    experts = {}
    for task in TASKS:
        expert = finetune(base, task, heads[task.name], size, seed)
        experts[task.name] = models / f"expert-{task.name}"
        expert.save_pretrained(experts[task.name])
        tokenizer.save_pretrained(experts[task.name])
    return DemoModels(data=data, base=paths["base"], experts=experts)
