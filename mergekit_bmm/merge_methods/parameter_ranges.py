"""The valid range of every numeric parameter of the plugin's merge methods, in one table.

mergekit checks a parameter's type; whether the value makes sense to the method is checked
here, once, when mergekit resolves the recipe: :class:`CheckedParameter` looks its
``(method, name)`` up in :data:`RANGES` and refuses a value outside with one line.

Why the ranges are what they are:

* ``scale`` (bmm) and ``alpha`` (tsv, iso_c, iso_cts, ace) multiply the merged task vector:
  ``W = W_pre + s·U``. ``0`` would give the base weights on the solved tensors next to the
  anchor's everywhere else, a hybrid no one asks for; a negative value negates the tasks
  ("forgetting"), which these methods do not model. Both must be > 0.
* ``lambda`` (bmm) is a prior strength: >= 0 (0 is the documented λ → 0⁺ limit; any
  finite value is computed stably, the anchor being the limit λ → ∞).
* ``epsilon``, ``common_space_fraction``, ``rank_fraction`` and ``off_diagonal_scale`` are
  interpolation weights in [0, 1]; ``learning_rate`` > 0; ACE's ``ridge``, ``iterations`` and
  ``anchor_seed`` >= 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pydantic
from mergekit.merge_methods.base import ParameterSpec

from mergekit_bmm.errors import ConfigError, shown


@dataclass(frozen=True)
class Range:
    """A closed or half-open interval of finite numbers (``None``: unbounded on that side)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    integer: bool = False

    def contains(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or value <= self.high

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        if self.low is not None and self.high is not None:
            return f"{kind} in [{self.low:g}, {self.high:g}]"
        if self.low is not None:
            return f"{kind} {'>' if self.low_open else '>='} {self.low:g}"
        return kind


POSITIVE = Range(0.0, low_open=True)
NON_NEGATIVE = Range(0.0)
UNIT_INTERVAL = Range(0.0, 1.0)
COUNT = Range(0.0, integer=True)

RANGES: dict[tuple[str, str], Range] = {
    ("bmm", "lambda"): NON_NEGATIVE,
    ("bmm", "scale"): POSITIVE,
    ("bmm", "epsilon"): UNIT_INTERVAL,
    ("bmm", "anchor_seed"): COUNT,
    ("tsv", "alpha"): POSITIVE,
    ("iso_c", "alpha"): POSITIVE,
    ("iso_cts", "alpha"): POSITIVE,
    ("iso_cts", "common_space_fraction"): UNIT_INTERVAL,
    ("ace", "alpha"): POSITIVE,
    ("ace", "ridge"): NON_NEGATIVE,
    ("ace", "rank_fraction"): UNIT_INTERVAL,
    ("regmean", "off_diagonal_scale"): UNIT_INTERVAL,
    ("wudi", "iterations"): COUNT,
    ("wudi", "learning_rate"): POSITIVE,
}


def check_range(owner: str, name: str, value: Any) -> Any:
    """``value`` if it lies in the range of ``owner``'s parameter ``name`` (or it has none)."""
    allowed = RANGES.get((owner, name))
    if allowed is None or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    if not allowed.contains(float(value)):
        raise ConfigError(f"{owner} parameter `{name}` must be {allowed.describe()}; got {shown(value)}")
    return value


@dataclass(frozen=True)
class CheckedParameter(ParameterSpec):
    """A ParameterSpec whose type and range failures are one readable line."""

    check: Any = None  # an extra check beyond the range (e.g. a registered method name)
    owner: str = "bmm"

    def validate(self, value: Any) -> Any:
        try:
            value = super().validate(value)
        except pydantic.ValidationError:
            raise ConfigError(
                f"{self.owner} parameter `{self.name}`: {shown(value)} is not a valid "
                f"{self.description or 'value'}"
            ) from None
        value = check_range(self.owner, self.name, value)
        return self.check(value) if self.check is not None and value is not None else value
