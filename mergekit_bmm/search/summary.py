"""``summary.json``: the state of a search in one typed document (the model card reads it).

The search builds a :class:`SearchSummary` in memory after every trial, writes it (one
atomic write), prints it at the end and hands the same object to the model card of
``best/``. Readers of the file (a later card, scripts) read it with :func:`read_summary`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, computed_field

from mergekit_bmm.errors import ConfigError
from mergekit_bmm.io.versioned_json import read_versioned, write_versioned
from mergekit_bmm.search.fidelity import fidelity_summary
from mergekit_bmm.search.log import TrialRecord

FORMAT_NAME = "mergekit-bmm-search-summary"
FORMAT_VERSION = 1
TIME_KEYS = ("merge", "evaluate", "surrogate")


class AnchorScore(BaseModel):
    """The anchor merge's validation score (``--eval-anchor``), cached in ``anchor.json``."""

    key: str
    description: str
    recipe: str | None = None
    model: str | None = None
    score: float
    per_task: dict[str, float | None]
    seconds: float = 0.0


class SearchSummary(BaseModel):
    """What a search did and found; field by field in docs/search.md."""

    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    status: str
    recipe: str | None = None
    strategy: str
    budget: int
    n_initial: int
    seed: int
    blocks: list[list[int]]
    groups: list[str]
    dimensions: list[str]
    completed_trials: int = 0
    failed_trials: int = 0
    best_trial: int | None = None
    best_score: float | None = None
    best_per_task: dict[str, float | None] = Field(default_factory=dict)
    best_values: dict[str, float] | None = None
    anchor: str | None = None
    anchor_score: float | None = None
    anchor_per_task: dict[str, float | None] | None = None
    evaluator: dict[str, Any] = Field(default_factory=dict)
    lambda_range: list[float]
    scale_range: list[float] | None = None
    epsilon_range: list[float] | None = None
    box: dict[str, list[float]] = Field(default_factory=dict)  # each dimension's final range
    box_changes: list[dict[str, Any]] = Field(default_factory=list)  # edges widened during the search
    acquisition: str | None = None
    mean_seconds: dict[str, float] = Field(default_factory=dict)
    trials: str | None = None  # where trials ran: memory or disk
    workers: int = 1  # trials run at once (parallel.workers)
    startup_seconds: float = 0.0  # loading the resident model and its factors
    memory_plan: dict[str, Any] | None = None  # bytes kept resident (trials: memory)
    fidelity: dict[str, Any] | None = None  # cheap-then-full evaluation (search/fidelity.py)
    not_searched: dict[str, Any] = Field(default_factory=dict)  # groups at the recipe's λ; weights kept
    convergence_plot: str | None = None
    lambda_plot: str | None = None
    best_recipe: str | None = None
    best_model: str | None = None
    trials_log: str = "trials.jsonl"
    experiment_hash: str = ""

    @computed_field
    @property
    def beats_anchor(self) -> bool | None:
        """Whether the best trial scores above the anchor merge (None: the anchor was not scored)."""
        if self.anchor_score is None or self.best_score is None:
            return None
        return self.best_score > self.anchor_score

    def anchor_verdict(self) -> str | None:
        """One plain sentence when the search did not beat its anchor (None otherwise)."""
        if self.beats_anchor is not False:
            return None
        return (
            f"No trial beat the anchor merge: best {self.best_score:.4g} against the anchor's "
            f"{self.anchor_score:.4g} on this validation score. The anchor ({self.anchor}) is the better "
            "model here; best/ is the best BMM merge found, not an improvement on it."
        )


def best_record(records: Sequence[TrialRecord]) -> TrialRecord | None:
    """The first fully scored trial with the highest score (ties keep the earlier one)."""
    best = None
    for record in records:
        if not (record.ok and record.full and record.score is not None):
            continue
        if best is None or record.score > best.score:
            best = record
    return best


def finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def finite_values(values: Mapping[str, float | None]) -> dict[str, float | None]:
    return {key: finite(value) for key, value in values.items()}


def mean_times(records: Sequence[TrialRecord]) -> dict[str, float]:
    if not records:
        return {key: 0.0 for key in TIME_KEYS}
    return {key: sum(r.time.get(key, 0.0) for r in records) / len(records) for key in TIME_KEYS}


def build_summary(
    *,
    config,
    recipe_path: Path,
    space,
    records: Sequence[TrialRecord],
    anchor: AnchorScore | None,
    status: str,
    experiment_hash: str,
    outputs: Mapping[str, str | None],
    **run: Any,
) -> SearchSummary:
    """The summary of ``records`` so far; ``outputs`` names the files that exist (plots, best)."""
    best = best_record(records)
    return SearchSummary(
        status=status,
        recipe=str(recipe_path),
        strategy=config.strategy,
        budget=config.budget,
        n_initial=config.n_initial,
        seed=config.seed,
        blocks=[list(block) for block in space.blocks],
        groups=list(space.groups),
        dimensions=space.names,
        completed_trials=len(records),
        failed_trials=sum(not r.ok for r in records),
        best_trial=best.trial if best else None,
        best_score=best.score if best else None,
        best_per_task=finite_values(best.per_task) if best else {},
        best_values=dict(best.values) if best else None,
        anchor=anchor.description if anchor else None,
        anchor_score=finite(anchor.score) if anchor else None,
        anchor_per_task=finite_values(anchor.per_task) if anchor else None,
        evaluator=config.evaluator.model_dump(mode="json"),
        lambda_range=space.initial_ranges["lambda"],
        scale_range=space.initial_ranges.get("scale"),
        epsilon_range=list(config.epsilon_range) if config.epsilon_range else None,
        acquisition=config.acquisition if config.strategy == "bo" else None,
        mean_seconds=mean_times(records),
        fidelity=fidelity_summary(records),
        experiment_hash=experiment_hash,
        **outputs,
        **run,
    )


def write_summary(path: Path, summary: SearchSummary) -> None:
    write_versioned(path, summary)


def read_summary(search_out: str | Path) -> SearchSummary:
    """``summary.json`` of a search's ``OUT_PATH`` folder."""
    path = Path(search_out) / "summary.json"
    try:
        return read_versioned(
            path,
            SearchSummary,
            "point at the OUT_PATH folder of a finished mergekit-bmm-search",
            label="a summary of",
        )
    except FileNotFoundError:
        raise ConfigError(
            f"{search_out} has no summary.json; point at the OUT_PATH folder of mergekit-bmm-search"
        ) from None
