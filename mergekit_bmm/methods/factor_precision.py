"""The stored precision of each cached factor, chosen against the float64 factors at the fill.

A factor stored in float16 (each column divided by its largest magnitude, the scales kept in
float32) takes half the disk of float32 and adds a rounding error that reaches the merged
weight ``W = W_pre + s·(U0 + (E Q·a) Qᵀ)`` as

* anchor ``U0``: ``s·‖ΔU0‖`` (exactly, for any λ);
* correction ``E Q``: ``s·‖ΔEQ·a‖`` (exactly: ``Q`` is orthonormal), largest at the smallest λ;
* basis ``Q``: at most ``s·‖EQ·a‖·‖ΔQ‖₂`` (``‖ΔQ‖₂`` by power iteration), twice that when
  another tensor's correction was formed in a basis rounded before it.

With ``cache_dtype: auto`` (the default) a factor is stored in float16 when its share, at the
smallest λ and largest s of the default search boxes (``λ = LAMBDA_FLOOR`` relative, or the
merge's own λ if smaller; ``s = max(SCALE_CEILING, |s|)``), stays within a third of
``TOLERANCE·‖W_pre‖``, and in float32 otherwise. So no trial inside those boxes moves a merged
weight by more than about ``TOLERANCE`` relative to float32 factors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOLERANCE = 1e-5
LAMBDA_FLOOR = 1e-3
SCALE_CEILING = 2.2
FACTORS = ("basis", "correction", "anchor")


def encode(matrix: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``matrix`` as stored in ``dtype``: float16 with per-column scales (float32), else as is."""
    if dtype != torch.float16:
        return matrix.to(dtype), None
    scale = matrix.abs().amax(dim=0)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(torch.float32)
    return (matrix / scale.to(matrix.dtype)).to(torch.float16), scale


def decode(stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The matrix a stored factor stands for, in ``dtype``."""
    matrix = stored.to(dtype)
    return matrix if scale is None else matrix * scale.to(dtype)


def rounding_error(matrix: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What storing ``matrix`` in ``dtype`` changes it by (in ``matrix``'s dtype)."""
    return decode(*encode(matrix, dtype), matrix.dtype) - matrix


def spectral_norm(matrix: torch.Tensor, iterations: int = 16) -> float:
    """``‖matrix‖₂`` by power iteration (a lower estimate that converges from below)."""
    if matrix.numel() == 0:
        return 0.0
    generator = torch.Generator(device=matrix.device).manual_seed(0)
    vector = torch.randn(matrix.shape[1], generator=generator, dtype=matrix.dtype, device=matrix.device)
    norm = 0.0
    for _ in range(iterations):
        image = matrix.T @ (matrix @ vector)
        norm = float(image.norm())
        if norm == 0.0:
            return 0.0
        vector = image / norm
    return float((matrix @ vector).norm())


@dataclass(frozen=True)
class Budget:
    """How much error one factor may add to ``W``, and at which λ (as weights ``a``) to check it."""

    allowance: float
    weights: torch.Tensor  # a = 1/(Λ + λ'_floor), float64

    @classmethod
    def of(cls, base_norm: float, scale: float, weights: torch.Tensor) -> Budget:
        worst_scale = max(SCALE_CEILING, abs(scale))
        return cls(TOLERANCE * base_norm / (3.0 * worst_scale), weights.to(torch.float64))

    def fits(self, error: float) -> bool:
        return error <= self.allowance


def anchor_precision(anchor: torch.Tensor, budget: Budget) -> torch.dtype:
    error = float(rounding_error(anchor, torch.float16).norm())
    return torch.float16 if budget.fits(error) else torch.float32


def correction_precision(correction: torch.Tensor, budget: Budget) -> torch.dtype:
    error = float((rounding_error(correction, torch.float16) * budget.weights).norm())
    return torch.float16 if budget.fits(error) else torch.float32


def basis_fits(correction: torch.Tensor, budget: Budget, basis_rounding: float, sides: int = 1) -> bool:
    """Whether a basis with rounding ``‖ΔQ‖₂ = basis_rounding`` keeps this tensor in budget."""
    return budget.fits(sides * float((correction * budget.weights).norm()) * basis_rounding)
