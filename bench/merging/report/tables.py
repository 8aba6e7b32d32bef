"""The result tables: every row, Table 1 in kind, range, the per-cell summary, ablation and data."""

from __future__ import annotations

from typing import Any

from bench.merging.evidence import DEFAULTS_BAR
from bench.merging.report.cells import (
    ANCHOR_LABELS,
    SETTING_LABELS,
    ci_text,
    interval_text,
    share_text,
    table_head,
    values_text,
)
from bench.merging.report.rows import dynamic_range, find_row, range_share


def markdown(results: dict[str, Any]) -> str:
    """The per-task test table (accuracy, %), with the validation average alongside."""
    tasks = results["tasks"]
    header = ["method", *tasks, "avg (test)", "avg (val)", "hyperparameters"]
    lines = table_head(header)

    def fmt(value) -> str:
        return "–" if value is None else f"{100 * value:.1f}"

    for row in results["rows"]:
        name = row["anchor"] if row["setting"] == "anchor" else f"{row['anchor']} + BMM ({row['setting']})"
        hyper = ", ".join(f"{k}={v}" for k, v in row["hyperparameters"].items() if k != "validation_sweep")
        cells = [fmt(row["per_task"].get(task)) for task in tasks]
        lines.append(
            f"| {name} | "
            + " | ".join(cells)
            + f" | {fmt(row['avg'])} | {fmt(row['validation_avg'])} | {hyper} |"
        )
    if len(results["indiv"]) == len(tasks):
        cells = [fmt(results["indiv"][task]) for task in tasks]
        avg = sum(results["indiv"].values()) / len(tasks)
        val = sum(results["indiv_validation"].values()) / len(tasks) if results["indiv_validation"] else None
        lines.append(
            "| Indiv. (each expert on its task) | " + " | ".join(cells) + f" | {fmt(avg)} | {fmt(val)} | |"
        )
    text = "\n".join(lines)
    span = dynamic_range(results)
    if span:
        text += "\n\nDynamic range (test avg): " + ", ".join(f"{k} {100 * v:.1f}" for k, v in span.items())
    ta = find_row(results, "task_arithmetic")
    if ta and "validation_sweep" in ta["hyperparameters"]:
        sweep = ta["hyperparameters"]["validation_sweep"]
        text += "\n\nTask Arithmetic weight sweep (validation avg): " + ", ".join(
            f"{w}: {100 * v:.1f}" for w, v in sweep.items()
        )
    return text


def table1(results: dict[str, Any]) -> str:
    """Paper Table 1 in kind: each anchor, then BMM over it: test accuracy with its 95 % bootstrap
    interval, the paired Δ against that anchor with its interval, where each model lands in the
    pretrained-to-experts range, and the spread over search seeds."""
    tasks = results["tasks"]
    header = [
        "method",
        *tasks,
        "avg [95% CI]",
        "Δ vs anchor [95% CI]",
        "share of range",
        "seeds (sd)",
        "K",
        "tuned on validation",
    ]
    lines = table_head(header)

    def pct(value) -> str:
        return "–" if value is None else f"{100 * value:.1f}"

    anchors = list(dict.fromkeys(r["anchor"] for r in results["rows"]))
    for anchor in anchors:
        base = find_row(results, anchor)
        for setting in ("anchor", "data_free", "data_assisted"):
            row = find_row(results, anchor, setting)
            if row is None or row["avg"] is None:
                continue
            name = ANCHOR_LABELS.get(anchor, anchor) + SETTING_LABELS[setting]
            change = spread = ""
            share = share_text(range_share(results, row["avg"]))
            if setting != "anchor":
                name = f"**{name}**"
                delta = row.get("delta")
                if delta:
                    change = f"{100 * delta[0]:+.1f}{ci_text(delta)}"
                elif base and base["avg"] is not None:
                    change = f"{100 * (row['avg'] - base['avg']):+.1f}"
                seeds = row.get("seeds") or []
                if len(seeds) > 1:
                    spread = f"{len(seeds)} seeds, ±{100 * row['seed_std']:.1f}"
            cells = [pct(row["per_task"].get(task)) for task in tasks]
            lines.append(
                f"| {name} | "
                + " | ".join(cells)
                + f" | {pct(row['avg'])}{ci_text(row)} | {change} | {share} | {spread} "
                f"| {row.get('budget') or ''} | {values_text(row)} |"
            )
    if len(results["indiv"]) == len(tasks):
        cells = [pct(results["indiv"][task]) for task in tasks]
        avg = sum(results["indiv"].values()) / len(tasks)
        ci = ci_text(results.get("indiv_ci"))
        lines.append(
            "| Indiv. (each expert on its task) | "
            + " | ".join(cells)
            + f" | {pct(avg)}{ci} | | 100% | | | |"
        )
    note = (
        "\n\nTest accuracy (%) on every test example of each task; avg = mean over tasks. Intervals: 95 % "
        "bootstrap over test examples (stratified by task, 2,000 replicates); Δ is paired (the same examples "
        "for both models) and, for BMM, uses each example's share of search seeds that got it right. Share "
        "of range = (avg − Pretrained) / (Indiv. − Pretrained): where a model lands between the pretrained "
        "model and the experts, as the paper's results read across benchmarks. BMM cells show the mean over "
        "seeds; `tuned on validation` shows the first seed's values."
    )
    return "\n".join(lines) + note


def range_markdown(results: dict[str, Any]) -> str:
    """Can this run tell merge methods apart? Experts against Pretrained and Task Arithmetic."""
    figures = results.get("range")
    if not figures:
        return ""
    parts = [f"experts (Indiv.) {interval_text(figures['indiv'])}"]
    if "pretrained" in figures:
        parts.append(f"Pretrained {interval_text(figures['pretrained'])}")
    if "task_arithmetic" in figures:
        parts.append(f"Task Arithmetic {interval_text(figures['task_arithmetic'])}")
    gaps = [
        f"experts − {label} **{interval_text(figures[key], True)}**"
        for key, label in (
            ("experts_minus_pretrained", "Pretrained"),
            ("experts_minus_task_arithmetic", "Task Arithmetic"),
        )
        if key in figures
    ]
    return (
        "Test average (%), 95 % bootstrap intervals: "
        + "; ".join(parts)
        + ".\n\nRange (paired): "
        + "; ".join(gaps)
        + "."
    )


def summary_markdown(results: dict[str, Any]) -> str:
    """Per anchor and mode: anchor, BMM, Δ with its interval, Δ against the best anchor, where both land
    in the pretrained-to-experts range, and BMM at its defaults (one merge) against the search."""
    summary = results.get("summary")
    if not summary:
        return ""
    best = results.get("best_anchor")
    best_label = ANCHOR_LABELS.get(best, best) if best else "–"
    versus = f"Δ vs best anchor ({best_label})"
    header = [
        "anchor", "mode", "anchor", "BMM", "Δ [95% CI]", versus, "share of range: anchor → BMM",
        "BMM at defaults (Δ; share of the search's Δ)",
    ]  # fmt: skip
    proposed = any("candidate_score" in cell for cell in summary)
    if proposed:
        header.append("BMM at a proposed default (Δ; share; vs the defaults)")
    evidence = any("auto_score" in cell for cell in summary)
    if evidence:
        header.append("BMM at `lambda: auto` (Δ; share; vs the search; vs the defaults)")
    oracle = any("oracle_score" in cell for cell in summary)
    if oracle:
        header.append(
            "oracle: BMM searched on test, not a result (Δ; share of it validation finds; vs the search)"
        )
    label_free = [kind for kind in LABEL_FREE_NAMES if any(f"{kind}_score" in cell for cell in summary)]
    for kind in label_free:
        header.append(
            f"BMM searched with no labels, {LABEL_FREE_NAMES[kind]} "
            "(Δ; share; vs the search; vs the defaults)"
        )
    lines = table_head(header)
    for cell in summary:
        versus_best = (
            f"{100 * cell['delta_best_anchor']:+.1f} [{100 * cell['delta_best_anchor_low']:.1f}, "
            f"{100 * cell['delta_best_anchor_high']:.1f}]"
            if "delta_best_anchor" in cell
            else "–"
        )
        lands = " → ".join(
            share_text(range_share(results, cell[key])) for key in ("anchor_score", "bmm_score")
        )
        lines.append(
            f"| {ANCHOR_LABELS.get(cell['anchor'], cell['anchor'])} | {cell['mode']} | "
            f"{100 * cell['anchor_score']:.1f} | {100 * cell['bmm_score']:.1f} | "
            f"{100 * cell['delta']:+.1f} [{100 * cell['delta_low']:.1f}, {100 * cell['delta_high']:.1f}] | "
            f"{versus_best} | {lands} | {_defaults_cell(cell)} |"
            + (f" {_candidate_cell(cell)} |" if proposed else "")
            + (f" {_auto_cell(cell)} |" if evidence else "")
            + (f" {_oracle_cell(cell)} |" if oracle else "")
            + "".join(f" {_auto_cell(cell, kind)} |" for kind in label_free)
        )
    counts = results.get("verdict") or {}
    tally = "; ".join(
        f"{mode}: above its anchor for {c['above']} of {c['anchors']}, interval above zero for "
        f"{c['interval_above_zero']}"
        for mode, c in counts.items()
    )
    defaults = "; ".join(
        f"{mode}: {c['defaults_reach_80']} of the {c['search_gained']} anchors where the search gained"
        for mode, c in counts.items()
        if "search_gained" in c
    )
    best_note = "the best anchor is the one with the best validation average"
    text = "\n".join(lines) + f"\n\n{tally}. ({best_note}.)"
    if defaults:
        text += (
            f"\n\nBMM at its defaults (one merge, no trials) reaching {100 * DEFAULTS_BAR:.0f} % of the "
            f"searched Δ on test — {defaults}."
        )
    tried = "; ".join(
        f"{mode} at {_parameters(next(c for c in summary if c['mode'] == mode and 'candidate_score' in c))}: "
        f"{c['candidate_reach_80']} of the {c.get('candidate_measured', c['search_gained'])}"
        for mode, c in counts.items()
        if "candidate_reach_80" in c
    )
    if tried:
        text += f" A proposed default (`search.default_candidates`) reaching it — {tried}."
    automatic = "; ".join(
        f"{mode}: {c['auto_reach_80']} of the {c.get('auto_measured', c['search_gained'])}"
        for mode, c in counts.items()
        if "auto_reach_80" in c
    )
    if automatic:
        text += (
            " BMM at `lambda: auto` (λ per weight from the evidence, s 1; no validation data) reaching it "
            f"— {automatic}."
        )
    proposed_vs = _paired_tally(counts, "candidate", "defaults")
    if proposed_vs:
        text += f"\n\nThe proposed default paired against today's defaults on test — {proposed_vs}."
    against = _paired_tally(counts, "auto", "defaults")
    if against:
        text += f"\n\n`lambda: auto` paired against BMM at its defaults (λ 0.1, s 1) on test — {against}."
    for kind in label_free:
        reach = "; ".join(
            f"{mode}: {c.get(f'{kind}_reach_80', 0)} of the {c.get(f'{kind}_measured', 0)} where it ran and "
            f"the labelled search gained"
            for mode, c in counts.items()
            if c.get(f"{kind}_measured")
        )
        versus = _paired_tally(counts, kind, "defaults")
        if not reach:
            continue
        text += (
            f"\n\nThe search with no labels ({LABEL_FREE_NAMES[kind]}, same K) reaching "
            f"{100 * DEFAULTS_BAR:.0f} % of the labelled search's Δ on test — {reach}. "
            f"Paired against BMM at its defaults — {versus or '–'}."
        )
    both = _paired_tally(counts, "agreement", "entropy")
    if both:
        text += f" Agreement against entropy, paired — {both}."
    return text


def _paired_tally(counts: dict[str, dict[str, int]], kind: str, other: str) -> str:
    """Per mode: over how many anchors ``kind`` was above and below ``other`` on test, paired, and how
    often with the interval clear of zero (the counts of :func:`bench.merging.evidence.verdict`)."""
    return "; ".join(
        f"{mode}: above for {c.get(f'{kind}_above_{other}', 0)} of {c[f'{kind}_vs_{other}']} "
        f"({c.get(f'{kind}_surely_above_{other}', 0)} with the interval above zero), below for "
        f"{c.get(f'{kind}_below_{other}', 0)} ({c.get(f'{kind}_surely_below_{other}', 0)} with it below zero)"
        for mode, c in counts.items()
        if c.get(f"{kind}_vs_{other}")
    )


def _oracle_cell(cell: dict[str, Any]) -> str:
    """The search scored on test: its Δ over the anchor, the share of it the validation search found."""
    if "oracle_score" not in cell:
        return "–"
    found = cell.get("found_share")
    share = "–" if found is None else f"{100 * found:.0f}% found"
    versus = interval_text(cell["oracle_vs_search"], True) if cell.get("oracle_vs_search") else "–"
    low, high = 100 * cell["oracle_delta_low"], 100 * cell["oracle_delta_high"]
    delta = f"{100 * cell['oracle_delta']:+.1f} [{low:.1f}, {high:.1f}]"
    return f"{100 * cell['oracle_score']:.1f} ({delta}; {share}; {versus})"


LABEL_FREE_NAMES = {
    "agreement": "agreement with the experts",
    "agreement-last": "agreement with the experts at the last token",
    "entropy": "AdaMerging's entropy",
}


def _auto_cell(cell: dict[str, Any], kind: str = "auto") -> str:
    """A model chosen without validation labels (``lambda: auto``, a label-free search): against the
    anchor (share of the search's Δ), the labelled search and the defaults (both paired)."""
    if f"{kind}_score" not in cell:
        return "–"
    text = _defaults_cell(cell, kind)
    for key in (f"{kind}_vs_search", f"{kind}_vs_defaults"):
        text += f"; {interval_text(cell[key], True)}" if cell.get(key) else "; –"
    return text


def _candidate_cell(cell: dict[str, Any]) -> str:
    """A proposed default: against the anchor (share of the search's Δ) and today's defaults (paired)."""
    if "candidate_score" not in cell:
        return "–"
    versus = cell.get("candidate_vs_defaults")
    return _defaults_cell(cell, "candidate") + (f"; {interval_text(versus, True)}" if versus else "; –")


def _parameters(cell: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in (cell.get("candidate_parameters") or {}).items())


def best_models_markdown(results: dict[str, Any]) -> str:
    """Per mode, the BMM model chosen on validation among every search (main and variants) against the
    best anchor on test: the comparison a user makes before paying for a search."""
    picks = results.get("best_models")
    if not picks:
        return ""
    best = results.get("best_anchor")
    anchor = find_row(results, best) if best else None
    label = ANCHOR_LABELS.get(best, best) if best else "–"
    versus = f"Δ vs {label} [95% CI]"
    header = [
        "mode",
        "BMM model (chosen on validation)",
        "of",
        "validation",
        "test",
        "share of range",
        versus,
    ]
    lines = table_head(header)
    for mode, pick in picks.items():
        delta = pick.get("delta_best_anchor")
        lines.append(
            f"| {mode} | {pick['label']} | {pick['candidates']} | {100 * pick['validation_avg']:.1f} | "
            f"{100 * pick['avg']:.1f} | {share_text(range_share(results, pick['avg']))} | "
            + (interval_text(delta, True) if delta else "–")
            + " |"
        )
    if anchor and anchor["avg"] is not None:
        lines.append(
            f"| anchor | {label} (best anchor on validation) | | {100 * anchor['validation_avg']:.1f} | "
            f"{100 * anchor['avg']:.1f} | {share_text(range_share(results, anchor['avg']))} | |"
        )
    return (
        "\n".join(lines)
        + "\n\n`of`: how many searches (main and variants) the pick was chosen from, by validation "
        "average; Δ is paired over the same test examples."
    )


def _defaults_cell(cell: dict[str, Any], kind: str = "defaults") -> str:
    """One no-search merge (``defaults``, or a ``candidate`` default) against the anchor and the search."""
    if f"{kind}_score" not in cell:
        return "–"
    share = cell.get(f"{kind}_share")
    of_search = "search gained nothing" if share is None else f"{100 * share:.0f}%"
    at = f"{_parameters(cell)}: " if kind == "candidate" else ""
    return (
        f"{at}{100 * cell[f'{kind}_score']:.1f} ({100 * cell[f'{kind}_delta']:+.1f} "
        f"[{100 * cell[f'{kind}_delta_low']:.1f}, {100 * cell[f'{kind}_delta_high']:.1f}]; {of_search})"
    )


def ablation_table(results: dict[str, Any]) -> str:
    ablation = results.get("ablation")
    if not ablation:
        return ""
    names = {"grid": "shared-λ grid (s = 1)", "random": "random search", "bo": "BO (GP, EI)"}
    lines = [
        "| strategy | K | best validation avg | test avg | values found |",
        "|---|---|---|---|---|",
    ]
    for row in ablation["rows"]:
        values = ", ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in (row["best_values"] or {}).items()
        )
        lines.append(
            f"| {names.get(row['strategy'], row['strategy'])} | {row['budget']} | "
            f"{100 * row['validation']:.1f} | {100 * row['test']:.1f} | {values} |"
        )
    return (
        f"BMM over {ANCHOR_LABELS.get(ablation['anchor'], ablation['anchor'])}, {ablation['setting']}, "
        "same space and budget:\n\n" + "\n".join(lines)
    )


def data_table(results: dict[str, Any]) -> str:
    header = [
        "task",
        "classes",
        "train",
        "head",
        "validation",
        "test",
        "head",
        "pretrained (val)",
        "expert steps (kept / trained)",
        "held-out best",
        "expert s",
    ]
    lines = table_head(header)
    for task in results["tasks"]:
        counts = results["data"][task]["counts"]
        head = results["heads"].get(task, {})
        expert = results["experts"].get(task, {})
        cells = [
            task,
            results["data"][task]["classes"],
            counts["train"],
            counts.get("head", "–"),
            counts["validation"],
            counts["test"],
            "zero-shot" if head.get("kind") == "zero_shot" else f"C={head.get('C', '–')}",
            "–" if head.get("validation_accuracy") is None else f"{100 * head['validation_accuracy']:.1f}",
            f"{expert.get('kept_step', expert.get('steps', '–'))} / {expert.get('steps', '–')}",
            "–" if expert.get("held_out_best") is None else f"{100 * expert['held_out_best']:.1f}",
            expert.get("train_seconds", "–"),
        ]
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return "\n".join(lines)
