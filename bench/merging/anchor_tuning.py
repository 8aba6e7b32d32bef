"""Anchor merges: each method's own scale tuned on validation, the best one kept on disk.

Every merge is a mergekit recipe run by mergekit itself (the project's registered
methods: ``ties``, ``regmean``, ``tsv``, ``wudi``, ``iso_cts``, ...). A grid point is
scored on the validation subset; the best point (ties broken towards the first value) is
merged once more into ``<cache>/anchors/<run>/<anchor>-<key>/`` and kept there, so the
BMM searches can start from exactly that model (an input marked ``anchor: true``).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from bench.merging.cache import read_json, write_json
from bench.merging.config import AnchorSpec
from bench.merging.merging import recipe_key, run_mergekit

MODEL_PREFIX = "model."


def anchor_recipe(
    spec: AnchorSpec, base: Path, experts: list[Path], value: float | None, stats: Path | None
) -> dict[str, Any]:
    """The mergekit recipe of ``spec`` at one grid value."""
    parameters = dict(spec.parameters)
    model_parameters = dict(spec.model_parameters)
    for name in spec.grid:
        if name.startswith(MODEL_PREFIX):
            model_parameters[name[len(MODEL_PREFIX) :]] = value
        else:
            parameters[name] = value
    if spec.method == "regmean":
        if stats is None:
            raise ValueError("regmean needs activation statistics (the stats stage)")
        parameters["stats"] = str(stats)
    recipe: dict[str, Any] = {
        "merge_method": spec.method,
        "base_model": str(base),
        "models": [
            {"model": str(path), **({"parameters": dict(model_parameters)} if model_parameters else {})}
            for path in experts
        ],
        "dtype": "float32",
    }
    if parameters:
        recipe["parameters"] = parameters
    return recipe


def grid_values(spec: AnchorSpec) -> list[float | None]:
    return list(next(iter(spec.grid.values()))) if spec.grid else [None]


def grid_edge(grid: list, best) -> str | None:
    """``"largest"``/``"smallest"`` when the best value ends an ordered grid of several points: the
    anchor may do better beyond it, so a comparison with it is not with the anchor at its best."""
    numbers = [value for value in grid if isinstance(value, int | float)]
    if len(numbers) < 2 or best not in numbers:
        return None
    return "largest" if best == max(numbers) else "smallest" if best == min(numbers) else None


def materialise(recipe: dict[str, Any], folder: Path) -> tuple[Path, float]:
    """Merge ``recipe`` into ``folder`` unless a finished copy is there; (folder, seconds)."""
    key = recipe_key(recipe)
    done = folder / "bench-anchor.json"
    if done.is_file() and read_json(done).get("key") == key:
        return folder, read_json(done)["merge_seconds"]
    partial = folder.with_name(folder.name + ".partial")
    started = time.time()
    run_mergekit(recipe, partial)
    seconds = round(time.time() - started, 1)
    write_json(partial / "bench-anchor.json", {"key": key, "recipe": recipe, "merge_seconds": seconds})
    if folder.exists():
        shutil.rmtree(folder)
    partial.rename(folder)
    return folder, seconds


def _folder(cache_dir: Path, run_name: str, spec: AnchorSpec, recipe: dict[str, Any]) -> Path:
    folder = cache_dir / "anchors" / run_name / f"{spec.name}-{recipe_key(recipe).split(':')[1][:12]}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    return folder


def tune_anchor(
    spec: AnchorSpec,
    base: Path,
    experts: list[Path],
    stats: Path | None,
    merge_and_score,
    validation_jobs,
    cache_dir: Path,
    run_name: str,
) -> dict[str, Any]:
    """Grid on validation, then the best merge materialised; returns what the row needs."""
    sweep: dict[str, float] = {}
    merge_seconds: dict[str, float | None] = {}
    best_value, best_score = None, None
    grid = grid_values(spec)
    for value in grid:
        recipe = anchor_recipe(spec, base, experts, value, stats)
        # a single point is merged straight into its kept folder (WUDI's Adam is costly)
        folder = _folder(cache_dir, run_name, spec, recipe) if len(grid) == 1 else None
        record = merge_and_score(recipe, validation_jobs, folder)
        scores = [record["scores"][(task.name, split)] for task, split in validation_jobs]
        score = sum(scores) / len(scores)
        sweep[str(value)] = round(score, 4)
        merge_seconds[str(value)] = record["merge_seconds"]
        if best_score is None or score > best_score:
            best_value, best_score = value, score
    recipe = anchor_recipe(spec, base, experts, best_value, stats)
    key = recipe_key(recipe)
    folder, seconds = materialise(recipe, _folder(cache_dir, run_name, spec, recipe))
    return {
        "grid_edge": grid_edge(grid, best_value),
        "recipe": recipe,
        "key": key,
        "folder": folder,
        "value": best_value,
        "parameter": next(iter(spec.grid), "").removeprefix(MODEL_PREFIX) or None,
        "sweep": sweep,
        "merge_seconds": seconds,
        "grid_merge_seconds": merge_seconds,
        "validation": best_score,
    }
