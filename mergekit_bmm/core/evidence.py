"""λ from the evidence: the ridge that maximises the marginal likelihood of the experts' outputs.

Per output row, BMM is Bayesian linear regression (docs/numerics.md, "λ from the evidence"):
prior ``u ~ N(u0, σ²/λ'·I)``, observations ``y_t = u_t X_t + ε`` with ``ε ~ N(0, σ²I)`` and
``X_t X_tᵀ = G_t`` (data-free: ``X_t = U_tᵀ``). Summed over the ``R`` rows of a weight (one λ'
and one σ² for all) and with σ² at its maximiser, the log evidence is

    L(λ') = −½·R·[ N·(log(2π·Q(λ')/(R·N)) + 1) + Σ_j log(1 + g_j/λ') ]
    Q(λ') = A − Σ_j β_j / (g_j + λ')

with ``g_j`` the eigenvalues of ``G``, ``β_j = ‖(C − U0 G) q_j‖²`` (the eigen factors' correction,
column by column), ``A = Σ_t tr((U_t − U0) G_t (U_t − U0)ᵀ)`` and ``N`` observations per row.
Given the eigendecomposition a merge with the factor cache already holds, every λ' costs O(r).

λ' is searched over a fixed log grid of the dimensionless λ (``λ' = λ·tr(G)/d_in``) and refined
between the best point's neighbours. When the experts can all be fitted exactly (``Q(0⁺) = 0``:
one expert, or experts in independent subspaces) the evidence grows without bound as λ' → 0;
when they carry nothing the anchor does not explain it is largest as λ' → ∞. Either way the
maximum sits on an edge of the grid, and the choice says so (``edge``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

AUTO_LAMBDA = "auto"  # the recipe's word for "λ from the evidence"
LOW, HIGH = 1e-4, 1e4  # the dimensionless λ the evidence may choose, inclusive
POINTS_PER_DECADE = 16
REFINE_POINTS = 64
WIDTH_NATS = 1.0  # the interval reported around the maximum: within this many nats of it
_RELATIVE_FLOOR = 1e-13  # Q below this fraction of A is rounding: an exact fit


def lambda_text(value: float | str) -> str:
    """A λ for a line of text: ``0.1``, or ``auto``."""
    return value if isinstance(value, str) else f"{value:g}"


@dataclass(frozen=True)
class EvidenceTerms:
    """What the log evidence of one weight needs, in float64: O(r) numbers, not the matrices."""

    eigenvalues: torch.Tensor  # g_j (r,), the Gram's eigenvalues (a thin basis leaves out zeros)
    column_energy: torch.Tensor  # β_j (r,), ‖(C − U0 G) q_j‖² summed over rows
    energy: float  # A = Σ_t tr((U_t − U0) G_t (U_t − U0)ᵀ)
    observations: float  # N per row
    rows: int  # R, the weight's output features
    mean_eigenvalue: float  # tr(G)/d_in: λ' = λ · this

    def residual(self, ridges: torch.Tensor) -> torch.Tensor:
        """``Q(λ')`` for each ridge: the prior-weighted misfit at the posterior mean."""
        g = self.eigenvalues.clamp_min(0.0)
        explained = (self.column_energy / (g + ridges[:, None])).sum(dim=1)
        return (self.energy - explained).clamp_min(self.energy * _RELATIVE_FLOOR)

    def log_evidence(self, ridges: torch.Tensor) -> torch.Tensor:
        """``L(λ')`` (σ² profiled out) for each ridge in ``ridges`` (float64, > 0)."""
        ridges = ridges.to(torch.float64)
        g = self.eigenvalues.clamp_min(0.0)
        log_det = torch.log1p(g / ridges[:, None]).sum(dim=1)
        n, rows = self.observations, self.rows
        fit = n * (torch.log(2 * math.pi * self.residual(ridges) / (rows * n)) + 1.0)
        return -0.5 * rows * (fit + log_det)


@dataclass(frozen=True)
class EvidenceChoice:
    """The λ the evidence chose for one weight, and how sharply."""

    lam: float  # dimensionless λ (λ' / mean eigenvalue)
    ridge: float  # λ'
    low: float  # the dimensionless λ interval within WIDTH_NATS of the maximum
    high: float
    edge: str | None  # "low" / "high": the maximum is on the grid's edge; "flat": any λ; else None
    log_evidence: float

    def record(self) -> dict:
        """The choice as the merge record stores it."""
        return {
            "lambda": self.lam,
            "interval": [self.low, self.high],
            "edge": self.edge,
            "log_evidence": None if math.isnan(self.log_evidence) else self.log_evidence,
        }


def terms_of(
    eigenvalues: torch.Tensor,
    correction: torch.Tensor,
    energy: float,
    observations: float,
    mean_eigenvalue: float,
) -> EvidenceTerms:
    """The terms from ``G``'s eigenvalues and the exact (unrounded) correction ``(C − U0 G) Q``."""
    return EvidenceTerms(
        eigenvalues=eigenvalues.detach().to(torch.float64).cpu(),
        column_energy=correction.detach().to(torch.float64).square().sum(dim=0).cpu(),
        energy=float(energy),
        observations=float(observations),
        rows=int(correction.shape[0]),
        mean_eigenvalue=float(mean_eigenvalue),
    )


def _grid(low: float, high: float, points: int) -> torch.Tensor:
    return torch.logspace(math.log10(low), math.log10(high), points, dtype=torch.float64)


def choose(terms: EvidenceTerms) -> EvidenceChoice:
    """The evidence's λ for one weight.

    When the experts differ from the anchor in nothing the Gram sees (``A = 0``; ``G = 0``
    included) every λ gives the anchor and the evidence is flat: the choice is the grid's top
    (``edge: "flat"``), which gives the anchor without a near-singular solve.
    """
    scale = max(terms.mean_eigenvalue, 0.0)
    if scale == 0 or terms.energy <= 0 or terms.observations <= 0:
        return EvidenceChoice(HIGH, HIGH * scale, LOW, HIGH, "flat", math.nan)
    decades = math.log10(HIGH / LOW)
    coarse = _grid(LOW, HIGH, int(decades * POINTS_PER_DECADE) + 1)
    values = terms.log_evidence(coarse * scale)
    best = int(values.argmax())
    edge = "low" if best == 0 else "high" if best == len(coarse) - 1 else None
    around = coarse[max(best - 1, 0)], coarse[min(best + 1, len(coarse) - 1)]
    fine = _grid(float(around[0]), float(around[1]), REFINE_POINTS)
    fine_values = terms.log_evidence(fine * scale)
    top = int(fine_values.argmax())
    lam, peak = float(fine[top]), float(fine_values[top])
    if edge is not None:  # the maximum is the edge itself, not a point beside it
        lam, peak = float(coarse[best]), float(values[best])
    low, high = _interval(coarse, values, fine, fine_values, peak)
    return EvidenceChoice(lam, lam * scale, low, high, edge, peak)


def _interval(coarse, values, fine, fine_values, peak: float) -> tuple[float, float]:
    """The λ range within WIDTH_NATS of ``peak``, read off both grids (the finer where it reaches)."""
    grid = torch.cat([coarse, fine])
    scores = torch.cat([values, fine_values])
    inside = grid[scores >= peak - WIDTH_NATS]
    return float(inside.min()), float(inside.max())
