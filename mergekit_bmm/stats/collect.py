"""Collect a statistics directory: every task's calibration data through its expert.

One expert is in memory at a time. Its accumulators are bounded by a memory budget
(:mod:`mergekit_bmm.stats.passes`): when they do not all fit, the data runs once per group
of layers and each pass writes its own part file. After each pass the task's progress is
saved, and after each task the manifest is rewritten to list it, so an interrupted run
keeps every finished pass and task; running the same ``stats.yml`` again skips tasks whose
model fingerprint and settings still match, finishes a task's remaining layers, and
collects the rest. A directory that differs from the config
(other settings, other checkpoints, extra tasks, another format version) is only
changed with ``force=True``; a non-empty folder that is not a statistics directory is
never written into.
"""

from __future__ import annotations

import gc
import inspect
import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from mergekit_bmm.devices import resolve_device
from mergekit_bmm.errors import ConfigError, StatisticsError
from mergekit_bmm.io.atomic import atomic_write_json
from mergekit_bmm.stats import passes as budgeting
from mergekit_bmm.stats.config import StatsConfig, TaskConfig
from mergekit_bmm.stats.expert_hooks import stack_accumulators
from mergekit_bmm.stats.gram_hooks import GramCollector, PassComplete
from mergekit_bmm.stats.gram_storage import tokens_are_smaller
from mergekit_bmm.stats.plan import TaskPlan, open_output, plan_tasks, reconcile, task_samples
from mergekit_bmm.stats.samples import tokenize_samples
from mergekit_bmm.stats.store import (
    GRAM_DIR,
    StatsManifest,
    TaskStats,
    write_manifest,
    write_part,
)

LOG = logging.getLogger("mergekit_bmm.stats")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ENCODER_MODEL_TYPES = frozenset(
    {"bert", "roberta", "xlm-roberta", "distilbert", "deberta", "deberta-v2", "electra", "albert", "mpnet"}
)


PROGRESS = "progress.json"


def load_expert(path: str, device: torch.device, dtype: torch.dtype):
    """The expert as ``AutoModelForCausalLM`` (decoders) or ``AutoModel`` (encoders), eval mode."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(f"cannot read the model config of {path} ({first})") from None
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError(
            f"{path} is an encoder-decoder ({config.model_type}); statistics are collected for decoder "
            "LLMs and encoders only"
        )
    decoder = is_decoder(config)
    loader = AutoModelForCausalLM if decoder else AutoModel
    # Straight onto an accelerator: loading on the host first held the whole float32 model in RAM
    # (21.8 GB of host memory for an 8B-wide expert of 16 layers, docs/performance.md).
    placement = {} if device.type == "cpu" else {"device_map": str(device)}
    model = loader.from_pretrained(path, dtype=dtype, **placement)
    model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer, config.model_type, decoder


def is_decoder(config: Any) -> bool:
    """Causal LMs get ``AutoModelForCausalLM``; encoders (BERT family) ``AutoModel``."""
    architectures = getattr(config, "architectures", None) or []
    if any(a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")) for a in architectures):
        return True
    if getattr(config, "is_decoder", False):
        return True
    if config.model_type in ENCODER_MODEL_TYPES:
        return False
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def _batches(
    sequences: list[list[int]], batch_size: int, pad_id: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Right-padded (input_ids, attention_mask) batches on the CPU, longest first (little padding)."""
    ordered = sorted(sequences, key=len, reverse=True)
    batches = []
    for start in range(0, len(ordered), batch_size):
        chunk = ordered[start : start + batch_size]
        width = len(chunk[0])
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, sequence in enumerate(chunk):
            ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
            mask[row, : len(sequence)] = 1
        batches.append((ids, mask))
    return batches


@dataclass
class TaskRun:
    """One task's expert in memory with its tokenised data, ready for passes."""

    model: torch.nn.Module
    model_type: str
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    extra: dict[str, Any]
    samples: int
    tokens: int
    device: torch.device

    def forward(self, collector: GramCollector, bar: tqdm | None = None) -> None:
        """Every batch through the expert with ``collector`` listening (a pass may end each early)."""
        with collector, torch.inference_mode():
            for ids, mask in self.batches:
                ids, mask = ids.to(self.device), mask.to(self.device)
                try:
                    with collector.batch(mask):
                        self.model(input_ids=ids, attention_mask=mask, **self.extra)
                except PassComplete:
                    pass
                if bar is not None:
                    bar.update(int(mask.sum()))


def _prepare(plan: TaskPlan, config: StatsConfig, device: torch.device) -> TaskRun:
    task = plan.task
    # Read the data before loading the expert: a bad file fails in a second.
    samples = task_samples(plan)
    model, tokenizer, model_type, decoder = load_expert(str(plan.model.path), device, DTYPES[config.dtype])
    sequences = tokenize_samples(tokenizer, samples, task.chat_template, _max_length(task, model))
    if not sequences:
        raise ConfigError(f"task {task.name!r}: the tokenizer produced no tokens for {task.data}")
    pad_id = tokenizer.pad_token_id
    if pad_id is None:  # padded positions are masked out, any valid id will do
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    extra = {"use_cache": False} if decoder else {}
    if decoder and "logits_to_keep" in _forward_parameters(model):
        extra["logits_to_keep"] = 1  # the Grams need no logits; skip the vocabulary projection
    tokens = sum(len(sequence) for sequence in sequences)
    batches = _batches(sequences, config.batch_size, pad_id)
    return TaskRun(model, model_type, batches, extra, len(sequences), tokens, device)


def _layer_bytes(run: TaskRun, sharing: dict[str, str]) -> tuple[dict[int, int], frozenset[str]]:
    """What each layer's accumulators take, and the keys kept as token rows."""
    probe = GramCollector(run.model, run.model_type, accumulate=False)
    keys = {}
    for name, (_, d_in) in probe.targets.items():
        key = sharing.get(name, name)  # a module the probe did not reach counts on its own
        keys[key] = (probe.layer_of[name], d_in)
    per_layer: dict[int, int] = {}
    for layer, d_in in keys.values():
        per_layer[layer] = per_layer.get(layer, 0) + budgeting.accumulator_bytes(d_in, run.tokens)
    rows = frozenset(key for key, (_, d_in) in keys.items() if tokens_are_smaller(run.tokens, d_in))
    top_k = int(getattr(run.model.config, "num_experts_per_tok", 0) or 0)
    for stack in probe.stacks.values():
        size, stack_rows = stack_accumulators(stack, run.tokens, top_k or stack.experts)
        per_layer[stack.layer] = per_layer.get(stack.layer, 0) + size
        rows |= stack_rows
    return per_layer, rows


def _probe_sharing(run: TaskRun) -> dict[str, str]:
    """Which modules read the same input, from the shortest batch (nothing is accumulated)."""
    probe = GramCollector(run.model, run.model_type, accumulate=False)
    single = TaskRun(run.model, run.model_type, run.batches[-1:], run.extra, 0, 0, run.device)
    single.forward(probe)
    return probe.modules()


@dataclass
class Progress:
    """A task's finished passes (``grams/<task>/progress.json``), so an interrupted task resumes."""

    fingerprint: str
    settings: dict[str, Any]
    parts: dict[str, str]
    layers: list[int]
    modules: dict[str, str]
    routed: dict[str, int] = field(default_factory=dict)  # expert slice -> tokens routed to it

    @classmethod
    def read(cls, folder: Path, plan: TaskPlan) -> Progress:
        fresh = cls(plan.fingerprint, plan.settings, {}, [], {}, {})
        try:
            saved = json.loads((folder / PROGRESS).read_text(encoding="utf-8"))
            progress = cls(**saved)
        except (OSError, ValueError, TypeError):
            progress = None
        if progress is None or (progress.fingerprint, progress.settings) != (plan.fingerprint, plan.settings):
            shutil.rmtree(folder, ignore_errors=True)  # another expert or settings: start the task over
            return fresh
        if not all((folder / part).exists() for part in progress.parts.values()):
            shutil.rmtree(folder, ignore_errors=True)
            return fresh
        return progress

    def write(self, folder: Path) -> None:
        atomic_write_json(folder / PROGRESS, self.__dict__)


def collect_task(
    plan: TaskPlan,
    config: StatsConfig,
    out: Path,
    device: torch.device,
    max_memory: int | None = None,
    progress: bool = True,
) -> tuple[TaskStats, dict[str, str], str]:
    """Collect one task into ``grams/<task>/``; its record, module map and model type."""
    task = plan.task
    folder = out / GRAM_DIR / plan.folder
    run = _prepare(plan, config, device)
    try:
        done = Progress.read(folder, plan)
        sharing = _probe_sharing(run)
        per_layer, rows = _layer_bytes(run, sharing)
        budget = max_memory if max_memory is not None else budgeting.default_budget(device)
        remaining = {layer: size for layer, size in per_layer.items() if layer not in done.layers}
        plan_passes = budgeting.plan_passes(remaining, budget)
        total_passes = len(set(done.parts.values())) + len(plan_passes)
        if len(plan_passes) > 1 or done.layers:
            LOG.info(
                "task %s: %d passes over the data (accumulators %s, budget %s)%s",
                task.name,
                total_passes,
                budgeting.describe_size(sum(per_layer.values())),
                budgeting.describe_size(budget),
                f"; {len(set(done.parts.values()))} already done" if done.layers else "",
            )
        for index, layers in enumerate(plan_passes):
            number = len(set(done.parts.values())) + 1
            collector = GramCollector(
                run.model,
                run.model_type,
                layers=(layers.first, layers.last),
                keep_rows=rows,
                stop_early=index < len(plan_passes) - 1,
            )
            bar = tqdm(
                total=run.tokens,
                desc=f"{task.name} pass {number}/{total_passes}",
                unit="tok",
                unit_scale=True,
                disable=not progress,
                leave=False,
            )
            run.forward(collector, bar)
            bar.close()
            part = write_part(out, plan.folder, number, dict(collector.stored_grams()))
            done.parts.update(dict.fromkeys(collector.counts, part))
            done.layers.extend(sorted({layer for layer in per_layer if layers.first <= layer <= layers.last}))
            done.modules.update(collector.modules())
            done.routed.update(collector.routed())
            done.write(folder)
        unseen = sorted(
            set(GramCollector(run.model, run.model_type, accumulate=False).targets) - set(done.modules)
        )
        if unseen:
            LOG.warning(
                "task %s: %d modules saw no input and get no Gram (e.g. %s)",
                task.name,
                len(unseen),
                unseen[0],
            )
        record = TaskStats(
            name=task.name,
            model=task.model,
            fingerprint=plan.fingerprint,
            file=plan.folder,
            samples=run.samples,
            tokens=run.tokens,
            data=task.data,
            settings=plan.settings,
            revision=plan.model.revision,
            parts=dict(sorted(done.parts.items())),
            passes=total_passes,
            routed=dict(sorted(done.routed.items())),
        )
        silent = [key for key, count in record.routed.items() if count == 0]
        if silent:
            LOG.warning(
                "task %s: %d mixture-of-experts slices received no routed token (e.g. %s); "
                "a merge keeps the anchor there unless another task's tokens reach them",
                task.name,
                len(silent),
                silent[0],
            )
        return record, dict(sorted(done.modules.items())), run.model_type
    finally:
        del run
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _max_length(task: TaskConfig, model: torch.nn.Module) -> int:
    """``max_length``, capped at the model's position embeddings."""
    for key in ("max_position_embeddings", "n_positions"):
        limit = getattr(model.config, key, None)
        if isinstance(limit, int) and 0 < limit < task.max_length:
            LOG.warning(
                "task %s: max_length %d exceeds the model's %d positions; using %d",
                task.name,
                task.max_length,
                limit,
                limit,
            )
            return limit
    return task.max_length


def _forward_parameters(model: torch.nn.Module) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


def collect_statistics(
    config: StatsConfig,
    out: str | Path,
    device: str = "cpu",
    force: bool = False,
    progress: bool = True,
    max_memory: int | None = None,
) -> StatsManifest:
    """Write (or complete) the statistics directory ``out`` for ``config``.

    ``max_memory`` bounds the accumulators in bytes (default: a share of the device's free
    memory once the expert is loaded).
    """
    from mergekit_bmm import __version__

    out = Path(out)
    torch_device = torch.device(resolve_device(device))
    plans = plan_tasks(config)
    existing = open_output(out, force)
    keep, todo, dropped = reconcile(out, existing, plans, force)
    modules = existing.modules if existing is not None and keep else {}
    model_type = existing.model_type if existing is not None and keep else ""
    order = [plan.task.name for plan in plans]

    def manifest(tasks: list[TaskStats]) -> StatsManifest:
        tasks = sorted(tasks, key=lambda t: order.index(t.name))
        return StatsManifest(
            package_version=__version__, tasks=tasks, modules=modules, model_type=model_type, dtype="float32"
        )

    # Drop entries about to be recollected first: a crash then never leaves the manifest
    # describing files that were already replaced. (A new folder gets its manifest now, so
    # that a resumed run recognises it.)
    if existing is None or [t.name for t in keep] != [t.name for t in existing.tasks]:
        write_manifest(out, manifest(keep))
    for task in dropped:
        shutil.rmtree(out / GRAM_DIR / task.file, ignore_errors=True)
    if not todo:
        LOG.info("statistics in %s are up to date", out)
    for plan in tqdm(todo, desc="tasks", unit="task", disable=not progress or len(todo) < 2):
        task = plan.task
        record, task_modules, task_type = collect_task(plan, config, out, torch_device, max_memory, progress)
        if modules and task_modules != modules:
            missing = sorted(set(modules) ^ set(task_modules))
            raise StatisticsError(
                f"task {task.name!r}: {task.model} has other linear modules than the tasks already in {out} "
                f"(e.g. {missing[0] if missing else 'a different input sharing'}); experts must share one "
                "architecture"
            )
        modules, model_type = task_modules, task_type
        keep = [entry for entry in keep if entry.name != task.name] + [record]
        write_manifest(out, manifest(keep))
        (out / GRAM_DIR / plan.folder / PROGRESS).unlink(missing_ok=True)
        LOG.info(
            "task %s: %d samples, %d tokens, %d Grams for %d modules in %d pass%s",
            task.name,
            record.samples,
            record.tokens,
            len(set(record.parts)),
            len(task_modules),
            record.passes,
            "" if record.passes == 1 else "es",
        )
    return manifest(keep)


def describe(manifest: StatsManifest, out: Path | None = None) -> str:
    """A short summary for the command line."""
    lines = [f"{'task':<20} {'samples':>8} {'tokens':>8} {'passes':>6}  model"]
    for task in manifest.tasks:
        model = f"{task.model}@{task.revision[:12]}" if task.revision else task.model
        lines.append(f"{task.name:<20} {task.samples:>8} {task.tokens:>8} {task.passes or 1:>6}  {model}")
    keys = len(set(manifest.modules.values()))
    size = ""
    if out is not None:
        total = sum(p.stat().st_size for p in (Path(out) / GRAM_DIR).rglob("*.safetensors"))
        size = f", {budgeting.describe_size(total)} on disk"
    lines.append(f"{len(manifest.modules)} modules, {keys} stored Grams per task{size}")
    return "\n".join(lines)
