"""Names and number formats every report table shares."""

from __future__ import annotations

from typing import Any

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


def share_text(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def ci_text(row_or_values) -> str:
    values = row_or_values.get("ci") if isinstance(row_or_values, dict) else row_or_values
    return f" [{100 * values[1]:.1f}, {100 * values[2]:.1f}]" if values else ""


def values_text(row: dict[str, Any]) -> str:
    hyper = row["hyperparameters"]
    if row["setting"] == "anchor":
        return ", ".join(f"{k}={v}" for k, v in hyper.items() if k != "validation_sweep" and v is not None)
    values = hyper.get("best_values") or {}
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())


def interval_text(figure: dict[str, float], signed: bool = False) -> str:
    sign = "+" if signed else ""
    return f"{100 * figure['estimate']:{sign}.1f} [{100 * figure['low']:.1f}, {100 * figure['high']:.1f}]"


def table_head(header: list[str]) -> list[str]:
    """A Markdown table's header and rule, as the first lines of the table."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
