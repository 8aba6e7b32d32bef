"""``merge_method: iso_cts`` — isotropic merge in common and task-specific subspaces.

See :mod:`mergekit_bmm.core.iso`.
"""

from __future__ import annotations

from mergekit.merge_methods.base import ParameterScope

from mergekit_bmm.core.iso import iso_cts_merge
from mergekit_bmm.merge_methods.parameter_ranges import CheckedParameter
from mergekit_bmm.merge_methods.task_vector_method import TaskVectorMethod, alpha_parameter

DEFAULT_COMMON_SPACE_FRACTION = 0.8


class IsoCTSMerge(TaskVectorMethod):
    """Common subspace of the sum plus each task's own directions, flat spectrum; ``W = W_pre + α·τ``."""

    method_name = "iso_cts"
    pretty_name = "Isotropic merging in common and task-specific subspaces (ISO-CTS)"
    reference_url = "https://arxiv.org/abs/2502.04959"

    def method_parameters(self):
        return (
            alpha_parameter(self.method_name),
            CheckedParameter(
                "common_space_fraction",
                float,
                ParameterScope.SHARED,
                default=DEFAULT_COMMON_SPACE_FRACTION,
                description="number in [0, 1] (share of the rank given to the common subspace)",
                owner=self.method_name,
            ),
        )

    def merge_matrix(self, task_vectors, group, tasks, parameters):
        return iso_cts_merge(task_vectors, parameters["common_space_fraction"])
