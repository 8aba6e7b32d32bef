"""How far a merged model's predictions are from an expert's, per position: the label-free objectives.

An expert's reference at one position is its top-``k`` log-probabilities (with their token or class
indices) and the log of the mass left over. Every divergence is taken on that coarsened
distribution: the ``k`` kept outcomes plus one "rest" bucket, the merged model's probabilities
summed the same way. For ``KL(expert ‖ merged)`` this is a lower bound of the full divergence
(coarsening never increases a KL) that is exact when ``k`` covers every outcome, as it does for
class distributions. Computed in float64 whatever the model's dtype.

Objectives (each a *divergence*: 0 is best, larger is worse):

- ``kl``: ``Σ p (log p − log q)``, expert ``p``, merged ``q`` — mass-covering;
- ``reverse_kl``: ``Σ q (log q − log p)`` on the same buckets — mode-seeking;
- ``top1``: 1 where the merged model's most likely outcome is not the expert's, else 0;
- ``entropy``: the merged model's own entropy over all outcomes (AdaMerging's objective; it needs
  no expert).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

OBJECTIVES = ("kl", "reverse_kl", "top1", "entropy")
# The smallest log-mass a bucket is given (e^-100 ≈ 4e-44): a rest bucket a float can not tell from 0.
LOG_FLOOR = -100.0


@dataclass(frozen=True)
class Reference:
    """An expert's coarsened distributions at ``n`` positions."""

    top_log_probs: torch.Tensor  # [n, k] float32, descending
    top_index: torch.Tensor  # [n, k] int64 (token or class ids)
    rest_log_prob: torch.Tensor  # [n] float32: log(1 − Σ top probabilities), LOG_FLOOR when none is left


def rest_log_mass(top_log_probs: torch.Tensor) -> torch.Tensor:
    """``log(1 − Σ exp(top))`` per row, in float64, floored at :data:`LOG_FLOOR`."""
    total = torch.logsumexp(top_log_probs.double(), dim=-1).clamp(max=0.0)
    rest = torch.log(-torch.expm1(total))
    return rest.clamp(min=LOG_FLOOR)


def reference_of(log_probs: torch.Tensor, top_k: int | None) -> Reference:
    """The top-``top_k`` outcomes (all of them for ``None`` or ``top_k ≥`` outcomes) of ``[n, V]``
    log-probabilities, and the rest's log-mass."""
    log_probs = log_probs.float()
    k = log_probs.shape[-1] if top_k is None else min(int(top_k), log_probs.shape[-1])
    values, index = torch.topk(log_probs, k, dim=-1)
    if k == log_probs.shape[-1]:
        rest = torch.full(values.shape[:-1], LOG_FLOOR)
    else:
        rest = rest_log_mass(values).float().cpu()
    return Reference(values.cpu(), index.cpu(), rest)


def _coarsened(log_probs: torch.Tensor, reference: Reference) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged model's log-probabilities on the reference's buckets: ``[n, k]`` and the rest ``[n]``."""
    top = torch.gather(log_probs.double(), -1, reference.top_index.to(log_probs.device)).clamp(min=LOG_FLOOR)
    return top, rest_log_mass(top)


def divergence(log_probs: torch.Tensor, reference: Reference | None, objective: str) -> torch.Tensor:
    """Per position (``[n]``, float64): ``objective`` between the merged model's ``[n, V]``
    log-probabilities and the expert's reference (``entropy`` needs none)."""
    if objective == "entropy":
        logs = log_probs.double()
        return -(logs.exp() * logs).sum(dim=-1).cpu()
    if reference is None:
        raise ValueError(f"objective {objective!r} compares with an expert: give its reference")
    if objective == "top1":
        return (log_probs.argmax(dim=-1).cpu() != reference.top_index[:, 0].cpu()).double()
    q_top, q_rest = _coarsened(log_probs, reference)
    p_top = reference.top_log_probs.double().to(q_top.device)
    p_rest = reference.rest_log_prob.double().to(q_top.device)
    if objective == "kl":
        value = (p_top.exp() * (p_top - q_top)).sum(dim=-1) + p_rest.exp() * (p_rest - q_rest)
    elif objective == "reverse_kl":
        value = (q_top.exp() * (q_top - p_top)).sum(dim=-1) + q_rest.exp() * (q_rest - p_rest)
    else:
        raise ValueError(f"unknown objective {objective!r}; use one of {', '.join(OBJECTIVES)}")
    # A divergence is ≥ 0; rounding of nearly equal distributions may leave a hair below.
    return value.clamp(min=0.0).cpu()
