"""``merge_method: bmm`` — the mergekit adapter over :mod:`mergekit_bmm.closed_form`.

Per output tensor: 2D weights of the transformer body's linear modules get the
anchor-regularised closed form ``W = W_pre + s·U``; every other tensor (embeddings,
``lm_head``, norms, biases, routers, names the module map does not know) gets the
anchor's result unchanged. Inputs arrive one tensor at a time through mergekit's lazy
loader, so memory stays at one module's tensors (T experts + base + anchor).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch
from mergekit.merge_methods.base import (
    BasePolicy,
    GroupMergeMethod,
    InputContract,
    MergeMethodSpec,
    OptionalTensorPolicy,
    TensorEntry,
    TensorGroup,
)

from mergekit_bmm import closed_form
from mergekit_bmm.errors import TensorInputError
from mergekit_bmm.methods.anchor import anchor_weight, resolve_anchor_method
from mergekit_bmm.methods.parameters import BMMSettings, build_spec
from mergekit_bmm.module_map import classify, layer_index
from mergekit_bmm.sampling import hook as solved_tensors
from mergekit_bmm.sampling.hook import SolvedTensor

LOG = logging.getLogger("mergekit_bmm")

PRETTY_NAME = "Bayesian Model Merging (BMM)"
REFERENCE_URL = "https://arxiv.org/abs/2605.12843"


@lru_cache(maxsize=64)
def _model_type_of(path: str) -> str | None:
    """``model_type`` from a local checkpoint's config.json (None if unavailable)."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as handle:
            return json.load(handle).get("model_type")
    except (OSError, ValueError):
        return None


def model_type_of(entry_id: Any) -> str | None:
    """Works for mergekit's ModelReference ids; plain ids (Python API) give None."""
    model = getattr(entry_id, "model", None)
    path = getattr(model, "path", None)
    return _model_type_of(path) if isinstance(path, str) else None


def check_finite(group: TensorGroup) -> None:
    for entry in group.entries:
        tensor = entry.tensor
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise TensorInputError(
                f"tensor {group.metadata.name} of model {entry.id} contains NaN or Inf; "
                "repair or re-export that checkpoint before merging"
            )


def split_entries(group: TensorGroup, flags: Any) -> tuple[list[TensorEntry], TensorEntry | None]:
    """Experts, and the input marked ``anchor: true`` (at most one)."""
    tasks, anchors = [], []
    for entry in group.non_base:
        (anchors if flags and flags.get(entry.id) else tasks).append(entry)
    if len(anchors) > 1:
        raise TensorInputError(
            "bmm: more than one input is marked `anchor: true` ("
            + ", ".join(str(e.id) for e in anchors)
            + "); mark exactly one"
        )
    return tasks, (anchors[0] if anchors else None)


_warned_patterns: set[str] = set()


def _note_unsolved(name: str) -> None:
    if layer_index(name) is None:
        return
    key = name.split(".weight")[0].rsplit(".", 1)[-1]
    if key not in _warned_patterns:
        _warned_patterns.add(key)
        LOG.info("bmm: no module group for %s; it keeps the anchor's value", name)


class BMMMerge(GroupMergeMethod):
    """The registered ``bmm`` method."""

    _contract = InputContract(base=BasePolicy.REQUIRED, min_non_base=1)

    def __init__(self) -> None:
        self._spec_cache: tuple[frozenset[str], MergeMethodSpec] | None = None

    @property
    def spec(self) -> MergeMethodSpec:
        # Rebuilt when methods are (un)registered: anchors' parameters are forwarded.
        from mergekit.merge_methods import registry

        key = frozenset(registry._METHODS)
        if self._spec_cache is None or self._spec_cache[0] != key:
            spec = build_spec(
                registry._METHODS,
                PRETTY_NAME,
                REFERENCE_URL,
                self._contract,
                OptionalTensorPolicy.PASSTHROUGH_BASE_SINGLETON,
            )
            self._spec_cache = (key, spec)
        return self._spec_cache[1]

    def merge_group(self, group: TensorGroup, /, **parameters: Any) -> torch.Tensor:
        settings = BMMSettings.from_parameters(parameters)
        check_finite(group)
        tasks, anchor_entry = split_entries(group, parameters.get("anchor"))
        method_name = resolve_anchor_method(settings.anchor_method, anchor_entry)
        base = group.base.tensor
        dtype = settings.compute_dtype

        anchor_full = anchor_weight(
            group, tasks, anchor_entry, method_name, parameters, dtype, settings.anchor_seed
        )
        name = group.metadata.name or ""
        info = classify(name, model_type_of(group.base.id)) if base.ndim == 2 else None
        if info is None or not tasks:
            if base.ndim == 2 and info is None:
                _note_unsolved(name)
            return anchor_full.to(base.dtype)

        transpose = _stored_in_out(settings.weight_layout, info.stored_in_out)
        base_c = base.to(dtype)
        orient = (lambda m: m.T) if transpose else (lambda m: m)
        task_vectors = [orient(entry.tensor.to(dtype) - base_c) for entry in tasks]
        prior = orient(anchor_full - base_c)
        del anchor_full

        equations = self.normal_equations(settings, group, tasks, task_vectors)
        merged = closed_form.merge_matrix(equations, prior, settings.lam, settings.lambda_mode)
        if solved_tensors.active():  # mergekit-bmm-sample is listening
            ridge = closed_form.effective_ridge(settings.lam, equations, settings.lambda_mode)
            solved_tensors.report(
                SolvedTensor(
                    name, equations.gram, ridge, merged, base_c, settings.scale, transpose, base.dtype, dtype
                )
            )
        return (base_c + settings.scale * orient(merged)).to(base.dtype)

    def normal_equations(
        self,
        settings: BMMSettings,
        group: TensorGroup,
        tasks: Sequence[TensorEntry],
        task_vectors: Sequence[torch.Tensor],
    ) -> closed_form.NormalEquations:
        """G and C for the configured Gram mode."""
        data_free = None
        if settings.gram in ("data_free", "mix"):
            data_free = closed_form.data_free_equations(task_vectors, settings.compute_dtype)
            if settings.gram == "data_free":
                return data_free
        from mergekit_bmm.stats.store import activation_grams_for

        d_in = task_vectors[0].shape[1]
        grams = activation_grams_for(settings.stats, group.metadata.name, [e.id for e in tasks], d_in=d_in)
        grams = [g.to(device=task_vectors[0].device) for g in grams]
        few = closed_form.activation_equations(task_vectors, grams, settings.compute_dtype)
        if settings.gram == "activations":
            return few
        return closed_form.mix_equations(few, data_free, settings.epsilon)


def _stored_in_out(weight_layout: str, detected: bool) -> bool:
    if weight_layout == "in_out":
        return True
    if weight_layout == "out_in":
        return False
    return detected
