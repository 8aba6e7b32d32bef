"""The language track's table (lm-eval accuracy per task, validation / test)."""

from __future__ import annotations

import re
from typing import Any

from bench.merging.report.cells import table_head
from bench.merging.report.label_free import language_traces, trace_table


def _bmm_label(anchor: str, bmm: dict[str, Any]) -> str:
    values = ", ".join(
        f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in (bmm["best_values"] or {}).items()
    )
    setting = bmm.get("setting", "data_free").replace("_", "-")
    return f"{anchor} + BMM ({setting}, K={bmm['budget']}; {values})"


def language_markdown(language: dict[str, Any]) -> str:
    """The language track's table: accuracy (%) per task, validation / test."""
    tasks = language["tasks"]
    header = ["model", *tasks, "avg (test)"]
    lines = table_head(header)

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
        lines += _one_merge_rows(row, "task_arithmetic", language["bmm"])
    lines += _anchor_rows(row, language.get("anchors", {}))
    if language.get("indiv"):  # a run for the LoRA track trains no dense experts
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
        text += (
            "\n\nPaired bootstrap over the test documents (the same documents for both models; "
            "experts: each on its own task).\n\n" + _interval_rows(language["intervals"])
        )
    if language.get("lora"):
        text += "\n\n" + lora_markdown(language["lora"], tasks, row)
    traced = trace_table(language_traces(language))
    if traced:
        text += "\n\n### Does a better agreement mean a better model?\n\n" + traced
    return text


def _interval_rows(found: dict[str, dict[str, float]]) -> str:
    rows = ["| comparison (test) | Δ (points) | 95 % interval |", "|---|---|---|"]
    for name, d in found.items():
        rows.append(f"| {name} | {_points(d)} |")
    text = "\n".join(rows)
    summary = label_free_summary(found)
    return text + ("\n\n" + summary if summary else "")


def _points(d: dict[str, float]) -> str:
    return f"{100 * d['delta']:+.1f} | [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}]"


_GAIN = re.compile(r"^bmm (?P<objective>\S+) over (?P<anchor>\S+) - (?P=anchor)$")
_ONE_MERGE = ("defaults", "auto", "candidate")  # BMM with no search, not a search without labels
_PEERS = (("bmm over {a}", "the labelled search"), ("bmm defaults over {a}", "the defaults"))
_PEERS += (("bmm entropy over {a}", "entropy"), ("bmm agreement over {a}", "agreement"))


def label_free_summary(found: dict[str, dict[str, float]]) -> str:
    """Each search that read no labels, from the paired intervals: its test gain over its anchor as a
    share of the labelled search's, and its paired difference from the labelled search, the defaults
    and the other objectives (intervals in brackets)."""
    lines = []
    for key, gain in found.items():
        match = _GAIN.match(key)
        if not match:
            continue
        objective, anchor = match["objective"], match["anchor"]
        if objective in _ONE_MERGE:
            continue
        name = f"bmm {objective} over {anchor}"
        labelled = found.get(f"bmm over {anchor} - {anchor}")
        if f"{name} - bmm over {anchor}" not in found or labelled is None:
            continue  # not a search that read no labels
        delta = labelled["delta"]
        share = (
            f"{gain['delta'] / delta:.0%} of the labelled search's" if delta > 0 else "the labelled search's"
        )
        parts = [f"{100 * gain['delta']:+.1f} over {anchor} ({share} {100 * delta:+.1f})"]
        for peer, label in _PEERS:
            d = found.get(f"{name} - {peer.format(a=anchor)}")
            if d is not None:
                parts.append(
                    f"{100 * d['delta']:+.1f} [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}] against {label}"
                )
        lines.append(f"- searched with no labels ({objective}): " + "; ".join(parts))
    return "Searches that read no labels, on test (paired):\n\n" + "\n".join(lines) if lines else ""


def lora_markdown(lora: dict[str, Any], tasks: list[str], row) -> str:
    """The LoRA experts' table: mergekit's anchors with BMM over them, PEFT's adapter merges, KnOTS."""
    lines = table_head(["model (LoRA experts)", *tasks, "avg (test)"])
    lines += _anchor_rows(row, lora.get("anchors", {}))
    for method, found in lora.get("peft", {}).items():
        density = f", density {found['density']}" if found.get("density") is not None else ""
        lines.append(row(f"PEFT {method} (weight {found['weight']}{density})", found["scores"]))
    for variant, found in lora.get("knots", {}).items():
        setting = f"top-K {found['top_k']}" if variant == "ties" else f"drop {found['dare']:g}"
        lines.append(
            row(
                f"KnOTS-{variant.upper().replace('_', '-')} (weight {found['weight']}, {setting})",
                found["scores"],
            )
        )
    lines.append(row("Indiv. (each LoRA expert on its task)", lora["indiv"]))
    text = (
        f"### LoRA experts (rank {lora['rank']}, α {lora['alpha']}, on {', '.join(lora['targets'])})\n\n"
        + "\n".join(lines)
    )
    if lora.get("intervals"):
        text += "\n\nPaired bootstrap over the test documents.\n\n" + _interval_rows(lora["intervals"])
    return text


def _anchor_rows(row, anchors: dict[str, Any]) -> list[str]:
    """Each tuned anchor's row, then BMM over it: searched, at its defaults, at ``lambda: auto``."""
    lines = []
    for name, anchor in anchors.items():
        tuned = f"{anchor['parameter']} {anchor['value']}" if anchor.get("parameter") else "defaults"
        lines.append(row(f"{name} ({tuned})", anchor["scores"]))
        searched = [anchor["bmm"]] if "bmm" in anchor else []
        for bmm in searched + list(
            (anchor.get("bmm_settings") or {}).values()
        ):  # data-free, then data-assisted and mix
            lines.append(row(_bmm_label(name, bmm), bmm["scores"]))
            lines += _one_merge_rows(row, name, bmm)
    return lines


def _mode(bmm: dict) -> str:
    setting = bmm.get("setting", "data_free")
    return "" if setting == "data_free" else f" ({setting.replace('_', '-')})"


def _one_merge_rows(row, anchor: str, bmm: dict) -> list[str]:
    """BMM over ``anchor`` with no labels: at its defaults, at ``lambda: auto`` (with the median λ
    the evidence chose), and searched on agreement with the experts (or entropy)."""
    lines = []
    if bmm.get("candidate"):
        proposed = ", ".join(f"{k}: {v}" for k, v in bmm["candidate"]["parameters"].items())
        lines.append(
            row(f"BMM{_mode(bmm)} over {anchor} at its defaults with {proposed}", bmm["candidate"]["scores"])
        )
    if "defaults" in bmm:
        lines.append(row(f"BMM{_mode(bmm)} over {anchor} at its defaults", bmm["defaults"]["scores"]))
    if "auto" in bmm:
        chosen = [c["lambda"] for c in (bmm["auto"].get("lambda_auto") or {}).values()]
        median = f", median λ {sorted(chosen)[len(chosen) // 2]:.3g}" if chosen else ""
        lines.append(row(f"BMM{_mode(bmm)} over {anchor} at lambda: auto{median}", bmm["auto"]["scores"]))
    for objective, entry in (bmm.get("label_free") or {}).items():  # searched, but read no labels
        lines.append(row(f"BMM over {anchor} searched with no labels ({objective})", entry["scores"]))
    return lines
