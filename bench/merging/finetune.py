"""Experts: the pretrained encoder fully fine-tuned on one task with its head frozen.

Freezing the head (fitted on pretrained features) keeps every expert's output space the
same as the pretrained encoder's, so one fixed head per task scores the pretrained
encoder, the expert and every merge alike — the paper's vision-track protocol.

Training is deterministic: a fixed step budget (or early stopping on the task's held-out
``head`` split, keeping the best-scoring step), seeded data order and dropout, a fixed
thread count and ``torch.use_deterministic_algorithms``; an interrupted build resumes
from its last checkpoint (:mod:`bench.merging.training`). The expert is saved as an HF
folder (safetensors + config + tokenizer) that mergekit reads directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from bench.merging import device
from bench.merging.cache import Stage, model_folder_fingerprint
from bench.merging.config import FinetuneSpec
from bench.merging.tasks import HEAD_SPLIT, TaskData
from bench.merging.training import batch_order, expert_key, expert_seed, summary, train_loop
from mergekit_bmm.errors import ConfigError
from mergekit_bmm.evaluation.classification import load_head, pool, pooled_features


@contextlib.contextmanager
def deterministic(threads: int) -> Iterator[None]:
    """Fixed threads and deterministic kernels for the duration of a training run."""
    previous_threads = torch.get_num_threads()
    previous_mode = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    # a kernel with no deterministic CUDA version warns instead of stopping a GPU run
    torch.use_deterministic_algorithms(True, warn_only=device.current() == "cuda")
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous_mode)
        torch.set_num_threads(previous_threads)


def train_encoder(
    encoder_dir: Path,
    head_file: Path,
    texts: list[str],
    labels: list[int],
    spec: FinetuneSpec,
    max_length: int,
    seed: int,
    out_dir: Path,
    progress: str | None = None,
    checkpoint_every: int = 25,
    on_step=None,
    held_out: tuple[list[str], list[int]] | None = None,
) -> dict[str, Any]:
    """Fine-tune (resuming from a checkpoint in ``out_dir``), save to ``out_dir``; return the record.

    ``held_out`` (texts, labels) is scored every ``spec.eval_every`` steps for early stopping.
    """
    from transformers import AutoModel, AutoTokenizer

    on = device.current()
    stored = load_head(head_file)
    head = dataclasses.replace(stored, weight=stored.weight.to(on), bias=stored.bias.to(on))
    targets = torch.tensor(labels, dtype=torch.long, device=on)
    with deterministic(spec.threads):
        torch.manual_seed(seed)
        model = AutoModel.from_pretrained(str(encoder_dir), dtype=torch.float32).to(on)
        tokenizer = AutoTokenizer.from_pretrained(str(encoder_dir))
        model.train()
        drop_token_types = getattr(model.config, "type_vocab_size", 0) <= 0

        def step_loss(rows: np.ndarray) -> tuple[torch.Tensor, int]:
            encoded = tokenizer(
                [texts[i] for i in rows],
                padding=True,
                truncation=True,
                max_length=max_length,
                return_tensors="pt",
            ).to(on)
            if drop_token_types:
                encoded.pop("token_type_ids", None)
            hidden = model(**encoded).last_hidden_state
            logits = head.logits(pool(hidden, encoded["attention_mask"], head.pooling))
            batch_targets = targets[torch.from_numpy(rows)]
            loss = F.cross_entropy(logits, batch_targets)
            return loss, int((logits.argmax(-1) == batch_targets).sum())

        def held_out_accuracy() -> float:
            assert held_out is not None
            features = pooled_features(model, tokenizer, held_out[0], max_length, 64, stored.pooling)
            return float((stored.logits(features).argmax(-1) == torch.tensor(held_out[1])).double().mean())

        batches = batch_order(len(texts), spec.batch_size, spec.steps, seed)
        evaluate = held_out_accuracy if held_out is not None and spec.eval_every else None
        state = train_loop(
            model, spec, batches, step_loss, out_dir, checkpoint_every, progress, on_step, evaluate
        )
        model.eval()
        model.save_pretrained(str(out_dir))
        tokenizer.save_pretrained(str(out_dir))
    return summary(state, spec, len(texts), seed)


def build_expert(
    task: TaskData,
    head_file: Path,
    head_sha: str,
    encoder_dir: Path,
    encoder_fingerprint: str,
    spec: FinetuneSpec,
    max_length: int,
    cache_dir: Path,
) -> tuple[Path, dict[str, Any], bool]:
    """``(expert_dir, record, cached)``: fine-tune once, then reuse the cached folder."""
    seed = expert_seed(spec, task.name)
    payload = expert_key(
        spec, max_length, seed, task_data=task.sha256, head=head_sha, encoder=encoder_fingerprint
    )
    stage = Stage(cache_dir, "experts", task.name, payload, model_folder_fingerprint)

    held_out = None
    if spec.eval_every:
        if not task.counts.get(HEAD_SPLIT):
            raise ConfigError(
                f"task {task.name}: finetune.eval_every scores the held-out split; set the task's `head` size"
            )
        texts, labels = task.examples(HEAD_SPLIT)
        held_out = (texts[: spec.eval_examples], labels[: spec.eval_examples])

    def produce(folder: Path) -> dict[str, Any]:
        texts, labels = task.examples("train")
        info = train_encoder(
            encoder_dir,
            head_file,
            texts,
            labels,
            spec,
            max_length,
            seed,
            folder,
            progress=f"expert {task.name}",
            held_out=held_out,
        )
        info["bytes"] = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        return info

    record, cached = stage.get(produce, resume=True)
    return stage.path, record, cached
