"""Ensemble averaging, accuracy and ECE (20 equal-width bins) against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from mergekit_bmm.ensemble.metrics import (
    accuracy,
    bin_indices,
    ensemble_probabilities,
    expected_calibration_error,
    negative_log_likelihood,
    reliability,
)
from mergekit_bmm.ensemble.scoring import evaluate_ensemble, mean_over_tasks
from mergekit_bmm.errors import TensorInputError


def test_perfectly_calibrated_predictor_has_ece_near_zero():
    """Confidence c, correct with probability c: ECE is only sampling noise (~1/sqrt(n per bin))."""
    generator = torch.Generator().manual_seed(0)
    n, classes = 200_000, 4
    confidence = 0.25 + 0.75 * torch.rand(n, generator=generator, dtype=torch.float64)
    predicted = torch.randint(classes, (n,), generator=generator)
    probabilities = ((1 - confidence) / (classes - 1))[:, None].repeat(1, classes)
    probabilities[torch.arange(n), predicted] = confidence
    correct = torch.rand(n, generator=generator, dtype=torch.float64) < confidence
    others = (predicted + torch.randint(1, classes, (n,), generator=generator)) % classes
    labels = torch.where(correct, predicted, others)
    assert expected_calibration_error(probabilities, labels) < 0.005


def test_miscalibrated_predictor_matches_hand_computation():
    probabilities = torch.tensor(
        [[0.9, 0.1], [0.9, 0.1], [0.6, 0.4], [0.3, 0.7], [0.95, 0.05]], dtype=torch.float64
    )
    labels = torch.tensor([0, 1, 0, 1, 1])
    # bins (0.85, 0.9]: 2 examples, acc 0.5, conf 0.9 → 0.4; (0.55, 0.6]: acc 1, conf 0.6 → 0.4;
    # (0.65, 0.7]: acc 1, conf 0.7 → 0.3; (0.9, 0.95]: acc 0, conf 0.95 → 0.95
    expected = (2 * 0.4 + 0.4 + 0.3 + 0.95) / 5
    assert expected_calibration_error(probabilities, labels) == pytest.approx(expected, abs=1e-12)
    assert accuracy(probabilities, labels) == pytest.approx(3 / 5)
    bins = reliability(probabilities, labels)
    assert bins.counts.tolist()[17] == 2 and int(bins.counts.sum()) == 5


def test_overconfident_predictor():
    """Always 90% sure, right 60% of the time: ECE = 0.3 exactly."""
    probabilities = torch.tensor([[0.9, 0.1]] * 10, dtype=torch.float64)
    labels = torch.tensor([0] * 6 + [1] * 4)
    assert expected_calibration_error(probabilities, labels) == pytest.approx(0.3, abs=1e-12)
    assert negative_log_likelihood(probabilities, labels) == pytest.approx(
        -(6 * math.log(0.9) + 4 * math.log(0.1)) / 10, rel=1e-12
    )


def test_bin_edges_are_right_closed():
    confidences = torch.tensor([0.0, 0.05, 0.0500001, 0.5, 0.95, 0.9500001, 1.0], dtype=torch.float64)
    assert bin_indices(confidences, 20).tolist() == [0, 0, 1, 9, 18, 19, 19]
    with pytest.raises(TensorInputError):
        bin_indices(torch.tensor([1.5]), 20)


def test_ensemble_averages_probabilities_not_logits():
    a = torch.tensor([[4.0, 0.0]])
    b = torch.tensor([[0.0, 0.0]])
    expected = (torch.softmax(a.double(), 1) + torch.softmax(b.double(), 1)) / 2
    assert torch.allclose(ensemble_probabilities([a, b]), expected, rtol=0, atol=1e-15)
    assert not torch.allclose(ensemble_probabilities([a, b]), torch.softmax((a + b).double() / 2, 1))


def test_evaluate_ensemble_over_member_folders(tmp_path):
    generator = torch.Generator().manual_seed(3)
    labels = {
        "sentiment": torch.randint(2, (50,), generator=generator),
        "topic": torch.randint(3, (40,), generator=generator),
    }
    logits = {
        f"m{i}": {
            task: torch.randn(len(y), int(y.max()) + 1, generator=generator) for task, y in labels.items()
        }
        for i in range(3)
    }

    def logits_fn(model_dir):
        return {task: (logits[model_dir.name][task], labels[task]) for task in labels}

    results = evaluate_ensemble([tmp_path / name for name in logits], logits_fn, progress=False)
    for task, y in labels.items():
        probabilities = ensemble_probabilities([logits[name][task] for name in logits])
        assert results[task].accuracy == pytest.approx(accuracy(probabilities, y), abs=1e-15)
        assert results[task].ece == pytest.approx(expected_calibration_error(probabilities, y), abs=1e-15)
        members = [accuracy(torch.softmax(logits[name][task].double(), 1), y) for name in logits]
        assert results[task].member_accuracy == pytest.approx(sum(members) / 3, abs=1e-15)
        assert results[task].members == 3 and results[task].examples == len(y)
    average = mean_over_tasks(results)
    assert average["ece"] == pytest.approx((results["sentiment"].ece + results["topic"].ece) / 2)

    def inconsistent(model_dir):
        out = logits_fn(model_dir)
        if model_dir.name == "m1":
            out["topic"] = (out["topic"][0], torch.zeros_like(labels["topic"]))
        return out

    with pytest.raises(TensorInputError, match="same data"):
        evaluate_ensemble([tmp_path / name for name in logits], inconsistent, progress=False)


def test_bad_inputs_are_one_line_errors():
    with pytest.raises(TensorInputError, match="NaN"):
        ensemble_probabilities([torch.tensor([[float("nan"), 0.0]])])
    with pytest.raises(TensorInputError, match=r"labels must lie in \[0, 1\]"):
        expected_calibration_error(torch.tensor([[0.5, 0.5]]), torch.tensor([2]))
    with pytest.raises(TensorInputError, match="sum to 1"):
        expected_calibration_error(torch.tensor([[3.0, 1.0]]), torch.tensor([0]))
    with pytest.raises(TensorInputError, match="shape"):
        ensemble_probabilities([torch.zeros(2, 3), torch.zeros(2, 4)])
