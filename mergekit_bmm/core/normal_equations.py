"""BMM's normal equations ``U·G = C`` for one weight: the Gram and cross term, before any ridge.

Data-free (``G = Σ U_tᵀU_t``, ``C = Σ U_t U_tᵀU_t``), from activation Grams (``G = Σ G_t``,
``C = Σ U_t G_t``) or their mix, each task optionally weighed by ``task_balance``
(:mod:`mergekit_bmm.core.task_balance`). Solving them is :mod:`mergekit_bmm.core.closed_form`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mergekit_bmm.core.task_balance import balance_weights, size_kind
from mergekit_bmm.errors import ConfigError, TensorInputError


@dataclass(frozen=True)
class NormalEquations:
    """The λ-independent part of one merge: ``U·G = C`` before the ridge is added.

    ``energy`` (``Σ w_t tr(U_t G_t U_tᵀ)``) and ``observations`` (per output row) are what the
    evidence for λ needs besides ``G`` and ``C`` (:mod:`mergekit_bmm.core.evidence`); None
    when the builder could not tell (activation statistics without token counts).
    """

    gram: torch.Tensor
    cross: torch.Tensor
    energy: float | None = None
    observations: float | None = None

    def __post_init__(self) -> None:
        d_in = self.gram.shape[-1]
        if self.gram.shape != (d_in, d_in) or self.cross.shape[-1] != d_in or self.cross.ndim != 2:
            raise TensorInputError(
                f"normal equations have inconsistent shapes: Gram {tuple(self.gram.shape)}, "
                f"cross term {tuple(self.cross.shape)}"
            )

    @property
    def d_in(self) -> int:
        return self.gram.shape[-1]

    @property
    def mean_eigenvalue(self) -> float:
        """``tr(G)/d_in``: the scale that makes λ and ε dimensionless."""
        return float(torch.diagonal(self.gram).sum()) / self.d_in

    def scaled(self, factor: float) -> NormalEquations:
        energy = None if self.energy is None else self.energy * factor
        return NormalEquations(self.gram * factor, self.cross * factor, energy, self.observations)

    def normalized(self) -> NormalEquations:
        """Divide Gram and cross term by the Gram's mean eigenvalue (no-op for G = 0)."""
        scale = self.mean_eigenvalue
        return self if scale <= 0 else self.scaled(1.0 / scale)


_ROWS = 256  # rows per float64 block of inner64: its extra memory is 256 × columns × 8 bytes


def inner64(left: torch.Tensor, right: torch.Tensor) -> float:
    """``Σ left ∘ right`` accumulated in float64, a block of rows at a time: as exact as a float64
    copy of both matrices (what the evidence's energy needs) without holding one."""
    total = 0.0
    for start in range(0, left.shape[0], _ROWS):
        block = slice(start, start + _ROWS)
        total += float((left[block].double() * right[block].double()).sum())
    return total


def _stack(task_vectors: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    if not task_vectors:
        raise TensorInputError("the closed form needs at least one task vector")
    shape = task_vectors[0].shape
    if len(shape) != 2:
        raise TensorInputError(f"task vectors must be 2D (out, in); got shape {tuple(shape)}")
    for index, vector in enumerate(task_vectors):
        if vector.shape != shape:
            raise TensorInputError(
                f"task vector {index} has shape {tuple(vector.shape)}, expected {tuple(shape)}"
            )
    return [vector.to(dtype) for vector in task_vectors]


def data_free_equations(
    task_vectors: Sequence[torch.Tensor], dtype: torch.dtype = torch.float32, balance: str = "none"
) -> NormalEquations:
    """``G = Σ w_t U_tᵀU_t`` and ``C = Σ w_t U_t U_tᵀU_t`` (paper eq. for data-free BMM; ``w_t = 1``
    unless ``balance`` weighs the tasks, see :mod:`mergekit_bmm.core.task_balance`).

    ``C`` is formed as ``Σ (U_t U_tᵀ) U_t`` when ``out < in`` (cheaper), else as
    ``Σ U_t (U_tᵀ U_t)``; both are the same matrix.
    """
    vectors = _stack(task_vectors, dtype)
    out_features, in_features = vectors[0].shape
    weights = balance_weights([_update_size(v, size_kind(balance)) for v in vectors], balance)
    gram = vectors[0].new_zeros((in_features, in_features))
    cross = vectors[0].new_zeros((out_features, in_features))
    energy = 0.0
    for vector, weight in zip(vectors, weights):
        task_gram = vector.T @ vector
        gram.add_(task_gram, alpha=weight)
        if out_features < in_features:
            outer = vector @ vector.T
            cross.add_(outer @ vector, alpha=weight)
            energy += weight * inner64(outer, outer)  # ‖U Uᵀ‖² = ‖UᵀU‖²
            del outer
        else:
            cross.add_(vector @ task_gram, alpha=weight)
            energy += weight * inner64(task_gram, task_gram)
        del task_gram
    # Data-free observations: each expert's own rows are its inputs (X_t = U_tᵀ, out columns).
    return NormalEquations(gram, cross, energy, float(len(vectors) * out_features))


def pooled_data_free_equations(
    task_vectors: Sequence[torch.Tensor],
    siblings: Sequence[Sequence[torch.Tensor]],
    dtype: torch.dtype = torch.float32,
    balance: str = "none",
) -> NormalEquations:
    """Data-free equations with one Gram per input: ``G_t = Σ_p U_t^pᵀU_t^p`` over this weight and
    its ``siblings`` (the other weights that read the same input: k and v beside q), then
    ``G = Σ w_t G_t`` and ``C = Σ w_t U_t G_t``. A fused weight (q, k and v stacked) gets these Grams
    by itself, so split and fused layouts solve the same problem."""
    vectors = _stack(task_vectors, dtype)
    grams, rows = pooled_grams(vectors, siblings, dtype)
    return pooled_equations(vectors, grams, rows, dtype, balance)


def pooled_grams(
    vectors: Sequence[torch.Tensor], siblings: Sequence[Sequence[torch.Tensor]], dtype: torch.dtype
) -> tuple[list[torch.Tensor], int]:
    """Per task ``Σ_p U_t^pᵀU_t^p`` over a weight and its ``siblings``, and the rows they hold together:
    the same for every weight that reads the input (:func:`pooled_equations` serves each of them)."""
    if len(siblings) != len(vectors):
        raise TensorInputError(f"got siblings for {len(siblings)} tasks and {len(vectors)} task vectors")
    grams = []
    for vector, parts in zip(vectors, siblings):
        vector = vector.to(dtype)
        gram = vector.T @ vector
        for part in parts:
            part = part.to(device=vector.device, dtype=dtype)
            if part.ndim != 2 or part.shape[1] != vector.shape[1]:
                raise TensorInputError(
                    f"a weight reading the same input has shape {tuple(part.shape)}, "
                    f"expected (*, {vector.shape[1]})"
                )
            gram.add_(part.T @ part)
        grams.append(gram)
    return grams, vectors[0].shape[0] + sum(part.shape[0] for part in siblings[0])


def pooled_equations(
    task_vectors: Sequence[torch.Tensor],
    grams: Sequence[torch.Tensor],
    rows: int,
    dtype: torch.dtype = torch.float32,
    balance: str = "none",
) -> NormalEquations:
    """``G = Σ w_t G_t`` and ``C = Σ w_t U_t G_t`` from pooled Grams holding ``rows`` rows per task."""
    vectors = _stack(task_vectors, dtype)
    equations = activation_equations(vectors, grams, dtype, balance)
    # Data-free observations: each expert's rows of every weight that reads the input.
    return NormalEquations(equations.gram, equations.cross, equations.energy, float(len(vectors) * rows))


def _update_size(vector: torch.Tensor, kind: str | None) -> float:
    """``tr(U_tᵀU_t)`` or ``‖U_tᵀU_t‖_F`` of one task's update (0 when no balance asks for it)."""
    if kind is None:
        return 0.0
    if kind == "trace":
        return float(vector.square().sum())
    small = vector @ vector.T if vector.shape[0] < vector.shape[1] else vector.T @ vector
    return float(small.norm())


def activation_equations(
    task_vectors: Sequence[torch.Tensor],
    activation_grams: Sequence[torch.Tensor],
    dtype: torch.dtype = torch.float32,
    balance: str = "none",
    tokens: Sequence[int] | None = None,
) -> NormalEquations:
    """``G = Σ w_t G_t`` and ``C = Σ w_t U_t G_t`` from per-task activation Grams (data-assisted;
    ``w_t = 1`` unless ``balance`` weighs the tasks by ``tr(G_t)`` or ``‖G_t‖_F``).

    ``tokens``: how many tokens each Gram averages; their sum is the number of observations
    (a token-mean Gram is ``X_t X_tᵀ / n_t``: the same ``n_t`` columns, rescaled)."""
    vectors = _stack(task_vectors, dtype)
    if len(activation_grams) != len(vectors):
        raise TensorInputError(
            f"got {len(activation_grams)} activation Grams for {len(vectors)} task vectors"
        )
    out_features, in_features = vectors[0].shape
    for index, task_gram in enumerate(activation_grams):
        if task_gram.shape != (in_features, in_features):
            raise TensorInputError(
                f"activation Gram {index} has shape {tuple(task_gram.shape)}, expected "
                f"({in_features}, {in_features}) for a weight of shape ({out_features}, {in_features})"
            )
    kind = size_kind(balance)
    sizes = [0.0 if kind is None else _gram_size(g, kind) for g in activation_grams]
    weights = balance_weights(sizes, balance)
    gram = vectors[0].new_zeros((in_features, in_features))
    cross = vectors[0].new_zeros((out_features, in_features))
    energy = 0.0
    for vector, task_gram, weight in zip(vectors, activation_grams, weights):
        task_gram = task_gram.to(device=vector.device, dtype=dtype)
        gram.add_(task_gram, alpha=weight)
        product = vector @ task_gram
        cross.add_(product, alpha=weight)
        energy += weight * inner64(product, vector)
        del product
    counted = tokens is not None and len(tokens) == len(vectors) and all(n > 0 for n in tokens)
    return NormalEquations(gram, cross, energy, float(sum(tokens)) if counted else None)


def _gram_size(gram: torch.Tensor, kind: str) -> float:
    return float(torch.diagonal(gram).double().sum()) if kind == "trace" else float(gram.double().norm())


def mix_equations(few_shot: NormalEquations, data_free: NormalEquations, epsilon: float) -> NormalEquations:
    """``ε·few + (1-ε)·df`` after normalising each by its Gram's mean eigenvalue."""
    if not 0.0 <= epsilon <= 1.0:
        raise ConfigError(f"epsilon must lie in [0, 1]; got {epsilon}")
    few = few_shot.normalized()
    free = data_free.normalized()
    # Both sets of observations are present (each weighted); a weight of 0 drops its set.
    parts = [(w, e) for w, e in ((epsilon, few), (1.0 - epsilon, free)) if w > 0]
    known = all(e.energy is not None and e.observations is not None for _, e in parts)
    return NormalEquations(
        epsilon * few.gram + (1.0 - epsilon) * free.gram,
        epsilon * few.cross + (1.0 - epsilon) * free.cross,
        sum(w * e.energy for w, e in parts) if known else None,
        sum(e.observations for _, e in parts) if known else None,
    )
