"""``merge_method: wudi`` — WUDI-Merging, see :mod:`mergekit_bmm.core.wudi`.

WUDI has no output scale (``W = W_pre + τ_m``, as the reference). The Adam solver runs
``iterations`` steps per 2D body weight, ``out·in²`` flops each: on large models run it on a
GPU (``mergekit-yaml --cuda``), and when it serves as BMM's anchor in a search, materialise
it once and pass it as an input marked ``anchor: true`` (see docs/anchors.md).
"""

from __future__ import annotations

from typing import Literal

from mergekit.merge_methods.base import ParameterScope

from mergekit_bmm.core.wudi import wudi_merge
from mergekit_bmm.merge_methods.parameter_ranges import CheckedParameter
from mergekit_bmm.merge_methods.task_vector_method import TaskVectorMethod

DEFAULT_ITERATIONS = 300
DEFAULT_LEARNING_RATE = 1e-5


class WUDIMerge(TaskVectorMethod):
    """Minimise the WUDI interference loss per matrix (Adam from the sum, or exactly)."""

    method_name = "wudi"
    pretty_name = "WUDI-Merging"
    reference_url = "https://arxiv.org/abs/2503.08099"

    def method_parameters(self):
        shared = ParameterScope.SHARED
        return (
            CheckedParameter(
                "solver",
                Literal["adam", "closed_form"],
                shared,
                default="adam",
                description="solver (adam or closed_form)",
                owner=self.method_name,
            ),
            CheckedParameter(
                "iterations",
                int,
                shared,
                default=DEFAULT_ITERATIONS,
                description="integer >= 0 (Adam steps)",
                owner=self.method_name,
            ),
            CheckedParameter(
                "learning_rate",
                float,
                shared,
                default=DEFAULT_LEARNING_RATE,
                description="number > 0 (Adam learning rate)",
                owner=self.method_name,
            ),
        )

    def output_scale(self, parameters):
        return 1.0

    def merge_matrix(self, task_vectors, group, tasks, parameters):
        return wudi_merge(
            task_vectors,
            solver=parameters["solver"],
            iterations=parameters["iterations"],
            learning_rate=parameters["learning_rate"],
        )
