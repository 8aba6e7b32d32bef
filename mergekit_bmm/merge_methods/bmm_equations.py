"""The normal equations ``G`` and ``C`` of one bmm weight, for the recipe's Gram mode.

Data-free: each expert's own rows (``U_tᵀU_t``), pooled over the weights that read one input under
``gram_sharing: input``; activations: the statistics' Grams (an expert of a mixture-of-experts stack
its own, a part of a fused weight its whole weight's); mix: both, weighted by ε.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from mergekit.merge_methods.base import TensorEntry, TensorGroup

from mergekit_bmm.core import normal_equations
from mergekit_bmm.merge_methods.bmm_parameters import BMMSettings
from mergekit_bmm.merge_methods.pieces import statistics_name
from mergekit_bmm.merge_methods.shared_inputs import sibling_task_vectors


def normal_equations_for(
    settings: BMMSettings,
    group: TensorGroup,
    tasks: Sequence[TensorEntry],
    task_vectors: Sequence[torch.Tensor],
    siblings: Sequence[str] = (),
    transpose: bool = False,
) -> normal_equations.NormalEquations:
    """G and C for the configured Gram mode; with ``siblings`` (``gram_sharing: input``) the
    data-free Gram pools the weights that read the same input."""
    data_free = None
    if settings.gram in ("data_free", "mix") and siblings:
        others = sibling_task_vectors(group, tasks, siblings, transpose, settings.compute_dtype)
        data_free = normal_equations.pooled_data_free_equations(
            task_vectors, others, settings.compute_dtype, settings.task_balance
        )
    elif settings.gram in ("data_free", "mix"):
        data_free = normal_equations.data_free_equations(
            task_vectors, settings.compute_dtype, settings.task_balance
        )
    if settings.gram == "data_free":
        return data_free
    from mergekit_bmm.stats.store import activation_grams_for, activation_tokens_for

    d_in = task_vectors[0].shape[1]
    models = [e.id for e in tasks]
    name = statistics_name(group.metadata.name or "")  # a fused weight's part reads its input
    grams = activation_grams_for(settings.stats, name, models, d_in=d_in)
    grams = [g.to(device=task_vectors[0].device) for g in grams]
    tokens = activation_tokens_for(settings.stats, models, name)
    few = normal_equations.activation_equations(
        task_vectors, grams, settings.compute_dtype, settings.task_balance, tokens
    )
    if settings.gram == "activations":
        return few
    return normal_equations.mix_equations(few, data_free, settings.epsilon)
