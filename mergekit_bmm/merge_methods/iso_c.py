"""``merge_method: iso_c`` — isotropic merge in the common subspace, see :mod:`mergekit_bmm.core.iso`."""

from __future__ import annotations

from mergekit_bmm.core.iso import iso_c_merge
from mergekit_bmm.merge_methods.task_vector_method import TaskVectorMethod, alpha_parameter


class IsoCMerge(TaskVectorMethod):
    """The Task Arithmetic sum with a flat spectrum; ``W = W_pre + α·τ``."""

    method_name = "iso_c"
    pretty_name = "Isotropic merging in common subspace (ISO-C)"
    reference_url = "https://arxiv.org/abs/2502.04959"

    def method_parameters(self):
        return (alpha_parameter(self.method_name),)

    def merge_matrix(self, task_vectors, group, tasks, parameters):
        return iso_c_merge(task_vectors)
