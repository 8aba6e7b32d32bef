"""``results.md`` and ``results.json``: the sections in reading order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.merging.cache import write_json
from bench.merging.report.explain import diagnostics_markdown, sweeps_markdown
from bench.merging.report.label_free import plot_language_trace, plot_trace, trace_markdown
from bench.merging.report.language import language_markdown
from bench.merging.report.plots import (
    plot,
    plot_anchors,
    plot_deltas,
    plot_evidence_lambdas,
    plot_expert_curves,
    plot_lora_intervals,
)
from bench.merging.report.rows import dynamic_range
from bench.merging.report.tables import (
    ablation_table,
    best_models_markdown,
    data_table,
    markdown,
    range_markdown,
    summary_markdown,
    table1,
)
from bench.merging.report.timings import runtime_table, stage_line, stage_seconds_markdown, timings_markdown


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
    if results.get("best_models"):
        text += ["## The BMM model to keep against the best anchor", "", best_models_markdown(results), ""]
    if results.get("summary"):
        text += ["## BMM against its anchor and the best anchor", "", summary_markdown(results), ""]
        if plot_deltas(results, folder / "deltas.png"):
            text += ["![paired test differences](deltas.png)", ""]
        if plot_evidence_lambdas(results, folder / "lambda_auto.png"):
            text += [
                "λ chosen by the evidence (`lambda: auto`, every weight) against the search's best λ, per "
                "module group:",
                "",
                "![lambda auto](lambda_auto.png)",
                "",
            ]
    traced = trace_markdown(results)
    if traced:
        text += ["## Without labels: does a better agreement mean a better model?", "", traced, ""]
        if plot_trace(results, folder / "label_free.png"):
            text += ["![label-free score against test accuracy along the search](label_free.png)", ""]
    if len(results["rows"]) > 1:  # a run stopped before the searches still shows its anchors
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
        lora = results["language"].get("lora") or {}
        if plot_lora_intervals(lora, folder / "lora.png"):
            text += ["![LoRA experts: BMM against each merge of the adapters](lora.png)", ""]
        if plot_language_trace(results["language"], folder / "language_label_free.png"):
            text += ["![language track: agreement against test accuracy](language_label_free.png)", ""]
    if results.get("stage_seconds"):
        text += ["## Runtime per stage", "", stage_seconds_markdown(results), ""]
    text += ["## Sizes and timings", "", timings_markdown(results), ""]
    (folder / "results.md").write_text("\n".join(text), encoding="utf-8")
