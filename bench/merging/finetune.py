"""Experts: the pretrained encoder fully fine-tuned on one task with its head frozen.

Freezing the head (fitted on pretrained features) keeps every expert's output space the
same as the pretrained encoder's, so one fixed head per task scores the pretrained
encoder, the expert and every merge alike — the paper's vision-track protocol.

Training is deterministic: a fixed step budget, seeded data order and dropout, a fixed
thread count and ``torch.use_deterministic_algorithms``. The expert is saved as an HF
folder (safetensors + config + tokenizer) that mergekit reads directly.
"""

from __future__ import annotations

import contextlib
import math
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from bench.merging.cache import Stage, model_folder_fingerprint
from bench.merging.config import FinetuneSpec
from bench.merging.tasks import TaskData
from mergekit_bmm.evaluation.classification import load_head, pool

NO_DECAY = ("bias", "LayerNorm.weight", "layer_norm.weight", "norm.weight")


@contextlib.contextmanager
def deterministic(threads: int) -> Iterator[None]:
    """Fixed threads and deterministic kernels for the duration of a training run."""
    previous_threads = torch.get_num_threads()
    previous_mode = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous_mode)
        torch.set_num_threads(previous_threads)


def batch_order(count: int, batch_size: int, steps: int, seed: int) -> Iterator[np.ndarray]:
    """Indices of each step's batch: seeded permutations, epoch after epoch."""
    rng = np.random.default_rng(seed)
    order = np.empty(0, dtype=np.int64)
    for _ in range(steps):
        while len(order) < batch_size:
            order = np.concatenate([order, rng.permutation(count)])
        yield order[:batch_size]
        order = order[batch_size:]


def linear_schedule(steps: int, warmup: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (steps - step) / max(1, steps - warmup))

    return factor


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            (no_decay if name.endswith(NO_DECAY) else decay).append(parameter)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


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
) -> dict[str, Any]:
    """Fine-tune, save to ``out_dir``; return the training record (losses, timings)."""
    from tqdm.auto import tqdm
    from transformers import AutoModel, AutoTokenizer

    head = load_head(head_file)
    with deterministic(spec.threads):
        torch.manual_seed(seed)
        model = AutoModel.from_pretrained(str(encoder_dir), dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(encoder_dir))
        model.train()
        optimizer = torch.optim.AdamW(parameter_groups(model, spec.weight_decay), lr=spec.lr)
        warmup = int(spec.warmup_fraction * spec.steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_schedule(spec.steps, warmup))
        targets = torch.tensor(labels, dtype=torch.long)
        losses, correct, seen = [], 0, 0
        started = time.time()
        bar = tqdm(total=spec.steps, desc=progress, disable=progress is None, leave=False)
        for step, rows in enumerate(batch_order(len(texts), spec.batch_size, spec.steps, seed)):
            encoded = tokenizer(
                [texts[i] for i in rows],
                padding=True,
                truncation=True,
                max_length=max_length,
                return_tensors="pt",
            )
            if getattr(model.config, "type_vocab_size", 0) <= 0:
                encoded.pop("token_type_ids", None)
            hidden = model(**encoded).last_hidden_state
            logits = head.logits(pool(hidden, encoded["attention_mask"], head.pooling))
            batch_targets = targets[torch.from_numpy(rows)]
            loss = F.cross_entropy(logits, batch_targets)
            if not math.isfinite(loss.item()):
                raise FloatingPointError(f"training loss became {loss.item()} at step {step}; lower the lr")
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            correct += int((logits.argmax(-1) == batch_targets).sum())
            seen += len(rows)
            bar.update()
            if step % 10 == 0:
                bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}")
        bar.close()
        seconds = time.time() - started
        model.eval()
        model.save_pretrained(str(out_dir))
        tokenizer.save_pretrained(str(out_dir))
    chunk = max(1, len(losses) // 10)
    return {
        "steps": spec.steps,
        "examples_seen": seen,
        "epochs": round(seen / len(texts), 3),
        "train_seconds": round(seconds, 1),
        "examples_per_second": round(seen / seconds, 2),
        "loss_curve": [round(float(np.mean(losses[i : i + chunk])), 4) for i in range(0, len(losses), chunk)],
        "train_accuracy_running": round(correct / seen, 4),
        "seed": seed,
    }


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
    seed = (spec.seed * 1_000_003 + zlib.crc32(task.name.encode())) % 2**31
    payload = {
        "task_data": task.sha256,
        "head": head_sha,
        "encoder": encoder_fingerprint,
        "finetune": spec.model_dump(mode="json"),
        "max_length": max_length,
        "seed": seed,
        "torch": torch.__version__.split("+")[0],
    }
    stage = Stage(cache_dir, "experts", task.name, payload, model_folder_fingerprint)

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
        )
        info["bytes"] = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        return info

    record, cached = stage.get(produce)
    return stage.path, record, cached
