"""Weights that read the same input (q, k and v; gate and up), for ``gram_sharing: input``.

In the data-free mode each weight's ``U_tᵀU_t`` estimates the Gram of its *input* from its own rows
(the paper's alignment argument, Sec. 4.3). q, k and v read one input, and a fused layout (Phi-3's
``qkv_proj``, GPT-2's ``c_attn``) already pools their rows into one Gram. With ``gram_sharing:
input`` a split layout does the same: each weight's Gram is the sum over the weights of its layer and
input group (``attn_in``: q/k/v; ``mlp_in``: gate/up), read through mergekit's own loaders, so the
split and fused layouts of the same weights solve the same problem.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch
from mergekit.merge_methods.base import TensorEntry, TensorGroup

from mergekit_bmm.core.module_map import ModuleGroup, ModuleInfo, classify
from mergekit_bmm.io.model_folder import weight_shapes_of

POOLED = (ModuleGroup.ATTN_IN, ModuleGroup.MLP_IN)


def sibling_names(name: str, info: ModuleInfo, base: object, model_type: str | None) -> tuple[str, ...]:
    """The other 2-D weights of ``name``'s layer and input group in the base checkpoint."""
    if info.group not in POOLED or info.experts:
        return ()
    reference = str(getattr(getattr(base, "model", None), "path", base))
    return tuple(
        other
        for other in _weights_by_input(reference, model_type).get((info.layer, info.group.value), ())
        if other != name
    )


def sibling_rows(base: object, names: Sequence[str]) -> int:
    """How many rows the weights ``names`` hold together in the base checkpoint (their observations)."""
    reference = str(getattr(getattr(base, "model", None), "path", base))
    shapes = weight_shapes_of(reference)
    return sum(int(shapes[name][0]) for name in names)


@lru_cache(maxsize=16)
def _weights_by_input(reference: str, model_type: str | None) -> dict[tuple[int, str], tuple[str, ...]]:
    found: dict[tuple[int, str], list[str]] = {}
    for other, shape in weight_shapes_of(reference).items():
        info = classify(other, model_type, len(shape))
        if info is not None and len(shape) == 2 and info.group in POOLED and not info.experts:
            found.setdefault((info.layer, info.group.value), []).append(other)
    return {key: tuple(sorted(names)) for key, names in found.items()}


def sibling_task_vectors(
    group: TensorGroup,
    tasks: Sequence[TensorEntry],
    names: Sequence[str],
    transpose: bool,
    dtype: torch.dtype,
) -> list[list[torch.Tensor]]:
    """Per expert, the task vectors ``W_t − W_pre`` of the weights ``names`` (oriented (out, in) as the
    solved weight is), read through mergekit's loaders as the merge reads its own inputs."""
    from mergekit.io.tasks import LoaderCache

    loaders = LoaderCache()
    device = group.base.tensor.device
    base = {
        name: loaders.get(group.base.id).get_tensor(name).to(device=device, dtype=dtype) for name in names
    }
    vectors = []
    for entry in tasks:
        loader = loaders.get(entry.id)
        parts = []
        for name in names:
            vector = loader.get_tensor(name).to(device=device, dtype=dtype) - base[name]
            parts.append(vector.T if transpose else vector)
        vectors.append(parts)
    return vectors
