"""The report's label-free section: along a label-free search's trials, each objective against test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.merging.report.cells import ANCHOR_LABELS
from bench.merging.report.plots import drawn_once

SCALES = ("base", "none")
OBJECTIVES = ("kl", "reverse_kl", "top1", "entropy")


def traces(results: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """``(label, trace)`` of every traced label-free search in the run."""
    out = []
    for row in results.get("rows", []):
        for objective, record in (row.get("label_free") or {}).items():
            if record.get("trace"):
                anchor = ANCHOR_LABELS.get(row["anchor"], row["anchor"])
                out.append((f"{anchor}, {row['setting']}, searched on {objective}", record["trace"]))
    return out


def language_traces(language: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """``(label, trace)`` of every traced label-free search of the language track, one per reading
    (every position, the answer's), in the shape of the encoder track's traces."""
    entries = [("dense experts", "task_arithmetic", language)]
    entries += [("dense experts", name, entry) for name, entry in (language.get("anchors") or {}).items()]
    lora = language.get("lora") or {}
    entries += [("LoRA experts", name, entry) for name, entry in (lora.get("anchors") or {}).items()]
    out = []
    for experts, anchor, entry in entries:
        for objective, record in ((entry.get("bmm") or {}).get("label_free") or {}).items():
            trace = record.get("trace")
            for positions in (trace or {}).get("correlations", {}):
                read = "every position" if positions == "all" else "the answer's position"
                over = ANCHOR_LABELS.get(anchor, anchor)
                label = f"{experts}, {over}, searched on {objective}, read at {read}"
                trials = [{**t, "divergences": t["positions"][positions]} for t in trace["trials"]]
                out.append(
                    (
                        label,
                        {
                            "trials": trials,
                            "base_divergence": trace["base_divergence"][positions],
                            "correlations": trace["correlations"][positions],
                        },
                    )
                )
    return out


def trace_markdown(results: dict[str, Any]) -> str:
    """Spearman's ρ of each objective (and scale) with the test average over a search's trials."""
    return trace_table(traces(results))


def trace_table(found: list[tuple[str, dict[str, Any]]]) -> str:
    """The table of :func:`trace_markdown` for ``(label, trace)`` pairs."""
    if not found:
        return ""
    header = ["search (trials)", *(f"{objective} ({scale})" for objective in OBJECTIVES for scale in SCALES)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, trace in found:
        rho = trace.get("correlations") or {}
        cells = [
            "–" if rho.get(f"{o}/{s}") is None else f"{rho[f'{o}/{s}']:+.2f}"
            for o in OBJECTIVES
            for s in SCALES
        ]
        lines.append(f"| {label} ({len(trace['trials'])}) | " + " | ".join(cells) + " |")
    return (
        "Spearman's rank correlation, over each traced search's trials (each re-merged), between a "
        "label-free score and the test average: how well each objective ranks models as test accuracy "
        "does. `base`: every task as the share of the base model's divergence closed; `none`: raw "
        "divergence (KL, reverse KL, top-1 disagreement, entropy; higher score = lower divergence).\n\n"
        + "\n".join(lines)
    )


@drawn_once(reads=("rows",))
def plot_trace(results: dict[str, Any], path: Path) -> Path | None:
    """Per traced search: test average against the agreement score (KL, base-scaled), one dot a trial."""
    return _draw_traces(traces(results), path)


@drawn_once(reads=("anchors", "lora", "bmm"))
def plot_language_trace(language: dict[str, Any], path: Path) -> Path | None:
    """:func:`plot_trace` for the language track's traced searches, one panel per reading."""
    return _draw_traces(language_traces(language), path)


def _draw_traces(found: list[tuple[str, dict[str, Any]]], path: Path) -> Path | None:
    from bench.merging.label_free_trace import objective_scores
    from bench.merging.report.plots import _pyplot, _save

    if not found:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(found), figsize=(4.2 * len(found), 3.6), squeeze=False)
    for axis, (label, trace) in zip(axes[0], found):
        trials = trace["trials"]
        x = [objective_scores(t, trace["base_divergence"])["kl/base"] for t in trials]
        y = [100 * t["test_avg"] for t in trials]
        points = axis.scatter(x, y, c=[t["trial"] for t in trials], cmap="viridis", s=18)
        rho = (trace.get("correlations") or {}).get("kl/base")
        axis.set_title(f"{label}\nρ = {rho:+.2f}" if rho is not None else label, fontsize=8)
        axis.set_xlabel("agreement: 1 − KL/KL_base (mean over tasks)", fontsize=8)
        axis.set_ylabel("test accuracy (%)", fontsize=8)
        fig.colorbar(points, ax=axis, label="trial")
    return _save(fig, path, 110)
