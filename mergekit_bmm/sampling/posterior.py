"""The Gaussian posterior of one BMM merge (paper App. B), in pure torch.

Every row of the merged task vector is independently ``N(u_MAP_row, Σ_row)`` with

    Σ_row = β⁻¹ (G + λ'I)⁻¹

where ``G`` is the Gram the merge solved with (data-free, activations or mix) and ``λ'``
its effective ridge. ``G`` is diagonalised once per tensor, ``G = Q Λ Qᵀ``, so that

    Σ_row = Mᵀ M   with   M = diag((β(Λ + λ'))^{-1/2}) Qᵀ,

and a draw is ``U_MAP + Z M`` with ``Z`` an ``(out, in)`` matrix of standard normals: the
rows of ``Z M`` have covariance ``Mᵀ M``. All samples share ``M``; no inverse is formed.

Randomness is reproducible and order-free: every (seed, tensor name, sample index) has
its own generator, so a sample does not depend on thread count, tensor order or on how
many samples are drawn.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy
import torch

from mergekit_bmm.core.closed_form import eigenvalue_floor
from mergekit_bmm.core.finite import all_finite
from mergekit_bmm.errors import ConfigError


def check_beta(beta: float) -> float:
    """β is a noise precision: a number > 0 (``inf`` gives the MAP merge itself)."""
    if not isinstance(beta, (int, float)) or math.isnan(beta) or beta <= 0:
        raise ConfigError(f"--beta must be a number > 0 (inf gives the MAP merge); got {beta}")
    return float(beta)


def check_sigma(sigma: float) -> float:
    if not isinstance(sigma, (int, float)) or not math.isfinite(sigma) or sigma < 0:
        raise ConfigError(f"--iid-sigma must be a finite number >= 0 (0 gives the MAP merge); got {sigma}")
    return float(sigma)


@dataclass(frozen=True)
class RowPosterior:
    """``Σ_row`` of one tensor in eigen form: ``Q diag(1/(β·precision)) Qᵀ``."""

    basis: torch.Tensor
    precisions: torch.Tensor
    beta: float

    @classmethod
    def from_gram(
        cls,
        gram: torch.Tensor,
        ridge: float,
        beta: float,
        solve_dtype: torch.dtype = torch.float32,
        name: str = "this tensor",
    ) -> RowPosterior:
        """Factorise ``G + λ'I`` once: ``G = QΛQᵀ`` in float64."""
        gram = gram.detach().to(device="cpu", dtype=torch.float64)
        if not all_finite(gram):
            raise ConfigError(f"the Gram of {name} contains NaN or Inf; cannot sample its posterior")
        eigenvalues, basis = torch.linalg.eigh(0.5 * (gram + gram.T))
        return cls.from_eigen(eigenvalues, basis, ridge, beta, solve_dtype, name)

    @classmethod
    def from_eigen(
        cls,
        eigenvalues: torch.Tensor,
        basis: torch.Tensor,
        ridge: float,
        beta: float,
        solve_dtype: torch.dtype = torch.float32,
        name: str = "this tensor",
    ) -> RowPosterior:
        """From an existing eigendecomposition of ``G`` (e.g. ``closed_form.EigenFactors``).

        Eigenvalues of ``G`` at or below the merge's own zero tolerance (``closed_form``,
        for the dtype the merge solved in) are exact zeros, as in the MAP solve. With
        ``λ' = 0`` such a direction has no precision at all: the posterior is improper and
        sampling is refused rather than drawing infinite noise.
        """
        beta = check_beta(beta)
        if ridge < 0 or ridge != ridge:
            raise ConfigError(f"the effective ridge of {name} must be >= 0; got {ridge}")
        eigenvalues = eigenvalues.detach().to(device="cpu", dtype=torch.float64)
        basis = basis.detach().to(device="cpu", dtype=torch.float64)
        largest = float(eigenvalues.max()) if eigenvalues.numel() else 0.0
        tolerance = eigenvalue_floor(largest, basis.shape[0], solve_dtype)
        eigenvalues = torch.where(eigenvalues > tolerance, eigenvalues, torch.zeros_like(eigenvalues))
        if ridge <= 0 and bool((eigenvalues == 0).any()):
            rank = int((eigenvalues > 0).sum())
            raise ConfigError(
                f"cannot sample {name}: lambda is 0 and its Gram is singular (rank {rank} of "
                f"{basis.shape[0]}), so the posterior is improper; give this tensor lambda > 0 "
                "or leave it out with --filter"
            )
        return cls(basis=basis, precisions=eigenvalues + ridge, beta=beta)

    @property
    def d_in(self) -> int:
        return self.basis.shape[0]

    def noise_factor(self) -> torch.Tensor:
        """``M`` with ``Mᵀ M = Σ_row`` (all zeros for β = ∞)."""
        if math.isinf(self.beta):
            return torch.zeros_like(self.basis)
        return (self.beta * self.precisions).rsqrt().unsqueeze(1) * self.basis.T

    def covariance(self) -> torch.Tensor:
        """``Σ_row`` itself (float64), for diagnostics and tests."""
        if math.isinf(self.beta):
            return torch.zeros_like(self.basis)
        return (self.basis / (self.beta * self.precisions)) @ self.basis.T

    def rms_std(self, beta: float | None = None) -> float:
        """``sqrt(tr(Σ_row)/d_in)``: the typical posterior standard deviation of an entry."""
        beta = self.beta if beta is None else beta
        if math.isinf(beta):
            return 0.0
        return math.sqrt(float((1.0 / self.precisions).mean()) / beta)


def sample_generator(seed: int, name: str, index: int) -> numpy.random.Generator:
    """The generator of sample ``index`` of tensor ``name``.

    numpy's ``SeedSequence`` mixes (seed, index, a SHA-256 of the name) into a 128-bit
    PCG64 state: stable across processes and platforms, and distinct per tensor and sample
    (torch's CPU generator keeps only 32 bits of a seed, too few for that).
    """
    if seed < 0:
        raise ConfigError(f"--seed must be >= 0; got {seed}")
    digest = hashlib.sha256(name.encode()).digest()
    words = [int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4)]
    return numpy.random.Generator(numpy.random.PCG64(numpy.random.SeedSequence([seed, index, *words])))


def standard_normal(shape: tuple[int, ...], seed: int, name: str, index: int) -> torch.Tensor:
    """Reproducible ``N(0, 1)`` entries (float64, CPU) for one sample of one tensor."""
    return torch.from_numpy(sample_generator(seed, name, index).standard_normal(shape))
