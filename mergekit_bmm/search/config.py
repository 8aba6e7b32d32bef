"""``search.yml``: what to tune, how, and how to score it — validated once, here.

Everything a search needs is checked before the first merge: field names and types, the
ranges, the groups, the budget, the template recipe (a ``merge_method: bmm`` recipe with
``models:``) and the evaluator's section. Problems are reported as one line naming the
field and how to fix it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from pathlib import Path
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from mergekit_bmm.core.module_map import GROUP_NAMES
from mergekit_bmm.errors import ConfigError
from mergekit_bmm.evaluation.config import EvaluatorConfig, resolve_path
from mergekit_bmm.recipes.parse import read_yaml

STRATEGIES = ("bo", "random", "grid")

# Default search boxes per Gram mode (λ relative, log-uniform; s uniform), from the sweeps in
# docs/search.md ("Search boxes"): an activation Gram averages the experts where their inputs
# overlap, so data-assisted merges need a lower s. Every λ box reaches 1000, where the merge is
# its anchor (to two digits of each group's norm), so the anchor start is the anchor itself.
DEFAULT_BOXES: dict[str, tuple[tuple[float, float], tuple[float, float]]] = {
    "data_free": ((1e-3, 1000.0), (0.8, 2.2)),
    "activations": ((1e-3, 1000.0), (0.3, 2.2)),
    "mix": ((1e-3, 1000.0), (0.3, 2.2)),
}


def recipe_gram(recipe: dict[str, Any]) -> str:
    """A template recipe's Gram mode (bmm's default: data-free)."""
    return str((recipe.get("parameters") or {}).get("gram", "data_free"))


def default_box(gram: str) -> tuple[tuple[float, float], tuple[float, float]]:
    """(λ range, s range) a search of this Gram mode gets when its config gives none."""
    return DEFAULT_BOXES.get(gram, DEFAULT_BOXES["data_free"])


def _range(name: str, value: tuple[float, float] | None) -> tuple[float, float] | None:
    if value is None:
        return None
    low, high = value
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError(f"{name} must be two finite numbers; got [{low}, {high}]")
    if low >= high:
        kind = "empty" if low == high else "inverted"
        raise ValueError(f"{kind} range [{low}, {high}]: give [low, high] with low < high")
    return (float(low), float(high))


class ParallelConfig(BaseModel):
    """``parallel:``: how many trials run at once, and where."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    workers: int = Field(default=1, ge=1)
    backend: Literal["local", "ray"] = "local"
    address: str | None = None  # ray: auto, ray://host:port, or empty for a local cluster


class FidelityConfig(BaseModel):
    """``fidelity:``: cheap-then-full evaluation and early stopping (docs/search.md, "Fidelity").

    Each trial is first scored on a fixed, stratified ``cheap`` share of every task's
    examples; only a trial whose cheap score plus ``promote_z`` standard errors reaches the
    incumbent's full score is scored on the rest. With ``early_stop``, scoring stops once the
    trial could not reach the incumbent even if every remaining example were right.
    Evaluators that cannot score single examples (a python function without ``examples``) score in full.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    cheap: float = Field(default=0.25, gt=0, le=1, description="share of each task's examples scored first")
    promote_z: float = Field(default=1.0, ge=0, description="standard errors of slack for promotion")
    early_stop: bool = True
    chunk: int = Field(default=64, ge=1, description="examples of one task scored between checks")


class SearchConfig(BaseModel):
    """The fields of ``search.yml`` (docs/search.md gives each one's meaning)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    recipe: str | dict[str, Any]
    blocks: int = Field(default=3, ge=1)
    groups: list[str] = Field(default_factory=lambda: list(GROUP_NAMES))  # []: λ stays the recipe's
    lambda_range: tuple[float, float] | None = None  # None: the recipe's Gram mode's default box
    scale_range: tuple[float, float] | Literal["auto"] | None = "auto"  # None: the recipe's scale, fixed
    epsilon_range: tuple[float, float] | None = None
    budget: int = Field(default=60, ge=1)
    n_initial: int = Field(default=10, ge=1)
    initial_point_generator: Literal["random", "sobol", "halton", "hammersly", "lhs"] = "random"
    acquisition: Literal["EI", "PI", "LCB", "gp_hedge"] = "EI"
    acq_optimizer: Literal["auto", "lbfgs", "sampling"] = "auto"
    seed: int = 0
    strategy: Literal["bo", "random", "grid"] = "bo"
    grid_scale: float = 1.0
    widen_box: bool = True
    anchor_start: bool = True  # the first trial: the box's point nearest the anchor (docs/search.md)
    trials: Literal["auto", "memory", "disk"] = "auto"
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    fidelity: FidelityConfig = Field(default_factory=FidelityConfig)
    trial_timeout: float | Literal["auto"] | None = "auto"  # seconds per trial (search/timeouts.py)
    evaluator: EvaluatorConfig

    @field_validator("recipe")
    @classmethod
    def _recipe_path(cls, value: str | dict, info: ValidationInfo) -> str | dict:
        return resolve_path(value, info) if isinstance(value, str) else value

    @field_validator("groups")
    @classmethod
    def _known_groups(cls, value: list[str]) -> list[str]:
        seen: set[str] = set()
        for entry in value:
            for group in entry.split("+"):
                if group not in GROUP_NAMES:
                    raise ValueError(
                        f"unknown group {group!r}; use {', '.join(GROUP_NAMES)} "
                        "(or tie several with '+', e.g. attn_in+attn_out)"
                    )
                if group in seen:
                    raise ValueError(f"group {group!r} is listed twice")
                seen.add(group)
        return value

    @field_validator("trial_timeout")
    @classmethod
    def _positive_timeout(cls, value: float | str | None) -> float | str | None:
        if isinstance(value, (int, float)) and not (math.isfinite(value) and value > 0):
            raise ValueError(f"trial_timeout must be a positive number of seconds, auto or null; got {value}")
        return value

    @field_validator("lambda_range")
    @classmethod
    def _lambda_range(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        value = _range("lambda_range", value)
        if value is not None and value[0] <= 0:
            raise ValueError(f"λ is sampled log-uniformly, so the range must be > 0; got {list(value)}")
        return value

    @field_validator("scale_range")
    @classmethod
    def _scale_range(cls, value: tuple[float, float] | str | None) -> tuple[float, float] | str | None:
        return value if value == "auto" else _range("scale_range", value)

    def box(self, gram: str) -> tuple[tuple[float, float], tuple[float, float] | None]:
        """(λ range, s range) of the search: the config's, else the defaults of the recipe's ``gram``."""
        lambdas, scales = default_box(gram)
        return (
            self.lambda_range or lambdas,
            scales if self.scale_range == "auto" else self.scale_range,
        )

    @field_validator("epsilon_range")
    @classmethod
    def _epsilon_range(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        value = _range("epsilon_range", value)
        if value is not None and not (0.0 <= value[0] and value[1] <= 1.0):
            raise ValueError(f"ε is a mixing weight in [0, 1]; got {list(value)}")
        return value

    @model_validator(mode="after")
    def _budget_covers_initial_points(self) -> SearchConfig:
        if self.strategy == "bo" and self.budget < self.n_initial:
            raise ValueError(
                f"budget ({self.budget}) is smaller than n_initial ({self.n_initial}): the Gaussian "
                "process would never be used; raise budget or lower n_initial"
            )
        return self

    def experiment_key(self) -> dict[str, Any]:
        """What defines the experiment: everything but the budget (which may grow on resume),
        where and how many trials run at once, and how much of the validation set they use.

        A grid's points depend on the budget, so there it stays in.
        """
        data = self.model_dump(mode="json")
        data.pop("trials")  # where trials run does not change their results
        data.pop("parallel")  # the log records each batch, so a search resumes with any number of workers
        data.pop("fidelity")  # how much of the validation set a trial used is in its record
        data.pop("trial_timeout")  # a trial that timed out is recorded failed, with the reason
        data.pop("anchor_start")  # the log holds each trial's values: a search resumes either way
        if self.strategy != "grid":
            data.pop("budget")
        if data["evaluator"].get("type") == "agreement":  # where references live, and the recipe's base
            data["evaluator"] = {
                k: v for k, v in data["evaluator"].items() if k not in ("references", "base_model")
            }
        return data

    def with_search_evaluator(self, base_model: str, references: Path) -> SearchConfig:
        """The config with the label-free evaluator's defaults filled in: the recipe's base model,
        and the references kept in the search's folder (workers read them from there)."""
        evaluator = self.evaluator
        if getattr(evaluator, "type", None) != "agreement":
            return self
        if evaluator.base_model is not None and evaluator.base_model != base_model:
            raise ConfigError(
                f"evaluator base_model {evaluator.base_model} is not the recipe's base_model {base_model}; "
                "remove it (the search uses the recipe's)"
            )
        filled = evaluator.model_copy(
            update={"base_model": base_model, "references": evaluator.references or str(references)}
        )
        return self.model_copy(update={"evaluator": filled})


def one_line_validation(error: pydantic.ValidationError, source: str) -> str:
    parts = []
    for detail in error.errors():
        where = ".".join(str(item) for item in detail["loc"])
        message = detail["msg"].removeprefix("Value error, ")
        kind = detail["type"]
        if kind == "extra_forbidden":
            message = "unknown field; check its spelling (see docs/search.md, `search.yml`)"
        elif kind == "missing":
            message = "required field is missing"
        elif kind == "union_tag_invalid" or kind == "union_tag_not_found":
            message = "evaluator needs `type:` python, lm_eval, classification or agreement"
        parts.append(f"`{where}`: {message}" if where else message)
    return f"{source}: " + "; ".join(parts[:3]) + ("; ..." if len(parts) > 3 else "")


def parse_search_config(raw: Any, base_dir: Path, source: str = "search config") -> SearchConfig:
    """Validate a loaded mapping; relative paths are taken from ``base_dir``."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of fields (recipe, evaluator, ...); got {raw!r}")
    try:
        return SearchConfig.model_validate(raw, context={"base_dir": Path(base_dir)})
    except pydantic.ValidationError as error:
        raise ConfigError(one_line_validation(error, source)) from None


def load_search_config(path: str | Path) -> SearchConfig:
    """Read and validate ``search.yml``."""
    path = Path(path)
    return parse_search_config(read_yaml(path, "search config"), path.resolve().parent, str(path))


def load_template(config: SearchConfig) -> dict[str, Any]:
    """The template recipe as a mapping, checked to be a ``models:``-style bmm recipe."""
    if isinstance(config.recipe, dict):
        recipe, source = copy.deepcopy(config.recipe), "the inline recipe"
    else:
        recipe, source = read_yaml(Path(config.recipe), "recipe"), config.recipe
    if not isinstance(recipe, dict):
        raise ConfigError(f"{source}: a recipe must be a mapping with merge_method, base_model, models")
    method = recipe.get("merge_method")
    if method != "bmm":
        raise ConfigError(
            f"{source}: merge_method is {method!r}; the search tunes `merge_method: bmm` recipes "
            "(wrap your merge as bmm's anchor: merge_method: bmm, parameters: {anchor_method: ...})"
        )
    if recipe.get("slices"):
        raise ConfigError(
            f"{source}: give the template with `models:` (not `slices:`); the search writes the slices"
        )
    if not recipe.get("models"):
        raise ConfigError(f"{source}: the recipe lists no `models:` to merge")
    if not recipe.get("base_model"):
        raise ConfigError(f"{source}: a bmm recipe needs `base_model:`")
    _absolute_model_paths(recipe)
    gram = recipe_gram(recipe)
    if config.epsilon_range is not None and gram != "mix":
        raise ConfigError(
            f"epsilon_range is set but the recipe's gram is {gram!r}; ε only exists for `gram: mix`"
        )
    return recipe


def _absolute_model_paths(recipe: dict[str, Any]) -> None:
    """Local model folders as absolute paths (mergekit reads relative ones from the working
    directory, and its model card asks the Hub about relative paths)."""

    def absolute(reference: Any) -> Any:
        path = Path(str(reference)).expanduser()
        return str(path.resolve()) if not path.is_absolute() and path.exists() else reference

    recipe["base_model"] = absolute(recipe["base_model"])
    for item in recipe["models"]:
        if isinstance(item, dict) and "model" in item:
            item["model"] = absolute(item["model"])


def canonical_hash(data: Any) -> str:
    """A stable hash of JSON-able data (sorted keys)."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()
