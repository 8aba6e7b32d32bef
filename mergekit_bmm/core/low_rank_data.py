"""Data-assisted (and mix) BMM for LoRA experts, at adapter cost.

Expert t's task vector is ``U_t = B_t A_t`` (``d_out × r_t`` by ``r_t × d_in``, scale folded into
``B_t``). Whatever the Gram, the cross term lives in the span of the ``B_t``:

    activations:  C = Σ U_t G_t = Σ B_t (A_t G_t)
    data-free:    C = Σ U_t U_tᵀU_t = Σ B_t (A_t A_tᵀ)(B_tᵀB_t) A_t
    mix:          the two above, each over its Gram's mean eigenvalue, weighted by ε and 1 − ε

so ``C = B Z`` with ``B = [B_1 … B_T]`` (``k = Σ r_t`` columns) and ``Z`` (``k × d_in``) formed from the
factors, never from a dense ``U_t``. With an anchor in the same span (``U0 = Σ c_t U_t``: Task
Arithmetic of the adapters, the base) the closed form is

    U = (C + λ'U0)(G + λ'I)⁻¹ = B · [(Z + λ' c⊙A)(G + λ'I)⁻¹]

one ``k``-row solve per weight, and the merged update has rank ≤ k: an adapter of rank Σ r_t holds
it exactly. ``G`` itself is ``d_in × d_in`` (Σ G_t over every task, an expert whose adapter leaves the
weight alone included: it asks for that weight's output to stay). Any other anchor keeps ``C = B Z``
and solves the ``d_out`` rows densely.

:func:`solve_in_input_span` is the variant that also keeps each row of the update in the
span of the ``A_t`` (``Q``, ``d_in × k`` orthonormal): ``U = U0 + (C − U0 G) Q (QᵀGQ + λ'I)⁻¹ Qᵀ``, a
``k × k`` solve with no ``d_in × d_in`` factorisation, which gives up the directions outside the
adapters' inputs (``low_rank_rows: adapters``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mergekit_bmm.core.low_rank import LowRankUpdate
from mergekit_bmm.core.normal_equations import NormalEquations
from mergekit_bmm.errors import TensorInputError


@dataclass(frozen=True)
class FactoredEquations:
    """``G`` and ``C = left @ right`` (``left`` = the stacked ``B_t``, ``right`` = ``Z``)."""

    gram: torch.Tensor
    left: torch.Tensor
    right: torch.Tensor

    def scaled(self, factor: float) -> FactoredEquations:
        return FactoredEquations(self.gram * factor, self.left, self.right * factor)

    def dense(self) -> NormalEquations:
        """The same equations with ``C`` formed (``d_out × k × d_in``): the dense routes' input."""
        return NormalEquations(self.gram, self.left @ self.right)

    def in_span(self, updates: Sequence[LowRankUpdate], coefficients: Sequence[float]) -> torch.Tensor:
        """``c⊙A``: the rows that express the span anchor ``U0 = Σ c_t B_t A_t = B (c⊙A)``."""
        dtype = self.right.dtype
        return torch.cat([coefficients[u.expert] * u.right.to(dtype) for u in updates], dim=0)


def _stacked_left(updates: Sequence[LowRankUpdate], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([u.left.to(dtype) for u in updates], dim=1)


def activation_factored(
    updates: Sequence[LowRankUpdate], grams: Sequence[torch.Tensor], dtype: torch.dtype
) -> FactoredEquations:
    """``G = Σ_t G_t`` over every task (``grams`` in the merge's expert order) and ``Z_t = A_t G_t``."""
    if not updates:
        raise TensorInputError("the low-rank data-assisted solve needs at least one expert's update")
    d_in = updates[0].right.shape[1]
    if any(g.shape != (d_in, d_in) for g in grams):
        raise TensorInputError(f"activation Grams must be {d_in} x {d_in} for this weight's adapters")
    grams = [g.to(dtype) for g in grams]
    gram = grams[0].clone()
    for other in grams[1:]:  # in place: one d_in² buffer, not one per task
        gram += other
    right = torch.cat([u.right.to(dtype) @ grams[u.expert] for u in updates], dim=0)
    return FactoredEquations(gram, _stacked_left(updates, dtype), right)


def data_free_factored(updates: Sequence[LowRankUpdate], dtype: torch.dtype) -> FactoredEquations:
    """``G = Σ A_tᵀ(B_tᵀB_t)A_t`` and ``Z_t = (A_t A_tᵀ)(B_tᵀB_t) A_t``."""
    d_in = updates[0].right.shape[1]
    gram = torch.zeros(d_in, d_in, dtype=dtype, device=updates[0].right.device)
    rows = []
    for update in updates:
        b, a = update.left.to(dtype), update.right.to(dtype)
        inner = b.T @ b
        gram += a.T @ (inner @ a)
        rows.append((a @ a.T) @ inner @ a)
    return FactoredEquations(gram, _stacked_left(updates, dtype), torch.cat(rows, dim=0))


def pooled_free_factored(
    updates: Sequence[LowRankUpdate], siblings: Sequence[LowRankUpdate], experts: int, dtype: torch.dtype
) -> FactoredEquations:
    """Data-free equations with each task's Gram pooled over the weights that read the input
    (``gram_sharing: input``): ``G_t = Σ_p A_pᵀ(B_pᵀB_p)A_p`` over this weight's and its ``siblings'``
    factors, ``G = Σ G_t`` and ``Z_t = A_t G_t`` (the activation form with these Grams)."""
    d_in = updates[0].right.shape[1]
    grams = [torch.zeros(d_in, d_in, dtype=dtype, device=updates[0].right.device) for _ in range(experts)]
    for update in (*updates, *siblings):
        b, a = update.left.to(dtype), update.right.to(dtype)
        grams[update.expert] += a.T @ ((b.T @ b) @ a)
    return activation_factored(updates, grams, dtype)


def mix_factored(few: FactoredEquations, free: FactoredEquations, epsilon: float) -> FactoredEquations:
    """``ε·few + (1 − ε)·free``, each over its Gram's mean eigenvalue (as ``mix_equations``)."""
    few = few.scaled(1.0 / _mean_eigenvalue(few.gram))
    free = free.scaled(1.0 / _mean_eigenvalue(free.gram))
    return FactoredEquations(
        epsilon * few.gram + (1.0 - epsilon) * free.gram,
        few.left,
        epsilon * few.right + (1.0 - epsilon) * free.right,
    )


def _mean_eigenvalue(gram: torch.Tensor) -> float:
    value = float(torch.diagonal(gram).sum()) / gram.shape[0]
    return value if value > 0 else 1.0


def regmean_low_rank(
    updates: Sequence[LowRankUpdate],
    grams: Sequence[torch.Tensor],
    experts: int,
    off_diagonal_scale: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """RegMean's merged update ``(Σ U_t G̃_t)(Σ G̃_t)⁻¹`` of LoRA experts as ``B · [Z G̃⁻¹]`` (``k`` rows),
    with the mean task vector ``Σ U_t / T = B (A / T)`` where no task's data reach (as
    :func:`~mergekit_bmm.core.regmean.regmean_merge`); ``grams`` over all ``experts``."""
    from mergekit_bmm.core.merge_tools import solve_normal
    from mergekit_bmm.core.regmean import shrink_off_diagonal

    shrunk = [shrink_off_diagonal(g.to(dtype), off_diagonal_scale) for g in grams]
    equations = activation_factored(updates, shrunk, dtype)
    mean = torch.cat([u.right.to(dtype) / experts for u in updates], dim=0)
    return equations.left @ solve_normal(equations.gram, equations.right, mean)


def solve_in_input_span(
    equations: FactoredEquations,
    updates: Sequence[LowRankUpdate],
    ridge: float,
    span_prior: torch.Tensor | None,
    dense_prior: torch.Tensor | None = None,
) -> torch.Tensor:
    """``U = U0 + (C − U0 G) Q (QᵀGQ + λ'I)⁻¹ Qᵀ`` with ``Q`` an orthonormal basis of the ``A_t``'s rows.
    The anchor is ``B · span_prior`` (``c⊙A``) or ``dense_prior``."""
    from mergekit_bmm.core import closed_form

    dtype = equations.right.dtype
    stacked = torch.cat([u.right.to(dtype) for u in updates], dim=0)  # A, k × d_in
    q, _ = torch.linalg.qr(stacked.T)  # d_in × k
    gram_q = equations.gram @ q
    inner = q.T @ gram_q
    inner = 0.5 * (inner + inner.T)
    if span_prior is not None:  # everything k-sized: (Z − P G) Q, then B · (P + W Qᵀ)
        residual = equations.right @ q - span_prior @ gram_q
        weights = closed_form.solve(NormalEquations(inner, residual), torch.zeros_like(residual), ridge)
        return equations.left @ (span_prior + weights @ q.T)
    residual = equations.left @ (equations.right @ q) - dense_prior.to(dtype) @ gram_q
    weights = closed_form.solve(NormalEquations(inner, residual), torch.zeros_like(residual), ridge)
    return dense_prior.to(dtype) + weights @ q.T
