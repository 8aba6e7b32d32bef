"""``merge_method: regmean`` — RegMean from per-task activation Grams.

The math is in :mod:`mergekit_bmm.core.regmean`.

The Grams come from a statistics directory (``stats:``, written by ``mergekit-bmm-stats``;
format in :mod:`mergekit_bmm.stats.store`), read only through
:func:`~mergekit_bmm.stats.store.activation_grams_for`, which matches each expert to its task
by path and refuses statistics made from other checkpoints. The same directory serves
data-assisted ``bmm``; each expert of a mixture-of-experts stack is solved with its own Grams
of the tokens routed to it. Inside a ``bmm`` recipe with ``anchor_method: regmean``, bmm's own
``stats`` feeds the anchor too unless ``anchor_stats`` is given.
"""

from __future__ import annotations

from mergekit.merge_methods.base import ParameterScope

from mergekit_bmm.core.low_rank import LowRankUpdate
from mergekit_bmm.core.low_rank_data import regmean_low_rank
from mergekit_bmm.core.merge_tools import mean_task_vector
from mergekit_bmm.core.regmean import DEFAULT_OFF_DIAGONAL_SCALE, regmean_merge
from mergekit_bmm.errors import ConfigError
from mergekit_bmm.merge_methods import merge_findings
from mergekit_bmm.merge_methods.lora_route import adapter_factors
from mergekit_bmm.merge_methods.parameter_ranges import CheckedParameter
from mergekit_bmm.merge_methods.pieces import unreached
from mergekit_bmm.merge_methods.task_vector_method import TaskVectorMethod


class RegMeanMerge(TaskVectorMethod):
    """Least-squares fit to every expert's outputs on its own calibration inputs."""

    method_name = "regmean"
    pretty_name = "RegMean"
    reference_url = "https://arxiv.org/abs/2212.09849"

    def method_parameters(self):
        shared = ParameterScope.SHARED
        return (
            CheckedParameter(
                "stats",
                str | None,
                shared,
                default=None,
                description="path to a statistics directory",
                owner=self.method_name,
            ),
            CheckedParameter(
                "off_diagonal_scale",
                float,
                shared,
                default=DEFAULT_OFF_DIAGONAL_SCALE,
                description="number in [0, 1] (factor on the Grams' off-diagonal entries)",
                owner=self.method_name,
            ),
        )

    def output_scale(self, parameters):
        return 1.0

    def check_parameters(self, parameters):
        if not parameters.get("stats"):
            raise ConfigError(
                "regmean needs activation statistics: add `stats: /path/to/stats` (made by "
                "mergekit-bmm-stats) to the recipe's parameters"
            )

    def merge_matrix(self, task_vectors, group, tasks, parameters):
        from mergekit_bmm.stats.store import activation_grams_for

        stats_dir = parameters["stats"]
        name = group.metadata.name or ""
        if unreached(stats_dir, name, [entry.id for entry in tasks]):
            # an expert of a stack no calibration token reached: RegMean's rule for weights it has
            # no statistics for (the experts' mean)
            merge_findings.note_averaged(name)  # one end-of-merge line, not one per expert
            return mean_task_vector(task_vectors)
        in_features = task_vectors[0].shape[1]
        # the store checks each Gram's size and finiteness against the weight
        grams = activation_grams_for(stats_dir, name, [entry.id for entry in tasks], d_in=in_features)
        device = task_vectors[0].device
        checked = [gram.to(device=device) for gram in grams]
        updates = self.adapter_updates(group, tasks, name, tuple(task_vectors[0].shape))
        if updates:  # LoRA experts: C = B·Z from their factors, k rows solved
            moved = [LowRankUpdate(u.left.to(device), u.right.to(device), u.expert) for u in updates]
            dtype = task_vectors[0].dtype
            return regmean_low_rank(moved, checked, len(tasks), parameters["off_diagonal_scale"], dtype)
        return regmean_merge(task_vectors, checked, parameters["off_diagonal_scale"])

    @staticmethod
    def adapter_updates(group, tasks, name: str, shape: tuple[int, int]) -> list[LowRankUpdate] | None:
        """The experts' adapter factors when every expert is a plain adapter on the base and the
        factors have the weight's (out, in) shape (not a transposed layout)."""
        if "[" in name:
            return None
        updates = adapter_factors(group, tasks, name)
        if not updates or any(u.left.shape[0] != shape[0] or u.right.shape[1] != shape[1] for u in updates):
            return None
        return updates
