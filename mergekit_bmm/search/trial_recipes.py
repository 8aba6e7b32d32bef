"""One trial's recipe: a point of the search space as a complete ``merge_method: bmm`` recipe.

The unit of truth is the YAML text: a trial's values become a recipe in the per-block
shape of :func:`mergekit_bmm.recipes.blockwise.blockwise_recipe`, which is written to
disk and hashed — so ``mergekit-yaml trials/trial-0007.yml OUT`` (or ``best.yml``)
rebuilds exactly the model that was scored.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mergekit_bmm.recipes.blockwise import blockwise_recipe
from mergekit_bmm.recipes.parse import yaml_text
from mergekit_bmm.search.space import SearchSpace


def text_sha256(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


class TrialRecipes:
    """Turns a point of the space into a trial's recipe text."""

    def __init__(
        self,
        template: Mapping[str, Any],
        space: SearchSpace,
        weight_names: Sequence[str],
        cache_dir: Path | None = None,
    ) -> None:
        self.template = copy.deepcopy(dict(template))
        self.cache_dir = cache_dir
        parameters = dict(self.template.get("parameters") or {})
        parameters.pop("cache", None)
        self.portable_template = {**self.template, "parameters": parameters}
        if cache_dir is not None:
            self.template["parameters"] = {**parameters, "cache": str(cache_dir)}
        self.space = space
        self.weight_names = list(weight_names)

    def recipe(self, values: Mapping[str, float]) -> dict[str, Any]:
        return blockwise_recipe(self.template, self.space.settings(values), self.weight_names)

    def text(self, values: Mapping[str, float]) -> str:
        return yaml_text(self.recipe(values))

    def portable_text(self, values: Mapping[str, float]) -> str:
        """The recipe without bmm's factor cache: what ``best.yml`` and a published model carry.

        The cache is a machine-local path and only a speed-up: the same values merge to the same
        model without it (to float rounding; bit for bit from this text).
        """
        return yaml_text(
            blockwise_recipe(self.portable_template, self.space.settings(values), self.weight_names)
        )
