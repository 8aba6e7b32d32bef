"""``gram: activations | mix`` over LoRA experts from their factors (:mod:`mergekit_bmm.core.low_rank_data`).

The cross term is formed as ``B Z`` from each adapter's ``(s·B, A)`` and the statistics' Grams, never
from the dense copies mergekit made of the adapters. With an anchor that sums the adapters' updates
(Task Arithmetic of them, the base) the solve has ``k = Σ r_t`` rows; with any other anchor the
``d_out`` rows of the dense closed form, from the same factored ``C``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import torch
from mergekit.merge_methods.base import TensorEntry

from mergekit_bmm.core import closed_form
from mergekit_bmm.core.closed_form import EigenFactors
from mergekit_bmm.core.low_rank import LowRankUpdate, SpanAnchor
from mergekit_bmm.core.low_rank_data import (
    FactoredEquations,
    activation_factored,
    data_free_factored,
    mix_factored,
    pooled_free_factored,
    solve_in_input_span,
)
from mergekit_bmm.core.normal_equations import NormalEquations
from mergekit_bmm.merge_methods.bmm_parameters import BMMSettings
from mergekit_bmm.merge_methods.factor_cache import key as cache_key
from mergekit_bmm.merge_methods.factor_cache.fill import fill_row_factors
from mergekit_bmm.merge_methods.factor_cache.store import FactorCache
from mergekit_bmm.merge_methods.lora_route import span_anchor
from mergekit_bmm.merge_methods.merge_findings import note_low_rank
from mergekit_bmm.merge_methods.pieces import statistics_name
from mergekit_bmm.merge_methods.shared_factor import shared_factor


def factored_equations(
    settings: BMMSettings,
    name: str,
    tasks: Sequence[TensorEntry],
    updates: Sequence[LowRankUpdate],
    d_in: int,
    device: torch.device,
    siblings: Sequence[LowRankUpdate] = (),
) -> FactoredEquations:
    """``G`` and ``C = B Z`` for the recipe's data-assisted Gram mode, from the adapters' factors;
    ``siblings``: the factors of the weights that read the same input, whose rows join the data-free
    part of ``mix`` (``gram_sharing: input``)."""
    from mergekit_bmm.stats.store import activation_grams_for

    dtype = settings.compute_dtype
    models = [entry.id for entry in tasks]
    grams = activation_grams_for(settings.stats, statistics_name(name), models, d_in=d_in)
    updates = [LowRankUpdate(u.left.to(device), u.right.to(device), u.expert) for u in updates]
    few = activation_factored(updates, [g.to(device) for g in grams], dtype)
    if settings.gram == "activations":
        return few
    if settings.gram_sharing == "input":
        siblings = [LowRankUpdate(u.left.to(device), u.right.to(device), u.expert) for u in siblings]
        free = pooled_free_factored(updates, siblings, len(tasks), dtype)
    else:
        free = data_free_factored(updates, dtype)
    return mix_factored(few, free, settings.epsilon)


def solve_factored(
    equations: FactoredEquations,
    updates: Sequence[LowRankUpdate],
    span: SpanAnchor | None,
    dense_prior: Callable[[], torch.Tensor],
    settings: BMMSettings,
    shared_input: Hashable | None = None,
) -> tuple[torch.Tensor, float]:
    """The merged update ``U`` (``d_out × d_in``) and the ridge λ' it was solved with.
    ``shared_input`` names the input when ``G`` is that input's alone (``gram: activations``): the
    weights reading it (q, k, v; gate, up) then share one factorisation of ``G + λ'I``."""
    rows = NormalEquations(equations.gram, equations.right)  # the same G: the same λ'
    ridge = closed_form.effective_ridge(settings.lam, rows, settings.lambda_mode)
    if settings.low_rank_rows == "adapters":  # rows in the span of the A_t: a k × k solve
        in_span = equations.in_span(updates, span.coefficients) if span is not None else None
        merged = solve_in_input_span(equations, updates, ridge, in_span, None if span else dense_prior())
        return merged, ridge
    factor = shared_factor(shared_input, equations.gram, ridge)
    if span is not None:  # U = B · [(Z + λ' c⊙A)(G + λ'I)⁻¹]: k rows
        prior = equations.in_span(updates, span.coefficients)
        solved = factor.solve(rows.cross, prior) if factor else closed_form.solve(rows, prior, ridge)
        return equations.left @ solved, ridge
    dense = equations.dense()
    prior = dense_prior()
    return (factor.solve(dense.cross, prior) if factor else closed_form.solve(dense, prior, ridge)), ridge


class DataRouteWeight(Protocol):
    """What :func:`cached_row_factors` reads of the weight being merged (bmm's tensor task)."""

    name: str
    settings: BMMSettings
    source: Any  # the anchor (AnchorSource)
    base: torch.Tensor

    def orient(self, matrix: torch.Tensor) -> torch.Tensor: ...
    def data_route_updates(self) -> list[LowRankUpdate] | None: ...
    def low_rank_data(self) -> tuple[list[LowRankUpdate], FactoredEquations | None] | None: ...


def cached_row_factors(
    cache: FactorCache, key: str, weight: DataRouteWeight, fill: bool = True
) -> EigenFactors | None:
    """The factor cache's entry for ``U = B·U_k`` over LoRA experts in a data-assisted mode and an
    anchor in their span (read back, or filled from the factored equations unless ``fill`` is
    False): a trial then costs ``k`` rows through the basis and one ``out × k × in`` product. None
    for any other weight."""
    updates = weight.data_route_updates()
    shape = tuple(weight.orient(weight.base).shape)
    span = span_anchor(weight.source, shape) if updates else None
    if span is None:
        return None
    key, k = cache_key.with_route(key, "low_rank_data/1"), sum(u.rank for u in updates)
    if fill:  # a merge (a reload during a search's trial is not one)
        note_low_rank(weight.name, k)
    dtype = weight.settings.compute_dtype
    factors = cache.load_factors(weight.name, key, (k, shape[1]), dtype)
    if factors is not None and factors.rows is not None and tuple(factors.rows.shape) == (shape[0], k):
        return factors
    if not fill:
        return None
    _, equations = weight.low_rank_data()
    problem = NormalEquations(equations.gram, equations.right)  # the k rows, with the weight's G
    prior = equations.in_span(updates, span.coefficients)
    base = weight.orient(weight.base)
    return fill_row_factors(cache, weight.name, key, problem, equations.left, prior, base, weight.settings)
