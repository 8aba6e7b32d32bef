"""Collect a statistics directory: every task's calibration data through its expert.

One expert is in memory at a time. After each task its Gram file is written atomically
and the manifest is rewritten to list it, so an interrupted run keeps every finished
task; running the same ``stats.yml`` again skips tasks whose model fingerprint and
settings still match and collects the rest. A directory that differs from the config
(other settings, other checkpoints, extra tasks, another format version) is only
changed with ``force=True``; a non-empty folder that is not a statistics directory is
never written into.
"""

from __future__ import annotations

import gc
import inspect
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from mergekit_bmm.devices import resolve_device
from mergekit_bmm.errors import ConfigError, StatisticsError
from mergekit_bmm.io.fingerprint import model_fingerprint
from mergekit_bmm.stats.config import StatsConfig, TaskConfig
from mergekit_bmm.stats.gram_hooks import GramCollector
from mergekit_bmm.stats.samples import data_fingerprint, read_samples, tokenize_samples
from mergekit_bmm.stats.store import (
    GRAM_DIR,
    MANIFEST,
    StatsManifest,
    TaskStats,
    load_manifest,
    write_grams,
    write_manifest,
)

LOG = logging.getLogger("mergekit_bmm.stats")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ENCODER_MODEL_TYPES = frozenset(
    {"bert", "roberta", "xlm-roberta", "distilbert", "deberta", "deberta-v2", "electra", "albert", "mpnet"}
)


@dataclass(frozen=True)
class TaskPlan:
    """One task of the config, with what identifies its result."""

    task: TaskConfig
    fingerprint: str
    settings: dict[str, Any]

    @property
    def file(self) -> str:
        return f"{self.task.name}.safetensors"


def task_settings(task: TaskConfig, config: StatsConfig) -> dict[str, Any]:
    """Everything besides the model that decides a task's Grams."""
    return {
        "data_fingerprint": data_fingerprint(task.data) if Path(task.data).exists() else "",
        "split": task.split,
        "text_field": task.text_field,
        "chat_template": task.chat_template,
        "max_samples": task.max_samples,
        "max_length": task.max_length,
        "forward_dtype": config.dtype,
        "accumulate_dtype": "float64",
    }


def plan_tasks(config: StatsConfig) -> list[TaskPlan]:
    plans = []
    for task in config.tasks:
        if not Path(task.data).exists():
            raise ConfigError(f"task {task.name!r}: calibration data {task.data} does not exist")
        if task.model.startswith(("/", ".", "~")) and not Path(task.model).is_dir():
            raise ConfigError(f"task {task.name!r}: model folder {task.model} does not exist")
        plans.append(TaskPlan(task, model_fingerprint(task.model), task_settings(task, config)))
    return plans


def _differences(recorded: TaskStats, plan: TaskPlan) -> list[str]:
    """What differs between a finished task and the config's version of it."""
    changes = []
    if recorded.model != plan.task.model:
        changes.append(f"model {recorded.model} vs {plan.task.model}")
    if recorded.data != plan.task.data:
        changes.append(f"data {recorded.data} vs {plan.task.data}")
    if recorded.fingerprint != plan.fingerprint:
        changes.append(f"checkpoint fingerprint {recorded.fingerprint or '-'} vs {plan.fingerprint or '-'}")
    for key, value in plan.settings.items():
        if recorded.settings.get(key) != value:
            changes.append(f"{key} {recorded.settings.get(key)!r} vs {value!r}")
    return changes


def open_output(out: Path, force: bool) -> StatsManifest | None:
    """The existing manifest in ``out`` (None for a new or empty folder)."""
    if not out.exists():
        out.mkdir(parents=True)
        return None
    if not out.is_dir():
        raise StatisticsError(f"OUT_PATH {out} is a file; choose a folder")
    if not (out / MANIFEST).exists():
        if any(entry.name != GRAM_DIR for entry in out.iterdir()) or any(
            (out / GRAM_DIR).glob("*.safetensors")
        ):
            raise StatisticsError(
                f"OUT_PATH {out} is not empty and is not a statistics directory; choose a new folder "
                "(nothing there is overwritten, even with --force)"
            )
        return None
    try:
        return load_manifest(out)
    except StatisticsError as error:
        if not force:
            raise StatisticsError(
                f"{error} — OUT_PATH {out} holds unusable statistics; pass --force to replace them"
            ) from None
        LOG.warning("replacing unusable statistics in %s (--force)", out)
        shutil.rmtree(out / GRAM_DIR, ignore_errors=True)
        (out / MANIFEST).unlink()
        return None


def reconcile(
    out: Path, existing: StatsManifest | None, plans: list[TaskPlan], force: bool
) -> tuple[list[TaskStats], list[TaskPlan], list[TaskStats]]:
    """Finished tasks to keep, tasks to (re)collect, and tasks to drop (only with ``force``)."""
    if existing is None:
        return [], plans, []
    wanted = {plan.task.name: plan for plan in plans}
    extra = [task.name for task in existing.tasks if task.name not in wanted]
    if extra and not force:
        raise StatisticsError(
            f"{out} also holds tasks {', '.join(extra)} that stats.yml does not list; pass --force to drop "
            "them, or choose a new OUT_PATH"
        )
    keep: list[TaskStats] = []
    todo: list[TaskPlan] = []
    recorded = {task.name: task for task in existing.tasks}
    for plan in plans:
        previous = recorded.get(plan.task.name)
        if previous is None:
            todo.append(plan)
            continue
        changes = _differences(previous, plan)
        if not (out / GRAM_DIR / previous.file).exists():
            changes.append("its Gram file is missing")
        if not changes:
            keep.append(previous)
            continue
        if not force:
            raise StatisticsError(
                f"task {plan.task.name!r} in {out} was collected differently ({'; '.join(changes)}); "
                "pass --force to recollect it, or choose a new OUT_PATH"
            )
        todo.append(plan)
    return keep, todo, [recorded[name] for name in extra]


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
    model = loader.from_pretrained(path, dtype=dtype)
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


def _batches(sequences: list[list[int]], batch_size: int, pad_id: int, device: torch.device):
    """Right-padded (input_ids, attention_mask) batches, longest first (little padding)."""
    ordered = sorted(sequences, key=len, reverse=True)
    for start in range(0, len(ordered), batch_size):
        chunk = ordered[start : start + batch_size]
        width = len(chunk[0])
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, sequence in enumerate(chunk):
            ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
            mask[row, : len(sequence)] = 1
        yield ids.to(device), mask.to(device)


def collect_task(
    task: TaskConfig, config: StatsConfig, device: torch.device, progress: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, str], int, int, str]:
    """One task's mean Grams, module map, sample and token counts, and model type."""
    # Read the data before loading the expert: a bad file fails in a second.
    samples = read_samples(task.data, task.text_field, task.max_samples, task.split, task.chat_template)
    model, tokenizer, model_type, decoder = load_expert(task.model, device, DTYPES[config.dtype])
    try:
        sequences = tokenize_samples(tokenizer, samples, task.chat_template, _max_length(task, model))
        if not sequences:
            raise ConfigError(f"task {task.name!r}: the tokenizer produced no tokens for {task.data}")
        pad_id = tokenizer.pad_token_id
        if pad_id is None:  # padded positions are masked out, any valid id will do
            pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        extra = {"use_cache": False} if decoder else {}
        if decoder and "logits_to_keep" in _forward_parameters(model):
            extra["logits_to_keep"] = 1  # the Grams need no logits; skip the vocabulary projection
        collector = GramCollector(model, model_type)
        bar = tqdm(total=len(sequences), desc=task.name, unit="seq", disable=not progress, leave=False)
        with collector, torch.inference_mode():
            for ids, mask in _batches(sequences, config.batch_size, pad_id, device):
                with collector.batch(mask):
                    model(input_ids=ids, attention_mask=mask, **extra)
                bar.update(ids.shape[0])
        bar.close()
        unseen = collector.unseen()
        if unseen:
            LOG.warning(
                "task %s: %d modules saw no input and get no Gram (e.g. %s)",
                task.name,
                len(unseen),
                unseen[0],
            )
        tokens = sum(len(sequence) for sequence in sequences)
        return collector.mean_grams(), collector.modules(), len(sequences), tokens, model_type
    finally:
        del model
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
) -> StatsManifest:
    """Write (or complete) the statistics directory ``out`` for ``config``."""
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
    # describing a file that was already replaced. (A new folder gets its manifest now, so
    # that a resumed run recognises it.)
    if existing is None or [t.name for t in keep] != [t.name for t in existing.tasks]:
        write_manifest(out, manifest(keep))
    for task in dropped:
        (out / GRAM_DIR / task.file).unlink(missing_ok=True)
    if not todo:
        LOG.info("statistics in %s are up to date", out)
    for plan in tqdm(todo, desc="tasks", unit="task", disable=not progress or len(todo) < 2):
        task = plan.task
        grams, task_modules, samples, tokens, task_type = collect_task(task, config, torch_device, progress)
        if modules and task_modules != modules:
            missing = sorted(set(modules) ^ set(task_modules))
            raise StatisticsError(
                f"task {task.name!r}: {task.model} has other linear modules than the tasks already in {out} "
                f"(e.g. {missing[0] if missing else 'a different input sharing'}); experts must share one "
                "architecture"
            )
        modules, model_type = task_modules, task_type
        write_grams(out / GRAM_DIR / plan.file, grams)
        keep.append(
            TaskStats(
                name=task.name,
                model=task.model,
                fingerprint=plan.fingerprint,
                file=plan.file,
                samples=samples,
                tokens=tokens,
                data=task.data,
                settings=plan.settings,
            )
        )
        write_manifest(out, manifest(keep))
        LOG.info(
            "task %s: %d samples, %d tokens, %d Grams for %d modules",
            task.name,
            samples,
            tokens,
            len(grams),
            len(task_modules),
        )
    return manifest(keep)


def describe(manifest: StatsManifest) -> str:
    """A short summary for the command line."""
    lines = [f"{'task':<20} {'samples':>8} {'tokens':>8}  model"]
    for task in manifest.tasks:
        lines.append(f"{task.name:<20} {task.samples:>8} {task.tokens:>8}  {task.model}")
    keys = len(set(manifest.modules.values()))
    lines.append(f"{len(manifest.modules)} modules, {keys} stored Grams per task")
    return "\n".join(lines)
