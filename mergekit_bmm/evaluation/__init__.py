"""Evaluators: turn a merged model folder into per-task scores for the search.

``python`` (a function of yours), ``lm_eval`` (lm-evaluation-harness tasks, local ones
included), ``classification`` (fixed heads on an encoder, accuracy) and ``agreement`` (no
labels: how closely the merge reproduces each expert on unlabelled text).
"""

from __future__ import annotations

from mergekit_bmm.devices import resolve_device
from mergekit_bmm.evaluation.base import Evaluator
from mergekit_bmm.evaluation.config import (
    AgreementEvaluatorConfig,
    ClassificationEvaluatorConfig,
    EvaluatorConfig,
    LMEvalEvaluatorConfig,
    PythonEvaluatorConfig,
    weighted_mean,
)


def make_evaluator(config: EvaluatorConfig, device: str = "cpu") -> Evaluator:
    """The evaluator for a validated ``evaluator:`` section (checked on construction)."""
    device = resolve_device(device)
    if isinstance(config, PythonEvaluatorConfig):
        from mergekit_bmm.evaluation.python_callable import PythonEvaluator

        return PythonEvaluator(config, device)
    if isinstance(config, LMEvalEvaluatorConfig):
        from mergekit_bmm.evaluation.lm_harness import LMEvalEvaluator

        return LMEvalEvaluator(config, device)
    if isinstance(config, ClassificationEvaluatorConfig):
        from mergekit_bmm.evaluation.classification import ClassificationEvaluator

        return ClassificationEvaluator(config, device)
    if isinstance(config, AgreementEvaluatorConfig):
        from mergekit_bmm.evaluation.agreement import AgreementEvaluator

        return AgreementEvaluator(config, device)
    raise TypeError(f"unknown evaluator config {type(config).__name__}")


__all__ = ["Evaluator", "make_evaluator", "resolve_device", "weighted_mean"]
