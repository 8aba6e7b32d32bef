"""What a user sees of a search: the progress bar while it runs, the table when it ends, the pictures."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path

from mergekit_bmm.core.evidence import lambda_text
from mergekit_bmm.io.atomic import replacing
from mergekit_bmm.search.log import TrialRecord
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
        fixed = ", ".join(f"{group} (lambda {lambda_text(value)})" for group, value in groups.items())
        lines.append(f"not searched, at the recipe's lambda: {fixed}")
    kept = not_searched.get("anchor_kept") or []
    if kept:
        shown = ", ".join(kept[:4]) + (f", ... ({len(kept)} in all)" if len(kept) > 4 else "")
        lines.append(f"outside every module group, kept at the anchor's value: {shown}")
    return lines


# -- What a running search shows: one progress bar with the best and the last score, and per
class SearchProgress:
    """A tqdm bar over the budget; ``write`` prints above it without breaking it."""

    def __init__(self, total: int, done: int, strategy: str, enabled: bool) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(
            total=max(total, done),
            initial=done,
            desc=f"search [{strategy}]",
            unit="trial",
            disable=not enabled,
            file=sys.stderr,
            dynamic_ncols=True,
        )
        self.status: dict[str, str] = {}
        self.full = 0  # trials of this run scored on every example (cheap-then-full evaluation)

    def show(self, best: TrialRecord | None, last: TrialRecord | None = None, workers: str = "") -> None:
        if best is not None:
            self.status["best"] = f"{best.score:.4f} (#{best.trial})"
        if last is not None:
            level = (last.fidelity or {}).get("level", "full")
            shown = f"{last.score:.4f}" + ("" if level == "full" else f" ({level})") if last.ok else "failed"
            self.status["last"] = shown
            if last.fidelity:
                self.full += level == "full"
                self.status["full"] = str(self.full)
        if workers:
            self.status["workers"] = workers
        self.bar.set_postfix(self.status, refresh=True)

    def advance(self, best: TrialRecord | None, last: TrialRecord, workers: str = "") -> None:
        self.bar.update(1)
        self.show(best, last, workers)

    def write(self, message: str) -> None:
        """A line above the bar (nothing when progress is off: ``--quiet``)."""
        if not self.bar.disable:
            self.bar.write(message, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()


# -- Pictures of a search: convergence, and where each group's λ went.
def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(figure, path: Path) -> None:
    with replacing(path, fsync=False) as temporary:
        figure.savefig(temporary, dpi=110, format=path.suffix.lstrip("."))


def plot_convergence(
    records: Sequence[TrialRecord], path: Path, anchor_score: float | None = None, title: str = ""
) -> Path:
    """Each trial's score, the best so far, and the anchor's score as a reference line."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7, 4.2))
    ok = [r for r in records if r.ok and r.score is not None and math.isfinite(r.score)]
    axis.scatter(
        [r.trial for r in ok], [r.score for r in ok], s=14, color="0.6", label="trial score", zorder=2
    )
    best, xs, ys = -math.inf, [], []
    for record in records:
        if record.ok and record.score is not None and record.score > best:
            best = record.score
        if best > -math.inf:
            xs.append(record.trial)
            ys.append(best)
    if xs:
        axis.step(xs, ys, where="post", color="C0", linewidth=2, label="best so far", zorder=3)
    failed = [r.trial for r in records if not r.ok]
    if failed:
        low = min((r.score for r in ok), default=0.0)
        axis.scatter(failed, [low] * len(failed), marker="x", color="C3", label="failed", zorder=3)
    shown = [r.score for r in ok]
    if anchor_score is not None and math.isfinite(anchor_score):
        axis.axhline(
            anchor_score, color="C2", linestyle="--", linewidth=1.5, label=f"anchor ({anchor_score:.4g})"
        )
        shown.append(anchor_score)
    if shown:  # every score and the anchor's line inside the frame, with room around them
        low, high = min(shown), max(shown)
        pad = 0.08 * (high - low) if high > low else 0.05 * max(abs(high), 1e-12)
        axis.set_ylim(low - pad, high + pad)
    axis.set_xlabel("trial")
    axis.set_ylabel("validation score (higher is better)")
    axis.set_title(title or "Search convergence")
    axis.grid(alpha=0.3)
    axis.legend(loc="lower right", fontsize=8)
    figure.subplots_adjust(left=0.13, right=0.97, top=0.9, bottom=0.13)
    _save(figure, path)
    plt.close(figure)
    return path


def plot_lambdas(
    records: Sequence[TrialRecord], space: SearchSpace, path: Path, best_trial: int | None
) -> Path:
    """One panel per group (and s, ε): the value each trial tried, per block; the best circled."""
    plt = _pyplot()
    kinds = [entry for entry in space.groups]
    extra = sorted({d.kind for d in space.dimensions if d.kind != "lambda"}, key=["scale", "epsilon"].index)
    panels = kinds + extra
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.2 * rows), squeeze=False)
    best = next((r for r in records if r.trial == best_trial), None)
    for index, panel in enumerate(panels):
        axis = axes[index // columns][index % columns]
        for block in range(len(space.blocks)):
            name = f"block{block}.{panel}"
            points = [(r.trial, r.values[name]) for r in records if name in r.values]
            if not points:
                continue
            start, end = space.blocks[block]
            axis.scatter(
                *zip(*points), s=10, color=f"C{block % 10}", label=f"block {block} (layers {start}-{end - 1})"
            )
            if best is not None and name in best.values:
                axis.scatter(
                    [best.trial], [best.values[name]], s=90, facecolors="none", edgecolors="k", linewidths=1.5
                )
        is_lambda = panel not in ("scale", "epsilon")
        if is_lambda:
            axis.set_yscale("log")
        axis.set_title(f"λ {panel}" if is_lambda else {"scale": "s (scale)", "epsilon": "ε (mix)"}[panel])
        axis.set_xlabel("trial")
        axis.grid(alpha=0.3)
    spare = [axes[index // columns][index % columns] for index in range(len(panels), rows * columns)]
    for axis in spare:
        axis.axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles and spare:  # the legend fills the first unused cell of the grid
        spare[0].legend(handles, labels, loc="center", fontsize=9, title="blocks", frameon=False)
    elif handles:
        figure.legend(handles, labels, loc="lower center", ncol=min(4, len(handles)), fontsize=8)
    figure.suptitle("Values tried per block (circled: best trial)")
    bottom = 0.1 if spare or not handles else 0.1 + 0.15 / rows
    figure.subplots_adjust(left=0.07, right=0.98, top=0.88, bottom=bottom, hspace=0.45, wspace=0.25)
    _save(figure, path)
    plt.close(figure)
    return path
