"""The anchor's own model, for ``--eval-anchor``: what BMM starts from, scored the same way.

The anchor is, as in ``bmm`` itself: an input marked ``anchor: true`` (scored as is),
the base model for ``anchor_method: pretrained``, or otherwise the anchor method run as
an ordinary mergekit recipe on the same base and experts with the parameters ``bmm``
would forward to it (:func:`~mergekit_bmm.merge_methods.bmm_parameters.anchor_parameters`, the rule
``bmm`` itself uses; ``anchor.yml`` in ``OUT_PATH``; ``mergekit-yaml anchor.yml`` rebuilds it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mergekit_bmm.merge_methods.bmm_parameters import DEFAULT_ANCHOR, PRETRAINED_ANCHOR, anchor_parameters


@dataclass(frozen=True)
class AnchorModel:
    """Either an existing model folder or a recipe to merge."""

    description: str
    model_dir: Path | None = None
    recipe: dict[str, Any] | None = None
    seed: int | None = None


def anchors_at_pretrained(template: Mapping[str, Any]) -> bool:
    """Whether BMM's anchor is the base model itself (``U0 = 0``)."""
    if any((item.get("parameters") or {}).get("anchor") for item in template.get("models") or []):
        return False
    return ((template.get("parameters") or {}).get("anchor_method") or DEFAULT_ANCHOR) == PRETRAINED_ANCHOR


def anchor_model(template: Mapping[str, Any]) -> AnchorModel:
    """Where the anchor of a ``models:``-style bmm recipe comes from."""
    parameters = dict(template.get("parameters") or {})
    for item in template.get("models") or []:
        if (item.get("parameters") or {}).get("anchor"):
            return AnchorModel(f"input {item['model']}, anchor: true", model_dir=Path(str(item["model"])))
    method = parameters.get("anchor_method") or DEFAULT_ANCHOR
    if method == PRETRAINED_ANCHOR:
        return AnchorModel(
            f"pretrained, {template['base_model']}", model_dir=Path(str(template["base_model"]))
        )
    recipe: dict[str, Any] = {"merge_method": method}
    for key, value in template.items():
        if key in ("merge_method", "parameters", "models"):
            continue
        recipe[key] = value
    models = []
    for item in template["models"]:
        entry = {"model": item["model"]}
        forwarded = anchor_parameters(item.get("parameters") or {})
        if forwarded:
            entry["parameters"] = forwarded
        models.append(entry)
    recipe["models"] = models
    shared = anchor_parameters(parameters)
    if shared:
        recipe["parameters"] = shared
    # Order like a hand-written recipe: method, base, models, parameters, the rest.
    ordered = {
        key: recipe[key] for key in ("merge_method", "base_model", "models", "parameters") if key in recipe
    }
    ordered.update({key: value for key, value in recipe.items() if key not in ordered})
    seed = int(parameters.get("anchor_seed", 0) or 0)
    return AnchorModel(f"{method} merge, anchor.yml", recipe=ordered, seed=seed)
