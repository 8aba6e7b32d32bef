"""The search space (paper Section 4.2) and how a point becomes per-block settings.

Consecutive layers are cut into ``B`` blocks; in each block the module groups share one
λ (sampled log-uniformly) and the block has one scale ``s``, optionally one ε for
``gram: mix``: 5B dimensions with the four default groups (6B with ε). Dimensions are
named ``block<b>.<group>``, ``block<b>.scale``, ``block<b>.epsilon``; a point is a
``{name: value}`` mapping in that order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mergekit_bmm.core.module_map import GROUP_NAMES, filter_rules
from mergekit_bmm.errors import ConfigError
from mergekit_bmm.io.model_folder import num_layers_of
from mergekit_bmm.recipes.blockwise import BlockSetting, layer_blocks
from mergekit_bmm.search.config import recipe_gram

DEFAULT_LAMBDA = 0.1  # bmm's own default, for groups that are not searched
DEFAULT_SCALE = 1.0


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


class SearchSpace:
    """Blocks × (groups, scale, ε) and the recipe values that stay fixed."""

    def __init__(
        self,
        blocks: Sequence[tuple[int, int]],
        groups: Sequence[str],
        lambda_range: tuple[float, float],
        scale_range: tuple[float, float] | None,
        epsilon_range: tuple[float, float] | None,
        fixed_lambda: float = DEFAULT_LAMBDA,
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
        fixed_lambda = (
            _scalar(recipe, "lambda", DEFAULT_LAMBDA, "groups that are not searched") if unsearched else 0.0
        )
        lambda_range, scale_range = config.box(recipe_gram(recipe))
        fixed_scale = (
            _scalar(recipe, "scale", DEFAULT_SCALE, "a search without scale_range")
            if scale_range is None
            else DEFAULT_SCALE
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
            lambdas = {group: self.fixed_lambda for group in GROUP_NAMES}
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
        return f"{len(self.dimensions)}-dimensional ({len(self.blocks)} blocks: " + ", ".join(parts) + ")"
