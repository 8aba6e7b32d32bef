"""The common mergekit adapter of the anchor methods (tsv, iso_c, iso_cts, wudi, regmean).

Per output tensor, with task vectors ``τ_t = W_t − W_pre`` computed in float32 (float64
if the inputs are) on the device mergekit put the inputs on:

* 2D weights of the transformer body (those :func:`mergekit_bmm.core.module_map.classify`
  knows — the same set ``bmm`` solves) get the method's matrix algorithm, in ``(out, in)``
  orientation (GPT-2's Conv1D weights are transposed for it and back);
* every other tensor (embeddings, ``lm_head``, norms, biases, routers, unknown names) gets
  the mean of the task vectors, as the reference implementations do for non-matrix tensors;
* ``W = W_pre + scale·τ_merged``, where ``scale`` is the method's ``alpha`` for TSV and ISO
  (applied to every tensor, as the references do) and 1 otherwise.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import torch
from mergekit.merge_methods.base import (
    BasePolicy,
    GroupMergeMethod,
    InputContract,
    MergeMethodSpec,
    OptionalTensorPolicy,
    ParameterScope,
    ParameterSpec,
    TensorEntry,
    TensorGroup,
)

from mergekit_bmm.core.merge_tools import compute_dtype, mean_task_vector
from mergekit_bmm.core.module_map import ModuleInfo, classify
from mergekit_bmm.io.model_folder import model_type_of
from mergekit_bmm.merge_methods.bmm import check_finite, checked_output
from mergekit_bmm.merge_methods.parameter_ranges import CheckedParameter


def alpha_parameter(method: str) -> ParameterSpec:
    """The output scale shared by tsv, iso_c and iso_cts: ``W = W_pre + α·τ``."""
    return CheckedParameter(
        "alpha",
        float,
        ParameterScope.SHARED,
        default=1.0,
        description="number > 0 (output scale)",
        owner=method,
    )


def body_matrix(group: TensorGroup) -> ModuleInfo | None:
    """Where the tensor sits, if it is a 2D body weight that gets the matrix algorithm."""
    if group.base.tensor.ndim != 2:
        return None
    return classify(group.metadata.name or "", model_type_of(group.base.id))


class TaskVectorMethod(GroupMergeMethod):
    """Base class: subclasses name themselves and implement :meth:`merge_matrix`."""

    method_name: str = ""
    pretty_name: str = ""
    reference_url: str = ""

    def method_parameters(self) -> tuple[ParameterSpec, ...]:
        return ()

    @cached_property
    def spec(self) -> MergeMethodSpec:
        return MergeMethodSpec(
            name=self.method_name,
            parameters=self.method_parameters(),
            contract=InputContract(base=BasePolicy.REQUIRED, min_non_base=1),
            pretty_name=self.pretty_name,
            reference_url=self.reference_url,
            optional_tensor_policy=OptionalTensorPolicy.PASSTHROUGH_BASE_SINGLETON,
            uses_accelerator=True,
        )

    def output_scale(self, parameters: dict[str, Any]) -> float:
        return float(parameters.get("alpha", 1.0))

    def check_parameters(self, parameters: dict[str, Any]) -> None:
        """Called once per tensor before any work (e.g. a required statistics directory)."""

    @abstractmethod
    def merge_matrix(
        self,
        task_vectors: Sequence[torch.Tensor],
        group: TensorGroup,
        tasks: Sequence[TensorEntry],
        parameters: dict[str, Any],
    ) -> torch.Tensor:
        """The merged task vector of one 2D body weight, given in ``(out, in)`` orientation."""

    def merge_group(self, group: TensorGroup, /, **parameters: Any) -> torch.Tensor:
        base = group.base.tensor
        tasks = group.non_base
        if not tasks:
            return base
        self.check_parameters(parameters)
        check_finite(group)
        dtype = compute_dtype(base.dtype)
        base_compute = base.to(dtype)
        task_vectors = [entry.tensor.to(dtype) - base_compute for entry in tasks]
        info = body_matrix(group)
        if info is None:
            merged = mean_task_vector(task_vectors)
        elif info.stored_in_out:
            oriented = [vector.T for vector in task_vectors]
            merged = self.merge_matrix(oriented, group, tasks, parameters).T
        else:
            merged = self.merge_matrix(task_vectors, group, tasks, parameters)
        del task_vectors
        scale = self.output_scale(parameters)
        if scale != 1.0:
            merged = merged * scale
        hint = (
            f"output scale {scale:g}; the values overflow the output dtype: check the inputs and parameters"
        )
        return checked_output(
            (base_compute + merged).to(base.dtype), group.metadata.name or "", self.method_name, hint
        )
