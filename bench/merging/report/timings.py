"""Where the time went: per search (Table 5 in kind), per stage, and sizes."""

from __future__ import annotations

from typing import Any

from bench.merging.report.cells import table_head


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
    lines = table_head(header)
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
    skipped = results.get("stages_skipped") or []
    done = [s for s in STAGES[: STAGES.index(reached) + 1] if s not in skipped] if reached in STAGES else []
    later = [s for s in STAGES[STAGES.index(reached) + 1 :] if s not in skipped] if reached in STAGES else []
    alone = "language" in later and bool(results.get("language"))  # run on its own (--language-only)
    if alone:
        later.remove("language")
    where = results.get("machine") or {}
    cores = f"{where['cores']} cores" if where.get("cores") else None
    machine = ", ".join(str(part) for part in (where.get("cpu"), cores, where.get("gpu")) if part)
    text = f"Stages run: {', '.join(done)}" if done else ""
    if results.get("stage_partial"):
        text += f" ({results['stage_partial']})"
    if alone:
        text += ", and language (run on its own)"
    if later:
        text += f"; not yet run: {', '.join(later)}"
    if skipped:
        text += f"; skipped: {', '.join(skipped)}"
    return text + (f". Machine: {machine}." if machine else ".")
