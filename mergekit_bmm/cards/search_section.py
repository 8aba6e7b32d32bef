"""The card's "Search" section: how a search chose λ and s, and the scores it measured.

It reads a search's summary (:class:`mergekit_bmm.search.summary.SearchSummary`) without
importing the search that writes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mergekit_bmm.cards.markdown import decimal_places, table
from mergekit_bmm.cards.recipe_view import format_value

# A search's summary (:class:`mergekit_bmm.search.summary.SearchSummary`, read with
# ``read_summary``): cards sit below the search in the pipeline, so they read it without importing it.
SearchFacts = Any


def search_section(summary: SearchFacts, plots: Mapping[str, str]) -> list[str]:
    """The card's "Search" section: how λ and s were chosen and what each task scored."""
    evaluator = summary.evaluator.get("type", "—") if summary.evaluator else "—"
    facts = [
        ("strategy", summary.strategy),
        ("budget", format_value(summary.budget)),
        ("initial points", format_value(summary.n_initial)),
        ("seed", format_value(summary.seed)),
        ("trials completed / failed", f"{summary.completed_trials} / {summary.failed_trials}"),
        ("best trial", format_value(summary.best_trial)),
        ("best score", format_value(summary.best_score)),
        (
            "anchor score",
            format_value(summary.anchor_score) if summary.anchor_score is not None else "not evaluated",
        ),
        ("evaluator", str(evaluator)),
        ("blocks", ", ".join(f"{a}–{b - 1}" for a, b in summary.blocks) or "—"),
        ("groups searched", ", ".join(summary.groups) or "—"),
    ]
    lines = [
        "## Search",
        "",
        "λ per block and group and s per block were chosen by `mergekit-bmm-search`, which scores each "
        "candidate merge on a validation set (Gaussian-process Bayesian optimisation with expected "
        "improvement for the `bo` strategy).",
        "",
        table(["search", "value"], facts),
        "",
    ]
    lines += label_free_lines(summary.evaluator or {})
    staged = (getattr(summary, "fidelity", None) or {}).get("description")
    if staged:  # how the search spent its validation examples (cheap-then-full evaluation)
        lines += [staged[0].upper() + staged[1:] + ".", ""]
    changes = getattr(summary, "box_changes", None) or []
    if changes:
        lines += ["The search box widened where the best point sat on an edge:", ""]
        lines += [
            f"- search box widened: `{change['dimension']}` "
            f"[{change['old_low']:.4g}, {change['old_high']:.4g}] → "
            f"[{change['low']:.4g}, {change['high']:.4g}] after trial {change['after_trial']}"
            for change in changes
        ]
        lines.append("")
    anchor = summary.anchor_per_task or {}
    tasks = list(dict.fromkeys([*summary.best_per_task, *anchor]))
    if tasks:
        scores = [*summary.best_per_task.values(), *anchor.values(), summary.best_score, summary.anchor_score]
        places = decimal_places([value for value in scores if value is not None])

        def score(value: float | None) -> str:
            return "—" if value is None else f"{value:.{places}f}"

        def delta(best: float | None, base: float | None) -> str:
            return "—" if best is None or base is None else f"{best - base:+.{places}f}"

        rows = [
            (
                task,
                score(summary.best_per_task.get(task)),
                score(anchor.get(task)),
                delta(summary.best_per_task.get(task), anchor.get(task)),
            )
            for task in tasks
        ]
        if summary.best_score is not None:
            overall = summary.anchor_score
            rows.append(
                ("**overall**", score(summary.best_score), score(overall), delta(summary.best_score, overall))
            )
        lines += ["Scores per task (this model against the anchor merge):", ""]
        lines += [table(["task", "BMM (this model)", "anchor", "Δ"], rows), ""]
        if summary.anchor_per_task is None:
            lines += ["The anchor was not evaluated (`mergekit-bmm-search --eval-anchor` adds it).", ""]
    verdict = summary.anchor_verdict()
    if verdict:
        lines += [f"**{verdict}**", ""]
    for title, file_name in plots.items():
        lines += [f"![{title}]({file_name})", ""]
    return lines


OBJECTIVE_WORDS = {
    "kl": "KL(expert ‖ merged) of their predictions",
    "reverse_kl": "KL(merged ‖ expert) of their predictions",
    "top1": "how often its most likely prediction is the expert's",
    "entropy": "the merged model's own prediction entropy (AdaMerging's objective; no expert involved)",
}


def label_free_lines(evaluator: Mapping[str, Any]) -> list[str]:
    """For a search scored with no labels (``type: agreement``): say so, and which texts it read."""
    if evaluator.get("type") != "agreement":
        return []
    objective = str(evaluator.get("objective", "kl"))
    if evaluator.get("stats"):
        texts = f"the tasks of the statistics config `{evaluator['stats']}`"
    else:
        texts = "; ".join(
            f"`{task.get('name')}`: `{task.get('data')}`"
            + (f" ({task['split']})" if task.get("split") else "")
            for task in evaluator.get("tasks") or []
        )
    if evaluator.get("split"):
        texts += f", split `{evaluator['split']}`"
    measure = OBJECTIVE_WORDS.get(objective, objective)
    scale = (
        "each task as the share of the base model's divergence closed"
        if evaluator.get("scale", "base") == "base"
        else "raw"
    )
    return [
        "**This search used no labels.** Each candidate merge was scored on unlabelled text of every "
        f"expert's task by {measure} ({scale}). Texts read: {texts}.",
        "",
    ]
