"""The Markdown pieces a card is made of: code fences, tables, model links, score precision."""

from __future__ import annotations

import math
from collections.abc import Sequence

from mergekit_bmm.cards.recipe_view import InputModel


def fence(text: str, language: str = "") -> str:
    """A code block whose fence is longer than any run of backticks inside ``text``."""
    longest, run = 0, 0
    for char in text:
        run = run + 1 if char == "`" else 0
        longest = max(longest, run)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{language}\n{text.rstrip()}\n{fence}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def cell(value: str) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


def model_link(model: InputModel) -> str:
    """A Hub link for a Hub model, else the local path in code; a LoRA input names its base and
    its adapter."""
    if model.adapter:
        base = _link(model.hub_id) if model.hub_id else f"`{model.reference.split('+', 1)[0]}`"
        return f"{base} with the LoRA adapter {_link_or_path(model.adapter)}"
    if model.hub_id:
        return _link(model.hub_id)
    return f"`{model.reference}`"


def _link(repo_id: str) -> str:
    return f"[{repo_id}](https://huggingface.co/{repo_id})"


def _link_or_path(reference: str) -> str:
    from mergekit_bmm.io.hub_models import is_hub_id

    repo_id = reference.partition("@")[0]
    return _link(repo_id) if is_hub_id(repo_id) else f"`{reference}`"


def decimal_places(values: Sequence[float], digits: int = 4) -> int:
    """Decimals that show ``digits`` significant digits of the largest value: one precision for a
    column of scores and their differences."""

    largest = max((abs(value) for value in values if value), default=1.0)
    return max(digits - 1 - math.floor(math.log10(largest)), 0)
