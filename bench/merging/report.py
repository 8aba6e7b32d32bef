"""Results: ``results.json``, a Markdown table and a per-task bar chart.

``results.json`` (the shape the full benchmark keeps): ``tasks``; ``indiv`` (each expert
on its own test split); ``rows``, one per (anchor, setting) with ``avg`` and ``per_task``
test accuracies, ``validation`` accuracies, the hyperparameters found and the search
budget; plus data sizes, head/expert records and timings. The Markdown table shows
absolute test accuracies and where each row sits between Task Arithmetic and the experts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.merging.cache import write_json
from bench.merging.evidence import DEFAULTS_BAR
from mergekit_bmm.core.module_map import GROUP_NAMES

SPLITS = ("train", "validation", "test")


def base_results(config, art) -> dict[str, Any]:
    tasks = list(art.tasks)
    results: dict[str, Any] = {
        "name": config.name,
        "encoder": config.encoder.name,
        "tasks": tasks,
        "config": config.model_dump(mode="json"),
        "data": {
            name: {"counts": task.data.counts, "classes": len(task.data.labels)}
            for name, task in art.tasks.items()
        },
        "indiv": {},
        "indiv_validation": {},
        "rows": [],
        "heads": {},
        "experts": {},
        "timings": {},
        "sizes": {},
    }
    for name in tasks:
        head = art.records.get(f"head/{name}")
        if head:
            results["heads"][name] = {
                "kind": head["info"].get("kind", "logistic"),
                "C": head["info"].get("C"),
                "validation_accuracy": head["info"]["validation_accuracy"],
                "seconds": head["seconds"],
            }
        expert = art.records.get(f"expert/{name}")
        if expert:
            info = expert["info"]
            results["experts"][name] = {
                key: info[key]
                for key in ("steps", "epochs", "train_seconds", "examples_per_second", "loss_curve", "bytes")
            }
            for key in ("max_steps", "held_out_curve", "kept_step", "held_out_best", "stopped_early"):
                if key in info:
                    results["experts"][name][key] = info[key]
    if results["heads"]:
        results["timings"]["heads_seconds"] = round(sum(h["seconds"] for h in results["heads"].values()), 1)
    if results["experts"]:
        results["timings"]["experts_seconds"] = round(
            sum(e["train_seconds"] for e in results["experts"].values()), 1
        )
        results["sizes"]["expert_bytes"] = next(iter(results["experts"].values()))["bytes"]
    encoder = art.records.get("encoder")
    if encoder:
        results["sizes"]["encoder_bytes"] = encoder["info"]["bytes"]
    return results


def add_row(
    results: dict[str, Any],
    anchor: str,
    setting: str,
    scores: dict[tuple[str, str], float],
    hyperparameters: dict[str, Any],
    budget: int | None = None,
) -> dict[str, Any]:
    tasks = results["tasks"]
    row = {
        "anchor": anchor,
        "setting": setting,
        "avg": None,
        "per_task": {},
        "validation_avg": None,
        "validation": {},
        "hyperparameters": hyperparameters,
        "budget": budget,
    }
    for split, key, avg_key in (("test", "per_task", "avg"), ("validation", "validation", "validation_avg")):
        values = {task: scores[(task, split)] for task in tasks if (task, split) in scores}
        row[key] = {task: round(value, 4) for task, value in values.items()}
        if len(values) == len(tasks):
            row[avg_key] = round(sum(values.values()) / len(values), 4)
    results["rows"] = [r for r in results["rows"] if (r["anchor"], r["setting"]) != (anchor, setting)] + [row]
    return row


def find_row(results, anchor: str, setting: str = "anchor") -> dict[str, Any] | None:
    """The row of ``anchor`` in ``setting`` (``anchor``, ``data_free``, ``data_assisted``), if any."""
    return next((r for r in results["rows"] if (r["anchor"], r["setting"]) == (anchor, setting)), None)


_row = find_row


def dynamic_range(results: dict[str, Any]) -> dict[str, float] | None:
    """Test averages of Pretrained, TA and the experts, and the TA-to-experts gap."""
    tasks = results["tasks"]
    if len(results["indiv"]) != len(tasks):
        return None
    indiv = sum(results["indiv"].values()) / len(tasks)
    out = {"indiv": round(indiv, 4)}
    pretrained = _row(results, "pretrained")
    if pretrained and pretrained["avg"] is not None:
        out["pretrained"] = pretrained["avg"]
    ta = _row(results, "task_arithmetic")
    if ta and ta["avg"] is not None:
        out["task_arithmetic"] = ta["avg"]
        out["gap_ta_to_indiv"] = round(indiv - ta["avg"], 4)
    return out


def range_share(results: dict[str, Any], avg: float | None) -> float | None:
    """Where a test average lands between Pretrained (0) and the experts (1): how the paper's tables
    read across benchmarks, whatever the anchor."""
    span = dynamic_range(results)
    if avg is None or not span or "pretrained" not in span:
        return None
    width = span["indiv"] - span["pretrained"]
    return (avg - span["pretrained"]) / width if abs(width) > 1e-9 else None


def _share(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def markdown(results: dict[str, Any]) -> str:
    """The per-task test table (accuracy, %), with the validation average alongside."""
    tasks = results["tasks"]
    header = ["method", *tasks, "avg (test)", "avg (val)", "hyperparameters"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

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
    ta = _row(results, "task_arithmetic")
    if ta and "validation_sweep" in ta["hyperparameters"]:
        sweep = ta["hyperparameters"]["validation_sweep"]
        text += "\n\nTask Arithmetic weight sweep (validation avg): " + ", ".join(
            f"{w}: {100 * v:.1f}" for w, v in sweep.items()
        )
    return text


ANCHOR_LABELS = {
    "pretrained": "Pretrained",
    "task_arithmetic": "Task Arithmetic",
    "ties": "TIES",
    "regmean": "RegMean",
    "tsv": "TSV-M",
    "wudi": "WUDI",
    "iso_cts": "ISO-CTS",
    "ace": "ACE",
}
SETTING_LABELS = {"anchor": "", "data_free": " + BMM (data-free)", "data_assisted": " + BMM (data-assisted)"}


def _values(row: dict[str, Any]) -> str:
    hyper = row["hyperparameters"]
    if row["setting"] == "anchor":
        return ", ".join(f"{k}={v}" for k, v in hyper.items() if k != "validation_sweep" and v is not None)
    values = hyper.get("best_values") or {}
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())


def _ci(row_or_values) -> str:
    values = row_or_values.get("ci") if isinstance(row_or_values, dict) else row_or_values
    return f" [{100 * values[1]:.1f}, {100 * values[2]:.1f}]" if values else ""


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
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def pct(value) -> str:
        return "–" if value is None else f"{100 * value:.1f}"

    anchors = list(dict.fromkeys(r["anchor"] for r in results["rows"]))
    for anchor in anchors:
        base = _row(results, anchor)
        for setting in ("anchor", "data_free", "data_assisted"):
            row = _row(results, anchor, setting)
            if row is None or row["avg"] is None:
                continue
            name = ANCHOR_LABELS.get(anchor, anchor) + SETTING_LABELS[setting]
            change = spread = ""
            share = _share(range_share(results, row["avg"]))
            if setting != "anchor":
                name = f"**{name}**"
                delta = row.get("delta")
                if delta:
                    change = f"{100 * delta[0]:+.1f}{_ci(delta)}"
                elif base and base["avg"] is not None:
                    change = f"{100 * (row['avg'] - base['avg']):+.1f}"
                seeds = row.get("seeds") or []
                if len(seeds) > 1:
                    spread = f"{len(seeds)} seeds, ±{100 * row['seed_std']:.1f}"
            cells = [pct(row["per_task"].get(task)) for task in tasks]
            lines.append(
                f"| {name} | "
                + " | ".join(cells)
                + f" | {pct(row['avg'])}{_ci(row)} | {change} | {share} | {spread} "
                f"| {row.get('budget') or ''} | {_values(row)} |"
            )
    if len(results["indiv"]) == len(tasks):
        cells = [pct(results["indiv"][task]) for task in tasks]
        avg = sum(results["indiv"].values()) / len(tasks)
        ci = _ci(results.get("indiv_ci"))
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


def _interval(figure: dict[str, float], signed: bool = False) -> str:
    sign = "+" if signed else ""
    return f"{100 * figure['estimate']:{sign}.1f} [{100 * figure['low']:.1f}, {100 * figure['high']:.1f}]"


def range_markdown(results: dict[str, Any]) -> str:
    """Can this run tell merge methods apart? Experts against Pretrained and Task Arithmetic."""
    figures = results.get("range")
    if not figures:
        return ""
    parts = [f"experts (Indiv.) {_interval(figures['indiv'])}"]
    if "pretrained" in figures:
        parts.append(f"Pretrained {_interval(figures['pretrained'])}")
    if "task_arithmetic" in figures:
        parts.append(f"Task Arithmetic {_interval(figures['task_arithmetic'])}")
    gaps = [
        f"experts − {label} **{_interval(figures[key], True)}**"
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
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for cell in summary:
        versus_best = (
            f"{100 * cell['delta_best_anchor']:+.1f} [{100 * cell['delta_best_anchor_low']:.1f}, "
            f"{100 * cell['delta_best_anchor_high']:.1f}]"
            if "delta_best_anchor" in cell
            else "–"
        )
        lands = " → ".join(_share(range_share(results, cell[key])) for key in ("anchor_score", "bmm_score"))
        lines.append(
            f"| {ANCHOR_LABELS.get(cell['anchor'], cell['anchor'])} | {cell['mode']} | "
            f"{100 * cell['anchor_score']:.1f} | {100 * cell['bmm_score']:.1f} | "
            f"{100 * cell['delta']:+.1f} [{100 * cell['delta_low']:.1f}, {100 * cell['delta_high']:.1f}] | "
            f"{versus_best} | {lands} | {_defaults_cell(cell)} |"
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
    return text


def _defaults_cell(cell: dict[str, Any]) -> str:
    if "defaults_score" not in cell:
        return "–"
    share = cell.get("defaults_share")
    of_search = "search gained nothing" if share is None else f"{100 * share:.0f}%"
    return (
        f"{100 * cell['defaults_score']:.1f} ({100 * cell['defaults_delta']:+.1f} "
        f"[{100 * cell['defaults_delta_low']:.1f}, {100 * cell['defaults_delta_high']:.1f}]; {of_search})"
    )


def diagnostics_markdown(results: dict[str, Any]) -> str:
    """How far each BMM merge went from its anchor, and how well U_tᵀU_t stands in for each
    expert's activation Gram (bench/merging/diagnostics.py)."""
    moved_rows = [r for r in results["rows"] if r.get("moved")]
    parts = []
    if moved_rows:
        groups = [g for g in GROUP_NAMES if any(g in r["moved"] for r in moved_rows)]
        header = ["anchor", "mode", "validation: anchor → BMM", *groups]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
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
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
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
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
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
        "task against its anchor.\n\n" + "\n".join(lines)
    )


def plot_expert_curves(results: dict[str, Any], path: Path) -> Path | None:
    """Each expert's held-out accuracy while it trains, the kept step marked: did it plateau?"""
    experts = results.get("experts", {})
    curves = {task: e["held_out_curve"] for task, e in experts.items() if e.get("held_out_curve")}
    if not curves:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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


def runtime_table(results: dict[str, Any]) -> str:
    """Paper Table 5 in kind: where a BMM search's time goes (seconds, this machine)."""
    runtime = results.get("bmm_runtime") or {}
    if not runtime:
        return ""
    anchors = results.get("anchor_runtime") or {}
    stats = results.get("timings", {}).get("stats_seconds")
    ta_merge = (anchors.get("task_arithmetic") or {}).get("merge_seconds")
    header = [
        "search (anchor / setting)",
        "Gram (stats, once)",
        "anchor merge (once)",
        "K",
        "merge / trial",
        "GP (total)",
        "validation / trial",
        "trial time (all workers)",
        "wall (search clock)",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for cell, times in runtime.items():
        anchor, setting = cell.split("/")
        k = max(times["trials"], 1)
        merge = times["merge"] / k
        gram = f"{stats}" if setting == "data_assisted" and stats is not None else "– (in merge)"
        anchor_merge = (anchors.get(anchor) or {}).get("merge_seconds", "–")
        total = times["merge"] + times["evaluate"] + times["surrogate"]
        wall = f"{times['wall'] / 60:.1f} min" if times.get("wall") else "–"
        lines.append(
            f"| {anchor} / {setting} | {gram} | {anchor_merge} | {times['trials']} | {merge:.1f} | "
            f"{times['surrogate']:.1f} | {times['evaluate'] / k:.1f} | {total:.0f} | {wall} |"
        )
    note = (
        "\n\n`merge / trial` is mergekit's whole merge of a trial: loading the inputs and the anchor, the "
        "Grams and the closed form, writing the model. The closed form is not timed on its own; the search "
        "passes bmm a λ-independent cache (`cache:`), so a Gram's eigendecomposition is computed once per "
        "search and later trials only re-solve. For scale, a plain Task Arithmetic merge of the same models "
        f"took {ta_merge} s. `Gram (stats, once)` is `mergekit-bmm-stats` over all tasks, shared by every "
        "data-assisted search and RegMean; data-free Grams `U_tᵀU_t` are formed inside the merge. "
        "`validation` is the classification evaluator on the validation subsets; `GP` is the surrogate "
        "(scikit-optimize) over the whole search. Seconds on a 2-core CPU shared with other work; "
        "`trial time` adds up every trial's merge, validation and GP, over all workers; `wall` is the "
        "search's own clock over all its runs (a search that resumed counts only the time it ran)."
    )
    return "\n".join(lines) + note


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


def plot_anchors(results: dict[str, Any], path: Path) -> Path | None:
    """One panel per anchor: per-task test accuracy of the anchor and BMM over it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    tasks = results["tasks"]
    anchors = [a for a in dict.fromkeys(r["anchor"] for r in results["rows"]) if _row(results, a)]
    if not anchors:
        return None
    columns = min(4, len(anchors))
    rows_n = (len(anchors) + columns - 1) // columns
    fig, axes = plt.subplots(rows_n, columns, figsize=(4.2 * columns, 3.4 * rows_n), squeeze=False)
    x = np.arange(len(tasks))
    colors = {"anchor": "#9e9e9e", "data_free": "#1f77b4", "data_assisted": "#d62728"}
    for ax, anchor in zip(axes.flat, anchors):
        settings = [s for s in ("anchor", "data_free", "data_assisted") if _row(results, anchor, s)]
        width = 0.8 / max(len(settings), 1)
        for i, setting in enumerate(settings):
            row = _row(results, anchor, setting)
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
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


def plot(results: dict[str, Any], path: Path) -> Path | None:
    """Grouped bars: test accuracy per task for each row and the experts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _bmm_label(anchor: str, bmm: dict[str, Any]) -> str:
    values = ", ".join(
        f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in (bmm["best_values"] or {}).items()
    )
    return f"{anchor} + BMM (data-free, K={bmm['budget']}; {values})"


def language_markdown(language: dict[str, Any]) -> str:
    """The language track's table: accuracy (%) per task, validation / test."""
    tasks = language["tasks"]
    header = ["model", *tasks, "avg (test)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def row(name: str, scores: dict[str, dict[str, float]]) -> str:
        cells = [f"{100 * scores[t]['validation']:.1f} / {100 * scores[t]['test']:.1f}" for t in tasks]
        avg = sum(scores[t]["test"] for t in tasks) / len(tasks)
        return f"| {name} | " + " | ".join(cells) + f" | {100 * avg:.1f} |"

    lines.append(row(f"pretrained ({language['model']})", language["pretrained"]))
    if "task_arithmetic" in language:
        ta = language["task_arithmetic"]
        lines.append(row(f"task_arithmetic (weight {ta['weight']})", ta["scores"]))
    if "bmm" in language:
        lines.append(row(_bmm_label("task_arithmetic", language["bmm"]), language["bmm"]["scores"]))
        if "defaults" in language["bmm"]:
            lines.append(
                row("BMM over task_arithmetic at its defaults", language["bmm"]["defaults"]["scores"])
            )
    for name, anchor in language.get("anchors", {}).items():
        tuned = f"{anchor['parameter']} {anchor['value']}" if anchor.get("parameter") else "defaults"
        lines.append(row(f"{name} ({tuned})", anchor["scores"]))
        if "bmm" in anchor:
            lines.append(row(_bmm_label(name, anchor["bmm"]), anchor["bmm"]["scores"]))
            if "defaults" in anchor["bmm"]:
                lines.append(row(f"BMM over {name} at its defaults", anchor["bmm"]["defaults"]["scores"]))
    lines.append(row("Indiv. (each expert on its task)", language["indiv"]))
    limit = language.get("eval_limit")
    text = (
        "Cells: validation / test accuracy (%), lm-eval `acc`"
        + (f", the first {limit} documents of each split" if limit else "")
        + ".\n\n"
        + "\n".join(lines)
    )
    if "task_arithmetic" in language:
        sweep = language["task_arithmetic"]["validation_sweep"]
        text += "\n\nTask Arithmetic weight sweep (validation avg): " + ", ".join(
            f"{w}: {100 * v:.1f}" for w, v in sweep.items()
        )
    if language.get("intervals"):
        rows = ["| comparison (test) | Δ (points) | 95 % interval |", "|---|---|---|"]
        for name, d in language["intervals"].items():
            rows.append(
                f"| {name} | {100 * d['delta']:+.1f} | [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}] |"
            )
        text += (
            "\n\nPaired bootstrap over the test documents (the same documents for both models; "
            "experts: each on its own task).\n\n" + "\n".join(rows)
        )
    return text


def stage_seconds_markdown(results: dict[str, Any]) -> str:
    """Wall time per stage on this machine, summed over the run's invocations."""
    entries = results.get("stage_seconds") or {}
    if not entries:
        return ""
    lines = ["| stage | wall time | invocations |", "|---|---|---|"]
    for stage, entry in entries.items():
        source = " (from its records)" if entry.get("from_records") else ""
        lines.append(f"| {stage} | {entry['seconds'] / 60:.1f} min{source} | {entry['invocations']} |")
    total = sum(entry["seconds"] for entry in entries.values())
    lines.append(f"| **all** | **{total / 60:.1f} min** | |")
    return "\n".join(lines)


def timings_markdown(results: dict[str, Any]) -> str:
    """Sizes and wall-clock seconds of the stages (as first built; cached stages cost ~0 now)."""
    lines = ["| what | value |", "|---|---|"]
    for key, value in results.get("sizes", {}).items():
        lines.append(f"| {key} | {value / 1e6:.1f} MB |")
    for key, value in results.get("timings", {}).items():
        lines.append(f"| {key} | {value} s |")
    for task, expert in results.get("experts", {}).items():
        lines.append(
            f"| expert {task} | {expert['train_seconds']} s, {expert['examples_per_second']} examples/s |"
        )
    language = results.get("language")
    if language:
        for key, value in language.get("timings", {}).items():
            lines.append(f"| language {key} | {value} s |")
        for task, expert in language.get("experts", {}).items():
            lines.append(f"| language expert {task} | {expert['train_seconds']} s |")
    return "\n".join(lines)


def stage_line(results: dict[str, Any]) -> str:
    """Which stages these figures come from, and on what machine."""
    from bench.merging.stages import STAGES

    reached = results.get("stage_reached", STAGES[-1])
    later = STAGES[STAGES.index(reached) + 1 :] if reached in STAGES else []
    where = results.get("machine") or {}
    cores = f"{where['cores']} cores" if where.get("cores") else None
    machine = ", ".join(str(part) for part in (where.get("cpu"), cores, where.get("gpu")) if part)
    text = f"Stages run: {', '.join(STAGES[: STAGES.index(reached) + 1])}" if reached in STAGES else ""
    if later:
        text += f"; not yet run: {', '.join(later)}"
    return text + (f". Machine: {machine}." if machine else ".")


def write(results: dict[str, Any], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    results["dynamic_range"] = dynamic_range(results)
    write_json(folder / "results.json", results)
    picture = plot(results, folder / "per_task.png")
    panels = plot_anchors(results, folder / "per_anchor.png") if len(results["rows"]) > 2 else None
    text = [f"# {results['name']}: {results['encoder']}, test accuracy (%)", ""]
    text += [stage_line(results), ""]
    if results.get("range"):
        text += ["## Range: can this run tell merge methods apart?", "", range_markdown(results), ""]
    if results.get("summary"):
        text += ["## BMM against its anchor and the best anchor", "", summary_markdown(results), ""]
    if any(r["setting"] != "anchor" for r in results["rows"]):
        text += ["## Anchors and BMM (Table 1 in kind)", "", table1(results), ""]
        if panels:
            text += ["![per-task test accuracy per anchor](per_anchor.png)", ""]
    if results.get("sweeps"):  # a run stopped after the sweeps has them but no BMM rows yet
        text += [
            "## Sweeps: validation along one λ group or s at a time",
            "",
            "![sweeps](sweeps.png)",
            "",
            sweeps_markdown(results),
        ]
    diagnostics = diagnostics_markdown(results)
    if diagnostics:
        text += ["## Why BMM moves or keeps its anchor", "", diagnostics, ""]
    if any(r["setting"] != "anchor" for r in results["rows"]):
        if results.get("ablation"):
            text += ["## Search strategy ablation (Table 3 in kind)", "", ablation_table(results), ""]
        if results.get("bmm_runtime"):
            text += ["## Runtime of the searches (Table 5 in kind)", "", runtime_table(results), ""]
    if results.get("variants"):
        from bench.merging.variants import variants_markdown

        text += [
            "## Variants: one choice changed, paired against the main search",
            "",
            variants_markdown(results),
            "",
        ]
    if results.get("balance_sweeps"):
        from bench.merging.sweeps import balance_markdown

        text += [
            "## Task balance: validation along one shared λ, then s, per `task_balance`",
            "",
            "![task balance](balance.png)",
            "",
            balance_markdown(results),
            "",
        ]
    text += ["## All rows", "", markdown(results), ""]
    text += ["## Data and experts", "", data_table(results), ""]
    if plot_expert_curves(results, folder / "experts.png"):
        text += ["![experts' held-out curves](experts.png)", ""]
    if picture:
        text += ["![per-task test accuracy](per_task.png)", ""]
    if results.get("language"):
        text += [
            f"## Language track: {results['language']['model']}",
            "",
            language_markdown(results["language"]),
            "",
        ]
    if results.get("stage_seconds"):
        text += ["## Runtime per stage", "", stage_seconds_markdown(results), ""]
    text += ["## Sizes and timings", "", timings_markdown(results), ""]
    (folder / "results.md").write_text("\n".join(text), encoding="utf-8")
