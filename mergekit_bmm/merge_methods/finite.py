"""NaN and Inf, refused on the way in (naming the tensor and the model) and on the way out: a merge
never writes a non-finite weight. Shared by every method of the plugin."""

from __future__ import annotations

import torch
from mergekit.merge_methods.base import TensorGroup

from mergekit_bmm.core.finite import all_finite
from mergekit_bmm.errors import NonFiniteOutputError, TensorInputError


def check_finite(group: TensorGroup) -> None:
    for entry in group.entries:
        tensor = entry.tensor
        if tensor.is_floating_point() and not all_finite(tensor):
            raise TensorInputError(
                f"tensor {group.metadata.name} of model {entry.id} contains NaN or Inf; "
                "repair or re-export that checkpoint before merging"
            )


def checked_output(tensor: torch.Tensor, name: str, method: str, hint: str) -> torch.Tensor:
    """``tensor`` if every value is finite; else refuse it, naming it: a merge never writes NaN."""
    if tensor.is_floating_point() and not all_finite(tensor):
        raise NonFiniteOutputError(
            f"{method} produced NaN or Inf in {name or 'a tensor'} ({hint}); nothing was written for it"
        )
    return tensor


def checked_base(group: TensorGroup) -> torch.Tensor:
    """A copy of the base's tensor, checked: what a weight keeps when no expert changed it."""
    check_finite(TensorGroup((group.base,), group.metadata))
    return group.base.tensor.clone()
