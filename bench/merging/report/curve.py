"""The curve the paper draws: merge methods against the number of tasks (nested runs at 8, 12, 16 tasks).

``python -m bench.merging curve RESULTS.json ...`` reads finished runs' ``results.json`` (one per task
count) and writes ``curve.md`` and ``curve.png``: per task count, where Task Arithmetic, TSV-M, ISO-CTS
and BMM over each of them the run searched (each mode, searched and at its defaults) land in the
pretrained → experts range, and BMM over ISO-CTS and over TSV-M minus that anchor with its paired
interval; the oracle (scored on test) beside it where the run has one. A run reported in parts (one
``results.json`` per pass, e.g. a data-free and a data-assisted pass over the same cache) is read as one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.merging.report.cells import interval_text
from bench.merging.report.plots import drawn_once
from bench.merging.report.rows import find_row, range_share

ANCHORS = ("task_arithmetic", "tsv", "iso_cts")
MODES = ("data_free", "data_assisted")
VERSUS = {"iso_cts": "ISO-CTS", "tsv": "TSV-M"}  # the strong anchors BMM is set against, by name


def _cell(results: dict[str, Any], anchor: str, mode: str) -> dict[str, Any]:
    return next((c for c in results.get("summary") or [] if (c["anchor"], c["mode"]) == (anchor, mode)), {})


def _mean_cosine(results: dict[str, Any], runs: list[dict[str, Any]]) -> tuple[float | None, str | None]:
    """The run's mean pairwise task-vector cosine, or, for a run that did not record it (zeroshot8's
    first), the mean over its own pairs in a run of more tasks that did: nested runs share their experts
    through the cache (one key per task; zeroshot8's first run trained its own with the same seeds and
    settings). The second item names that run."""
    own = (results.get("task_cosines") or {}).get("mean")
    if own is not None:
        return own, None
    tasks = set(results["tasks"])
    for other in runs:
        pairs = (other.get("task_cosines") or {}).get("pairs") or {}
        if other is results or not tasks <= set(other["tasks"]) or not pairs:
            continue
        mine = [value for pair, value in pairs.items() if set(pair.split(" / ")) <= tasks]
        if len(mine) == len(tasks) * (len(tasks) - 1) // 2:
            return round(sum(mine) / len(mine), 4), other["name"]
    return None, None


def _joined(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One run from its parts: rows by (anchor, setting) and summary cells by (anchor, mode), the first
    part's value winning for a key that several hold (passes over one cache agree on what they share),
    the later parts filling what it lacks (an oracle, the other mode)."""
    joined = dict(parts[0])
    for field, key in (("rows", ("anchor", "setting")), ("summary", ("anchor", "mode"))):
        merged: dict[tuple, dict[str, Any]] = {}
        for part in parts:
            for item in part.get(field) or []:
                ident = tuple(item[name] for name in key)
                merged[ident] = {**item, **merged.get(ident, {})}
        joined[field] = list(merged.values())
    return joined


def join_parts(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs with the same name and tasks read as one (see ``_joined``), in the order first given."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for results in runs:
        groups.setdefault((results["name"], tuple(results["tasks"])), []).append(results)
    return [_joined(parts) for parts in groups.values()]


def curve_points(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One point per run, ordered by its number of tasks: each model's share of the range, and BMM over
    ISO-CTS and over TSV-M against that anchor (paired Δ and interval), searched and by the oracle."""
    runs = join_parts(runs)
    points = []
    for results in sorted(runs, key=lambda r: len(r["tasks"])):
        shares: dict[str, float | None] = {}
        for anchor in ANCHORS:
            row = find_row(results, anchor)
            shares[anchor] = range_share(results, row["avg"]) if row else None
        for anchor in ANCHORS:
            for mode in MODES:
                row = find_row(results, anchor, mode)
                if row:
                    shares[f"bmm over {anchor} ({mode})"] = range_share(results, row["avg"])
                    defaults = row.get("defaults") or {}
                    if defaults.get("avg") is not None:
                        shares[f"bmm over {anchor} ({mode}), defaults"] = range_share(
                            results, defaults["avg"]
                        )
        versus = {}
        for anchor, label in VERSUS.items():
            for mode in MODES:
                cell = _cell(results, anchor, mode)
                for prefix, key in (
                    ("", f"over {label}, {mode}"),
                    ("oracle_", f"over {label}, {mode}, oracle"),
                ):
                    if f"{prefix}delta" in cell:
                        versus[key] = {
                            "estimate": cell[f"{prefix}delta"],
                            "low": cell[f"{prefix}delta_low"],
                            "high": cell[f"{prefix}delta_high"],
                        }
        cosine, cosine_from = _mean_cosine(results, runs)
        points.append(
            {
                "name": results["name"],
                "tasks": len(results["tasks"]),
                "shares": shares,
                "versus": versus,
                "task_cosine": cosine,
                "task_cosine_from": cosine_from,
            }
        )
    return points


def curve_markdown(points: list[dict[str, Any]]) -> str:
    names = list(dict.fromkeys(name for point in points for name in point["shares"]))
    lines = ["| model | " + " | ".join(f"{p['tasks']} tasks ({p['name']})" for p in points) + " |"]
    lines.append("|---|" + "---|" * len(points))
    for name in names:
        cells = ["–" if p["shares"].get(name) is None else f"{100 * p['shares'][name]:.0f} %" for p in points]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    cells = [
        "–"
        if p.get("task_cosine") is None
        else f"{p['task_cosine']:+.3f}"
        + (f" ({p['task_cosine_from']}'s pairs)" if p.get("task_cosine_from") else "")
        for p in points
    ]
    lines.append("| experts' task vectors: mean pairwise cosine | " + " | ".join(cells) + " |")
    keys = list(dict.fromkeys(key for point in points for key in point["versus"]))
    lines += [
        "",
        "| BMM − the anchor it starts from (test, paired) | "
        + " | ".join(f"{p['tasks']} tasks" for p in points)
        + " |",
    ]
    lines.append("|---|" + "---|" * len(points))
    for key in keys:
        cells = []
        for point in points:
            figure = point["versus"].get(key)
            cells.append("–" if figure is None else interval_text(figure, True))
        lines.append(
            f"| {key}{' (test as objective: a ceiling)' if 'oracle' in key else ''} | "
            + " | ".join(cells)
            + " |"
        )
    return (
        "Share of the pretrained → experts range (test average) per number of tasks (with how far the "
        "experts pull the encoder apart: the mean cosine between two of their task vectors), and BMM over "
        "ISO-CTS and over TSV-M against that anchor (points, 95 % paired interval).\n\n" + "\n".join(lines)
    )


@drawn_once
def plot_curve(points: list[dict[str, Any]], path: Path) -> Path | None:
    from bench.merging.report.plots import _pyplot, _save

    if not points:
        return None
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    counts = [p["tasks"] for p in points]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for name in dict.fromkeys(n for p in points for n in p["shares"] if "defaults" not in n):
        values = [None if p["shares"].get(name) is None else 100 * p["shares"][name] for p in points]
        anchor = next(a for a in ANCHORS if a in name)  # an anchor and BMM over it in one colour
        style = ":" if name == anchor else "--" if "data_assisted" in name else "-"
        left.plot(
            counts,
            values,
            marker="s" if name == anchor else "o",
            linestyle=style,
            color=colours[ANCHORS.index(anchor)],
            label=name,
        )
    left.set_xlabel("tasks merged")
    left.set_ylabel("share of the pretrained → experts range (%)")
    left.set_xticks(counts)
    left.legend(fontsize=7)
    keys = list(dict.fromkeys(k for p in points for k in p["versus"]))
    bases = list(dict.fromkeys(key.removesuffix(", oracle") for key in keys))
    spread = 0.06 * (max(counts) - min(counts) or 8) / max(len(keys), 1)  # side by side, not on one x
    for index, key in enumerate(keys):
        held = [p for p in points if key in p["versus"]]
        figures = [p["versus"][key] for p in held]
        ys = [100 * f["estimate"] for f in figures]
        # a search and its oracle alike
        colour = colours[bases.index(key.removesuffix(", oracle")) % len(colours)]
        right.errorbar(
            [p["tasks"] + (index - (len(keys) - 1) / 2) * spread for p in held],
            ys,
            yerr=[
                [y - 100 * f["low"] for y, f in zip(ys, figures)],
                [100 * f["high"] - y for y, f in zip(ys, figures)],
            ],
            marker="o",
            capsize=3,
            label=key,
            color=colour,
            linestyle="--" if "oracle" in key else "-",
            markerfacecolor="white" if "oracle" in key else None,
        )
    right.axhline(0, color="gray", linewidth=1)
    right.set_xlabel("tasks merged")
    right.set_ylabel("BMM − the anchor it starts from (test points)")
    right.set_xticks(counts)
    if right.get_legend_handles_labels()[0]:
        right.legend(fontsize=7)
    else:  # no BMM over ISO-CTS or TSV-M in these runs yet
        right.text(
            0.5, 0.5, "no BMM over ISO-CTS or TSV-M yet", ha="center", va="center", transform=right.transAxes
        )
    return _save(fig, path, 110)


def write_curve(result_files: list[Path], out: Path) -> Path:
    import json

    runs = [json.loads(Path(path).read_text(encoding="utf-8")) for path in result_files]
    points = curve_points(runs)
    out.mkdir(parents=True, exist_ok=True)
    text = ["# BMM against the number of tasks", "", curve_markdown(points), ""]
    if plot_curve(points, out / "curve.png"):
        text += ["![the curve](curve.png)", ""]
    (out / "curve.md").write_text("\n".join(text), encoding="utf-8")
    (out / "curve.json").write_text(json.dumps(points, indent=2) + "\n", encoding="utf-8")
    return out / "curve.md"
