"""Activation statistics and BMM searches, through the project's own commands.

``mergekit-bmm-stats`` collects each task's Grams (its expert on its train split);
``mergekit-bmm-search`` tunes BMM's λ per block and module group and s per block on the
validation subsets, with the classification evaluator (the benchmark's own scorer), and
merges the best recipe into ``best/``, which the benchmark then scores on test. Each
search lives in its own folder, keyed by everything it depends on: re-running the
benchmark resumes an interrupted search (the command replays its ``trials.jsonl``) and
skips a finished one.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from bench.merging import device
from bench.merging.cache import read_json, stable_key, write_json
from bench.merging.config import SearchSpec, StatsSpec
from bench.merging.scoring import mean
from mergekit_bmm.errors import ConfigError

SETTING_GRAM = {"data_free": "data_free", "data_assisted": "activations", "mix": "mix"}


def keyed_search(search: dict[str, Any], budget: bool = False) -> dict[str, Any]:
    """A search config as a folder's key sees it: bmm's changed defaults written into its recipe (a
    search that relied on an old default is another search), without the budget unless asked (a
    larger budget extends the same search: it resumes)."""
    from mergekit_bmm.recipes.changed_defaults import keyed_recipe

    return {k: keyed_recipe(v) if k == "recipe" else v for k, v in search.items() if budget or k != "budget"}


def _run(command: str, args: list[str], log: Path) -> None:
    """Run one of the project's console commands in this process (no interpreter start-up).

    ``command`` is ``mergekit-bmm-stats`` or ``mergekit-bmm-search``: exactly the click
    command a user runs, called with the same arguments; its one-line error becomes ours.
    """
    import contextlib

    from mergekit_bmm.cli.search import main as search_main
    from mergekit_bmm.cli.stats import main as stats_main

    entry = {"mergekit-bmm-stats": stats_main, "mergekit-bmm-search": search_main}[command]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a", encoding="utf-8") as handle:
        handle.write(f"\n$ {command} {' '.join(args)}\n")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    with contextlib.redirect_stderr(sys.stdout):  # progress bars and errors go to the run's log
        try:
            entry.main(args=args, prog_name=command, standalone_mode=False)
        except SystemExit as stop:
            if stop.code not in (0, None):
                raise ConfigError(f"`{command} {' '.join(args[:1])} ...` failed (exit {stop.code})") from None


def collect_stats(
    spec: StatsSpec,
    experts: dict[str, Path],
    data: dict[str, Path],
    max_length: int,
    cache_dir: Path,
    run_name: str,
    fingerprints: dict[str, str],
) -> tuple[Path, float]:
    """``mergekit-bmm-stats`` over every task's train split; (directory, seconds of collection)."""
    key = stable_key({"spec": spec.model_dump(), "max_length": max_length, "experts": fingerprints})
    folder = cache_dir / "stats" / f"{run_name}-{key}"
    record = folder.with_name(folder.name + ".json")
    if record.is_file() and (folder / "manifest.json").is_file():
        return folder, read_json(record)["seconds"]
    stats_yml = {
        "max_samples": spec.max_samples,
        "max_length": max_length,
        "batch_size": spec.batch_size,
        "tasks": [
            {"name": name, "model": str(experts[name]), "data": str(data[name]), "split": "train"}
            for name in experts
        ],
    }
    folder.parent.mkdir(parents=True, exist_ok=True)
    config_path = folder.with_name(folder.name + ".yml")
    config_path.write_text(yaml.safe_dump(stats_yml, sort_keys=False), encoding="utf-8")
    started = time.time()
    args = [str(config_path), str(folder), "--device", device.current()]
    _run("mergekit-bmm-stats", args, folder.with_name(folder.name + ".log"))
    seconds = round(time.time() - started, 1)
    write_json(record, {"seconds": seconds, "stats_yml": stats_yml})
    return folder, seconds


def bmm_template(
    base: Path,
    experts: list[Path],
    anchor: Path | None,
    setting: str,
    stats: Path | None,
    gram_sharing: str | None = None,
) -> dict[str, Any]:
    """The bmm recipe a search tunes: the experts, the anchor (a kept folder, or pretrained);
    ``gram_sharing`` stated where the run sets it (None: bmm's default)."""
    models: list[dict[str, Any]] = [{"model": str(path)} for path in experts]
    parameters: dict[str, Any] = {"gram": SETTING_GRAM[setting]}
    if gram_sharing is not None:
        parameters["gram_sharing"] = gram_sharing
    if anchor is None:
        parameters["anchor_method"] = "pretrained"
    else:
        models.append({"model": str(anchor), "parameters": {"anchor": True}})
    if setting != "data_free":
        if stats is None:
            raise ConfigError("data-assisted BMM needs the statistics stage")
        parameters["stats"] = str(stats)
    return {
        "merge_method": "bmm",
        "base_model": str(base),
        "models": models,
        "parameters": parameters,
        "dtype": "float32",
    }


def search_config(
    spec: SearchSpec, template: dict[str, Any], evaluator: dict[str, Any], strategy: str, seed: int
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "recipe": template,
        "blocks": spec.blocks,
        "groups": list(spec.groups),
        "budget": spec.budget,
        "n_initial": min(spec.n_initial, spec.budget),
        "acq_optimizer": spec.acq_optimizer,
        "strategy": strategy,
        "seed": seed,
        "widen_box": spec.widen_box,
        "anchor_start": spec.anchor_start,
        "evaluator": evaluator,
    }
    if spec.lambda_range is not None:
        config["lambda_range"] = list(spec.lambda_range)
    if spec.scale_range is not None:
        config["scale_range"] = list(spec.scale_range)
    return config


def run_search(
    config: dict[str, Any], folder: Path, threads: int, workers: int = 1, cache: Path | None = None
) -> dict[str, Any]:
    """Run (or resume, or reuse) one ``mergekit-bmm-search``; its summary and time splits."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    config_path = folder.with_name(folder.name + ".search.yml")
    config_path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    summary_path = folder / "summary.json"
    finished = False
    if summary_path.is_file():
        summary = read_json(summary_path)
        finished = summary.get("status") == "finished" and (folder / "best.yml").is_file()
    if not finished:
        args = [str(config_path), str(folder), "--device", device.current(), "-j", str(threads)]
        args += ["--workers", str(workers)]
        if cache is not None:
            args += ["--cache-dir", str(cache)]
        _run("mergekit-bmm-search", args, folder.with_name(folder.name + ".log"))
    outcome = read_search(folder)
    outcome["template"] = config["recipe"]
    outcome["best_recipe"] = best_recipe(folder / "best.yml", config["recipe"])
    return outcome


def best_recipe(best_yml: Path, template: dict[str, Any]) -> dict[str, Any]:
    """The search's best recipe as its trials were merged (:func:`as_merged`)."""
    return as_merged(yaml.safe_load(best_yml.read_text(encoding="utf-8")), template)


def as_merged(recipe: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
    """A recipe the search wrote (its best, a trial's) as its trials were merged. One written before
    bmm's ``gram_sharing`` default changed leaves the rule out; the folder was found under a template
    that states it (its key spells the rule out), so the template's rule is written in: the model is
    merged again, and its scores keyed, as the merge the search scored."""
    stated = (template.get("parameters") or {}).get("gram_sharing")
    if stated is None or recipe.get("merge_method") != "bmm":
        return recipe
    recipe.setdefault("parameters", {}).setdefault("gram_sharing", stated)
    return recipe


def search_clock(records: list[dict]) -> list[tuple[float, dict]]:
    """Each record with when it ended on the search's own clock, in finishing order.

    ``time.elapsed`` restarts at zero when a search resumes, so every restart adds the time
    the search had run before it: the clock counts the search's running time over all its
    runs, not the pauses between them.
    """
    ordered = sorted(records, key=lambda r: (r.get("finished_at") or "", r["time"]["elapsed"]))
    clock, offset, previous = [], 0.0, 0.0
    for record in ordered:
        elapsed = record["time"]["elapsed"]
        if elapsed < previous:  # a resumed run: its clock started again
            offset += previous
        clock.append((offset + elapsed, record))
        previous = elapsed
    return clock


def search_seconds(records: list[dict]) -> float:
    """How long the search has run: when its last trial ended, on its clock over all its runs."""
    return max((seconds for seconds, _ in search_clock(records)), default=0.0)


def read_search(folder: Path) -> dict[str, Any]:
    summary = read_json(folder / "summary.json")
    lines = (folder / "trials.jsonl").read_text(encoding="utf-8").splitlines()
    trials = [item for item in (json.loads(line) for line in lines if line.strip()) if "event" not in item]
    times = {"merge": 0.0, "evaluate": 0.0, "surrogate": 0.0}
    for trial in trials:
        for key in times:
            times[key] += float((trial.get("time") or {}).get(key) or 0.0)
    # the search's own best: only trials scored on every validation example can be it
    return {
        "summary": summary,
        "trials": len(trials),
        "failed": sum(1 for t in trials if t.get("status") != "ok"),
        "times": {key: round(value, 1) for key, value in times.items()},
        "wall": round(search_seconds(trials), 1),
        "best_values": summary.get("best_values"),
        "best_validation": summary.get("best_score"),
        "best_per_task": summary.get("best_per_task"),
        "best_yml": folder / "best.yml",
        "best_dir": folder / "best",
        "curve": [t.get("score") for t in trials],
        "box_changes": summary.get("box_changes") or [],
        "box": summary.get("box") or {},
    }


def seed_record(outcome: dict[str, Any], tasks: list[str]) -> dict[str, Any]:
    """One search's best model as a results row keeps it: its id, test and validation averages, λ/s."""
    test = {t: outcome["scores"][(t, "test")] for t in tasks}
    return {
        "seed": outcome["seed"],
        "model_id": outcome["model_id"],
        "avg": round(mean(list(test.values())), 4),
        "validation_avg": round(mean([outcome["scores"][(t, "validation")] for t in tasks]), 4),
        "per_task": {t: round(value, 4) for t, value in test.items()},
        "best_values": outcome["best_values"],
        "search_validation": outcome["best_validation"],
        "box_changes": outcome["box_changes"],
        "search": str(outcome["folder"]),
    }
