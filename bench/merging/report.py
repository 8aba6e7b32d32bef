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
                "C": head["info"]["C"],
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


def _row(results, anchor: str, setting: str = "anchor") -> dict[str, Any] | None:
    return next((r for r in results["rows"] if (r["anchor"], r["setting"]) == (anchor, setting)), None)


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


def data_table(results: dict[str, Any]) -> str:
    header = ["task", "classes", "train", "head", "validation", "test", "head C", "expert steps", "expert s"]
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
            head.get("C", "–"),
            expert.get("steps", "–"),
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
    lines.append(row("Indiv. (each expert on its task)", language["indiv"]))
    text = "Cells: validation / test accuracy (%), lm-eval `acc`.\n\n" + "\n".join(lines)
    if "task_arithmetic" in language:
        sweep = language["task_arithmetic"]["validation_sweep"]
        text += "\n\nTask Arithmetic weight sweep (validation avg): " + ", ".join(
            f"{w}: {100 * v:.1f}" for w, v in sweep.items()
        )
    return text


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


def write(results: dict[str, Any], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    results["dynamic_range"] = dynamic_range(results)
    write_json(folder / "results.json", results)
    picture = plot(results, folder / "per_task.png")
    text = [f"# {results['name']}: {results['encoder']}, test accuracy (%)", "", markdown(results), ""]
    text += ["## Data and experts", "", data_table(results), ""]
    if picture:
        text += ["![per-task test accuracy](per_task.png)", ""]
    if results.get("language"):
        text += [
            f"## Language track: {results['language']['model']}",
            "",
            language_markdown(results["language"]),
            "",
        ]
    text += ["## Sizes and timings", "", timings_markdown(results), ""]
    (folder / "results.md").write_text("\n".join(text), encoding="utf-8")
