"""The search space (paper Section 4.2): its box (which widens), and a point as per-block settings and recipe.

Consecutive layers are cut into ``B`` blocks; in each block the module groups share one
λ (sampled log-uniformly) and the block has one scale ``s``, optionally one ε for
``gram: mix``: 5B dimensions with the four default groups (6B with ε). Dimensions are
named ``block<b>.<group>``, ``block<b>.scale``, ``block<b>.epsilon``; a point is a
``{name: value}`` mapping in that order.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mergekit_bmm.core.evidence import AUTO_LAMBDA
from mergekit_bmm.core.module_map import GROUP_NAMES, filter_rules
from mergekit_bmm.errors import ConfigError
from mergekit_bmm.io.model_folder import num_layers_of
from mergekit_bmm.recipes.blockwise import BlockSetting, blockwise_recipe, layer_blocks
from mergekit_bmm.recipes.parse import yaml_text
from mergekit_bmm.search.config import recipe_gram

DEFAULT_LAMBDA = 0.1  # bmm's own default, for groups that are not searched
DEFAULT_SCALE = 1.0

if TYPE_CHECKING:  # annotations only: log imports this module
    from mergekit_bmm.search.log import TrialRecord


@dataclass(frozen=True)
class Dimension:
    """One searched number."""

    name: str
    kind: str  # "lambda" | "scale" | "epsilon"
    block: int
    low: float
    high: float
    groups: tuple[str, ...] = ()

    @property
    def log_uniform(self) -> bool:
        return self.kind == "lambda"

    def to_skopt(self):
        from skopt.space import Real

        prior = "log-uniform" if self.log_uniform else "uniform"
        return Real(self.low, self.high, prior=prior, name=self.name)


def _scalar(recipe: Mapping[str, Any], key: str, default: float, why: str) -> float:
    value = (recipe.get("parameters") or {}).get(key, default)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"the recipe's `{key}` is {value!r}, not one number; {why} need a single value there"
        ) from None
    if not math.isfinite(number):
        raise ConfigError(f"the recipe's `{key}` must be finite; got {value!r}")
    return number


def _recipe_lambda(recipe: Mapping[str, Any]) -> float | str:
    """The recipe's λ for the groups a search leaves alone: a number, or ``auto`` (the evidence's)."""
    value = (recipe.get("parameters") or {}).get("lambda", DEFAULT_LAMBDA)
    if value == AUTO_LAMBDA:
        return AUTO_LAMBDA
    return _scalar(recipe, "lambda", DEFAULT_LAMBDA, "groups that are not searched")


class SearchSpace:
    """Blocks × (groups, scale, ε) and the recipe values that stay fixed."""

    def __init__(
        self,
        blocks: Sequence[tuple[int, int]],
        groups: Sequence[str],
        lambda_range: tuple[float, float],
        scale_range: tuple[float, float] | None,
        epsilon_range: tuple[float, float] | None,
        fixed_lambda: float | str = DEFAULT_LAMBDA,
        fixed_scale: float = DEFAULT_SCALE,
    ) -> None:
        self.blocks = [tuple(block) for block in blocks]
        self.groups = list(groups)
        self.fixed_lambda = fixed_lambda
        self.fixed_scale = fixed_scale
        self.dimensions: list[Dimension] = []
        for index in range(len(self.blocks)):
            for entry in self.groups:
                self.dimensions.append(
                    Dimension(
                        f"block{index}.{entry}", "lambda", index, *lambda_range, tuple(entry.split("+"))
                    )
                )
            if scale_range is not None:
                self.dimensions.append(Dimension(f"block{index}.scale", "scale", index, *scale_range))
            if epsilon_range is not None:
                self.dimensions.append(Dimension(f"block{index}.epsilon", "epsilon", index, *epsilon_range))
        self.initial_ranges = {
            kind: list(value)
            for kind, value in (("lambda", lambda_range), ("scale", scale_range), ("epsilon", epsilon_range))
            if value is not None
        }

    @classmethod
    def from_config(cls, config, recipe: Mapping[str, Any], weight_names: Sequence[str]) -> SearchSpace:
        """The space for a validated search config and its template recipe."""
        layers = num_layers_of(str(recipe["base_model"]))
        if config.blocks > layers:
            raise ConfigError(
                f"blocks is {config.blocks} but the base model has {layers} layers; use at most {layers}"
            )
        present = {rule.group.value for rule in filter_rules(list(weight_names)) if rule.group is not None}
        searched = {group for entry in config.groups for group in entry.split("+")}
        missing = sorted(searched - present)
        if missing:
            raise ConfigError(
                f"group(s) {missing} match no weight of the base model {recipe['base_model']}; "
                f"it has {sorted(present)}: drop them from `groups`"
            )
        unsearched = set(GROUP_NAMES) - searched
        fixed_lambda = _recipe_lambda(recipe) if unsearched else 0.0
        lambda_range, scale_range = config.box(recipe_gram(recipe))
        fixed_scale = (
            _scalar(recipe, "scale", DEFAULT_SCALE, "a search without scale_range")
            if scale_range is None
            else DEFAULT_SCALE
        )
        if not config.groups and scale_range is None and config.epsilon_range is None:
            raise ConfigError(
                "nothing to search: `groups` is empty and there is no scale_range or epsilon_range; "
                "list groups whose lambda to search, or give scale_range"
            )
        return cls(
            layer_blocks(layers, config.blocks),
            config.groups,
            lambda_range,
            scale_range,
            config.epsilon_range,
            fixed_lambda,
            fixed_scale,
        )

    @property
    def names(self) -> list[str]:
        return [dimension.name for dimension in self.dimensions]

    def skopt_dimensions(self) -> list:
        return [dimension.to_skopt() for dimension in self.dimensions]

    def as_values(self, point: Sequence[float]) -> dict[str, float]:
        return {name: float(value) for name, value in zip(self.names, point)}

    def as_point(self, values: Mapping[str, float]) -> list[float]:
        if set(values) != set(self.names):
            raise ConfigError(
                f"a logged trial has values for {sorted(values)} but this search space has {self.names}"
            )
        return [float(values[name]) for name in self.names]

    def shared_lambda_values(self, lam: float, scale: float) -> dict[str, float]:
        """The grid strategy's point: one λ for every group and block, a fixed s."""
        values = {}
        for dimension in self.dimensions:
            if dimension.kind == "lambda":
                values[dimension.name] = lam
            elif dimension.kind == "scale":
                values[dimension.name] = scale
            else:  # ε is not part of the single-λ grid: keep the middle of its range
                values[dimension.name] = 0.5 * (dimension.low + dimension.high)
        return values

    def anchor_point(self) -> dict[str, float]:
        """The point of the box nearest the anchor: every λ at its upper edge (BMM tends to its
        anchor as λ grows), s = 1 clipped to its range, ε in the middle of its range."""
        _, top = self.initial_ranges["lambda"]
        low, high = self.initial_ranges.get("scale", (1.0, 1.0))
        return self.shared_lambda_values(top, min(max(1.0, low), high))

    def begin_in(self, kind: str, low: float, high: float) -> None:
        """Give every dimension of ``kind`` the range [low, high] as the one the search began
        with (a resumed search goes on in the box it began in)."""
        self.dimensions = [
            Dimension(d.name, d.kind, d.block, low, high, d.groups) if d.kind == kind else d
            for d in self.dimensions
        ]
        self.initial_ranges[kind] = [low, high]

    def widen(self, name: str, low: float, high: float) -> None:
        """Give dimension ``name`` the range [low, high] (the search box widened)."""
        self.dimensions = [
            Dimension(d.name, d.kind, d.block, low, high, d.groups) if d.name == name else d
            for d in self.dimensions
        ]

    def ranges(self) -> dict[str, list[float]]:
        return {d.name: [d.low, d.high] for d in self.dimensions}

    def kind_range(self, kind: str) -> list[float] | None:
        """The range the search began with for ``kind`` (lambda, scale, epsilon)."""
        return self.initial_ranges.get(kind)

    def block_of(self, layer: int | None) -> int:
        """The block holding ``layer``."""
        for index, (start, end) in enumerate(self.blocks):
            if layer is not None and start <= layer < end:
                return index
        raise ConfigError(f"layer {layer} lies in no block of this search space ({self.blocks})")

    def settings(self, values: Mapping[str, float]) -> list[BlockSetting]:
        """Per-block settings for :func:`mergekit_bmm.recipes.blockwise.blockwise_recipe`."""
        settings = []
        for index, (start, end) in enumerate(self.blocks):
            lambdas: dict[str, float | str] = {group: self.fixed_lambda for group in GROUP_NAMES}
            scale = self.fixed_scale
            extra: dict[str, float] = {}
            for dimension in self.dimensions:
                if dimension.block != index:
                    continue
                value = float(values[dimension.name])
                if dimension.kind == "lambda":
                    lambdas.update({group: value for group in dimension.groups})
                elif dimension.kind == "scale":
                    scale = value
                else:
                    extra["epsilon"] = value
            settings.append(BlockSetting(start, end, lambdas, scale, extra))
        return settings

    def describe(self) -> str:
        kinds = {"lambda": 0, "scale": 0, "epsilon": 0}
        for dimension in self.dimensions:
            kinds[dimension.kind] += 1
        parts = [f"{kinds['lambda']} λ"] + [f"{n} {k}" for k, n in kinds.items() if k != "lambda" and n]
        blocks = f"{len(self.blocks)} block" + ("s" if len(self.blocks) != 1 else "")
        return f"{len(self.dimensions)}-dimensional ({blocks}: " + ", ".join(parts) + ")"


# -- One trial's recipe: a point of the search space as a complete ``merge_method: bmm`` recipe.
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


# -- A search box that notices it is too small, and widens.
EDGE_FRACTION = 0.03
LAMBDA_FACTOR = 10.0
LAMBDA_LIMITS = (1e-6, 1e4)
SCALE_LIMITS = (0.05, 5.0)
EPSILON_LIMITS = (0.0, 1.0)
MAX_WIDENINGS = 2  # per edge: two decades of λ, or twice half the range of s


@dataclass(frozen=True)
class BoxChange:
    """One widened edge: ``dimension`` now spans [low, high] (it spanned [old_low, old_high])."""

    after_trial: int
    dimension: str
    old_low: float
    old_high: float
    low: float
    high: float
    best_trial: int
    best_value: float

    def describe(self) -> str:
        return (
            f"{self.dimension}: [{self.old_low:.4g}, {self.old_high:.4g}] -> "
            f"[{self.low:.4g}, {self.high:.4g}] after trial {self.after_trial} "
            f"(best trial {self.best_trial} at {self.best_value:.4g})"
        )

    def as_event(self) -> dict:
        return {"event": "box", **vars(self)}


def _position(dimension: Dimension, value: float) -> float:
    """Where ``value`` lies in the range, 0 (low) to 1 (high), in the prior's scale."""
    if dimension.log_uniform:
        low, high = math.log(dimension.low), math.log(dimension.high)
        return (math.log(value) - low) / (high - low)
    return (value - dimension.low) / (dimension.high - dimension.low)


def _limits(dimension: Dimension) -> tuple[float, float]:
    return {"lambda": LAMBDA_LIMITS, "scale": SCALE_LIMITS}.get(dimension.kind, EPSILON_LIMITS)


def _widened(dimension: Dimension, at_low: bool) -> tuple[float, float]:
    low, high = dimension.low, dimension.high
    floor, ceiling = _limits(dimension)
    if dimension.kind == "lambda":
        return (
            (max(floor, low / LAMBDA_FACTOR), high) if at_low else (low, min(ceiling, high * LAMBDA_FACTOR))
        )
    step = 0.5 * (high - low)
    return (max(floor, low - step), high) if at_low else (low, min(ceiling, high + step))


def cooldown_trials(space: SearchSpace) -> int:
    """Trials between two widenings: one per dimension, so the surrogate sees the new box."""
    return len(space.dimensions)


def edge_changes(
    space: SearchSpace, records: list[TrialRecord], n_initial: int, previous: list[BoxChange] = ()
) -> list[BoxChange]:
    """The edges to widen now, given every finished trial (none before the initial points) and
    the changes made so far."""
    finished = [record for record in records if record.ok and record.full and record.score is not None]
    if len(records) < n_initial or not finished:
        return []
    last = max(record.trial for record in records)
    if previous and last - max(change.after_trial for change in previous) < cooldown_trials(space):
        return []
    best = max(finished, key=lambda record: (record.score, -record.trial))
    changes = []
    for dimension in space.dimensions:
        value = best.values[dimension.name]
        position = _position(dimension, value)
        for at_low, near in ((True, position <= EDGE_FRACTION), (False, position >= 1 - EDGE_FRACTION)):
            moved = sum(
                change.dimension == dimension.name and (change.low < change.old_low) == at_low
                for change in previous
            )
            if not near or moved >= MAX_WIDENINGS:
                continue
            low, high = _widened(dimension, at_low)
            if (low, high) != (dimension.low, dimension.high):
                changes.append(
                    BoxChange(
                        last, dimension.name, dimension.low, dimension.high, low, high, best.trial, value
                    )
                )
    return changes
