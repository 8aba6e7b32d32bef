"""The report's pictures: per-task bars, one panel per anchor, the experts' held-out curves, the
LoRA track's paired differences."""

from __future__ import annotations

import contextvars
import functools
import hashlib
import inspect
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from bench.merging.report.cells import ANCHOR_LABELS
from bench.merging.report.rows import find_row
from bench.merging.variants import variant_rows

# What changes from one report to the next without changing any picture (clocks, the stage line).
VOLATILE = ("timings", "stage_seconds", "stage_reached", "stage_partial", "stages_skipped", "machine")
KEPT_IN = Path(tempfile.gettempdir()) / "mergekit-bmm-pictures"  # pictures kept for reuse across reports
KEPT_PICTURES = 200  # the newest kept (a few MB)
STAMP = "mergekit-bmm-inputs"  # the PNG text chunk holding the digest of what a picture was drawn from
_PENDING_STAMP: contextvars.ContextVar[str | None] = contextvars.ContextVar("picture_stamp", default=None)
Draw = TypeVar("Draw", bound=Callable[..., "Path | None"])


def drawn_once(draw: Draw | None = None, *, reads: tuple[str, ...] | None = None):
    """Draw a picture only when what it shows has changed since it was drawn: a run writes its
    report at every stage boundary (and a resumed one again), and rendering every PNG each time
    was most of a report's cost. ``reads``: the only keys of the results the picture is drawn from
    (a stage that adds anything else leaves it as it is); None: all of them but the clocks."""

    def decorate(draw: Draw) -> Draw:
        drawing = _source_digest(draw)  # a changed drawing draws again, whatever the inputs

        @functools.wraps(draw)
        def wrapper(data: Any, path: Path, *args: Any, **kwargs: Any) -> Path | None:
            path = Path(path)
            shown = _shown(data, reads)
            text = json.dumps([draw.__qualname__, drawing, shown, args, kwargs], sort_keys=True, default=str)
            digest = hashlib.sha256(text.encode()).hexdigest()
            if _stamp(path) == digest or _drawn_before(digest, path):
                return path
            token = _PENDING_STAMP.set(digest)
            try:
                drawn = draw(data, path, *args, **kwargs)
            finally:
                _PENDING_STAMP.reset(token)
            if drawn is not None:
                _keep(digest, path)
            return drawn

        return wrapper  # type: ignore[return-value]

    return decorate(draw) if draw is not None else decorate


def _shown(data: Any, reads: tuple[str, ...] | None) -> Any:
    """What of ``data`` a picture depends on (a results dict less its clocks, or the keys it reads)."""
    if not isinstance(data, dict):
        return data
    if reads is not None:
        return {key: data.get(key) for key in reads}
    return {k: v for k, v in data.items() if k not in VOLATILE}


def _kept(digest: str) -> Path:
    """Where a picture drawn from ``digest`` is kept: a resumed run writes its report at every stage
    boundary with the rows it has reloaded so far, so the same few states come back run after run."""
    return KEPT_IN / f"{digest}.png"


def _source_digest(draw: Callable[..., Any]) -> str:
    """The drawing's own code and this module's (the helpers every drawing calls: ``_save``,
    ``_pyplot``), so a picture kept from an older drawing is not reused for a new one."""
    try:
        source = inspect.getsource(draw)
    except (OSError, TypeError):  # no source to read (a frozen build): its bytecode stands in
        source = draw.__code__.co_code.hex()
    return hashlib.sha256((source + helpers_digest()).encode()).hexdigest()[:16]


@functools.cache
def helpers_digest() -> str:
    """The digest of this module's source (read once; empty where no source ships)."""
    try:
        source = Path(__file__).read_bytes()
    except OSError:
        source = b""
    return hashlib.sha256(source).hexdigest()[:16]


def _drawn_before(digest: str, path: Path) -> bool:
    """Copy the picture of the same inputs drawn before, if one is kept (it carries its stamp)."""
    kept = _kept(digest)
    try:
        shutil.copyfile(kept, path)
    except OSError:
        return False
    return True


def _keep(digest: str, path: Path) -> None:
    """Keep a copy of a new picture (atomically: parallel runs share the folder), the newest
    ``KEPT_PICTURES`` only."""
    kept = _kept(digest)
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        partial = kept.with_name(f"{kept.stem}.{os.getpid()}.partial")
        shutil.copyfile(path, partial)
        os.replace(partial, kept)
        pictures = sorted(kept.parent.glob("*.png"), key=lambda p: p.stat().st_mtime)
        for old in pictures[:-KEPT_PICTURES]:
            old.unlink(missing_ok=True)
    except OSError:  # only a cache: the report has its picture
        pass


def _stamp(path: Path) -> str | None:
    """The digest a PNG was drawn from (None: no picture, or one drawn before stamps)."""
    if not path.is_file():
        return None
    from PIL import Image

    try:
        with Image.open(path) as image:
            return image.info.get(STAMP)
    except OSError:
        return None


@drawn_once(reads=("experts", "heads"))
def plot_expert_curves(results: dict[str, Any], path: Path) -> Path | None:
    """Each expert's held-out accuracy while it trains, the kept step marked: did it plateau?"""
    experts = results.get("experts", {})
    curves = {task: e["held_out_curve"] for task, e in experts.items() if e.get("held_out_curve")}
    if not curves:
        return None
    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for task, curve in curves.items():
        steps, scores = zip(*curve)
        (line,) = ax.plot(steps, [100 * v for v in scores], marker=".", label=task)
        kept = results["experts"][task].get("kept_step")
        if kept in steps:
            ax.scatter([kept], [100 * scores[steps.index(kept)]], s=60, color=line.get_color(), zorder=3)
        head = results.get("heads", {}).get(task, {}).get("validation_accuracy")
        if head is not None:
            ax.axhline(100 * head, color=line.get_color(), linestyle=":", linewidth=0.8)
    ax.set_xlabel("training step (batches of 32)")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_title("Experts' held-out accuracy (dot: kept step; dotted: zero-shot head)", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, path, dpi=110)


@drawn_once(reads=("tasks", "rows", "indiv", "encoder", "name"))
def plot_anchors(results: dict[str, Any], path: Path) -> Path | None:
    """One panel per anchor: per-task test accuracy of the anchor and BMM over it."""
    import numpy as np

    plt = _pyplot()

    tasks = results["tasks"]
    anchors = [a for a in dict.fromkeys(r["anchor"] for r in results["rows"]) if find_row(results, a)]
    if not anchors:
        return None
    columns = min(4, len(anchors))
    rows_n = (len(anchors) + columns - 1) // columns
    fig, axes = plt.subplots(rows_n, columns, figsize=(4.2 * columns, 3.4 * rows_n), squeeze=False)
    x = np.arange(len(tasks))
    colors = {"anchor": "#9e9e9e", "data_free": "#1f77b4", "data_assisted": "#d62728"}
    for ax, anchor in zip(axes.flat, anchors):
        settings = [s for s in ("anchor", "data_free", "data_assisted") if find_row(results, anchor, s)]
        width = 0.8 / max(len(settings), 1)
        for i, setting in enumerate(settings):
            row = find_row(results, anchor, setting)
            values = [row["per_task"].get(t, 0.0) for t in tasks]
            label = {"anchor": "anchor", "data_free": "BMM data-free", "data_assisted": "BMM data-assisted"}
            ax.bar(
                x + (i - (len(settings) - 1) / 2) * width,
                values,
                width,
                color=colors[setting],
                label=f"{label[setting]} ({100 * row['avg']:.1f})"
                if row["avg"] is not None
                else label[setting],
            )
        if len(results["indiv"]) == len(tasks):
            ax.scatter(
                x,
                [results["indiv"][t] for t in tasks],
                marker="_",
                s=200,
                color="black",
                label="expert",
                zorder=3,
            )
        ax.set_title(ANCHOR_LABELS.get(anchor, anchor), fontsize=10)
        ax.set_xticks(x, tasks, rotation=35, ha="right", fontsize=7)
        ax.set_ylim(0, 1)
        ax.legend(fontsize=6, loc="lower left")
    for ax in list(axes.flat)[len(anchors) :]:
        ax.axis("off")
    fig.suptitle(f"{results['encoder']}: per-task test accuracy, anchors and BMM ({results['name']})")
    return _save(fig, path, dpi=110)


@drawn_once(reads=("tasks", "rows", "indiv", "encoder", "name"))
def plot(results: dict[str, Any], path: Path) -> Path | None:
    """Grouped bars: test accuracy per task for each row and the experts."""
    import numpy as np

    plt = _pyplot()

    tasks = results["tasks"]
    series = [
        (r["anchor"] if r["setting"] == "anchor" else f"{r['anchor']}+bmm/{r['setting']}", r["per_task"])
        for r in results["rows"]
        if len(r["per_task"]) == len(tasks)
    ]
    if len(results["indiv"]) == len(tasks):
        series.append(("indiv. (experts)", results["indiv"]))
    if not series:
        return None
    x = np.arange(len(tasks))
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(tasks)), 4))
    for i, (label, values) in enumerate(series):
        ax.bar(x + (i - (len(series) - 1) / 2) * width, [values[t] for t in tasks], width, label=label)
    ax.set_xticks(x, tasks, rotation=20, ha="right")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1)
    ax.set_title(f"{results['encoder']}: per-task test accuracy ({results['name']})")
    ax.legend(fontsize=8, loc="lower left")
    return _save(fig, path, dpi=120)


@drawn_once(reads=("summary", "variants", "config", "name"))
def plot_deltas(results: dict[str, Any], path: Path) -> Path | None:
    """Paired test Δ with 95 % intervals at a glance: BMM (searched, and at its defaults) against its
    anchor per mode, and each variant against the search it is paired with."""
    cells = [c for c in results.get("summary") or [] if c["anchor"] != "pretrained"]
    variants = [(name, row) for name, row in variant_rows(results) if row.get("delta_main")]
    if not cells and not variants:
        return None
    plt = _pyplot()
    panels = [panel for panel in (cells, variants) if panel]
    heights = [max(2.0, 0.32 * len(panel) + 1.2) for panel in panels]
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(7.5, sum(heights)), squeeze=False, gridspec_kw={"height_ratios": heights}
    )
    colors = {"data_free": "#1f77b4", "data_assisted": "#d62728"}
    axes = list(axes.flat)
    if cells:
        ax = axes.pop(0)
        for i, cell in enumerate(reversed(cells)):
            color = colors.get(cell["mode"], "black")
            _whisker(ax, i, (cell["delta"], cell["delta_low"], cell["delta_high"]), fmt="o", color=color)
            one_merge = (("defaults", "o"), ("candidate", "D"), ("auto", "^"))  # no search
            for kind, marker in one_merge:
                if f"{kind}_delta" in cell:
                    ax.plot(
                        100 * cell[f"{kind}_delta"], i, marker=marker, mfc="white", color=color, linestyle=""
                    )
        labels = [
            f"{ANCHOR_LABELS.get(c['anchor'], c['anchor'])} ({c['mode'].replace('_', '-')})" for c in cells
        ]
        ax.set_yticks(range(len(cells)), list(reversed(labels)), fontsize=7)
        ax.axvline(0, color="grey", linewidth=0.8)
        ax.set_xlabel(
            "test Δ vs its anchor\n(filled: searched; hollow: at its defaults; ◇: a proposed default; "
            "△: lambda auto)"
        )
    if variants:
        ax = axes.pop(0)
        for i, (_, row) in enumerate(reversed(variants)):
            won = (
                row.get("main_validation_avg") is not None
                and row["validation_avg"] > row["main_validation_avg"]
            )
            _whisker(ax, i, row["delta_main"], fmt="s", color="#2ca02c" if won else "#7f7f7f")
        labels = [
            f"{name}: {ANCHOR_LABELS.get(row['anchor'], row['anchor'])} ({row['setting'].replace('_', '-')})"
            for name, row in variants
        ]
        ax.set_yticks(range(len(variants)), list(reversed(labels)), fontsize=7)
        ax.axvline(0, color="grey", linewidth=0.8)
        ax.set_xlabel("test Δ vs the search it is paired with (green: ahead on validation)")
    fig.suptitle(f"{results['name']}: paired test differences, 95 % intervals", fontsize=10)
    return _save(fig, path, dpi=110)


def evidence_lambdas(row: dict[str, Any]) -> dict[str, list[float]]:
    """The λ the evidence chose in a row's ``lambda: auto`` merge, per module group."""
    from mergekit_bmm.merge_methods.chosen_lambdas import by_group

    return by_group((row.get("auto") or {}).get("lambda_auto") or {})


def searched_lambdas(row: dict[str, Any]) -> dict[str, list[float]]:
    """The search's best λ per module group (every block's), from the row's ``best_values``."""
    found: dict[str, list[float]] = {}
    best = row.get("best_values") or (row.get("hyperparameters") or {}).get("best_values") or {}
    for name, value in best.items():
        _, _, groups = name.partition(".")
        for group in groups.split("+"):
            if group not in ("scale", "epsilon"):
                found.setdefault(group, []).append(float(value))
    return found


@drawn_once(reads=("rows", "name"))
def plot_evidence_lambdas(results: dict[str, Any], path: Path) -> Path | None:
    """Per mode, each anchor's λ per module group: chosen by the evidence (every weight, dots; their
    median, a bar) against the search's best (crosses), on one log axis."""
    rows = [r for r in results.get("rows") or [] if r.get("setting") != "anchor" and evidence_lambdas(r)]
    if not rows:
        return None
    import numpy as np

    plt = _pyplot()
    modes = sorted({r["setting"] for r in rows})
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.2), squeeze=False)
    for ax, mode in zip(axes.flat, modes):
        picked = [r for r in rows if r["setting"] == mode]
        groups = sorted({g for r in picked for g in evidence_lambdas(r)})
        width = 0.8 / max(len(picked), 1)
        for i, row in enumerate(picked):
            color = f"C{i}"
            chosen, searched = evidence_lambdas(row), searched_lambdas(row)
            for j, group in enumerate(groups):
                x = j + (i - (len(picked) - 1) / 2) * width
                values = chosen.get(group) or []
                ax.plot([x] * len(values), values, ".", color=color, alpha=0.5, markersize=4)
                if values:
                    ax.plot([x - width / 3, x + width / 3], [float(np.median(values))] * 2, color=color)
                for value in searched.get(group) or []:
                    ax.plot(x, value, "x", color=color, markersize=7)
            ax.plot([], [], "s", color=color, label=ANCHOR_LABELS.get(row["anchor"], row["anchor"]))
        ax.set_yscale("log")
        ax.set_xticks(range(len(groups)), groups)
        ax.set_ylabel("λ (dimensionless)")
        ax.set_title(f"{mode.replace('_', '-')}: λ from the evidence (dots, median bar) vs searched (×)")
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle(f"{results['name']}: the evidence's λ per weight against the search's", fontsize=10)
    return _save(fig, path, dpi=110)


@drawn_once
def plot_lora_intervals(lora: dict[str, Any], path: Path) -> Path | None:
    """The LoRA track at a glance: BMM over each mergekit anchor (searched: filled; at its defaults:
    ○; at ``lambda: auto``: △) against every other merge of the same adapters, paired test Δ with
    95 % intervals for the searched one."""
    found = lora.get("intervals") or {}
    anchors = [name.removeprefix("bmm over ") for name in {k.split(" - ")[0] for k in found}]
    anchors = sorted(a for a in anchors if not a.startswith("bmm "))
    if not anchors:
        return None
    peers = list(dict.fromkeys(k.split(" - ")[1] for k in found))
    plt = _pyplot()
    fig, axes = plt.subplots(
        1, len(anchors), figsize=(4.2 * len(anchors), 0.35 * len(peers) + 1.6), squeeze=False, sharey=True
    )
    for ax, anchor in zip(axes.flat, anchors):
        for y, peer in enumerate(reversed(peers)):
            searched = found.get(f"bmm over {anchor} - {peer}")
            if searched:
                figure = (searched["delta"], searched["low"], searched["high"])
                above = searched["low"] > 0
                _whisker(ax, y, figure, fmt="o", color="#2ca02c" if above else "#1f77b4")
            for kind, marker in (("defaults", "o"), ("auto", "^")):
                one = found.get(f"bmm {kind} over {anchor} - {peer}")
                if one:
                    ax.plot(100 * one["delta"], y, marker=marker, mfc="white", color="#7f7f7f", linestyle="")
        ax.set_yticks(range(len(peers)), list(reversed(peers)), fontsize=7)
        ax.axvline(0, color="grey", linewidth=0.8)
        ax.set_title(f"BMM over {anchor}", fontsize=9)
        ax.set_xlabel(
            "test Δ (points) against the row\n● searched (green: interval above zero), ○ defaults, △ λ auto",
            fontsize=8,
        )
    fig.suptitle(
        f"LoRA experts (rank {lora.get('rank')}): BMM against each merge of the adapters", fontsize=10
    )
    return _save(fig, path, dpi=110)


def _whisker(ax, y: float, figure, **style) -> None:
    """One paired difference (estimate, low, high; fractions) as a point with its interval, in points."""
    estimate, low, high = (100 * value for value in figure)
    ax.errorbar(estimate, y, xerr=[[estimate - low], [high - estimate]], capsize=3, **style)


def _pyplot():
    """matplotlib's pyplot on the file-only backend (benchmarks run without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path, dpi: int) -> Path:
    fig.tight_layout()
    stamp = _PENDING_STAMP.get()
    fig.savefig(path, dpi=dpi, metadata={STAMP: stamp} if stamp else None)
    _pyplot().close(fig)
    return path
