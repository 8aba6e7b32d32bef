"""bmm defaults that changed, spelled out wherever a recipe becomes a key.

A search's experiment hash (and any cache keyed on a recipe) must name the merge the recipe makes
*today*. Where a default changed, a recipe that leaves the key out made another merge before, so its
key spells the new value out; a recipe that states the old value keeps the key that the old default
gave it, so work done before the change is found again by writing the old value into the recipe.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

# gram_sharing's default was "weight" (one data-free Gram per logical weight) until the measurement on
# zeroshot8 made it "input" (docs/architectures.md#fused-weights); activations read one Gram either way
GRAM_SHARING_BEFORE = "weight"
GRAM_SHARING_NOW = "input"


def _sharing_matters(recipe: Mapping[str, Any]) -> bool:
    """Whether gram_sharing changes what ``recipe`` merges: data-free or mix bmm."""
    parameters = recipe.get("parameters") or {}
    return (
        recipe.get("merge_method") == "bmm"
        and isinstance(parameters, Mapping)
        and parameters.get("gram", "data_free") != "activations"
    )


def keyed_recipe(recipe: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``recipe`` as keys see it: the old ``gram_sharing`` value left out (it was the
    default), today's default written in; left out of ``gram: activations`` recipes, whose merge it
    does not change (a recipe stating it names the same merge as one leaving it out)."""
    keyed = copy.deepcopy(dict(recipe))
    parameters = keyed.get("parameters")
    if _sharing_matters(keyed):
        parameters = keyed["parameters"] = dict(parameters or {})
        if parameters.get("gram_sharing", GRAM_SHARING_NOW) == GRAM_SHARING_BEFORE:
            del parameters["gram_sharing"]
        else:
            parameters.setdefault("gram_sharing", GRAM_SHARING_NOW)
    elif (
        keyed.get("merge_method") == "bmm"
        and isinstance(parameters, Mapping)
        and "gram_sharing" in parameters
    ):
        keyed["parameters"] = {k: v for k, v in parameters.items() if k != "gram_sharing"}
    return keyed


def relies_on_changed_default(recipe: Mapping[str, Any]) -> bool:
    """Whether ``recipe`` leaves ``gram_sharing`` to a default that made another merge before."""
    return _sharing_matters(recipe) and "gram_sharing" not in (recipe.get("parameters") or {})
