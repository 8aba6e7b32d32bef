"""Per-block, per-group λ and per-block s in a stock mergekit recipe.

mergekit can express piecewise-constant values with its own means: one ``slices:``
entry per block of layers, and in each, ``lambda`` as an ordered list of
``{filter: substring, value}`` (first match wins) whose substrings are exactly the
module map's rules. :func:`blockwise_recipe` turns a ``models:``-style ``bmm`` recipe
into that shape; ``mergekit-bmm-search`` writes every trial this way, so any trial can
be replayed with ``mergekit-yaml``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mergekit_bmm.core.evidence import AUTO_LAMBDA
from mergekit_bmm.core.module_map import GROUP_NAMES, filter_rules
from mergekit_bmm.errors import ConfigError
from mergekit_bmm.io.model_folder import merge_names_of


@dataclass(frozen=True)
class BlockSetting:
    """Values for one block of layers ``[start, end)``."""

    start: int
    end: int
    lambdas: Mapping[str, float | str]  # a number, or "auto" (λ from the evidence)
    scale: float
    extra: Mapping[str, Any] = field(default_factory=dict)


def lambda_value(value: float | str) -> float | str:
    """A λ as a recipe holds it: a float, or ``auto`` as is."""
    return value if value == AUTO_LAMBDA else float(value)


def layer_blocks(num_layers: int, blocks: int) -> list[tuple[int, int]]:
    """Split ``num_layers`` into ``blocks`` sequential, near-equal ranges."""
    if not 1 <= blocks <= num_layers:
        raise ConfigError(f"blocks must be between 1 and the model's {num_layers} layers; got {blocks}")
    edges = [round(index * num_layers / blocks) for index in range(blocks + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _sources(recipe: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The recipe's inputs as slice sources, base first; parameters kept per model."""
    if recipe.get("slices"):
        raise ConfigError("the recipe already uses `slices:`; give it with `models:` to make it block-wise")
    base = recipe.get("base_model")
    if not base:
        raise ConfigError("a bmm recipe needs `base_model:`")
    models = recipe.get("models") or []
    sources = []
    if not any(str(item.get("model")) == str(base) for item in models):
        sources.append({"model": base})
    for item in models:
        source = {"model": item["model"]}
        if item.get("parameters"):
            source["parameters"] = copy.deepcopy(item["parameters"])
        sources.append(source)
    return sources


def _with_range(source: Mapping[str, Any], start: int, end: int) -> dict[str, Any]:
    """A fresh copy of a slice source (no shared dicts: YAML would write aliases)."""
    out: dict[str, Any] = {"model": source["model"], "layer_range": [start, end]}
    if source.get("parameters"):
        out["parameters"] = copy.deepcopy(dict(source["parameters"]))
    return out


def blockwise_recipe(
    recipe: Mapping[str, Any],
    settings: Sequence[BlockSetting],
    weight_names: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The recipe with one slice per block holding that block's λ per group and s.

    ``weight_names`` (default: every name a merge of the base may read, the checkpoint's and
    transformers' layout's) choose which module-map rules become filters; each rule's filter carries
    the λ of its group.
    """
    if recipe.get("merge_method") != "bmm":
        raise ConfigError(f"expected a `merge_method: bmm` recipe; got {recipe.get('merge_method')!r}")
    names = list(weight_names) if weight_names is not None else merge_names_of(recipe["base_model"])
    rules = filter_rules(names)
    sources = _sources(recipe)
    out = {key: copy.deepcopy(value) for key, value in recipe.items() if key != "models"}
    parameters = dict(out.get("parameters") or {})
    for key in ("lambda", "scale"):
        parameters.pop(key, None)
    if parameters:
        out["parameters"] = parameters
    else:
        out.pop("parameters", None)
    slices = []
    for block in settings:
        unknown = set(block.lambdas) - set(GROUP_NAMES)
        if unknown:
            raise ConfigError(f"unknown module group(s) {sorted(unknown)}; use {list(GROUP_NAMES)}")
        lambdas = [
            {"filter": rule.pattern, "value": lambda_value(block.lambdas[rule.group.value])}
            for rule in rules
            if rule.group is not None and rule.group.value in block.lambdas
        ]
        slice_parameters: dict[str, Any] = {"lambda": lambdas, "scale": float(block.scale)}
        slice_parameters.update({k: v for k, v in block.extra.items()})
        slices.append(
            {
                "sources": [_with_range(source, block.start, block.end) for source in sources],
                "parameters": slice_parameters,
            }
        )
    out["slices"] = slices
    return out
