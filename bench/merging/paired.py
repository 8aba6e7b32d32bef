"""Paired test figures for every row of a run: intervals, Δ against the anchor and the best anchor,
BMM at its defaults, variants, and the model to keep (:mod:`bench.merging.evidence` does the figures;
this module gathers each model's per-example test results from the score cache)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from bench.merging import report
from bench.merging.artifacts import Artifacts
from bench.merging.cache import ScoreCache
from bench.merging.config import RunConfig, limits

# searches scored with no labels (config `search.label_free`), by name
LABEL_FREE = ("agreement", "agreement-last", "entropy")


def add_intervals(config: RunConfig, cache_dir: Path, art: Artifacts, results: dict[str, Any]) -> None:
    """95 % bootstrap intervals of every row's test average; for BMM rows the paired Δ against
    their anchor and against the best anchor (seed-averaged per example), the share of the
    anchor-to-experts gap closed; the run's range figures and per-cell summary
    (:mod:`bench.merging.evidence`)."""
    from bench.merging.evidence import best_anchor, best_models, range_figures, summary_row, verdict
    from bench.merging.intervals import interval, paired_difference, seed_mean
    from bench.merging.scoring import correct_flags

    cache, tasks = ScoreCache(cache_dir), list(art.tasks.values())
    test_limit = limits(config).get("test")

    def flags(model_id: str) -> dict[str, list[bool]]:
        return {
            t.name: correct_flags(model_id, t, "test", config.max_length, cache, test_limit) for t in tasks
        }

    indiv = {
        t.name: correct_flags(
            art.records[f"expert/{t.name}"]["fingerprint"], t, "test", config.max_length, cache, test_limit
        )
        for t in tasks
        if f"expert/{t.name}" in art.records
    }
    indiv_flags = indiv if len(indiv) == len(tasks) else None
    if indiv_flags:
        results["indiv_ci"] = [round(v, 4) for v in interval(indiv_flags)]
    anchors: dict[str, dict[str, list[bool]]] = {}
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for row in results["rows"]:
        try:
            if row["setting"] == "anchor" and row.get("model_id"):
                anchors[row["anchor"]] = flags(row["model_id"])
                row["ci"] = [round(v, 4) for v in interval(anchors[row["anchor"]])]
            elif row.get("seeds"):
                expected = seed_mean([flags(seed["model_id"]) for seed in row["seeds"]])
                merged[(row["anchor"], row["setting"])] = expected
                row["ci"] = [round(v, 4) for v in interval(expected)]
                row["seed_std"] = round(float(_std([seed["avg"] for seed in row["seeds"]])), 4)
        except KeyError as missing:  # a row scored before per-example scores were kept
            tqdm.write(f"intervals: {missing}")
    if indiv_flags:
        ta_flags = anchors.get("task_arithmetic")
        results["range"] = range_figures(indiv_flags, anchors.get("pretrained"), ta_flags)
    best = best_anchor(results["rows"])
    summary = []
    for (anchor, setting), expected in merged.items():
        if anchor not in anchors:
            continue
        cell = summary_row(anchor, setting, expected, anchors[anchor], anchors.get(best), indiv_flags)
        row = report.find_row(results, anchor, setting)
        scored: dict[str, dict[str, list[bool]]] = {}  # each model's flags, read once
        # one merge, no search (today's defaults, a proposed one, λ from the evidence), then the
        # searches that read no labels (agreement with the experts, AdaMerging's entropy)
        merges = {kind: row.get(kind) or {} for kind in ("defaults", "candidate", "auto")}
        merges.update(row.get("label_free") or {})
        if row.get("oracle"):  # the search scored on test: how much of its gain validation finds
            merges["oracle"] = row["oracle"]
        for kind, merge in merges.items():
            if not merge.get("model_id"):
                continue
            scored[kind] = flags(merge["model_id"])
            estimate, low, high = paired_difference(scored[kind], anchors[anchor])
            if kind in ("candidate", "auto", *LABEL_FREE):  # against the search it replaces, the defaults
                cell[f"{kind}_vs_search"] = _paired(scored[kind], expected)
                if "defaults" in scored:
                    cell[f"{kind}_vs_defaults"] = _paired(scored[kind], scored["defaults"])
            if kind == "oracle":
                cell["oracle_vs_search"] = _paired(scored[kind], expected)
                cell["found_share"] = round(cell["delta"] / estimate, 4) if estimate > 0 else None
            if kind == "entropy" and "agreement" in scored:  # the two label-free objectives
                cell["agreement_vs_entropy"] = _paired(scored["agreement"], scored["entropy"])
            cell.update(
                {
                    f"{kind}_score": merge["avg"],
                    f"{kind}_delta": round(estimate, 4),
                    f"{kind}_delta_low": round(low, 4),
                    f"{kind}_delta_high": round(high, 4),
                    f"{kind}_share": round(estimate / cell["delta"], 4) if cell["delta"] > 0 else None,
                }
            )
            if merge.get("parameters"):
                cell[f"{kind}_parameters"] = merge["parameters"]
        summary.append({**cell, "best_anchor": best})
        row["delta"] = [cell["delta"], cell["delta_low"], cell["delta_high"]]
        row["gap_closed"] = cell.get("gap_closed")
        if best is not None:
            row["delta_best_anchor"] = [
                cell["delta_best_anchor"],
                cell["delta_best_anchor_low"],
                cell["delta_best_anchor_high"],
            ]
    results["summary"] = summary
    results["best_anchor"] = best
    searched = [  # every search's best model, main and variants: what the model to keep is chosen from
        {
            "label": f"{anchor} ({setting})",
            "mode": setting,
            "flags": expected,
            **_row_scores(results, anchor, setting),
        }
        for (anchor, setting), expected in merged.items()
    ]
    if results.get("variants"):
        from bench.merging.variants import variant_intervals

        for (name, cell), expected in variant_intervals(results, flags, merged, anchors).items():
            row = results["variants"][name][cell]
            label = f"{row['anchor']} ({row['setting']}, {name})"
            searched.append(
                {"label": label, "mode": row["setting"], "flags": expected}
                | {key: row[key] for key in ("validation_avg", "avg")}
            )
    results["best_models"] = best_models(searched, anchors.get(best))
    results["verdict"] = verdict(summary)


def _paired(first: dict[str, list[bool]], second: dict[str, list[bool]]) -> dict[str, float]:
    """The paired Δ first − second over the same test examples, with its 95 % interval."""
    from bench.merging.intervals import paired_difference

    estimate, low, high = paired_difference(first, second)
    return {"estimate": round(estimate, 4), "low": round(low, 4), "high": round(high, 4)}


def _row_scores(results: dict[str, Any], anchor: str, setting: str) -> dict[str, float | None]:
    row = report.find_row(results, anchor, setting) or {}
    return {"validation_avg": row.get("validation_avg"), "avg": row.get("avg")}


def _std(values: list[float]) -> float:
    import statistics

    return statistics.stdev(values) if len(values) > 1 else 0.0
