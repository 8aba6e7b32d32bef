"""Does a better agreement mean a better model? A label-free search's trials, re-merged and scored.

Every trial, or with ``trace_trials`` that many evenly spaced over the search (its best included):
each trial's recipe (``trials/trial-NNNN.yml``) is merged again, scored on test by the benchmark's own
scorer, and read by the label-free evaluator under every objective (KL, reverse KL, top-1, entropy;
raw divergences from one forward pass, from which the base-scaled scores follow). Across the trials,
the rank correlation of each objective with test accuracy says which objective transfers best and
whether tasks are better put on one scale by the base's gap (``scale: base``) or left raw. Cached per
trial model.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import yaml

from bench.merging.artifacts import Artifacts
from bench.merging.cache import ScoreCache, read_json, write_json
from bench.merging.config import LabelFreeSpec, RunConfig, limits
from bench.merging.encoder import load_encoder
from bench.merging.merging import recipe_key, run_mergekit
from bench.merging.scoring import mean, score_model
from bench.merging.searches import as_merged

OBJECTIVES = ("kl", "reverse_kl", "top1", "entropy")


def _evaluator(config: RunConfig, art: Artifacts, spec: LabelFreeSpec, references: Path) -> Any:
    """The search's label-free evaluator on raw divergences (``scale: none``), sharing its references:
    one forward pass of a trial's model gives every objective (``divergences``)."""
    from bench.merging.model_scores import label_free_block
    from mergekit_bmm.evaluation import make_evaluator
    from mergekit_bmm.evaluation.config import AgreementEvaluatorConfig

    block = label_free_block(config, art, spec.model_copy(update={"scale": "none"}))
    block.update(objective="kl", references=str(references), base_model=str(art.encoder))
    evaluator = make_evaluator(AgreementEvaluatorConfig.model_validate(block), "cpu")
    evaluator.prepare()
    return evaluator


def _trial_records(folder: Path) -> list[dict[str, Any]]:
    lines = (folder / "trials.jsonl").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return [r for r in records if "event" not in r and r.get("status") == "ok"]


def traced_trials(
    folder: Path, cache_dir: Path, limit: int | None, template: dict[str, Any]
) -> list[tuple[dict, dict, str, Path]]:
    """(record, recipe, key, stored score) of the trials to trace: all, or ``limit`` evenly spaced over
    the search with its best, plus any traced before (free: their scores are stored); each recipe as
    the search merged it (``template``: the one the search was found under)."""
    found = []
    for record in _trial_records(folder):
        recipe = yaml.safe_load((folder / record["yaml"]).read_text(encoding="utf-8"))
        recipe = as_merged(recipe, template)
        recipe["parameters"].pop("cache", None)  # where the factors were kept does not change the model
        key = recipe_key(recipe)
        found.append((record, recipe, key, cache_dir / "label_free_trace" / f"{key.split(':')[1]}.json"))
    if limit is None or len(found) <= limit:
        return found
    picked = {round(i * (len(found) - 1) / (limit - 1)) for i in range(limit)}
    picked.add(max(range(len(found)), key=lambda i: found[i][0]["score"]))
    picked |= {i for i, entry in enumerate(found) if entry[3].is_file()}
    return [found[i] for i in sorted(picked)]


def trace_search(
    config: RunConfig,
    cache_dir: Path,
    art: Artifacts,
    spec: LabelFreeSpec,
    folder: Path,
    template: dict[str, Any],
) -> dict[str, Any]:
    """Per trial of the search in ``folder`` (found under ``template``): its search score, test average
    and every objective's raw divergence per task; then each objective's rank correlation with the test
    average."""
    tasks = list(art.tasks.values())
    evaluator = _evaluator(config, art, spec, folder / "references")
    # each task's base divergence per objective (the base-scaled score's denominator)
    gaps = {objective: evaluator.base_divergence(objective) for objective in OBJECTIVES}
    cache, work = ScoreCache(cache_dir), cache_dir / "merges" / "trace-work"
    trials = []
    for record, recipe, key, stored in traced_trials(folder, cache_dir, spec.trace_trials, template):
        if not stored.is_file():
            out = run_mergekit(recipe, work / key.split(":")[1])
            model, tokenizer = load_encoder(out, config.work_threads)
            divergences = evaluator.divergences(model, tokenizer, OBJECTIVES)
            jobs = [(t, "test") for t in tasks]
            scores = score_model(
                key,
                lambda loaded=(model, tokenizer): loaded,
                jobs,
                config.max_length,
                config.eval_batch_size,
                cache,
                "trace",
                limits(config),
            )
            write_json(
                stored,
                {"divergences": divergences, "test": {t.name: scores[(t.name, "test")] for t in tasks}},
            )
            shutil.rmtree(work, ignore_errors=True)
        trials.append(trial_row(record, read_json(stored), "divergences"))
    return {"trials": trials, "base_divergence": gaps, "correlations": correlations(trials, gaps)}


def trial_row(record: dict[str, Any], found: dict[str, Any], reading: str) -> dict[str, Any]:
    """A traced trial as the report reads it: its number, search score, test average and what was
    stored of it under ``reading`` (its divergences)."""
    return {
        "trial": record["trial"],
        "search_score": record["score"],
        "test_avg": round(mean(list(found["test"].values())), 4),
        reading: found[reading],
    }


def objective_scores(trial: dict[str, Any], gaps: dict[str, dict[str, float]]) -> dict[str, float]:
    """A trial's score under every objective and scale: ``{objective}/base`` (mean over tasks of
    ``1 − D/D_base``) and ``{objective}/none`` (mean of ``−D``)."""
    out = {}
    for objective, per_task in trial["divergences"].items():
        gap = gaps[objective]  # a base that already matches an expert leaves the scale undefined (NaN)
        out[f"{objective}/base"] = mean(
            [1.0 - value / gap[task] if gap[task] > 1e-12 else math.nan for task, value in per_task.items()]
        )
        out[f"{objective}/none"] = mean([-value for value in per_task.values()])
    return out


def correlations(trials: list[dict[str, Any]], gaps: dict[str, dict[str, float]]) -> dict[str, float | None]:
    """Spearman's rank correlation of each objective/scale with the test average over the trials."""
    from scipy.stats import spearmanr

    if len(trials) < 3:
        return {}
    scored = [objective_scores(trial, gaps) for trial in trials]
    tests = [trial["test_avg"] for trial in trials]
    out: dict[str, float | None] = {}
    for name in scored[0]:
        values = [row[name] for row in scored]
        if any(math.isnan(value) for value in values) or len(set(values)) < 2 or len(set(tests)) < 2:
            out[name] = None  # undefined: a scale the base left at 0, or a constant objective or test
            continue
        rho = spearmanr(values, tests).statistic
        out[name] = None if math.isnan(rho) else round(float(rho), 3)
    return out
