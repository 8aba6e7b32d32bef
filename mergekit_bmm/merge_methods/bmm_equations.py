"""The normal equations ``G`` and ``C`` of one bmm weight, for the recipe's Gram mode.

Data-free: each expert's own rows (``U_tᵀU_t``), pooled over the weights that read one input under
``gram_sharing: input``; activations: the statistics' Grams (an expert of a mixture-of-experts stack
its own, a part of a fused weight its whole weight's); mix: both, weighted by ε.
"""

from __future__ import annotations

import threading
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
        grams, rows = _pooled(settings, group, tasks, task_vectors, siblings, transpose)
        data_free = normal_equations.pooled_equations(
            task_vectors, grams, rows, settings.compute_dtype, settings.task_balance
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


_POOLED: dict[tuple, tuple[list[torch.Tensor], int, set]] = {}  # the last input: Grams, rows, formed by
_lock = threading.Lock()


def _pooled(
    settings: BMMSettings,
    group: TensorGroup,
    tasks: Sequence[TensorEntry],
    task_vectors: Sequence[torch.Tensor],
    siblings: Sequence[str],
    transpose: bool,
) -> tuple[list[torch.Tensor], int]:
    """Each task's Gram pooled over the weights that read one input, formed once for all of them (q,
    k and v merged one after the other read it from here instead of loading each other again). The
    key holds the weights, the experts and a checksum of this weight's task vectors."""
    name = group.metadata.name or ""
    dtype = settings.compute_dtype
    checksum = tuple(float(v.sum(dtype=torch.float64)) for v in task_vectors)
    weights = tuple(sorted((*siblings, name)))
    key = (str(group.base.id), weights, tuple(str(t.id) for t in tasks), transpose, dtype, checksum)
    own = (name, checksum)
    with _lock:
        found = _POOLED.get(key[:5])
    if found is not None and own in found[2]:
        return found[0], found[1]
    others = sibling_task_vectors(group, tasks, siblings, transpose, dtype)
    grams, rows = normal_equations.pooled_grams(task_vectors, others, dtype)
    sums = {
        (sibling, tuple(float(parts[i].sum(dtype=torch.float64)) for parts in others))
        for i, sibling in enumerate(siblings)
    }
    with _lock:
        _POOLED.clear()  # one input at a time: its Grams are T × d_in² each
        _POOLED[key[:5]] = (grams, rows, sums | {own})
    return grams, rows
