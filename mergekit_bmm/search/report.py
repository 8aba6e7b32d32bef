"""``summary.json`` (the contract the model card reads) and the table printed at the end."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mergekit_bmm.search.log import TrialRecord
from mergekit_bmm.search.space import SearchSpace


def best_record(records: Sequence[TrialRecord]) -> TrialRecord | None:
    """The first trial with the highest score (ties keep the earlier one)."""
    best = None
    for record in records:
        if record.ok and record.score is not None and (best is None or record.score > best.score):
            best = record
    return best


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def mean_times(records: Sequence[TrialRecord]) -> dict[str, float]:
    keys = ("merge", "evaluate", "surrogate")
    if not records:
        return {key: 0.0 for key in keys}
    return {key: sum(r.time.get(key, 0.0) for r in records) / len(records) for key in keys}


def build_summary(
    *,
    config,
    recipe_path: Path,
    space: SearchSpace,
    records: Sequence[TrialRecord],
    anchor: dict[str, Any] | None,
    out,
    status: str,
    experiment_hash: str,
    best_model_current: bool = True,
) -> dict[str, Any]:
    """Contract B: rewritten after every trial and at the end."""
    best = best_record(records)

    def present(path: Path) -> str | None:
        return path.name if path.exists() else None

    return {
        "recipe": str(recipe_path),
        "strategy": config.strategy,
        "budget": config.budget,
        "n_initial": config.n_initial,
        "seed": config.seed,
        "blocks": [list(block) for block in space.blocks],
        "groups": list(space.groups),
        "completed_trials": len(records),
        "failed_trials": sum(not r.ok for r in records),
        "best_trial": best.trial if best else None,
        "best_score": best.score if best else None,
        "best_per_task": {k: _finite(v) for k, v in best.per_task.items()} if best else None,
        "best_values": dict(best.values) if best else None,
        "anchor_score": _finite(anchor["score"]) if anchor else None,
        "anchor_per_task": {k: _finite(v) for k, v in anchor["per_task"].items()} if anchor else None,
        "evaluator": config.evaluator.model_dump(mode="json"),
        "convergence_plot": present(out.convergence_png),
        "lambda_plot": present(out.lambdas_png),
        "best_recipe": present(out.best_yml),
        "best_model": present(out.best_dir) if best_model_current else None,
        # additions to the contract
        "status": status,
        "dimensions": space.names,
        "lambda_range": list(config.lambda_range),
        "scale_range": list(config.scale_range) if config.scale_range else None,
        "epsilon_range": list(config.epsilon_range) if config.epsilon_range else None,
        "acquisition": config.acquisition if config.strategy == "bo" else None,
        "mean_seconds": mean_times(records),
        "anchor": anchor.get("description") if anchor else None,
        "trials_log": out.trials_jsonl.name,
        "experiment_hash": experiment_hash,
    }


def _format_value(value: float, kind: str) -> str:
    return f"{value:.3g}" if kind == "lambda" else f"{value:.3f}"


def format_report(
    summary: dict[str, Any], space: SearchSpace, out_dir: Path, wall_seconds: float | None
) -> str:
    """The human-readable summary printed when a search ends."""
    lines = []
    done, failed = summary["completed_trials"], summary["failed_trials"]
    took = f" in {_duration(wall_seconds)}" if wall_seconds is not None else ""
    lines.append(
        f"mergekit-bmm-search [{summary['strategy']}] {done}/{summary['budget']} trials "
        f"({failed} failed){took}"
        f" — {summary['status']} — {out_dir}"
    )
    if summary["best_trial"] is None:
        lines.append("no trial succeeded; see trials.jsonl and errors.log")
        return "\n".join(lines)
    anchor = summary["anchor_score"]
    line = f"best: trial {summary['best_trial']}, score {summary['best_score']:.4f}"
    if anchor is not None:
        line += f"   anchor ({summary['anchor']}): {anchor:.4f}   gain {summary['best_score'] - anchor:+.4f}"
    lines.append(line)
    lines.append("")

    per_task = summary["best_per_task"] or {}
    anchor_tasks = summary["anchor_per_task"] or {}
    width = max([len(t) for t in per_task] + [10])
    header = f"{'task':<{width}}  {'best':>8}" + (f"  {'anchor':>8}  {'gain':>8}" if anchor_tasks else "")
    lines.append(header)
    lines.append("-" * len(header))
    for task, value in per_task.items():
        row = f"{task:<{width}}  {_cell(value)}"
        if anchor_tasks:
            reference = anchor_tasks.get(task)
            gain = value - reference if value is not None and reference is not None else None
            row += f"  {_cell(reference)}  {_cell(gain, signed=True)}"
        lines.append(row)
    if len(per_task) > 1:
        row = f"{'mean':<{width}}  {_cell(summary['best_score'])}"
        if anchor_tasks:
            row += f"  {_cell(anchor)}  {_cell(summary['best_score'] - anchor, signed=True)}"
        lines.append(row)
    lines.append("")

    values = summary["best_values"]
    columns = [entry for entry in space.groups] + sorted(
        {d.kind for d in space.dimensions if d.kind != "lambda"}, key=["scale", "epsilon"].index
    )
    kinds = {c: ("lambda" if c in space.groups else c) for c in columns}
    labels = [f"block {i} (layers {s}-{e - 1})" for i, (s, e) in enumerate(space.blocks)]
    label_width = max(len(label) for label in labels)
    col_width = max([len(c) for c in columns] + [9])
    header = f"{'best values':<{label_width}}  " + "  ".join(f"{c:>{col_width}}" for c in columns)
    lines.append(header)
    lines.append("-" * len(header))
    for index, label in enumerate(labels):
        cells = [_format_value(values[f"block{index}.{c}"], kinds[c]) for c in columns]
        lines.append(f"{label:<{label_width}}  " + "  ".join(f"{c:>{col_width}}" for c in cells))
    lines.append("")
    times = summary["mean_seconds"]
    lines.append(
        "mean time per trial: "
        + ", ".join(f"{key} {times[key]:.2f} s" for key in ("merge", "evaluate", "surrogate"))
    )
    best_model = summary["best_model"] and summary["best_model"] + "/"
    outputs = [summary["best_recipe"], best_model, summary["convergence_plot"], summary["lambda_plot"]]
    outputs = [item for item in outputs if item]
    lines.append("outputs: " + ", ".join(outputs + ["trials.jsonl", "summary.json"]))
    return "\n".join(lines)


def _cell(value: float | None, signed: bool = False) -> str:
    if value is None:
        return f"{'-':>8}"
    return f"{value:>+8.4f}" if signed else f"{value:>8.4f}"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"
