"""The common mergekit adapter of the anchor methods (tsv, iso_c, iso_cts, wudi, regmean).

Per output tensor, with task vectors ``τ_t = W_t − W_pre`` computed in float32 (float64
if the inputs are) on the device mergekit put the inputs on:

* 2D weights of the transformer body (those :func:`mergekit_bmm.core.module_map.classify`
  knows — the same set ``bmm`` solves) get the method's matrix algorithm, in ``(out, in)``
  orientation (GPT-2's Conv1D weights are transposed for it and back), and so does each
  expert of a mixture-of-experts stack;
* every other tensor (embeddings, ``lm_head``, norms, biases, routers, unknown names) gets
  the mean of the task vectors, as the reference implementations do for non-matrix tensors;
* ``W = W_pre + scale·τ_merged``, where ``scale`` is the method's ``alpha`` for TSV and ISO
  (applied to every tensor, as the references do) and 1 otherwise.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import replace
from functools import cached_property
from typing import Any, Literal

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
from mergekit_bmm.errors import TensorInputError
from mergekit_bmm.io.model_folder import model_type_of
from mergekit_bmm.merge_methods.finite import check_finite, checked_output
from mergekit_bmm.merge_methods.parameter_ranges import CheckedParameter
from mergekit_bmm.merge_methods.pieces import expert_slice


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


LAYOUT_PARAMETER = CheckedParameter(
    "weight_layout",
    Literal["auto", "out_in", "in_out"],
    ParameterScope.SHARED,
    default="auto",
    description="weight layout (auto, out_in or in_out)",
    owner="anchor method",
)


def body_matrix(group: TensorGroup, weight_layout: str = "auto") -> ModuleInfo | None:
    """Where the tensor sits, if it is a 2D body weight (or an expert stack) that gets the
    matrix algorithm; a layout nobody can tell is refused in one line."""
    name = group.metadata.name or ""
    info = classify(name, model_type_of(group.base.id), group.base.tensor.ndim)
    if info is not None and weight_layout != "auto":
        return replace(info, stored_in_out=weight_layout == "in_out")
    if info is not None and info.stored_in_out is None:
        raise TensorInputError(
            f"cannot tell whether {name} is stored (out, in) or (in, out): the architecture of "
            f"{group.base.id} is unknown (its config.json could not be read, locally or from the Hub "
            "cache); make it readable, or set `weight_layout: out_in` (nn.Linear) or `in_out` (Conv1D)"
        )
    return info


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
            parameters=(*self.method_parameters(), LAYOUT_PARAMETER),
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

    def _matrix(
        self,
        task_vectors: Sequence[torch.Tensor],
        group: TensorGroup,
        tasks: Sequence[TensorEntry],
        parameters: dict[str, Any],
        info: ModuleInfo,
    ) -> torch.Tensor:
        """:meth:`merge_matrix` in ``(out, in)`` orientation, stored orientation back."""
        if not info.stored_in_out:
            return self.merge_matrix(task_vectors, group, tasks, parameters)
        return self.merge_matrix([vector.T for vector in task_vectors], group, tasks, parameters).T

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
        info = body_matrix(group, parameters.get("weight_layout") or "auto")
        if info is None:
            merged = mean_task_vector(task_vectors)
        elif info.experts:  # a mixture-of-experts stack: each expert is its own matrix (``stack[e]``)
            merged = torch.stack(
                [
                    self._matrix(
                        [v[e] for v in task_vectors], expert_slice(group, e), tasks, parameters, info
                    )
                    for e in range(base.shape[0])
                ]
            )
        else:
            merged = self._matrix(task_vectors, group, tasks, parameters, info)
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
