"""Pictures of a search: convergence, and where each group's λ went.

Written with matplotlib's Agg backend (no display needed), atomically, next to the log.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from mergekit_bmm.io.atomic import replacing
from mergekit_bmm.search.log import TrialRecord
from mergekit_bmm.search.space import SearchSpace


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
