"""Why BMM moved or kept its anchor: distance moved, task sizes, Gram alignment and the sweeps."""

from __future__ import annotations

from typing import Any

from bench.merging.report.cells import ANCHOR_LABELS, table_head
from bench.merging.report.rows import find_row
from mergekit_bmm.core.module_map import GROUP_NAMES


def diagnostics_markdown(results: dict[str, Any]) -> str:
    """How far each BMM merge went from its anchor, and how well U_tᵀU_t stands in for each
    expert's activation Gram (bench/merging/diagnostics.py)."""
    moved_rows = [r for r in results["rows"] if r.get("moved")]
    parts = []
    if moved_rows:
        groups = [g for g in GROUP_NAMES if any(g in r["moved"] for r in moved_rows)]
        header = ["anchor", "mode", "validation: anchor → BMM", *groups]
        lines = table_head(header)
        for row in moved_rows:
            anchor = find_row(results, row["anchor"])
            before = (
                "–"
                if not anchor or anchor["validation_avg"] is None
                else f"{100 * anchor['validation_avg']:.1f}"
            )
            after = "–" if row["validation_avg"] is None else f"{100 * row['validation_avg']:.1f}"
            cells = [f"{row['moved'][g]:.2f}" if g in row["moved"] else "–" for g in groups]
            label = ANCHOR_LABELS.get(row["anchor"], row["anchor"])
            lines.append(f"| {label} | {row['setting']} | {before} → {after} | " + " | ".join(cells) + " |")
        parts.append(
            "How far each BMM merge went from its anchor, per module group: "
            "‖W_BMM − W_anchor‖ / ‖W_anchor − W_pre‖ over the group's body weights (0: the search kept "
            "the anchor; BMM can only differ from an anchor it moved away from).\n\n" + "\n".join(lines)
        )
    norms = task_norms_markdown(results)
    if norms:
        parts.append(norms)
    alignment = results.get("alignment")
    if alignment:
        groups = [g for g in GROUP_NAMES if any(g in task["groups"] for task in alignment.values())]
        header = ["expert", "mean cos_F", "min", *groups]
        lines = table_head(header)
        order = [task for task in results.get("tasks", []) if task in alignment] or list(alignment)
        for task in order:  # the run's task order (the cached file's may be sorted)
            figures = alignment[task]
            cells = [f"{figures['groups'][g]:.2f}" if g in figures["groups"] else "–" for g in groups]
            lines.append(
                f"| {task} | {figures['mean']:.2f} | {figures['min']:.2f} | " + " | ".join(cells) + " |"
            )
        parts.append(
            "How well each expert's U_tᵀU_t stands in for its activation Gram (Theorem 1, "
            "`mergekit-bmm-align`): cos_F per module, mean and minimum over modules and mean per group; "
            "data-free BMM relies on clearly positive values (the paper measures > 0.26).\n\n"
            + "\n".join(lines)
        )
    return "\n\n".join(parts)


def task_norms_markdown(results: dict[str, Any]) -> str:
    """Each task's update size and weight in the data-free Gram, beside what data-free BMM did to the
    task against Task Arithmetic and the best anchor: do the tasks the Gram weighs least lose?"""
    norms = results.get("task_norms")
    if not norms:
        return ""
    pairs = []
    for anchor in dict.fromkeys(a for a in ("task_arithmetic", results.get("best_anchor")) if a):
        theirs, ours = find_row(results, anchor), find_row(results, anchor, "data_free")
        if theirs and ours and theirs["avg"] is not None and ours["avg"] is not None:
            pairs.append((ANCHOR_LABELS.get(anchor, anchor), theirs, ours))
    header = [
        "task",
        "‖U_t‖_F",
        "share of Σ tr(U_tᵀU_t)",
        *(f"{label} + BMM data-free − {label}" for label, _, _ in pairs),
    ]
    lines = table_head(header)
    order = [task for task in results.get("tasks", []) if task in norms] or list(norms)
    for task in order:
        changes = [
            f"{100 * (ours['per_task'][task] - theirs['per_task'][task]):+.1f}"
            if task in ours["per_task"] and task in theirs["per_task"]
            else "–"
            for _, theirs, ours in pairs
        ]
        lines.append(
            f"| {task} | {norms[task]['norm']:.2f} | {100 * norms[task]['trace_share']:.0f}% | "
            + " | ".join(changes)
            + " |"
        )
    sizes = [figures["norm"] for figures in norms.values() if figures["norm"] > 0]
    spread = f" (largest / smallest {max(sizes) / min(sizes):.1f}×)" if len(sizes) > 1 else ""
    return (
        f"How much each expert moved{spread}: the data-free Gram Σ U_tᵀU_t weighs a task by the size of its "
        "update (`task_balance:` evens it out); beside it, test points data-free BMM gained or lost on the "
        "task against its anchor.\n\n" + "\n".join(lines) + cosines_sentence(results.get("task_cosines"))
    )


def cosines_sentence(cosines: dict[str, Any] | None) -> str:
    """The experts' pairwise task-vector cosines in one sentence (how far they pull the model apart)."""
    if not cosines or cosines.get("mean") is None:
        return ""
    aligned, opposed = cosines["most_aligned"], cosines["most_opposed"]
    return (
        f"\n\nCosine between two experts' task vectors (over the solved weights), mean over "
        f"{len(cosines['pairs'])} pairs: {cosines['mean']:+.3f} (most aligned {aligned['pair']} "
        f"{aligned['cosine']:+.3f}, most opposed {opposed['pair']} {opposed['cosine']:+.3f})."
    )


def sweeps_markdown(results: dict[str, Any]) -> str:
    """The sweeps' numbers: validation at each point, per setting, and the size of U against U0."""
    sweeps = results.get("sweeps")
    if not sweeps:
        return ""
    lines = []
    for setting, result in sweeps["settings"].items():
        lines += [
            f"**{setting}** (validation avg %, and ‖U‖/‖U0‖ of the swept group; s: mean over groups)",
            "",
        ]
        lines += [
            "| along | value | validation | ‖U‖/‖U0‖ |",
            "|---|---|---|---|",
        ]
        for point in result["points"]:
            ratio = point["norm_ratio"]
            shown = ratio.get(point["along"]) if point["along"] in ratio else sum(ratio.values()) / len(ratio)
            value = "" if point["value"] is None else f"{point['value']:g}"
            lines.append(f"| {point['along']} | {value} | {100 * point['validation']:.1f} | {shown:.2f} |")
        lines.append("")
    return "\n".join(lines)
