"""The run's headline evidence, from per-example test results: range, and what BMM adds.

Two questions decide whether a benchmark can tell merge methods apart and what it says:
*is there range* (experts well above the pretrained model and above Task Arithmetic, with
intervals), and *does BMM beat its anchor and the best anchor* (paired Δ with intervals,
and the share of the anchor-to-experts gap closed). Every figure here is a paired
bootstrap over the same test examples (:mod:`bench.merging.intervals`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bench.merging.intervals import interval, paired_difference

Flags = Mapping[str, Sequence[float]]


def _triple(values: tuple[float, float, float]) -> dict[str, float]:
    estimate, low, high = values
    return {"estimate": round(estimate, 4), "low": round(low, 4), "high": round(high, 4)}


def range_figures(indiv: Flags, pretrained: Flags | None, task_arithmetic: Flags | None) -> dict[str, Any]:
    """Experts, pretrained and Task Arithmetic test averages and the paired gaps between them."""
    out: dict[str, Any] = {"indiv": _triple(interval(indiv))}
    if pretrained is not None:
        out["pretrained"] = _triple(interval(pretrained))
        out["experts_minus_pretrained"] = _triple(paired_difference(indiv, pretrained))
    if task_arithmetic is not None:
        out["task_arithmetic"] = _triple(interval(task_arithmetic))
        out["experts_minus_task_arithmetic"] = _triple(paired_difference(indiv, task_arithmetic))
    return out


def best_anchor(rows: Sequence[Mapping[str, Any]]) -> str | None:
    """The merge anchor (not Pretrained) with the best *validation* average: chosen as a user would."""
    candidates = [
        r
        for r in rows
        if r["setting"] == "anchor" and r["anchor"] != "pretrained" and r.get("validation_avg") is not None
    ]
    return max(candidates, key=lambda r: r["validation_avg"])["anchor"] if candidates else None


def summary_row(
    anchor: str,
    setting: str,
    bmm: Flags,
    anchor_flags: Flags,
    best: Flags | None,
    indiv: Flags | None,
) -> dict[str, Any]:
    """One (anchor, mode) cell: both scores, Δ with its interval, Δ against the best anchor, gap closed."""
    anchor_score, bmm_score = interval(anchor_flags)[0], interval(bmm)[0]
    delta = paired_difference(bmm, anchor_flags)
    row: dict[str, Any] = {
        "anchor": anchor,
        "mode": setting,
        "anchor_score": round(anchor_score, 4),
        "bmm_score": round(bmm_score, 4),
        "delta": round(delta[0], 4),
        "delta_low": round(delta[1], 4),
        "delta_high": round(delta[2], 4),
        "above_anchor": delta[0] > 0,
        "interval_above_zero": delta[1] > 0,
    }
    if best is not None:
        versus_best = paired_difference(bmm, best)
        row.update(
            delta_best_anchor=round(versus_best[0], 4),
            delta_best_anchor_low=round(versus_best[1], 4),
            delta_best_anchor_high=round(versus_best[2], 4),
        )
    if indiv is not None:
        gap = interval(indiv)[0] - anchor_score
        row["gap_closed"] = round(delta[0] / gap, 4) if abs(gap) > 1e-9 else None
    return row


def verdict(summary: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """Per mode: over how many anchors BMM is above its anchor, and with the interval above zero;
    where the search gained, for how many BMM at its defaults reaches 80 % of that gain (the bar
    for a default worth documenting: one merge instead of a search); and for how many `lambda: auto`
    is above or below the defaults, paired (with the interval clear of zero: ``surely``)."""
    out: dict[str, dict[str, int]] = {}
    for row in summary:
        counts = out.setdefault(
            row["mode"],
            {"anchors": 0, "above": 0, "interval_above_zero": 0, "search_gained": 0, "defaults_reach_80": 0},
        )
        counts["anchors"] += 1
        counts["above"] += int(row["above_anchor"])
        counts["interval_above_zero"] += int(row["interval_above_zero"])
        if row.get("defaults_share") is not None:
            counts["search_gained"] += 1
            counts["defaults_reach_80"] += int(row["defaults_share"] >= DEFAULTS_BAR)
        # the same bar for each: a proposed default, λ from the evidence, a search with no labels
        for kind in ("candidate", "auto", "agreement", "agreement-last", "entropy"):
            if row.get(f"{kind}_share") is not None:  # measured where the search gained: out of how many
                counts[f"{kind}_measured"] = counts.get(f"{kind}_measured", 0) + 1
                counts[f"{kind}_reach_80"] = counts.get(f"{kind}_reach_80", 0) + int(
                    row[f"{kind}_share"] >= DEFAULTS_BAR
                )
        for key in (
            "candidate_vs_defaults",
            "auto_vs_defaults",
            "agreement_vs_defaults",
            "entropy_vs_defaults",
            "agreement_vs_entropy",
        ):
            versus = row.get(key)  # the choice itself: would it be the better default (or objective)?
            if versus is None:
                continue
            kind, _, other = key.partition("_vs_")
            for name, won in (
                (key, True),
                (f"{kind}_above_{other}", versus["estimate"] > 0),
                (f"{kind}_below_{other}", versus["estimate"] < 0),
                (f"{kind}_surely_above_{other}", versus["low"] > 0),
                (f"{kind}_surely_below_{other}", versus["high"] < 0),
            ):
                counts[name] = counts.get(name, 0) + int(won)
    return out


def best_models(
    candidates: Sequence[Mapping[str, Any]], best_anchor_flags: Flags | None
) -> dict[str, dict[str, Any]]:
    """Per mode, the BMM model a user would keep (best *validation* average over the main searches and
    every variant) and its paired test Δ against the best anchor: does a search beat one merge?

    Each candidate has ``label``, ``mode``, ``validation_avg``, ``avg`` and ``flags`` (per-example
    test results, seed-averaged)."""
    out: dict[str, dict[str, Any]] = {}
    for mode in dict.fromkeys(c["mode"] for c in candidates):
        scored = [c for c in candidates if c["mode"] == mode and c.get("validation_avg") is not None]
        if not scored:
            continue
        pick = max(scored, key=lambda c: c["validation_avg"])
        entry: dict[str, Any] = {
            "label": pick["label"],
            "validation_avg": pick["validation_avg"],
            "avg": pick["avg"],
            "candidates": len(scored),
        }
        if best_anchor_flags is not None:
            entry["delta_best_anchor"] = _triple(paired_difference(pick["flags"], best_anchor_flags))
        out[mode] = entry
    return out


DEFAULTS_BAR = 0.8  # defaults that reach this share of the searched Δ on test become bmm's documented ones
