"""Reading a mergekit recipe: one place that turns YAML text into mergekit's configuration.

Every command that takes a recipe goes through :func:`load_recipe` or :func:`parse_recipe`,
so a recipe that cannot be read, is not YAML, or is not a valid mergekit configuration is
refused the same way everywhere: one line naming the file, the place and the problem.
A fresh configuration is parsed each time, since mergekit's planner mutates the one it
is given.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mergekit_bmm.errors import ConfigError


@dataclass(frozen=True)
class Recipe:
    """A recipe as written (text and mapping), as mergekit reads it, and where it came from."""

    text: str
    raw: dict[str, Any]
    config: Any  # mergekit.config.MergeConfiguration
    source: str = "the recipe"


def yaml_text(recipe: Mapping[str, Any]) -> str:
    """A recipe mapping as YAML, keys in their written order."""
    return yaml.safe_dump(dict(recipe), sort_keys=False, allow_unicode=True)


def read_text(path: str | Path, what: str) -> str:
    """A text file's content; a one-line error naming the file if it cannot be read."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"cannot read {what} {path}: {error.strerror or error}") from None


def read_yaml(path: str | Path, what: str) -> Any:
    """A YAML file's content; a one-line error naming the file (and line) if it cannot be read."""
    return _load_yaml(read_text(path, what), f"{what} {path}")


def _load_yaml(text: str, source: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or " ".join(str(error).split())
        raise ConfigError(f"{source}{where} is not valid YAML: {problem}") from None


def mergekit_configuration(raw: Mapping[str, Any], source: str = "the recipe") -> Any:
    """mergekit's ``MergeConfiguration`` for a recipe mapping; one line naming the first problem."""
    import copy

    from mergekit.config import MergeConfiguration
    from pydantic import ValidationError

    try:
        return MergeConfiguration.model_validate(copy.deepcopy(dict(raw)))
    except RuntimeError as error:  # mergekit's own validators raise these unwrapped
        raise ConfigError(
            f"{source} is not a valid mergekit recipe: {' '.join(str(error).split())}"
        ) from None
    except ValidationError as error:
        detail = error.errors()[0]
        where = ".".join(str(item) for item in detail["loc"])
        message = detail["msg"].removeprefix("Value error, ")
        raise ConfigError(
            f"{source} is not a valid mergekit recipe: `{where}`: {message}"
            if where
            else f"{source} is not a valid mergekit recipe: {message}"
        ) from None


def parse_recipe(text: str, source: str = "the recipe") -> Recipe:
    """Parse recipe text (YAML) into a :class:`Recipe`."""
    raw = _load_yaml(text, source)
    if not isinstance(raw, dict):
        raise ConfigError(f"{source} is not a YAML mapping (merge_method, base_model, models, ...)")
    return Recipe(text, raw, mergekit_configuration(raw, source), source)


def load_recipe(recipe: str | Path | Mapping[str, Any]) -> Recipe:
    """A recipe file (or an inline mapping) as a :class:`Recipe`."""
    if isinstance(recipe, Mapping):
        return parse_recipe(yaml_text(recipe))
    return parse_recipe(read_text(recipe, "recipe"), f"recipe {recipe}")
