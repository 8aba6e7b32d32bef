"""Scores of merged or saved models with the run's fixed heads, and the run's manifest and
evaluator blocks (what a search needs to score a trial the same way)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import yaml

from bench.merging.anchor_tuning import materialise
from bench.merging.artifacts import Artifacts
from bench.merging.cache import ScoreCache, read_json, stable_key, write_json
from bench.merging.config import LabelFreeSpec, RunConfig, limits
from bench.merging.encoder import load_encoder
from bench.merging.merging import chooses_lambda, chosen_lambdas, recipe_key, run_mergekit
from bench.merging.scoring import ScoredTask, score_model
from mergekit_bmm.errors import ConfigError


def merge_and_score(
    recipe,
    jobs,
    config: RunConfig,
    cache: ScoreCache,
    cache_dir: Path,
    work: Path,
    folder: Path | None = None,
):
    """Scores of a mergekit recipe (merging only if some score is not cached).

    With ``folder`` the merge is kept there (made once, see ``anchors.materialise``).
    """
    key = recipe_key(recipe)
    record_path = cache_dir / "merges" / f"{key.split(':')[1]}.json"
    merge_seconds = read_json(record_path)["merge_seconds"] if record_path.is_file() else None
    out = work / key.split(":")[1]

    def load():
        nonlocal merge_seconds
        if folder is not None:
            path, merge_seconds = materialise(recipe, folder)
        else:
            started = time.time()
            path = run_mergekit(recipe, out)
            merge_seconds = round(time.time() - started, 1)
        found = {"recipe": recipe, "key": key, "merge_seconds": merge_seconds}
        if chooses_lambda(recipe):
            found["lambda_auto"] = chosen_lambdas(path)
        write_json(record_path, found)
        return load_encoder(path, config.work_threads)

    scores = score_model(
        key, load, jobs, config.max_length, config.eval_batch_size, cache, "merge", limits(config)
    )
    if out.exists() and not config.task_arithmetic.keep_models:
        shutil.rmtree(out)
    if folder is not None and merge_seconds is None:
        merge_seconds = materialise(recipe, folder)[1]
    outcome = {"scores": scores, "merge_seconds": merge_seconds, "key": key}
    if record_path.is_file() and "lambda_auto" in read_json(record_path):
        outcome["lambda_auto"] = read_json(record_path)["lambda_auto"]
    return outcome


def tasks_from_manifest(manifest: dict[str, Any]) -> dict[str, ScoredTask]:
    """The run's tasks with their heads, as recorded by :func:`write_manifest`."""
    from bench.merging.tasks import TaskData

    return {
        name: ScoredTask(
            data=TaskData(
                name=name,
                data=Path(manifest["data"][name]),
                labels=tuple(manifest["labels"][name]),
                counts=manifest["counts"][name],
                sha256=manifest["data_fingerprints"][name],
            ),
            head=Path(manifest["heads"][name]),
            head_sha=manifest["head_fingerprints"][name],
        )
        for name in manifest["heads"]
    }


def score_folder(
    manifest: dict[str, Any],
    model_dir: Path,
    splits: list[str],
    tasks: list[str] | None,
    cache_dir: Path,
    split_limits: dict[str, int | None] | None = None,
) -> dict[tuple[str, str], float]:
    """Scores of any encoder folder (a merge, an expert) with the run's fixed heads (cached).

    ``split_limits`` (the run's ``evaluation`` subsets) makes them comparable with the table.
    """
    from mergekit_bmm.io.fingerprint import model_fingerprint

    known = tasks_from_manifest(manifest)
    unknown = sorted(set(tasks or []) - set(known))
    if unknown:
        raise ConfigError(f"tasks {unknown} are not in run {manifest['name']}; known: {sorted(known)}")
    chosen = [known[name] for name in (tasks or list(known))]
    jobs = [(task, split) for task in chosen for split in splits]
    return score_model(
        model_fingerprint(model_dir),
        lambda: load_encoder(model_dir),
        jobs,
        manifest["max_length"],
        manifest["eval_batch_size"],
        ScoreCache(cache_dir),
        model_dir.name,
        split_limits,
    )


def evaluator_block(config: RunConfig, art: Artifacts, split: str = "validation") -> dict[str, Any]:
    """Contract A's ``evaluator:`` block for a search over this run's tasks."""
    return {
        "type": "classification",
        "max_length": config.max_length,
        "batch_size": config.eval_batch_size,
        "tasks": [
            {
                "name": task.name,
                "head": str(task.head),
                "data": str(task.data.data),
                "split": split,
                "limit": limits(config).get(split) or task.data.counts[split],
                "text_field": "text",
                "label_field": "label",
            }
            for task in art.tasks.values()
        ],
    }


def label_free_block(config: RunConfig, art: Artifacts, spec: LabelFreeSpec | None = None) -> dict[str, Any]:
    """An ``evaluator: {type: agreement}`` block: every expert against the merge on its task's
    unlabelled text (the statistics' split, through the task's zero-shot head); no labels read."""
    spec = spec or LabelFreeSpec()
    return {
        "type": "agreement",
        "objective": "entropy" if spec.objective == "entropy" else spec.divergence,
        "scale": spec.scale,
        **spec.evaluator_extras(),
        "max_samples": spec.max_samples or config.stats.max_samples,
        "max_length": config.max_length,
        "batch_size": config.eval_batch_size,
        "tasks": [
            {
                "name": task.name,
                "model": str(art.experts[task.name]),
                "data": str(task.data.data),
                "split": spec.split,
                "text_field": "text",
                "head": str(task.head),
            }
            for task in art.tasks.values()
        ],
    }


def search_evaluator(
    config: RunConfig, art: Artifacts, label_free: LabelFreeSpec | None, oracle: bool = False
) -> dict[str, Any]:
    """What a search scores: validation accuracy, or (``label_free``, or ``search.objective`` other than
    ``labelled``) the label-free objective; an ``oracle`` search scores test accuracy (a ceiling)."""
    if oracle:
        return evaluator_block(config, art, "test")
    if label_free is None and config.search.objective != "labelled":
        label_free = LabelFreeSpec(objective=config.search.objective)
    return (
        evaluator_block(config, art, "validation")
        if label_free is None
        else label_free_block(config, art, label_free)
    )


def write_manifest(config: RunConfig, cache_dir: Path, art: Artifacts) -> Path:
    """``<cache>/runs/<name>/manifest.json`` and ``evaluator.yml``: the inputs of phase 2."""
    folder = cache_dir / "runs" / config.name
    folder.mkdir(parents=True, exist_ok=True)
    manifest = {
        "name": config.name,
        "config_key": stable_key(config.model_dump(mode="json")),
        "base": str(art.encoder),
        "base_fingerprint": art.encoder_fingerprint,
        "experts": {name: str(path) for name, path in art.experts.items()},
        "heads": {name: str(task.head) for name, task in art.tasks.items() if task.head_sha},
        "head_fingerprints": {name: task.head_sha for name, task in art.tasks.items() if task.head_sha},
        "data": {name: str(task.data.data) for name, task in art.tasks.items()},
        "data_fingerprints": {name: task.data.sha256 for name, task in art.tasks.items()},
        "labels": {name: list(task.data.labels) for name, task in art.tasks.items()},
        "counts": {name: task.data.counts for name, task in art.tasks.items()},
        "max_length": config.max_length,
        "eval_batch_size": config.eval_batch_size,
    }
    write_json(folder / "manifest.json", manifest)
    if all(task.head_sha for task in art.tasks.values()):
        for split in ("validation", "test"):
            block = {"evaluator": evaluator_block(config, art, split)}
            (folder / f"evaluator-{split}.yml").write_text(
                yaml.safe_dump(block, sort_keys=False), encoding="utf-8"
            )
    return folder / "manifest.json"
