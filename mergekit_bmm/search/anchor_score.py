"""``--eval-anchor``: the merge BMM starts from, as a model of its own, scored once the way every trial is.

The result is cached in ``anchor.json`` under a key of the anchor's recipe and the
experiment, so a resumed search keeps it without scoring again.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mergekit_bmm.errors import error_summary, find_bmm_error
from mergekit_bmm.evaluation import weighted_mean
from mergekit_bmm.io.atomic import atomic_write_json, atomic_write_text
from mergekit_bmm.merge_methods.bmm_parameters import DEFAULT_ANCHOR, PRETRAINED_ANCHOR, anchor_parameters
from mergekit_bmm.plugin import run as recipe_run
from mergekit_bmm.recipes.parse import yaml_text
from mergekit_bmm.search.config import canonical_hash
from mergekit_bmm.search.experiment import Experiment, RunFolder
from mergekit_bmm.search.summary import AnchorScore
from mergekit_bmm.search.trials import ErrorLog


def anchor_key(experiment: Experiment) -> str:
    target = anchor_model(experiment.template)
    return canonical_hash(
        {"anchor": target.description, "recipe": target.recipe, "evaluator": experiment.definition}
    )


def cached_anchor_score(experiment: Experiment, folder: RunFolder) -> AnchorScore | None:
    """The score in ``anchor.json`` if it belongs to this experiment."""
    try:
        cached = AnchorScore.model_validate(json.loads(folder.anchor_json.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None
    return cached if cached.key == anchor_key(experiment) else None


def score_anchor(
    experiment: Experiment,
    folder: RunFolder,
    evaluator: Any,
    merge_options: Any,
    echo: Callable[[str], None],
) -> AnchorScore | None:
    """The anchor's score: from ``anchor.json``, else merged (if it is a recipe) and evaluated."""
    cached = cached_anchor_score(experiment, folder)
    if cached is not None:
        return cached
    target = anchor_model(experiment.template)
    echo(f"scoring the anchor: {target.description} ...")
    started = time.perf_counter()
    model_dir = target.model_dir
    work = folder.work_dir / "anchor"
    try:
        if target.recipe is not None:
            text = yaml_text(target.recipe)
            atomic_write_text(folder.anchor_yml, text)
            options = recipe_run.merge_options(merge_options, random_seed=target.seed)
            recipe_run.merge_recipe_text(text, work, options)
            model_dir = work
        per_task = evaluator.evaluate(model_dir)
    except Exception as error:
        ours = find_bmm_error(error)
        if ours is not None:
            raise ours from None
        ErrorLog(folder.errors_log).write("anchor", error)
        echo(f"warning: the anchor could not be scored ({error_summary(error)}); continuing without it")
        return None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    score = AnchorScore(
        key=anchor_key(experiment),
        description=target.description,
        recipe=folder.anchor_yml.name if target.recipe is not None else None,
        model=str(target.model_dir) if target.model_dir is not None else None,
        score=weighted_mean(per_task, evaluator.weights),
        per_task=per_task,
        seconds=time.perf_counter() - started,
    )
    if math.isfinite(score.score):
        atomic_write_json(folder.anchor_json, score.model_dump(mode="json"))
    echo(f"anchor score: {score.score:.4f}")
    return score


# -- The anchor's own model, for ``--eval-anchor``: what BMM starts from, scored the same way.
@dataclass(frozen=True)
class AnchorModel:
    """Either an existing model folder or a recipe to merge."""

    description: str
    model_dir: Path | None = None
    recipe: dict[str, Any] | None = None
    seed: int | None = None


def anchors_at_pretrained(template: Mapping[str, Any]) -> bool:
    """Whether BMM's anchor is the base model itself (``U0 = 0``)."""
    if any((item.get("parameters") or {}).get("anchor") for item in template.get("models") or []):
        return False
    return ((template.get("parameters") or {}).get("anchor_method") or DEFAULT_ANCHOR) == PRETRAINED_ANCHOR


def anchor_model(template: Mapping[str, Any]) -> AnchorModel:
    """Where the anchor of a ``models:``-style bmm recipe comes from."""
    parameters = dict(template.get("parameters") or {})
    for item in template.get("models") or []:
        if (item.get("parameters") or {}).get("anchor"):
            return AnchorModel(f"input {item['model']}, anchor: true", model_dir=Path(str(item["model"])))
    method = parameters.get("anchor_method") or DEFAULT_ANCHOR
    if method == PRETRAINED_ANCHOR:
        return AnchorModel(
            f"pretrained, {template['base_model']}", model_dir=Path(str(template["base_model"]))
        )
    recipe: dict[str, Any] = {"merge_method": method}
    for key, value in template.items():
        if key in ("merge_method", "parameters", "models"):
            continue
        recipe[key] = value
    models = []
    for item in template["models"]:
        entry = {"model": item["model"]}
        forwarded = anchor_parameters(item.get("parameters") or {})
        if forwarded:
            entry["parameters"] = forwarded
        models.append(entry)
    recipe["models"] = models
    shared = anchor_parameters(parameters)
    if shared:
        recipe["parameters"] = shared
    # Order like a hand-written recipe: method, base, models, parameters, the rest.
    ordered = {
        key: recipe[key] for key in ("merge_method", "base_model", "models", "parameters") if key in recipe
    }
    ordered.update({key: value for key, value in recipe.items() if key not in ordered})
    seed = int(parameters.get("anchor_seed", 0) or 0)
    return AnchorModel(f"{method} merge, anchor.yml", recipe=ordered, seed=seed)
