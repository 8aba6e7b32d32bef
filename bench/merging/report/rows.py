"""The shape of ``results.json``: one row per (anchor, setting), and where a score lands in the
pretrained-to-experts range."""

from __future__ import annotations

from typing import Any

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


def dynamic_range(results: dict[str, Any]) -> dict[str, float] | None:
    """Test averages of Pretrained, TA and the experts, and the TA-to-experts gap."""
    tasks = results["tasks"]
    if len(results["indiv"]) != len(tasks):
        return None
    indiv = sum(results["indiv"].values()) / len(tasks)
    out = {"indiv": round(indiv, 4)}
    pretrained = find_row(results, "pretrained")
    if pretrained and pretrained["avg"] is not None:
        out["pretrained"] = pretrained["avg"]
    ta = find_row(results, "task_arithmetic")
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
