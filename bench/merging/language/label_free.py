"""The language track's searches that read no labels, and the names its paired intervals give BMM's models.

A label-free search scores each trial by agreement with the experts (or AdaMerging's entropy) on
every task's unlabelled training prompts (``evaluator: {type: agreement}``); its best model is then
scored with lm-eval on validation and test like every other model of the track.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from bench.merging.cache import ScoreCache, stable_key
from bench.merging.config import RunConfig
from bench.merging.language.lm_eval_runner import score_lm, summarize
from bench.merging.merging import recipe_key
from bench.merging.searches import keyed_search, run_search, search_config


def bmm_models(anchor: str, bmm: dict[str, Any], setting: str = "data_free") -> dict[str, str]:
    """The models of BMM over one anchor, by the names the paired intervals use: searched on
    validation, at its defaults, at ``lambda: auto``, and each search that read no labels (a
    data-assisted or mix setting named after ``bmm``: ``bmm mix defaults over ties``)."""
    mode = "" if setting == "data_free" else f" {setting}"
    models = {
        f"bmm{mode} over {anchor}": bmm["model_id"],
        f"bmm{mode} defaults over {anchor}": bmm["defaults"]["model_id"],
    }
    if bmm.get("auto"):  # λ from the evidence (search.evidence_lambda)
        models[f"bmm{mode} auto over {anchor}"] = bmm["auto"]["model_id"]
    if bmm.get("candidate"):  # a proposed no-search default (e.g. low_rank_rows: adapters)
        models[f"bmm{mode} candidate over {anchor}"] = bmm["candidate"]["model_id"]
    for objective, entry in (bmm.get("label_free") or {}).items():
        models[f"bmm {objective} over {anchor}"] = entry["model_id"]
    return models


def label_free_pairs(anchor: str, entry: dict[str, Any]) -> list[tuple[str, str]]:
    """What each search over ``anchor`` that read no labels is paired against on test, by the
    intervals' names: the anchor (its gain), the labelled search and the defaults over the same anchor,
    and agreement against entropy and the answer's position against every position."""
    free = (entry.get("bmm") or {}).get("label_free") or {}
    pairs = []
    for objective in free:
        name = f"bmm {objective} over {anchor}"
        pairs += [(name, anchor), (name, f"bmm over {anchor}"), (name, f"bmm defaults over {anchor}")]
    for first, second in (("agreement", "entropy"), ("agreement-last", "agreement")):
        if first in free and second in free:
            pairs.append((f"bmm {first} over {anchor}", f"bmm {second} over {anchor}"))
    return pairs


def every_bmm_model(anchor: str, entry: dict[str, Any]) -> dict[str, str]:
    """The paired intervals' names of every BMM model over ``anchor`` (each setting's)."""
    models = bmm_models(anchor, entry["bmm"]) if "bmm" in entry else {}
    for setting, found in (entry.get("bmm_settings") or {}).items():
        models.update(bmm_models(anchor, found, setting))
    return models


def label_free_evaluator(spec: Any, tasks, experts, max_length: int, batch: int) -> dict[str, Any]:
    """An ``evaluator: {type: agreement}`` block: each expert against the merge on its task's
    unlabelled training prompts (the text its statistics would read); no answer, no label."""
    return {
        "type": "agreement",
        "objective": "entropy" if spec.objective == "entropy" else spec.divergence,
        "scale": spec.scale,
        **spec.evaluator_extras(),
        "max_samples": spec.max_samples or 128,
        "max_length": max_length,
        "batch_size": batch,
        "tasks": [
            {
                "name": task.name,
                "model": str(expert),
                "data": str(task.file(spec.split)),
                "text_field": "query",
                "split": spec.split,
            }
            for task, expert in zip(tasks, experts)
        ],
    }


def label_free_searches(
    config: RunConfig,
    cache_dir: Path,
    anchor: str,
    template: dict[str, Any],
    tasks,
    experts,
    include,
    jobs,
    search_spec=None,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Per label-free objective configured for ``anchor``: the search (same K and seed as the labelled
    one, ``search_spec`` or the language track's) and its best model's lm-eval scores; ``progress`` is
    handed those found so far after each search (a run of several sessions keeps each one)."""
    spec = config.language
    search_spec = search_spec or spec.search
    cache, limit, batch = ScoreCache(cache_dir), spec.eval_limit, spec.eval_batch_size
    out = {}
    for free in search_spec.label_free:
        if anchor not in free.anchors or "data_free" not in free.settings:
            continue
        evaluator = label_free_evaluator(free, tasks, experts, spec.max_length, batch)
        search = search_config(search_spec, template, evaluator, "bo", search_spec.seeds[0])
        key = stable_key(keyed_search(search))
        folder = cache_dir / "searches" / config.name / f"language-{free.name}-{anchor}-data_free-{key}"
        tqdm.write(f"LM bmm    search over {anchor} with no labels ({free.name}) -> {folder}")
        found = run_search(search, folder, search_spec.threads, search_spec.workers)
        recipe = found["best_recipe"]
        scores, _ = score_lm(recipe_key(recipe), found["best_dir"], jobs, include, cache, batch, limit)
        out[free.name] = {
            "model_id": recipe_key(recipe),
            "best_values": found["best_values"],
            "search_score": found["best_validation"],
            "scores": summarize(scores),
            "search": str(folder),
        }
        if progress is not None:
            progress(dict(out))
    return out
