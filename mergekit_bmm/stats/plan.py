"""What a statistics run must collect: each task located and fingerprinted, against what OUT_PATH holds.

A task is kept when its expert's fingerprint, revision, data and settings match what the
manifest recorded and its Gram files are there; anything else is collected again, and only
with ``force`` does a run replace or drop what differs. A folder that is not a statistics
directory is never written into.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mergekit_bmm.errors import ConfigError, StatisticsError
from mergekit_bmm.io.fingerprint import model_fingerprint, reference_fingerprint
from mergekit_bmm.stats.config import StatsConfig, TaskConfig
from mergekit_bmm.stats.hub import ResolvedModel, fetch_dataset, load_hub_dataset, resolve_model
from mergekit_bmm.stats.samples import Sample, data_fingerprint, dataset_samples, read_samples
from mergekit_bmm.stats.store import (
    FORMAT_VERSION,
    GRAM_DIR,
    MANIFEST,
    StatsManifest,
    TaskStats,
    load_manifest,
)

LOG = logging.getLogger("mergekit_bmm.stats")


@dataclass(frozen=True)
class TaskPlan:
    """One task of the config, with what identifies its result."""

    task: TaskConfig
    model: ResolvedModel
    fingerprint: str
    settings: dict[str, Any]
    data_folder: Path | None = None  # a fetched Hub data set

    @property
    def folder(self) -> str:
        return self.task.name


def _hub_data(task: TaskConfig) -> bool:
    return not Path(task.data).exists() and not task.data.startswith(("/", ".", "~"))


def task_settings(task: TaskConfig, config: StatsConfig, data_commit: str = "") -> dict[str, Any]:
    """Everything besides the model that decides a task's Grams."""
    if _hub_data(task):
        data = {"data_fingerprint": f"hub:{data_commit}", "data_config": task.data_config}
    else:
        data = {"data_fingerprint": data_fingerprint(task.data) if Path(task.data).exists() else ""}
    return {
        **data,
        "split": task.split,
        "text_field": task.text_field,
        "chat_template": task.chat_template,
        "max_samples": task.max_samples,
        "max_length": task.max_length,
        "forward_dtype": config.dtype,
        "accumulate_dtype": "float64",
    }


def plan_tasks(config: StatsConfig) -> list[TaskPlan]:
    """Every task with its expert and data located (Hub ones fetched into the cache) and fingerprinted."""
    plans = []
    for task in config.tasks:
        data_folder, commit = None, ""
        if _hub_data(task):
            data_folder, commit = fetch_dataset(task.data, task.data_revision)
        elif not Path(task.data).exists():
            raise ConfigError(f"task {task.name!r}: calibration data {task.data} does not exist")
        local = task.model.startswith(("/", ".", "~")) and "+" not in task.model
        if local and not Path(task.model).is_dir():
            raise ConfigError(f"task {task.name!r}: model folder {task.model} does not exist")
        try:
            model = resolve_model(task.model, task.revision)
        except ConfigError as error:
            raise ConfigError(f"task {task.name!r}: {error}") from None
        settings = task_settings(task, config, commit)
        fingerprint = (
            reference_fingerprint(task.model) if "+" in task.model else model_fingerprint(model.path)
        )
        plans.append(TaskPlan(task, model, fingerprint, settings, data_folder))
    return plans


def _differences(recorded: TaskStats, plan: TaskPlan) -> list[str]:
    """What differs between a finished task and the config's version of it."""
    changes = []
    if recorded.revision != plan.model.revision:
        changes.append(f"revision {recorded.revision or '-'} vs {plan.model.revision or '-'}")
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
    if (out / MANIFEST).exists() and _version(out / MANIFEST) not in (None, FORMAT_VERSION):
        if not force:
            raise StatisticsError(
                f"OUT_PATH {out} holds statistics of format version {_version(out / MANIFEST)} (merges still "
                f"read them); pass --force to recollect them as version {FORMAT_VERSION}, or choose a new "
                "OUT_PATH"
            )
        LOG.warning("replacing version %s statistics in %s (--force)", _version(out / MANIFEST), out)
        shutil.rmtree(out / GRAM_DIR, ignore_errors=True)
        (out / MANIFEST).unlink()
        return None
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


def _version(manifest: Path) -> int | None:
    """The manifest's format version when it names a readable one (other files are judged later)."""
    try:
        version = json.loads(manifest.read_text(encoding="utf-8")).get("format_version")
    except (OSError, ValueError, AttributeError):
        return None
    return version if version in (1,) else None


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
        if not all((out / GRAM_DIR / file).exists() for file in previous.files()):
            changes.append("its Gram files are missing")
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


def task_samples(plan: TaskPlan) -> list[Sample]:
    """The task's first ``max_samples`` samples, from its local data or its Hub data set."""
    task = plan.task
    if plan.data_folder is not None:
        dataset = load_hub_dataset(plan.data_folder, task.data, task.data_config, task.split)
        return dataset_samples(dataset, task.data, task.text_field, task.max_samples, task.chat_template)
    return read_samples(task.data, task.text_field, task.max_samples, task.split, task.chat_template)
