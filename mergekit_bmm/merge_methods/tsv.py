"""``merge_method: tsv`` — Task Singular Vectors merge (TSV-M), see :mod:`mergekit_bmm.core.tsv`."""

from __future__ import annotations

from mergekit_bmm.core.tsv import tsv_merge
from mergekit_bmm.merge_methods.task_vector_method import TaskVectorMethod, alpha_parameter


class TSVMerge(TaskVectorMethod):
    """Per task the top ⌊r/T⌋ singular triplets, orthogonalised across tasks; ``W = W_pre + α·τ``."""

    method_name = "tsv"
    pretty_name = "Task Singular Vectors (TSV-M)"
    reference_url = "https://arxiv.org/abs/2412.00081"

    def method_parameters(self):
        return (alpha_parameter(self.method_name),)

    def merge_matrix(self, task_vectors, group, tasks, parameters):
        return tsv_merge(task_vectors)
