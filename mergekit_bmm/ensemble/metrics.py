"""Ensemble predictions and calibration metrics (paper App. B), as pure functions.

* The ensemble's prediction is the average of the members' softmax probabilities
  (paper eq. 13), not the softmax of averaged logits.
* ECE (Guo et al., 2017; the paper's definition): predictions are grouped by confidence
  ``max_y p(y|x)`` into κ equal-width bins, and
  ``ECE = Σ_b |B_b|/n · |acc(B_b) − conf(B_b)|``. The paper uses κ = 20.

  Bin edges: bin b covers ``(b/κ, (b+1)/κ]`` — right-closed, as in Guo et al.'s reference
  implementation (``lower < conf <= upper``) — and the first bin also takes a confidence
  of exactly 0. Edges are compared in float64, so a confidence of exactly 0.05 lies in the
  first of 20 bins. Empty bins contribute nothing.

Everything is computed in float64 whatever the input dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mergekit_bmm.errors import TensorInputError

DEFAULT_BINS = 20


def _check_logits(logits: torch.Tensor, what: str = "logits") -> torch.Tensor:
    if logits.ndim != 2 or logits.shape[1] < 1:
        raise TensorInputError(
            f"{what} must be a [examples, classes] matrix; got shape {tuple(logits.shape)}"
        )
    logits = logits.detach().to(device="cpu", dtype=torch.float64)
    if not bool(torch.isfinite(logits).all()):
        raise TensorInputError(f"{what} contain NaN or Inf; the model's outputs are unusable")
    return logits


def _check_labels(labels: torch.Tensor, examples: int, classes: int) -> torch.Tensor:
    labels = labels.detach().to("cpu")
    if labels.ndim != 1 or labels.shape[0] != examples:
        raise TensorInputError(
            f"labels must be a vector of {examples} class indices; got shape {tuple(labels.shape)}"
        )
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise TensorInputError(f"labels must be integer class indices; got dtype {labels.dtype}")
    labels = labels.long()
    if examples and (int(labels.min()) < 0 or int(labels.max()) >= classes):
        raise TensorInputError(
            f"labels must lie in [0, {classes - 1}]; got {int(labels.min())}..{int(labels.max())}"
        )
    return labels


def _check_probabilities(probabilities: torch.Tensor) -> torch.Tensor:
    if probabilities.ndim != 2:
        raise TensorInputError(
            f"probabilities must be [examples, classes]; got shape {tuple(probabilities.shape)}"
        )
    probabilities = probabilities.detach().to(device="cpu", dtype=torch.float64)
    if not bool(torch.isfinite(probabilities).all()) or bool((probabilities < 0).any()):
        raise TensorInputError("probabilities must be finite and non-negative")
    if probabilities.numel() and float((probabilities.sum(1) - 1).abs().max()) > 1e-6:
        raise TensorInputError("probabilities must sum to 1 over classes; pass softmax outputs, not logits")
    return probabilities


def softmax_probabilities(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(_check_logits(logits), dim=1)


def ensemble_probabilities(member_logits: Sequence[torch.Tensor]) -> torch.Tensor:
    """``(1/S) Σ_r softmax(z(x; θ_r))`` over the S members (paper eq. 13)."""
    if not member_logits:
        raise TensorInputError("an ensemble needs at least one member")
    shape = tuple(member_logits[0].shape)
    total = None
    for index, logits in enumerate(member_logits):
        if tuple(logits.shape) != shape:
            raise TensorInputError(
                f"member {index} has logits of shape {tuple(logits.shape)}, expected {shape}"
            )
        probabilities = softmax_probabilities(logits)
        total = probabilities if total is None else total + probabilities
    return total / len(member_logits)


def accuracy(probabilities: torch.Tensor, labels: torch.Tensor) -> float:
    probabilities = _check_probabilities(probabilities)
    labels = _check_labels(labels, *probabilities.shape)
    if not len(labels):
        raise TensorInputError("accuracy of zero examples is undefined")
    return float((probabilities.argmax(1) == labels).double().mean())


def negative_log_likelihood(probabilities: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean ``−log p(y_true|x)`` (probabilities clamped at 1e-300 so a hard miss stays finite)."""
    probabilities = _check_probabilities(probabilities)
    labels = _check_labels(labels, *probabilities.shape)
    picked = probabilities.gather(1, labels[:, None]).squeeze(1)
    return float(-picked.clamp_min(1e-300).log().mean())


def bin_indices(confidences: torch.Tensor, bins: int = DEFAULT_BINS) -> torch.Tensor:
    """Bin of each confidence: b such that b/κ < c <= (b+1)/κ (c = 0 goes to bin 0)."""
    if bins < 1:
        raise TensorInputError(f"the number of bins must be >= 1; got {bins}")
    confidences = confidences.to(torch.float64)
    if bool(((confidences < 0) | (confidences > 1)).any()):
        raise TensorInputError("confidences must lie in [0, 1]")
    inner_edges = torch.arange(1, bins, dtype=torch.float64) / bins
    return torch.bucketize(confidences, inner_edges, right=False)


@dataclass(frozen=True)
class ReliabilityBins:
    """Per bin: example count, mean accuracy and mean confidence (NaN where empty)."""

    counts: torch.Tensor
    accuracy: torch.Tensor
    confidence: torch.Tensor

    @property
    def ece(self) -> float:
        total = int(self.counts.sum())
        if total == 0:
            raise TensorInputError("ECE of zero examples is undefined")
        filled = self.counts > 0
        gaps = (self.accuracy[filled] - self.confidence[filled]).abs()
        return float((self.counts[filled].double() * gaps).sum() / total)


def reliability(
    probabilities: torch.Tensor, labels: torch.Tensor, bins: int = DEFAULT_BINS
) -> ReliabilityBins:
    probabilities = _check_probabilities(probabilities)
    labels = _check_labels(labels, *probabilities.shape)
    confidences, predictions = probabilities.max(dim=1)
    correct = (predictions == labels).double()
    index = bin_indices(confidences, bins)
    counts = torch.bincount(index, minlength=bins)
    sums_correct = torch.zeros(bins, dtype=torch.float64).index_add_(0, index, correct)
    sums_confidence = torch.zeros(bins, dtype=torch.float64).index_add_(0, index, confidences)
    safe = counts.clamp_min(1).double()
    empty = counts == 0
    nan = torch.full((bins,), float("nan"), dtype=torch.float64)
    return ReliabilityBins(
        counts=counts,
        accuracy=torch.where(empty, nan, sums_correct / safe),
        confidence=torch.where(empty, nan, sums_confidence / safe),
    )


def expected_calibration_error(
    probabilities: torch.Tensor, labels: torch.Tensor, bins: int = DEFAULT_BINS
) -> float:
    """ECE with ``bins`` equal-width confidence bins (the paper: 20)."""
    return reliability(probabilities, labels, bins).ece
