"""``merge_method: ace`` — ACE-Merging, covariances estimated from the task vectors.

See :mod:`mergekit_bmm.core.ace`.
"""

from __future__ import annotations

from mergekit.merge_methods.base import ParameterScope

from mergekit_bmm.core.ace import DEFAULT_RANK_FRACTION, DEFAULT_RIDGE, ace_merge
from mergekit_bmm.merge_methods.parameter_ranges import CheckedParameter
from mergekit_bmm.merge_methods.task_vector_method import TaskVectorMethod, alpha_parameter


class ACEMerge(TaskVectorMethod):
    """RegMean's closed form with ``Σ_t`` from each task vector, adaptive normalisation, a
    collective prior and spectral refinement; ``W = W_pre + α·τ``."""

    method_name = "ace"
    pretty_name = "ACE-Merging (adaptive covariance estimation)"
    reference_url = "https://arxiv.org/abs/2603.02945"

    def method_parameters(self):
        return (
            alpha_parameter(self.method_name),
            CheckedParameter(
                "ridge",
                float,
                ParameterScope.SHARED,
                default=DEFAULT_RIDGE,
                description="number >= 0 (ε added to each covariance estimate)",
                owner=self.method_name,
            ),
            CheckedParameter(
                "rank_fraction",
                float,
                ParameterScope.SHARED,
                default=DEFAULT_RANK_FRACTION,
                description="number in [0, 1] (share of the rank given to the spectral refinement)",
                owner=self.method_name,
            ),
        )

    def merge_matrix(self, task_vectors, group, tasks, parameters):
        return ace_merge(task_vectors, parameters["ridge"], parameters["rank_fraction"])
