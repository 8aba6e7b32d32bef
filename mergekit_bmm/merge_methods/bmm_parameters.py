"""Parameters of ``merge_method: bmm``: declaration, validation, and the typed view.

Two kinds of parameters reach the kernel:

* BMM's own (``lambda``, ``scale``, ``anchor_method``, ``gram``, ...), validated once
  when mergekit resolves the recipe, with one-line errors;
* parameters of the anchor method (``weight``, ``density``, ``alpha``, ...). The spec
  declares every parameter that any registered method accepts, so mergekit resolves
  them from the recipe like its own; the kernel forwards to the chosen anchor only
  those it declares. A name that BMM uses itself (``lambda``, ``epsilon``) reaches the
  anchor as ``anchor_lambda``/``anchor_epsilon``. ``stats`` is the exception: BMM's own
  value also serves an anchor that reads statistics (``regmean``) unless
  ``anchor_stats`` is given.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from mergekit.merge_methods.base import MergeMethodSpec, ParameterScope, ParameterSpec

from mergekit_bmm.core.evidence import AUTO_LAMBDA, lambda_text
from mergekit_bmm.errors import ConfigError, shown
from mergekit_bmm.merge_methods.parameter_ranges import CheckedParameter

PRETRAINED_ANCHOR = "pretrained"
DEFAULT_ANCHOR = "task_arithmetic"
GRAM_MODES = ("data_free", "activations", "mix")
ANCHOR_PREFIX = "anchor_"


def _known_anchor(value: str) -> str:
    from mergekit_bmm.merge_methods.registry import registered_names

    names = registered_names() - {"bmm"}
    if value == PRETRAINED_ANCHOR or value in names:
        return value
    known = sorted(names)
    raise ConfigError(
        f"bmm parameter `anchor_method`: unknown method {shown(value)}; use `pretrained` or one of: "
        + ", ".join(known)
    )


def _cache_directory(value: str) -> str:
    if os.path.exists(value) and not os.path.isdir(value):
        raise ConfigError(
            f"bmm parameter `cache`: {shown(value)} exists and is not a directory; give a directory "
            "(it is created if missing)"
        )
    return value


def own_parameters() -> tuple[ParameterSpec, ...]:
    """BMM's own parameters (shared unless noted)."""
    shared = ParameterScope.SHARED
    return (
        CheckedParameter(
            "lambda",
            float | Literal["auto"],
            shared,
            default=0.1,
            description="number >= 0, or auto (chosen per weight by the evidence)",
        ),
        CheckedParameter("scale", float, shared, default=1.0, description="number > 0"),
        CheckedParameter(
            "anchor_method",
            str | None,
            shared,
            default=None,
            description="merge method name",
            check=_known_anchor,
        ),
        CheckedParameter(
            "gram",
            Literal["data_free", "activations", "mix"],
            shared,
            default="data_free",
            description="Gram mode (data_free, activations or mix)",
        ),
        CheckedParameter(
            "lambda_mode",
            Literal["relative", "absolute"],
            shared,
            default="relative",
            description="lambda mode (relative or absolute)",
        ),
        CheckedParameter("epsilon", float, shared, default=0.5, description="number in [0, 1]"),
        CheckedParameter(
            "task_balance",
            Literal["none", "trace", "frobenius", "adaptive"],
            shared,
            default="none",
            description="task balance (none, trace, frobenius or adaptive)",
        ),
        CheckedParameter(
            "gram_sharing",
            Literal["weight", "input"],
            shared,
            default="input",
            description="data-free Gram pooled over the weights that read one input, q/k/v and "
            "gate/up (input), or one per weight (weight, the earlier default)",
        ),
        CheckedParameter(
            "stats", str | None, shared, default=None, description="path to a statistics directory"
        ),
        CheckedParameter(
            "compute_dtype",
            Literal["float32", "float64"],
            shared,
            default="float32",
            description="compute dtype (float32 or float64)",
        ),
        CheckedParameter(
            "weight_layout",
            Literal["auto", "out_in", "in_out"],
            shared,
            default="auto",
            description="weight layout (auto, out_in or in_out)",
        ),
        CheckedParameter("anchor_seed", int, shared, default=0, description="integer seed"),
        CheckedParameter(
            "low_rank",
            bool,
            shared,
            default=True,
            description="boolean (LoRA experts solved in their T·r subspace; false: the full route)",
        ),
        CheckedParameter(
            "low_rank_rows",
            Literal["any", "adapters"],
            shared,
            default="any",
            description="LoRA experts, data-assisted: the exact closed form (any) or each row of the update "
            "kept in the span of the adapters' A_t (adapters: a k x k solve)",
        ),
        CheckedParameter(
            "cache",
            str | None,
            shared,
            default=None,
            description="directory for the lambda-independent factor cache",
            check=_cache_directory,
        ),
        CheckedParameter(
            "cache_dtype",
            Literal["auto", "float32", "int16", "float16", "float64"] | None,
            shared,
            default=None,
            description="precision of cached factors: auto (default: int16 fixed point or float32 per "
            "factor, within 1e-5 of float32), float32, int16, float16 or float64",
        ),
        CheckedParameter(
            "anchor",
            bool,
            ParameterScope.NON_BASE,
            default=False,
            description="boolean (marks the input that is the prior)",
        ),
    )


OWN_NAMES = frozenset(parameter.name for parameter in own_parameters())


def forwarded_parameters(methods: Sequence[Any]) -> tuple[ParameterSpec, ...]:
    """Every parameter some other registered method declares, optional and untyped.

    Values are validated by the anchor method itself when it is called. Per-model
    parameters are declared for the non-base inputs (as mergekit's task-arithmetic
    family does); shared ones stay shared.
    """
    scopes: dict[str, ParameterScope] = {}
    for method in methods:
        for parameter in method.spec.parameters:
            key = ANCHOR_PREFIX + parameter.name if parameter.name in OWN_NAMES else parameter.name
            per_model = parameter.scope != ParameterScope.SHARED
            if per_model or key not in scopes:
                scopes[key] = ParameterScope.NON_BASE if per_model else ParameterScope.SHARED
    return tuple(
        ParameterSpec(key, Any, scope, default=None, description="forwarded to the anchor method")
        for key, scope in sorted(scopes.items())
        if key not in OWN_NAMES
    )


def build_spec(
    methods: Sequence[Any], pretty_name: str, reference_url: str, contract, policy
) -> MergeMethodSpec:
    return MergeMethodSpec(
        name="bmm",
        parameters=own_parameters() + forwarded_parameters(methods),
        contract=contract,
        pretty_name=pretty_name,
        reference_url=reference_url,
        optional_tensor_policy=policy,
        uses_accelerator=True,
    )


_DTYPES = {"int16": torch.int16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}


def _cache_dtype(asked: str | None, compute: str) -> torch.dtype | None:
    """One dtype for every cached factor, or None (``auto``: chosen per factor at the fill).
    A float64 merge keeps float64 factors unless told otherwise."""
    if asked in (None, "auto"):
        return torch.float64 if asked is None and compute == "float64" else None
    return _DTYPES[asked]


@dataclass(frozen=True)
class BMMSettings:
    """The typed, per-tensor view of BMM's own parameters."""

    lam: float | str  # a number, or AUTO_LAMBDA
    scale: float
    anchor_method: str | None
    gram: str
    lambda_mode: str
    epsilon: float
    stats: str | None
    task_balance: str
    compute_dtype: torch.dtype
    weight_layout: str
    anchor_seed: int
    cache: str | None = None
    cache_dtype: torch.dtype | None = None  # None: chosen per factor (methods/factor_precision.py)
    low_rank: bool = True  # LoRA experts through their T·r subspace (mergekit_bmm.core.low_rank)
    gram_sharing: str = "input"  # one data-free Gram per input (q/k/v, gate/up); "weight": one per weight
    low_rank_rows: str = "any"  # "adapters": LoRA data route with rows in the span of the A_t

    @property
    def lambda_auto(self) -> bool:
        """Whether λ is chosen per weight by the evidence (:mod:`mergekit_bmm.core.evidence`)."""
        return self.lam == AUTO_LAMBDA

    @property
    def lambda_text(self) -> str:
        return lambda_text(self.lam)

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, Any]) -> BMMSettings:
        dtype = torch.float64 if parameters["compute_dtype"] == "float64" else torch.float32
        settings = cls(
            lam=parameters["lambda"],
            scale=parameters["scale"],
            anchor_method=parameters["anchor_method"],
            gram=parameters["gram"],
            lambda_mode=parameters["lambda_mode"],
            epsilon=parameters["epsilon"],
            stats=parameters["stats"],
            task_balance=parameters.get("task_balance") or "none",
            compute_dtype=dtype,
            weight_layout=parameters["weight_layout"],
            anchor_seed=parameters["anchor_seed"],
            cache=parameters.get("cache") or None,
            cache_dtype=_cache_dtype(parameters.get("cache_dtype"), parameters["compute_dtype"]),
            low_rank=parameters.get("low_rank", True) is not False,
            gram_sharing=parameters.get("gram_sharing") or "input",
            low_rank_rows=parameters.get("low_rank_rows") or "any",
        )
        if settings.gram in ("activations", "mix") and not settings.stats:
            raise ConfigError(
                f"bmm: `gram: {settings.gram}` needs activation statistics; add `stats: /path/to/stats` "
                "(made by mergekit-bmm-stats) or use `gram: data_free`"
            )
        return settings


# BMM's own parameters whose value also serves an anchor that declares the same name,
# unless ``anchor_<name>`` is given: one statistics directory feeds both data-assisted
# BMM and a RegMean anchor; a weight layout is a fact about the checkpoints, the same for both.
SHARED_WITH_ANCHOR = frozenset({"stats", "weight_layout"})


def anchor_parameters(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """bmm's parameters as its anchor method sees them: the one forwarding rule.

    ``anchor_<name>`` reaches the anchor as ``<name>`` and wins over a plain ``<name>``; a
    name BMM does not use itself passes as is; of BMM's own names only those in
    :data:`SHARED_WITH_ANCHOR` (``stats``, ``weight_layout``) pass too. Used per tensor by ``bmm`` and, on the
    recipe, by the search's anchor model, so both give the anchor the same parameters.
    """
    forwarded = {
        key: value
        for key, value in parameters.items()
        if not key.startswith(ANCHOR_PREFIX) and (key not in OWN_NAMES or key in SHARED_WITH_ANCHOR)
    }
    for key, value in parameters.items():
        if key.startswith(ANCHOR_PREFIX) and key not in OWN_NAMES and value is not None:
            forwarded[key[len(ANCHOR_PREFIX) :]] = value
    return forwarded


def anchor_value(parameters: Mapping[str, Any], name: str) -> Any:
    """The value the user gave for the anchor's parameter ``name`` (None if unset)."""
    return anchor_parameters(parameters).get(name)
