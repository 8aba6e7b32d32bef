"""What a merge recipe says, in the terms a reader of the model card needs.

The card must show the values the merge *actually used*, so nothing here re-implements
mergekit's rules: the recipe is parsed by ``MergeConfiguration``, and λ and s for every
body weight are resolved with mergekit's own ``resolve_parameter`` over the same
precedence (slice > module > global > default) and the same per-slice ``t`` as the
planner. Weights are then grouped by block of output layers and by module group
(:mod:`mergekit_bmm.core.module_map`), which gives the per-block, per-group table whatever
shape the recipe has (global values, ``blockwise_recipe``'s slices and filters, or
gradients).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from mergekit.config import ConfigReader, MergeConfiguration, OutputSliceDefinition
from mergekit.parameter_resolver import resolve_parameter

from mergekit_bmm.core.module_map import GROUP_NAMES, classify, layer_index
from mergekit_bmm.errors import BMMError
from mergekit_bmm.io.hub_ids import looks_like_repo_id
from mergekit_bmm.recipes.parse import parse_recipe

ROLE_BASE = "base"
ROLE_EXPERT = "expert"
ROLE_ANCHOR = "anchor"


@dataclass(frozen=True)
class InputModel:
    """One model the recipe merges."""

    reference: str
    role: str
    parameters: Mapping[str, Any]
    local_path: Path | None
    hub_id: str | None
    adapter: str | None = None  # the LoRA adapter of a ``BASE+ADAPTER`` input (path or Hub id)

    @property
    def card_id(self) -> str:
        """How the card's ``base_model`` names it: the Hub id if known, else the local folder."""
        if self.adapter:
            return self.reference
        if self.hub_id:
            return self.hub_id
        return str(self.local_path) if self.local_path is not None else self.reference


@dataclass(frozen=True)
class BlockRow:
    """λ per module group and s for one block of output layers ``[start, end)``."""

    start: int | None
    end: int | None
    lambdas: Mapping[str, str]
    scale: str
    module: str = ""

    @property
    def label(self) -> str:
        if self.start is None or self.end is None:
            span = "all"
        elif self.end - self.start == 1:
            span = str(self.start)
        else:
            span = f"{self.start}–{self.end - 1}"
        return f"{self.module}: {span}" if self.module else span


@dataclass
class RecipeView:
    """The parsed recipe plus the resolved per-block table."""

    config: MergeConfiguration
    raw: Mapping[str, Any]
    inputs: list[InputModel]
    blocks: list[BlockRow] = field(default_factory=list)

    @property
    def merge_method(self) -> str:
        return self.config.merge_method

    @property
    def base(self) -> InputModel | None:
        return next((model for model in self.inputs if model.role == ROLE_BASE), None)

    @property
    def experts(self) -> list[InputModel]:
        return [model for model in self.inputs if model.role == ROLE_EXPERT]

    @property
    def anchor_input(self) -> InputModel | None:
        return next((model for model in self.inputs if model.role == ROLE_ANCHOR), None)

    def setting(self, name: str, default: Any = None) -> Any:
        """A shared value as written (global first, else the first slice that sets it)."""
        sources = [self.config.parameters]
        for module in (self.config.modules or {}).values():
            sources.append(module.parameters)
            sources.extend(s.parameters for s in module.slices or [])
        sources.extend(s.parameters for s in self.config.slices or [])
        for scope in sources:
            if scope and name in scope and scope[name] is not None:
                return scope[name]
        return default


def local_folder(path: str) -> Path | None:
    """The absolute folder a model path names on this machine, if it is one."""
    candidate = Path(os.path.abspath(os.path.expanduser(path)))  # symlinks kept as named
    return candidate if candidate.is_dir() else None


def hub_id_of(path: str, local: Path | None) -> str | None:
    """The Hub id of a model reference, when it can be known without asking the Hub.

    A reference that is not a local folder was fetched from the Hub by mergekit, so it
    *is* the id. A local folder inside the Hugging Face cache
    (``.../models--org--name/snapshots/<rev>``) names its repo; any other local folder
    has no known id.
    """
    if local is None:
        return path if looks_like_repo_id(path) else None
    parts = local.parts
    for index, part in enumerate(parts[:-2]):
        if part.startswith("models--") and parts[index + 1] == "snapshots":
            candidate = part[len("models--") :].replace("--", "/")
            return candidate if looks_like_repo_id(candidate) else None
    return None


def _describe_input(reference: Any, role: str, parameters: Mapping[str, Any] | None) -> InputModel:
    path = reference.model.path
    text = str(reference)
    local = local_folder(path)
    adapter = getattr(reference.lora, "path", None)
    return InputModel(
        reference=text,
        role=role,
        parameters=dict(parameters or {}),
        local_path=local,
        hub_id=hub_id_of(path, local),  # of the base, for a BASE+ADAPTER input
        adapter=adapter,
    )


def _model_entries(config: MergeConfiguration) -> list[tuple[Any, Mapping[str, Any] | None]]:
    """Every input with its per-model parameters (from the first slice for slices)."""
    if config.models:
        return [(item.model, item.parameters) for item in config.models]
    slices: Sequence[OutputSliceDefinition] = config.slices or []
    if not slices and config.modules:
        module = next(iter(config.modules.values()))
        if module.models:
            return [(item.model, item.parameters) for item in module.models]
        slices = module.slices or []
    if not slices:
        return []
    return [(source.model, source.parameters) for source in slices[0].sources]


def _is_anchor_flag(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.strip().lower() in ("true", "yes", "1"))


def describe_inputs(config: MergeConfiguration) -> list[InputModel]:
    """Base first, then the other inputs in recipe order (``anchor: true`` marks the anchor)."""
    inputs: list[InputModel] = []
    base = config.base_model
    if base is not None:
        inputs.append(_describe_input(base, ROLE_BASE, None))
    seen = {str(base)} if base is not None else set()
    for reference, parameters in _model_entries(config):
        if str(reference) in seen:
            continue
        seen.add(str(reference))
        role = ROLE_ANCHOR if _is_anchor_flag((parameters or {}).get("anchor")) else ROLE_EXPERT
        inputs.append(_describe_input(reference, role, parameters))
    return inputs


def _layer_names(weight_names: Sequence[str]) -> dict[int, list[str]]:
    by_layer: dict[int, list[str]] = {}
    for name in weight_names:
        layer = layer_index(name)
        if layer is not None and classify(name) is not None:
            by_layer.setdefault(layer, []).append(name)
    return by_layer


def format_value(value: Any) -> str:
    """Numbers with 4 significant digits; anything else in YAML flow style."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return f"{value:.4g}"
    if value is None:
        return "—"
    if isinstance(value, str):
        return value
    return yaml.safe_dump(_plain(value), default_flow_style=True, sort_keys=False).strip()


def _plain(value: Any) -> Any:
    """Recipe values (pydantic conditions included) as plain YAML data."""
    if hasattr(value, "model_dump"):
        return _plain(value.model_dump(exclude_none=True))
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _span(values: list[float]) -> str:
    if not values:
        return "—"
    low, high = min(values), max(values)
    return format_value(low) if low == high else f"{format_value(low)}–{format_value(high)}"


def _resolve(spec: Any, reader: ConfigReader, name: str, t: float) -> Any:
    """One shared parameter for one output tensor, exactly as mergekit's planner does it."""
    return resolve_parameter(spec, tuple(reader.parameter_sources(None)), tensor_name=name, t=t)


def block_table(
    config: MergeConfiguration, weight_names: Sequence[str] | None, spec_parameters: Sequence[Any]
) -> list[BlockRow]:
    """λ per group and s per block of output layers, resolved as the planner resolves them.

    ``spec_parameters`` are the method's ParameterSpecs (``lambda`` and ``scale`` carry
    the defaults and validation). Blocks are the recipe's slices (one block over every
    layer for a ``models:`` recipe). Without weight names, λ is shown as written.
    """
    specs = {parameter.name: parameter for parameter in spec_parameters}
    by_layer = _layer_names(weight_names or [])
    all_layers = (0, max(by_layer) + 1) if by_layer else (None, None)
    rows: list[BlockRow] = []
    modules = config.modules or {}
    if config.slices or config.models or not modules:
        units = [("", None, config.slices)]
    else:
        named = len(modules) > 1
        units = [(name if named else "", module, module.slices) for name, module in modules.items()]
    for module_name, module, slices in units:
        if not slices:
            reader = ConfigReader(config=config, module=module, t=0)
            rows.append(_row(reader, by_layer, *all_layers, specs, module_name))
            continue
        offset = 0
        for definition in slices:
            first = definition.sources[0].layer_range
            length = first[1] - first[0]
            reader = ConfigReader(config=config, slice_out=definition, module=module, t=0)
            rows.append(_row(reader, by_layer, offset, offset + length, specs, module_name))
            offset += length
    return rows


def _row(
    reader: ConfigReader,
    by_layer: Mapping[int, list[str]],
    start: int | None,
    end: int | None,
    specs: Mapping[str, Any],
    module_name: str,
) -> BlockRow:
    lam, scale = specs["lambda"], specs["scale"]
    values: dict[str, list[float]] = {group: [] for group in GROUP_NAMES}
    scales: list[float] = []
    if start is not None and end is not None:
        count = end - start
        for offset, layer in enumerate(range(start, end)):
            t = offset / (count - 1) if count > 1 else 1.0  # as MergePlanner.plan_slice
            for name in by_layer.get(layer, []):
                group = classify(name).group.value
                values[group].append(_resolve(lam, reader, name, t))
                scales.append(_resolve(scale, reader, name, t))
    if not scales:
        # No weight names to resolve against: show what the recipe says for the block.
        sources = [scope for scope in reader.parameter_sources(None) if scope]
        lam_text = next(
            (format_value(s["lambda"]) for s in sources if "lambda" in s), format_value(lam.default)
        )
        scale_text = next(
            (format_value(s["scale"]) for s in sources if "scale" in s), format_value(scale.default)
        )
        return BlockRow(start, end, {group: lam_text for group in GROUP_NAMES}, scale_text, module_name)
    lambdas = {group: _span(found) for group, found in values.items()}
    return BlockRow(start, end, lambdas, _span(scales), module_name)


def describe_recipe(
    text: str, weight_names: Sequence[str] | None = None, spec_parameters: Sequence[Any] | None = None
) -> RecipeView:
    """Parse ``text`` and, when the method has ``lambda``/``scale``, resolve the block table."""
    recipe = parse_recipe(text)
    config = recipe.config
    view = RecipeView(config=config, raw=recipe.raw, inputs=describe_inputs(config))
    if spec_parameters is not None:
        names = {parameter.name for parameter in spec_parameters}
        if {"lambda", "scale"} <= names:
            view.blocks = block_table(config, weight_names, spec_parameters)
    return view


def method_spec(name: str):
    """The registered method's spec, or None (the card must not fail on it)."""
    try:
        from mergekit import merge_methods

        return merge_methods.get(name).spec
    except Exception:
        return None


def weight_names_for(out_dir: Path | None, view_base: str | None) -> list[str] | None:
    """Tensor names of the merged folder, else of the base (headers only)."""
    from mergekit_bmm.io.model_folder import weight_names_of

    for candidate in (out_dir, view_base):
        if candidate is None:
            continue
        try:
            return weight_names_of(str(candidate))
        except BMMError:
            continue
    return None


def view_of(recipe_text: str, out_dir: Path | None = None) -> RecipeView:
    """Parse the recipe; resolve λ/s against the merged (or base) weights' names."""
    config = parse_recipe(recipe_text).config
    spec = method_spec(config.merge_method)
    parameters = list(spec.parameters) if spec is not None else None
    base = config.base_model.model.path if config.base_model is not None else None
    names = weight_names_for(out_dir, base) if parameters else None
    return describe_recipe(recipe_text, names, parameters)
