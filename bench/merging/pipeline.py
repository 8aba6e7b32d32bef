"""The benchmark's stages, in order, each cached and resumable.

``run_benchmark`` builds what is missing and reuses what is cached: task data, the
pretrained encoder, heads, experts, scores of the pretrained encoder and the experts
("Indiv."), Task Arithmetic merges (weight chosen on validation, reported on test) and
the language track. It writes ``results.json``, ``results.md`` and a per-task PNG under
the results folder, and ``<cache>/runs/<name>/manifest.json`` (every path a later stage
or a search needs: base, experts, heads, task data, an evaluator block).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from tqdm.auto import tqdm

from bench.merging import report
from bench.merging.cache import ScoreCache, read_json, stable_key, write_json
from bench.merging.config import RunConfig
from bench.merging.encoder import load_encoder, prepare_encoder
from bench.merging.finetune import build_expert
from bench.merging.heads import build_head
from bench.merging.merging import recipe_key, run_mergekit, task_arithmetic_recipe
from bench.merging.scoring import ScoredTask, mean, score_model
from bench.merging.tasks import build_task_data
from mergekit_bmm.errors import ConfigError

STAGES = ("data", "heads", "experts", "scores", "task_arithmetic", "language")


def say(message: str) -> None:
    tqdm.write(message)


@dataclass
class Artifacts:
    """What the stages produced, by task name."""

    encoder: Path | None = None
    encoder_fingerprint: str = ""
    tasks: dict[str, ScoredTask] = field(default_factory=dict)
    experts: dict[str, Path] = field(default_factory=dict)
    records: dict[str, dict[str, Any]] = field(default_factory=dict)


class EncoderHandle:
    """Loads the pretrained encoder at most once, and only when a stage needs it."""

    def __init__(self, folder: Path, threads: int) -> None:
        self.folder, self.threads = folder, threads
        self._loaded = None

    def __call__(self):
        if self._loaded is None:
            self._loaded = load_encoder(self.folder, self.threads)
        return self._loaded


def lower_priority(niceness: int) -> None:
    """Share the machine politely: raise this process's niceness to ``niceness``."""
    try:
        current = os.nice(0)
        if current < niceness:
            os.nice(niceness - current)
    except OSError:
        pass


def run_benchmark(
    config: RunConfig, cache_dir: Path, results_dir: Path, until: str = "language"
) -> dict[str, Any]:
    """Run every stage up to ``until``; return the results dictionary (also written)."""
    import torch

    lower_priority(config.niceness)
    torch.set_num_threads(config.finetune.threads)
    cache_dir, results_dir = Path(cache_dir).resolve(), Path(results_dir).resolve()
    stop = STAGES.index(until)
    art = Artifacts()
    started = time.time()
    for spec in tqdm(config.tasks, desc="task data", leave=False):
        data, cached = build_task_data(spec, cache_dir, config.seed)
        art.tasks[spec.name] = ScoredTask(data=data, head=Path(), head_sha="")
        say(
            f"data      {spec.name:18s} {_counts(data.counts)}  {len(data.labels)} classes  "
            f"{'cached' if cached else 'built'}"
        )
    data_seconds = round(time.time() - started, 1)
    art.encoder, record, cached = prepare_encoder(config.encoder, cache_dir)
    art.encoder_fingerprint = record["fingerprint"]
    art.records["encoder"] = record
    say(f"encoder   {config.encoder.name} -> {art.encoder} ({'cached' if cached else 'copied'})")
    encoder = EncoderHandle(art.encoder, config.finetune.threads)
    if stop >= STAGES.index("heads"):
        _heads(config, cache_dir, art, encoder)
    if stop >= STAGES.index("experts"):
        _experts(config, cache_dir, art)
    results = report.base_results(config, art)
    results["timings"]["data_seconds_this_run"] = data_seconds
    if stop >= STAGES.index("scores"):
        _scores(config, cache_dir, art, encoder, results)
    if stop >= STAGES.index("task_arithmetic"):
        _task_arithmetic(config, cache_dir, art, results)
    write_manifest(config, cache_dir, art)
    if stop >= STAGES.index("language") and config.language.enabled:
        from bench.merging.language.track import run_language_track

        results["language"] = run_language_track(config, cache_dir)
    results["timings"]["this_run_seconds"] = round(time.time() - started, 1)
    report.write(results, results_dir / config.name)
    say(report.markdown(results))
    return results


def _counts(counts: dict[str, int]) -> str:
    return "/".join(f"{split} {counts[split]}" for split in counts)


def _heads(config: RunConfig, cache_dir: Path, art: Artifacts, encoder: EncoderHandle) -> None:
    for name in tqdm(list(art.tasks), desc="heads", leave=False):
        task = art.tasks[name]
        head, record, cached = build_head(
            task.data,
            art.encoder,
            art.encoder_fingerprint,
            config.head,
            config.max_length,
            config.eval_batch_size,
            cache_dir,
            encoder,
        )
        art.tasks[name] = ScoredTask(data=task.data, head=head, head_sha=record["fingerprint"])
        art.records[f"head/{name}"] = record
        info = record["info"]
        say(
            f"head      {name:18s} C={info['C']:<6g} validation {info['validation_accuracy']:.4f}  "
            f"{record['seconds']:.0f} s {'(cached)' if cached else ''}"
        )


def _experts(config: RunConfig, cache_dir: Path, art: Artifacts) -> None:
    for name in tqdm(list(art.tasks), desc="experts", leave=False):
        task = art.tasks[name]
        path, record, cached = build_expert(
            task.data,
            task.head,
            task.head_sha,
            art.encoder,
            art.encoder_fingerprint,
            config.finetune,
            config.max_length,
            cache_dir,
        )
        art.experts[name] = path
        art.records[f"expert/{name}"] = record
        info = record["info"]
        say(
            f"expert    {name:18s} {info['steps']} steps, {info['epochs']} epochs, "
            f"loss {info['loss_curve'][0]:.3f} -> {info['loss_curve'][-1]:.3f}, "
            f"{info['train_seconds']:.0f} s {'(cached)' if cached else ''}"
        )


def _scores(config: RunConfig, cache_dir: Path, art: Artifacts, encoder: EncoderHandle, results) -> None:
    cache = ScoreCache(cache_dir)
    tasks = list(art.tasks.values())
    jobs = [(task, split) for task in tasks for split in ("validation", "test")]
    started = time.time()
    pretrained = score_model(
        art.encoder_fingerprint, encoder, jobs, config.max_length, config.eval_batch_size, cache, "pretrained"
    )
    report.add_row(results, "pretrained", "anchor", pretrained, {})
    for task in tqdm(tasks, desc="score experts", leave=False):
        path = art.experts[task.name]
        own = score_model(
            art.records[f"expert/{task.name}"]["fingerprint"],
            lambda path=path: load_encoder(path, config.finetune.threads),
            [(task, "validation"), (task, "test")],
            config.max_length,
            config.eval_batch_size,
            cache,
            task.name,
        )
        results["indiv"][task.name] = own[(task.name, "test")]
        results["indiv_validation"][task.name] = own[(task.name, "validation")]
    results["timings"]["scores_seconds_this_run"] = round(time.time() - started, 1)


def _task_arithmetic(config: RunConfig, cache_dir: Path, art: Artifacts, results) -> None:
    """TA over all experts at each weight on validation; the best weight also on test."""
    cache = ScoreCache(cache_dir)
    tasks = list(art.tasks.values())
    experts = [art.experts[task.name] for task in tasks]
    work = cache_dir / "merges" / "work"
    records = {}
    for weight in tqdm(config.task_arithmetic.weights, desc="task arithmetic", leave=False):
        recipe = task_arithmetic_recipe(art.encoder, experts, weight)
        records[weight] = _merge_and_score(
            recipe, [(t, "validation") for t in tasks], config, cache, cache_dir, work
        )
        say(
            f"task_arithmetic weight {weight:<4g} validation avg "
            f"{mean([records[weight]['scores'][(t.name, 'validation')] for t in tasks]):.4f} "
            f"merge {records[weight]['merge_seconds']:.0f} s"
        )
    best = max(
        config.task_arithmetic.weights,
        key=lambda w: (mean([records[w]["scores"][(t.name, "validation")] for t in tasks]), -w),
    )
    recipe = task_arithmetic_recipe(art.encoder, experts, best)
    final = _merge_and_score(
        recipe, [(t, s) for t in tasks for s in ("validation", "test")], config, cache, cache_dir, work
    )
    sweep = {
        str(w): round(mean([records[w]["scores"][(t.name, "validation")] for t in tasks]), 4)
        for w in config.task_arithmetic.weights
    }
    report.add_row(
        results,
        "task_arithmetic",
        "anchor",
        final["scores"],
        {"weight": best, "validation_sweep": sweep},
        budget=len(config.task_arithmetic.weights),
    )
    results["timings"]["task_arithmetic_merge_seconds"] = final["merge_seconds"]
    if work.exists() and not config.task_arithmetic.keep_models:
        shutil.rmtree(work)


def _merge_and_score(recipe, jobs, config: RunConfig, cache: ScoreCache, cache_dir: Path, work: Path):
    """Scores of a mergekit recipe (merging only if some score is not cached)."""
    key = recipe_key(recipe)
    record_path = cache_dir / "merges" / f"{key.split(':')[1]}.json"
    merge_seconds = read_json(record_path)["merge_seconds"] if record_path.is_file() else None
    out = work / key.split(":")[1]

    def load():
        nonlocal merge_seconds
        started = time.time()
        run_mergekit(recipe, out)
        merge_seconds = round(time.time() - started, 1)
        write_json(record_path, {"recipe": recipe, "key": key, "merge_seconds": merge_seconds})
        return load_encoder(out, config.finetune.threads)

    scores = score_model(key, load, jobs, config.max_length, config.eval_batch_size, cache, "merge")
    if out.exists() and not config.task_arithmetic.keep_models:
        shutil.rmtree(out)
    return {"scores": scores, "merge_seconds": merge_seconds, "key": key}


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
    manifest: dict[str, Any], model_dir: Path, splits: list[str], tasks: list[str] | None, cache_dir: Path
) -> dict[tuple[str, str], float]:
    """Scores of any encoder folder (a merge, an expert) with the run's fixed heads (cached)."""
    from mergekit_bmm.fingerprint import model_fingerprint

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
                "limit": task.data.counts[split],
                "text_field": "text",
                "label_field": "label",
            }
            for task in art.tasks.values()
        ],
    }


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
