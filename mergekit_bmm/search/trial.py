"""One trial's recipe, and merging a recipe through mergekit.

The unit of truth is the YAML text: a trial's values become a complete
``merge_method: bmm`` recipe in the per-block shape of
:func:`mergekit_bmm.recipe.blockwise_recipe`, which is written to disk, hashed, and then
merged from that very text — so ``mergekit-yaml trials/trial-0007.yml OUT`` (or
``best.yml``) rebuilds exactly the model that was scored.
"""

from __future__ import annotations

import copy
import hashlib
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from mergekit_bmm.recipe import blockwise_recipe
from mergekit_bmm.search.space import SearchSpace


def bmm_accepts_cache() -> bool:
    """Whether the installed ``bmm`` has the λ-independent ``cache`` parameter."""
    from mergekit.merge_methods import registry

    import mergekit_bmm  # noqa: F401  (registers bmm)

    return any(parameter.name == "cache" for parameter in registry.get("bmm").spec.parameters)


def yaml_text(recipe: Mapping[str, Any]) -> str:
    return yaml.safe_dump(dict(recipe), sort_keys=False, allow_unicode=True)


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
        if cache_dir is not None:
            parameters = dict(self.template.get("parameters") or {})
            parameters.setdefault("cache", str(cache_dir))
            self.template["parameters"] = parameters
        self.space = space
        self.weight_names = list(weight_names)

    def recipe(self, values: Mapping[str, float]) -> dict[str, Any]:
        return blockwise_recipe(self.template, self.space.settings(values), self.weight_names)

    def text(self, values: Mapping[str, float]) -> str:
        return yaml_text(self.recipe(values))


def _quiet_mergekit() -> None:
    for name in ("mergekit", "mergekit.merge", "mergekit.plan", "mergekit.graph", "mergekit.card"):
        logging.getLogger(name).setLevel(logging.WARNING)


def merge_text(
    text: str, out_dir: Path, device: str = "cpu", model_card: bool = False, seed: int | None = None
) -> None:
    """Merge a recipe given as YAML text into ``out_dir`` with mergekit's ``run_merge``.

    A fresh configuration is parsed from the text every time (mergekit's planner mutates
    the one it is given), and the loader cache is cleared so inputs are read as they are
    now. The options are ``mergekit-yaml``'s defaults (plus ``quiet``), so the result is
    the one the stock command gives.
    """
    from mergekit.config import MergeConfiguration
    from mergekit.io.tasks import LoaderCache
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    import mergekit_bmm  # noqa: F401  (registers bmm)

    _quiet_mergekit()
    LoaderCache().loaders.clear()
    config = MergeConfiguration.model_validate(yaml.safe_load(text))
    options = MergeOptions(
        device=device,
        quiet=True,
        copy_tokenizer=True,
        write_model_card=model_card,
        random_seed=seed,
    )
    run_merge(config, str(out_dir), options=options, config_source=text)
