"""Searches that change one choice of the main ones (blocks, budget, task balance), read pairwise.

Each variant runs ``mergekit-bmm-search`` over its anchors and settings exactly as the main
searches do but for the fields it sets, and its best model is scored on the same validation and
test examples. On test it gets two paired differences with 95 % bootstrap intervals: against the
main search of its cell (does the change help?) and against the anchor itself. Which variant to
keep is decided on validation (``validation_avg``); test only says whether that holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

from bench.merging.config import RunConfig, VariantSpec
from bench.merging.scoring import mean
from bench.merging.searches import seed_record


def run_variants(
    config: RunConfig, art: Any, results: dict[str, Any], one_search: Callable[..., dict[str, Any]]
) -> None:
    """Every variant's searches (each resumes or is reused from the cache like the main ones)."""
    rows = results.setdefault("variants", {})
    cells = [(v, a, s) for v in config.variants for a in v.anchors for s in v.settings]
    for variant, anchor, setting in tqdm(cells, desc="variant searches", leave=False):
        outcomes = [one_search(anchor, setting, "bo", seed, variant=variant) for seed in variant.seeds]
        rows.setdefault(variant.name, {})[f"{anchor}/{setting}"] = _row(
            variant, anchor, setting, outcomes, art
        )
        row = rows[variant.name][f"{anchor}/{setting}"]
        tqdm.write(
            f"variant   {variant.name:16s} {anchor:16s} {setting:13s} K={row['trials']}  "
            f"validation {100 * row['validation_avg']:.1f}  test {100 * row['avg']:.1f}"
        )


def _row(
    variant: VariantSpec, anchor: str, setting: str, outcomes: list[dict[str, Any]], art: Any
) -> dict[str, Any]:
    seeds = [seed_record(outcome, list(art.tasks)) for outcome in outcomes]
    return {
        "variant": variant.model_dump(exclude={"anchors", "settings", "seeds"}),
        "anchor": anchor,
        "setting": setting,
        "trials": outcomes[0]["trials"],
        "avg": round(mean([seed["avg"] for seed in seeds]), 4),
        "validation_avg": round(mean([seed["validation_avg"] for seed in seeds]), 4),
        "seeds": seeds,
        "seconds": round(sum(outcome["wall"] for outcome in outcomes), 1),
    }


def variant_intervals(
    results: dict[str, Any],
    flags: Callable[[str], dict[str, list[bool]]],
    merged: dict[tuple[str, str], dict[str, Any]],
    anchors: dict[str, dict[str, list[bool]]],
) -> dict[tuple[str, str], dict[str, list[float]]]:
    """Paired test differences of every variant row against its main search (or the variant it
    names in ``against``), its anchor and the best anchor; returns each row's per-example flags
    (seed-averaged), keyed by (variant, cell)."""
    from bench.merging.intervals import paired_difference, seed_mean

    expected = {
        (name, cell): seed_mean([flags(seed["model_id"]) for seed in row["seeds"]])
        for name, rows in results["variants"].items()
        for cell, row in rows.items()
    }
    for (name, cell), mine in expected.items():
        row = results["variants"][name][cell]
        against = row["variant"].get("against")
        if against is None:
            other = merged.get((row["anchor"], row["setting"]))
            other_row = next(
                (
                    r
                    for r in results["rows"]
                    if (r["anchor"], r["setting"]) == (row["anchor"], row["setting"])
                ),
                {},
            )
        else:
            other = expected.get((against, cell))
            other_row = results["variants"].get(against, {}).get(cell, {})
        if other is not None:
            row["delta_main"] = [round(v, 4) for v in paired_difference(mine, other)]
            row["main_validation_avg"] = other_row.get("validation_avg")
            row["main_avg"] = other_row.get("avg")
        if row["anchor"] in anchors:
            anchor = anchors[row["anchor"]]
            row["delta_anchor"] = [round(v, 4) for v in paired_difference(mine, anchor)]
        best = results.get("best_anchor")
        if best in anchors:
            row["delta_best_anchor"] = [round(v, 4) for v in paired_difference(mine, anchors[best])]
    return expected


def _signed(figure: list[float] | None) -> str:
    if not figure:
        return "—"
    estimate, low, high = figure
    return f"{100 * estimate:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}]"


def variant_rows(results: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every variant row in the config's order (variants, then their anchors): the report and its
    pictures read alike whether the results are fresh or read back from JSON written with sorted keys."""
    variants = results.get("variants") or {}
    specs = {v["name"]: v.get("anchors") or [] for v in (results.get("config") or {}).get("variants") or []}
    names = [n for n in specs if n in variants] + [n for n in variants if n not in specs]
    out = []
    for name in names:
        anchors = specs.get(name, [])
        rank = {anchor: i for i, anchor in enumerate(anchors)}
        rows = sorted(variants[name].values(), key=lambda r: rank.get(r["anchor"], len(anchors)))
        out += [(name, row) for row in rows]
    return out


def variants_markdown(results: dict[str, Any]) -> str:
    """One line per variant cell: its change, validation and test against the main search's."""
    lines = [
        "Each variant is paired with the main search of its cell unless it names another variant "
        "(`against`); validation decides, test says whether it holds.",
        "",
        "| variant | change | against | anchor | setting | K | validation (theirs) | test (theirs) | "
        "Δ test vs theirs | Δ test vs anchor | Δ test vs best anchor |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in variant_rows(results):
        fields = row["variant"].items()
        change = ", ".join(f"{k} {v}" for k, v in fields if k not in ("name", "against") and v is not None)
        against = row["variant"].get("against") or "main search"
        main_validation = row.get("main_validation_avg")
        main_test = row.get("main_avg")
        lines.append(
            f"| {name} | {change or '—'} | {against} | {row['anchor']} | {row['setting']} | "
            f"{row['trials']} | "
            f"{100 * row['validation_avg']:.1f}"
            + (f" ({100 * main_validation:.1f})" if main_validation is not None else "")
            + f" | {100 * row['avg']:.1f}"
            + (f" ({100 * main_test:.1f})" if main_test is not None else "")
            + f" | {_signed(row.get('delta_main'))} | {_signed(row.get('delta_anchor'))} "
            f"| {_signed(row.get('delta_best_anchor'))} |"
        )
    return "\n".join(lines)
