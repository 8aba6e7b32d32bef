"""The table ``mergekit-bmm-search`` prints when it ends."""

from __future__ import annotations

from pathlib import Path

from mergekit_bmm.search.space import SearchSpace
from mergekit_bmm.search.summary import SearchSummary


def _format_value(value: float, kind: str) -> str:
    return f"{value:.3g}" if kind == "lambda" else f"{value:.3f}"


def format_report(
    summary: SearchSummary, space: SearchSpace, out_dir: Path, wall_seconds: float | None
) -> str:
    """The human-readable summary printed when a search ends."""
    lines = []
    done, failed = summary.completed_trials, summary.failed_trials
    took = f" in {_duration(wall_seconds)}" if wall_seconds is not None else ""
    lines.append(
        f"mergekit-bmm-search [{summary.strategy}] {done}/{summary.budget} trials "
        f"({failed} failed){took}"
        f" — {summary.status} — {out_dir}"
    )
    if summary.best_trial is None:
        lines.append("no trial succeeded; see trials.jsonl and errors.log")
        return "\n".join(lines)
    anchor = summary.anchor_score
    line = f"best: trial {summary.best_trial}, score {summary.best_score:.4f}"
    if anchor is not None:
        line += f"   anchor ({summary.anchor}): {anchor:.4f}   gain {summary.best_score - anchor:+.4f}"
    lines.append(line)
    verdict = summary.anchor_verdict()
    if verdict:
        lines.append(f"note: {verdict}")
    lines.append("")

    per_task = summary.best_per_task or {}
    anchor_tasks = summary.anchor_per_task or {}
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
        row = f"{'mean':<{width}}  {_cell(summary.best_score)}"
        if anchor_tasks:
            row += f"  {_cell(anchor)}  {_cell(summary.best_score - anchor, signed=True)}"
        lines.append(row)
    lines.append("")

    values = summary.best_values
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
    times = summary.mean_seconds
    lines.append(
        "mean time per trial: "
        + ", ".join(f"{key} {times[key]:.2f} s" for key in ("merge", "evaluate", "surrogate"))
    )
    if summary.fidelity:
        lines.append(summary.fidelity["description"])
    lines.extend(not_searched_lines(summary.not_searched))
    best_model = summary.best_model and summary.best_model + "/"
    outputs = [summary.best_recipe, best_model, summary.convergence_plot, summary.lambda_plot]
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


def not_searched_lines(not_searched: dict) -> list[str]:
    """What the search left alone: groups at the recipe's λ, weights that keep the anchor's value."""
    lines = []
    groups = not_searched.get("groups") or {}
    if groups:
        fixed = ", ".join(f"{group} (lambda {value:g})" for group, value in groups.items())
        lines.append(f"not searched, at the recipe's lambda: {fixed}")
    kept = not_searched.get("anchor_kept") or []
    if kept:
        shown = ", ".join(kept[:4]) + (f", ... ({len(kept)} in all)" if len(kept) > 4 else "")
        lines.append(f"outside every module group, kept at the anchor's value: {shown}")
    return lines
