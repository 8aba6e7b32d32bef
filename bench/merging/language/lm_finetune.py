"""Language-track experts: the causal LM fine-tuned on one multiple-choice task.

The loss is the cross-entropy of the right answer's tokens after ``query + " "`` — the
very continuation lm-eval scores — so an expert learns its task's answer format and
content, and nothing about the prompt. Tokenisation follows lm-eval's HF model (no
special tokens; continuation = tokens of the whole string after those of the context).
Deterministic and resumable like the encoder experts: fixed steps, seeded order, fixed
threads, checkpoints in the stage's ``.partial`` folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.merging import device
from bench.merging.cache import Stage, model_folder_fingerprint
from bench.merging.config import FinetuneSpec
from bench.merging.finetune import deterministic
from bench.merging.language.mc_tasks import MCTask
from bench.merging.training import batch_order, expert_key, expert_seed, summary, train_loop


def encode_example(tokenizer, query: str, answer: str, max_length: int) -> tuple[list[int], int]:
    """``(token ids, number of answer tokens at the end)``, the context cut from the left."""
    context = tokenizer(query, add_special_tokens=False)["input_ids"]
    whole = tokenizer(query + " " + answer, add_special_tokens=False)["input_ids"]
    answer_tokens = max(1, len(whole) - len(context))
    return whole[-max_length:], min(answer_tokens, max_length - 1)


def collate(examples: list[tuple[list[int], int]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for row, (ids, n_answer) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        labels[row, len(ids) - n_answer : len(ids)] = torch.tensor(ids[len(ids) - n_answer :])
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


def train_lm(
    model_dir: Path,
    task: MCTask,
    spec: FinetuneSpec,
    max_length: int,
    seed: int,
    out_dir: Path,
    progress: str | None = None,
    checkpoint_every: int = 20,
) -> dict[str, Any]:
    """Fine-tune on the task's train split (resumable), save to ``out_dir``; return the record."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    records = task.records("train")
    with deterministic(spec.threads):
        torch.manual_seed(seed)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        model.to(device.current()).train()
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        examples = [
            encode_example(tokenizer, r["query"], r["choices"][r["label"]], max_length) for r in records
        ]

        def step_loss(rows: np.ndarray) -> tuple[torch.Tensor, int]:
            rows_batch = collate([examples[i] for i in rows], pad_id)
            batch = {name: tensor.to(model.device) for name, tensor in rows_batch.items()}
            output = model(**batch)
            answer = batch["labels"][:, 1:] != -100
            predicted = output.logits[:, :-1].argmax(-1)
            correct = ((predicted == batch["labels"][:, 1:]) | ~answer).all(dim=1)
            return output.loss, int(correct.sum())

        batches = batch_order(len(examples), spec.batch_size, spec.steps, seed)
        state = train_loop(model, spec, batches, step_loss, out_dir, checkpoint_every, progress)
        model.eval()
        model.save_pretrained(str(out_dir))
        tokenizer.save_pretrained(str(out_dir))
    return summary(state, spec, len(examples), seed)


def build_lm_expert(
    task: MCTask,
    model_dir: Path,
    model_fp: str,
    spec: FinetuneSpec,
    max_length: int,
    cache_dir: Path,
) -> tuple[Path, dict[str, Any], bool]:
    seed = expert_seed(spec, task.name)
    payload = expert_key(spec, max_length, seed, task_data=task.sha256, model=model_fp)
    stage = Stage(cache_dir, "language/experts", task.name, payload, model_folder_fingerprint)

    def produce(folder: Path) -> dict[str, Any]:
        info = train_lm(model_dir, task, spec, max_length, seed, folder, progress=f"LM expert {task.name}")
        info["bytes"] = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        return info

    record, cached = stage.get(produce, resume=True)
    return stage.path, record, cached
