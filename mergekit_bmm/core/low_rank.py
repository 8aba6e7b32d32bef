"""The data-free closed form for LoRA experts, solved in the T·r-dimensional subspace they span.

Expert t's task vector is ``U_t = B_t A_t`` (its adapter's scale ``α/r`` folded into ``B_t``: ``B_t``
is ``d_out × r_t``, ``A_t`` is ``r_t × d_in``). Stack ``A = [A_1; …; A_T]`` (``k × d_in``, ``k = Σ r_t``)
and let ``Aᵀ = Q R`` (``Q``: ``d_in × k`` orthonormal). With ``M = blockdiag(w_t B_tᵀB_t)``:

    G = Σ w_t U_tᵀU_t = Aᵀ M A = Q H Qᵀ,        H = R M Rᵀ   (k × k)
    C = Σ w_t U_t U_tᵀ U_t = Σ w_t B_t (A_t A_tᵀ)(B_tᵀ B_t) A_t,   C (I − QQᵀ) = 0

so ``G`` lives in ``span(Q)`` and the closed form is exactly

    U = U0 + (C − U0 G) Q (H + λ'I)⁻¹ Qᵀ

for *any* anchor ``U0`` (low-rank or not) — the thin-basis eigen factors of
:class:`~mergekit_bmm.core.closed_form.EigenFactors` with basis ``Q V`` (``H = V Λ Vᵀ``). Forming them
costs ``O(d_out · d_in · k)`` (``U0 Q``) and ``O(d_in · k²)`` (the QR), never a ``d_in × d_in`` matrix.
An anchor inside the span, ``U0 = Σ c_t U_t`` (:class:`SpanAnchor`: Task Arithmetic of the adapters,
or the base with ``c = 0``), is never formed at all: ``U0 Q = Σ c_t B_t (A_t Q)`` is ``k``-sized and
``U`` itself is ``(U0 Q V + E Q V·a)(Q V)ᵀ``, one ``d_out × k × d_in`` product for the whole weight.
On one 2048 × 4096 weight with three rank-4 adapters the full float32 route spent 8.7 s forming
``G`` and ``C`` alone (docs/numerics.md). The eigenproblem is ``k × k`` and well conditioned where
``G + λ'I`` is not: ``G``'s ``d_in − k`` zero eigenvalues never enter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mergekit_bmm.core.closed_form import EigenFactors, eigenvalue_floor
from mergekit_bmm.core.evidence import terms_of
from mergekit_bmm.errors import TensorInputError


@dataclass(frozen=True)
class LowRankUpdate:
    """One expert's task vector ``U_t = left @ right`` (``d_out × r`` and ``r × d_in``, scale folded in)."""

    left: torch.Tensor
    right: torch.Tensor
    expert: int = 0  # which of the merge's experts it belongs to (an anchor's coefficients are per expert)

    @property
    def rank(self) -> int:
        return self.right.shape[0]

    def dense(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        return self.left.to(dtype) @ self.right.to(dtype)


@dataclass(frozen=True)
class SpanAnchor:
    """An anchor inside the experts' span: ``U0 = Σ_t coefficients[t] · U_t`` over the merge's
    experts (``LowRankUpdate.expert`` indexes them), ``shape`` the weight's ``(d_out, d_in)``.

    Task Arithmetic of the adapters is one (its coefficients read from mergekit's own method,
    :meth:`~mergekit_bmm.merge_methods.bmm_anchor.AnchorSource.span_coefficients`), the base another
    (all 0). Built from the factors it is exact, where Task Arithmetic of the dense copies carries their
    rounding to the storage dtype (large in bfloat16: the update is a small fraction of the weight).
    """

    coefficients: tuple[float, ...]
    shape: tuple[int, int]


def _check(updates: Sequence[LowRankUpdate], anchor: torch.Tensor | SpanAnchor) -> None:
    if not updates:
        raise TensorInputError("the low-rank closed form needs at least one expert")
    d_out, d_in = anchor.shape
    for index, update in enumerate(updates):
        r = update.rank
        if update.left.shape != (d_out, r) or update.right.shape != (r, d_in):
            raise TensorInputError(
                f"LoRA factors of expert {index} have shapes {tuple(update.left.shape)} and "
                f"{tuple(update.right.shape)}; the weight is ({d_out}, {d_in})"
            )


def _check_siblings(siblings: Sequence[LowRankUpdate], d_in: int) -> None:
    for update in siblings:
        if update.right.shape[1] != d_in or update.left.shape[1] != update.rank:
            raise TensorInputError(
                f"LoRA factors of a weight reading the same input have shapes {tuple(update.left.shape)} "
                f"and {tuple(update.right.shape)}; expected (*, r) and (r, {d_in})"
            )


def low_rank_factors(
    updates: Sequence[LowRankUpdate],
    anchor: torch.Tensor | SpanAnchor,
    weights: Sequence[float] | None = None,
    dtype: torch.dtype = torch.float64,
    experts: int | None = None,
    siblings: Sequence[LowRankUpdate] = (),
    rows: int | None = None,
) -> EigenFactors:
    """The closed form's eigen factors for low-rank experts (thin basis of rank ``k = Σ r_t``), in
    ``dtype``, with the evidence's terms (:mod:`mergekit_bmm.core.evidence`); data-free Grams,
    ``weights`` the tasks' balance weights (default 1). ``experts``: how many experts the merge has
    (an expert whose adapter leaves this weight alone has no update here but still observed it);
    no update at all gives the anchor (a rank-0 basis). A :class:`SpanAnchor` gives factors whose
    anchor is held in the basis (``EigenFactors.anchor_in_basis``), never as a dense matrix.

    ``siblings`` (``gram_sharing: input``): the experts' updates of the other weights that read this
    weight's input; each expert's Gram pools them, ``G_t = Σ_p U_t^pᵀU_t^p``, and ``C = Σ U_t G_t``
    (the basis then spans every ``A`` of the input); ``rows``: the rows an expert's pooled Gram
    holds (default ``d_out``), its observations for the evidence."""
    d_out, d_in = anchor.shape
    if not updates and not siblings:
        if isinstance(anchor, SpanAnchor):  # every coefficient multiplies a missing update: U0 = 0
            raise TensorInputError("a span anchor needs at least one expert's update; give the dense anchor")
        return _anchor_only(anchor, experts or 0)
    if updates:
        _check(updates, anchor)
    _check_siblings(siblings, d_in)
    if siblings and weights is not None:
        raise TensorInputError("balance weights and pooled Grams do not combine on the low-rank route")
    weights = list(weights) if weights is not None else [1.0] * len(updates)
    every = [*updates, *siblings]
    lefts = [u.left.to(dtype) for u in every]
    rights = [u.right.to(dtype) for u in every]
    stacked = torch.cat(rights, dim=0)  # A, k × d_in
    q, r_factor = torch.linalg.qr(stacked.T)  # Aᵀ = Q R
    blocks = [w * (b.T @ b) for w, b in zip([*weights, *[1.0] * len(siblings)], lefts)]  # w_t B_tᵀ B_t
    m = torch.block_diag(*blocks)
    h = r_factor @ m @ r_factor.T
    h = 0.5 * (h + h.T)
    right_in_q = [a @ q for a in rights]  # A_p Q, r_p × k
    # Per own update, A_t G_t Q and A_t G_t A_tᵀ with G_t = Σ_p A_pᵀ M_p A_p over the expert's updates
    # of this input (its own alone without siblings): every factor k-sized
    own = range(len(updates))
    pooled_q, pooled_own = [], []
    for i in own:
        mine = [i, *(j for j in range(len(updates), len(every)) if every[j].expert == every[i].expert)]
        pooled_q.append(sum((rights[i] @ rights[j].T) @ blocks[j] @ right_in_q[j] for j in mine))
        pooled_own.append(
            sum((rights[i] @ rights[j].T) @ blocks[j] @ (rights[j] @ rights[i].T) for j in mine)
        )
    cross_q = sum((lefts[i] @ pooled_q[i] for i in own), torch.zeros(d_out, q.shape[1], dtype=dtype))
    if isinstance(anchor, SpanAnchor):  # U0 Q = Σ c_t B_t (A_t Q): k-sized, exact in ``dtype``
        coefficients = [anchor.coefficients[u.expert] for u in updates]
        anchor_q = sum(
            (c * (lefts[i] @ right_in_q[i]) for c, i in zip(coefficients, own)),
            torch.zeros(d_out, q.shape[1], dtype=dtype),
        )
    else:
        # U0 Q, the one d_out × d_in × k product, in the anchor's own dtype (the merge's compute dtype):
        # a float32 product is exact to its rounding, and the rest is k-sized and in ``dtype``
        anchor_q = (anchor @ q.to(anchor.dtype)).to(dtype)
    residual_q = cross_q - anchor_q @ h  # (C − U0 G) Q
    eigenvalues, vectors = torch.linalg.eigh(h)
    basis = q @ vectors
    correction = residual_q @ vectors
    trace = float(torch.diagonal(h).sum())
    # S = Σ w_t ⟨U_t G_t, U_t⟩ = Σ w_t tr(B_tᵀB_t · A_t G_t A_tᵀ) (r_t × r_t; G_t = U_tᵀU_t: ‖U_tᵀU_t‖²_F)
    energy = sum(float(torch.trace((lefts[i].T @ lefts[i]) @ pooled_own[i])) for i in own)
    # A = S − ⟨U0, C⟩ − ⟨U0, C − U0 G⟩, each inner product through Q (C and U0 G live in span Q)
    misfit = energy - float((anchor_q * cross_q).sum()) - float((anchor_q * residual_q).sum())
    observations = (experts or len(updates)) * (rows or d_out)
    evidence = terms_of(eigenvalues, correction, misfit, observations, trace / d_in)
    in_span = isinstance(anchor, SpanAnchor)
    return EigenFactors(
        basis=basis,
        eigenvalues=eigenvalues,
        correction=correction,
        anchor=None if in_span else anchor,
        anchor_in_basis=anchor_q @ vectors if in_span else None,  # U0 = (U0 Q V)(Q V)ᵀ
        mean_eigenvalue=trace / d_in,
        diagonal_max=float(eigenvalues.max()) if eigenvalues.numel() else 0.0,
        evidence=evidence,
        # the numerical zero of this k × k eigenproblem in ``dtype``, not of a d_in × d_in float32 one
        zero_floor=eigenvalue_floor(
            float(eigenvalues.max()) if eigenvalues.numel() else 0.0, len(eigenvalues), dtype
        ),
    )


def _anchor_only(anchor: torch.Tensor, experts: int) -> EigenFactors:
    """Factors of ``G = 0`` (no expert moved this weight): the anchor for every λ."""
    d_out, d_in = anchor.shape
    empty = anchor.new_zeros((0,))
    terms = terms_of(empty, anchor.new_zeros((d_out, 0)), 0.0, experts * d_out, 0.0)
    return EigenFactors(
        basis=anchor.new_zeros((d_in, 0)),
        eigenvalues=empty,
        correction=anchor.new_zeros((d_out, 0)),
        anchor=anchor,
        mean_eigenvalue=0.0,
        diagonal_max=0.0,
        evidence=terms,
    )
