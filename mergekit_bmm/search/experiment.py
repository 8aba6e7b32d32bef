"""What one search is, checked before ``OUT_PATH`` is touched: the recipe, the space, the hash.

The experiment's *definition* (the search config except its budget, the template recipe,
and fingerprints of the input models) is hashed: re-running with the same definition
resumes, a different one is refused (see :mod:`mergekit_bmm.search.run_folder`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mergekit_bmm.core.module_map import filter_rules, outside_groups
from mergekit_bmm.errors import ConfigError
from mergekit_bmm.io.fingerprint import model_fingerprint
from mergekit_bmm.io.model_folder import model_type_of, weight_names_of, weight_shapes_of
from mergekit_bmm.recipes.parse import mergekit_configuration
from mergekit_bmm.search.config import SearchConfig, canonical_hash, load_template
from mergekit_bmm.search.space import SearchSpace
from mergekit_bmm.search.trial_recipes import TrialRecipes


@dataclass(frozen=True)
class Experiment:
    config: SearchConfig
    template: dict[str, Any]
    weight_names: list[str]
    space: SearchSpace
    definition: dict[str, Any]
    hash: str
    recipes: TrialRecipes
    not_searched: dict[str, Any]  # what the search does not tune (the summary and report list it)

    @property
    def base_model(self) -> str:
        return str(self.template["base_model"])


def prepare_experiment(config: SearchConfig, cache_dir: Path | None) -> Experiment:
    """Read and check everything the search needs; ``cache_dir`` is bmm's factor cache (or None)."""
    template = load_template(config)
    base = str(template["base_model"])
    if not Path(base).is_dir():
        raise ConfigError(f"base_model {base} is not a local folder; the search needs local checkpoints")
    weight_names = weight_names_of(base)
    space = SearchSpace.from_config(config, template, weight_names)
    models = [base] + [str(item["model"]) for item in template["models"]]
    definition = {
        "search": config.experiment_key(),
        "recipe": template,
        "models": {path: model_fingerprint(path) for path in models},
    }
    recipes = TrialRecipes(template, space, weight_names, cache_dir)
    _check_with_mergekit(recipes, space)
    return Experiment(
        config,
        template,
        weight_names,
        space,
        definition,
        canonical_hash(definition),
        recipes,
        not_searched_of(base, weight_names, space),
    )


def not_searched_of(base: str, weight_names: list[str], space: SearchSpace) -> dict[str, Any]:
    """Module groups the search leaves at the recipe's λ, and 2-D weights outside every group
    (they keep the anchor's value)."""
    present = {rule.group.value for rule in filter_rules(weight_names) if rule.group is not None}
    searched = {group for entry in space.groups for group in entry.split("+")}
    return {
        "groups": {group: space.fixed_lambda for group in sorted(present - searched)},
        "anchor_kept": outside_groups(weight_shapes_of(base), model_type_of(base)),
    }


def middle_of(space: SearchSpace) -> dict[str, float]:
    """The centre of the space (geometric for λ): a valid point to check recipes with."""
    return {
        d.name: math.sqrt(d.low * d.high) if d.log_uniform else 0.5 * (d.low + d.high)
        for d in space.dimensions
    }


def _check_with_mergekit(recipes: TrialRecipes, space: SearchSpace) -> None:
    """Parse one trial recipe as mergekit would, so schema errors show before any work."""
    import yaml

    mergekit_configuration(yaml.safe_load(recipes.text(middle_of(space))), "the search's trial recipe")
