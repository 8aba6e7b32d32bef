"""The fine-tuning loop shared by the encoder and language-model experts, resumable.

AdamW with a linear warm-up/decay schedule and gradient clipping over a fixed number of
steps, or, given an ``evaluate`` callback and ``eval_every``, until a held-out score stops
improving for ``patience`` evaluations; the best-scoring weights are the ones kept.
Every ``checkpoint_every`` steps the model, optimiser, scheduler, torch RNG state
(dropout) and the loop's counters are saved in the stage's ``.partial`` folder; an
interrupted build resumes from there and produces exactly the weights an uninterrupted
one would (the batch order is a pure function of the seed).
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.merging import device
from bench.merging.config import FinetuneSpec
from mergekit_bmm.io.atomic import replacing

CHECKPOINT = "resume-state.ckpt"
BEST = "best-state.ckpt"
NO_DECAY = ("bias", "LayerNorm.weight", "layer_norm.weight", "norm.weight")


def expert_seed(spec: FinetuneSpec, task_name: str) -> int:
    """Each task's expert draws its own batch order and dropout from the run's seed."""
    return (spec.seed * 1_000_003 + zlib.crc32(task_name.encode())) % 2**31


def expert_key(spec: FinetuneSpec, max_length: int, seed: int, **inputs: str) -> dict[str, Any]:
    """What an expert's weights depend on: its ``inputs`` (data, starting model, head), the
    training settings, torch's version and the device (:func:`bench.merging.device.cache_key`)."""
    return {
        **inputs,
        "finetune": spec.model_dump(mode="json"),
        "max_length": max_length,
        "seed": seed,
        "torch": torch.__version__.split("+")[0],
        **device.cache_key(),
    }


def linear_schedule(steps: int, warmup: int) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (steps - step) / max(1, steps - warmup))

    return factor


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """No weight decay on biases and normalisation weights (the usual AdamW practice)."""
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            (no_decay if name.endswith(NO_DECAY) else decay).append(parameter)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def batch_order(count: int, batch_size: int, steps: int, seed: int) -> Iterable[np.ndarray]:
    """Indices of each step's batch: seeded permutations, epoch after epoch."""
    rng = np.random.default_rng(seed)
    order = np.empty(0, dtype=np.int64)
    for _ in range(steps):
        while len(order) < batch_size:
            order = np.concatenate([order, rng.permutation(count)])
        yield order[:batch_size]
        order = order[batch_size:]


def train_loop(
    model: torch.nn.Module,
    spec: FinetuneSpec,
    batches: Iterable[np.ndarray],
    step_loss: Callable[[np.ndarray], tuple[torch.Tensor, int]],
    folder: Path | None = None,
    checkpoint_every: int = 25,
    progress: str | None = None,
    on_step: Callable[[int], None] | None = None,
    evaluate: Callable[[], float] | None = None,
) -> dict[str, Any]:
    """Run up to ``spec.steps`` optimiser steps; ``step_loss(rows) -> (loss, correct)``.

    Returns the loop's counters: ``losses`` (per step), ``correct``, ``seen``,
    ``seconds`` (training time, summed over resumptions), ``resumed_at``, and with
    ``evaluate``: ``evals`` ([step, score] pairs), ``best`` (the kept step and its score)
    and ``stopped_early``.
    """
    from tqdm.auto import tqdm

    optimizer = torch.optim.AdamW(parameter_groups(model, spec.weight_decay), lr=spec.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, linear_schedule(spec.steps, int(spec.warmup_fraction * spec.steps))
    )
    state: dict[str, Any] = {
        "step": 0,
        "losses": [],
        "correct": 0,
        "seen": 0,
        "seconds": 0.0,
        "resumed_at": None,
        "evals": [],
        "best": None,
        "stopped_early": False,
    }
    checkpoint = folder / CHECKPOINT if folder is not None else None
    if folder is not None:
        remove_interrupted_writes(folder)
    best_weights = BestWeights(folder)
    if checkpoint is not None and checkpoint.is_file():
        saved = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        torch.set_rng_state(saved["rng"])
        if "cuda_rng" in saved:  # dropout on a GPU draws from its own generator
            torch.cuda.set_rng_state_all(saved["cuda_rng"])
        state = saved["state"]
        state["resumed_at"] = state["step"]
    start, started = state["step"], time.time() - state["seconds"]
    bar = tqdm(total=spec.steps, initial=start, desc=progress, disable=progress is None, leave=False)
    for step, rows in enumerate(batches):
        if step < start:
            continue
        loss, correct = step_loss(rows)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"training loss became {loss.item()} at step {step}; lower the lr")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        state["losses"].append(loss.item())
        state["correct"] += correct
        state["seen"] += len(rows)
        state["step"] = step + 1
        state["seconds"] = time.time() - started
        bar.update()
        bar.set_postfix(loss=f"{np.mean(state['losses'][-20:]):.3f}")
        if evaluate is not None and spec.eval_every and state["step"] % spec.eval_every == 0:
            if _evaluate_and_keep_best(model, evaluate, state, best_weights, spec.patience):
                state["stopped_early"] = True
                bar.set_postfix(loss=f"{np.mean(state['losses'][-20:]):.3f}", best=state["best"]["score"])
                break
        if checkpoint is not None and state["step"] % checkpoint_every == 0 and state["step"] < spec.steps:
            _save(checkpoint, model, optimizer, scheduler, state)
        if on_step is not None:
            on_step(step)
    bar.close()
    if evaluate is not None and spec.eval_every:
        if not state["evals"] or state["evals"][-1][0] != state["step"]:  # score the last step too
            _evaluate_and_keep_best(model, evaluate, state, best_weights, spec.patience)
        if state["best"]["step"] != state["step"]:
            model.load_state_dict(best_weights.load())
    best_weights.discard()
    if checkpoint is not None and checkpoint.exists():
        checkpoint.unlink()
    return state


class BestWeights:
    """The best-scoring weights so far: a file in the build folder (it survives a resume), or memory."""

    def __init__(self, folder: Path | None) -> None:
        self.path = folder / BEST if folder is not None else None
        self._memory: dict[str, torch.Tensor] | None = None

    def keep(self, model: torch.nn.Module) -> None:
        weights = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
        if self.path is None:
            self._memory = weights
            return
        with replacing(self.path, fsync=False) as temporary:
            torch.save(weights, temporary)

    def load(self) -> dict[str, torch.Tensor]:
        if self.path is None:
            assert self._memory is not None
            return self._memory
        return torch.load(self.path, weights_only=True)

    def discard(self) -> None:
        self._memory = None
        if self.path is not None and self.path.exists():
            self.path.unlink()


def _evaluate_and_keep_best(
    model: torch.nn.Module,
    evaluate: Callable[[], float],
    state: dict[str, Any],
    best: BestWeights,
    patience: int,
) -> bool:
    """Score the model, keep its weights if best so far; True once ``patience`` scores brought nothing."""
    score = round(float(evaluate()), 4)
    state["evals"].append([state["step"], score])
    if state["best"] is None or score > state["best"]["score"]:
        state["best"] = {"step": state["step"], "score": score}
        best.keep(model)
        return False
    since_best = sum(1 for step, _ in state["evals"] if step > state["best"]["step"])
    return since_best >= patience


def remove_interrupted_writes(folder: Path) -> None:
    """A process killed while saving a checkpoint leaves the half-written temporary of
    :func:`~mergekit_bmm.io.atomic.replacing` behind; a resumed build would otherwise install it,
    hundreds of MB, with the finished model."""
    for name in (CHECKPOINT, BEST):
        for stale in folder.glob(f".{name}.*.tmp"):
            stale.unlink(missing_ok=True)


def _save(path: Path, model, optimizer, scheduler, state: dict[str, Any]) -> None:
    saved = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": torch.get_rng_state(),
        "state": state,
    }
    if next(model.parameters()).is_cuda:
        saved["cuda_rng"] = torch.cuda.get_rng_state_all()
    with replacing(path, fsync=False) as temporary:
        torch.save(saved, temporary)


def summary(state: dict[str, Any], spec: FinetuneSpec, examples: int, seed: int) -> dict[str, Any]:
    """The training record kept in the expert's ``done.json``."""
    losses = state["losses"]
    chunk = max(1, len(losses) // 10)
    return {
        "steps": state["step"],
        "max_steps": spec.steps,
        "examples_seen": state["seen"],
        "epochs": round(state["seen"] / examples, 3),
        "train_seconds": round(state["seconds"], 1),
        "examples_per_second": round(state["seen"] / max(state["seconds"], 1e-9), 2),
        "loss_curve": [round(float(np.mean(losses[i : i + chunk])), 4) for i in range(0, len(losses), chunk)],
        "train_accuracy_running": round(state["correct"] / max(state["seen"], 1), 4),
        "resumed_at_step": state["resumed_at"],
        "seed": seed,
        "held_out_curve": state.get("evals", []),
        "kept_step": (state.get("best") or {}).get("step", state["step"]),
        "held_out_best": (state.get("best") or {}).get("score"),
        "stopped_early": state.get("stopped_early", False),
    }
