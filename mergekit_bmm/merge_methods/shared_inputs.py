"""Weights that read the same input (q, k and v; gate and up), for ``gram_sharing: input``.

In the data-free mode each weight's ``U_tᵀU_t`` estimates the Gram of its *input* from its own rows
(the paper's alignment argument, Sec. 4.3). q, k and v read one input, and a fused layout (Phi-3's
``qkv_proj``, GPT-2's ``c_attn``) already pools their rows into one Gram. With ``gram_sharing:
input`` a split layout does the same: each weight's Gram is the sum over the weights of its module that read
the input (``attn_in``: q/k/v of one attention; ``mlp_in``: gate/up of one MLP, or of one expert
stored split), read through mergekit's own loaders, so the split and fused layouts of the same
weights solve the same problem. Weights of one group but another module (each expert of a split
mixture-of-experts layer, its shared expert) or another input width (DeepSeek's q_a/q_b) read other
inputs and keep their own Gram.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch
from mergekit.merge_methods.base import TensorEntry, TensorGroup

from mergekit_bmm.core.module_map import ModuleGroup, ModuleInfo, classify
from mergekit_bmm.errors import ConfigError
from mergekit_bmm.io.model_folder import layout_shapes_of, weight_shapes_of

POOLED = (ModuleGroup.ATTN_IN, ModuleGroup.MLP_IN)


def sibling_names(name: str, info: ModuleInfo, base: object, model_type: str | None) -> tuple[str, ...]:
    """The other 2-D weights of the base model that read ``name``'s input."""
    if info.group not in POOLED or info.experts:
        return ()
    naming = _naming_of(_reference(base), name)
    if naming is None:
        return ()
    shapes = _shapes(_reference(base), naming)
    readers = _weights_by_input(_reference(base), model_type, naming).get(
        _input_of(name, info, shapes[name]), ()
    )
    return tuple(other for other in readers if other != name)


def sibling_rows(base: object, names: Sequence[str]) -> int:
    """How many rows the weights ``names`` hold together in the base model (their observations)."""
    shapes = _shapes(_reference(base), _naming_of(_reference(base), names[0]) or "checkpoint")
    return sum(int(shapes[name][0]) for name in names)


def _reference(base: object) -> str:
    return str(getattr(getattr(base, "model", None), "path", base))


def _shapes(reference: str, naming: str) -> dict[str, tuple[int, ...]]:
    return weight_shapes_of(reference) if naming == "checkpoint" else layout_shapes_of(reference)


def _naming_of(reference: str, name: str) -> str | None:
    """Which names the merge reads ``name`` under: the checkpoint's own, or transformers' layout
    (mergekit converts a checkpoint saved under older names on load); None for neither, or where no
    checkpoint can be listed (tensors handed to ``merge_tensors`` under made-up ids: each weight then
    reads its input alone)."""
    for naming in ("checkpoint", "layout"):
        try:
            shape = _shapes(reference, naming).get(name)
        except (ConfigError, OSError):
            return None
        if shape is not None and len(shape) == 2:
            return naming
    return None


def _input_of(name: str, info: ModuleInfo, shape: Sequence[int]) -> tuple[int, str, str, int]:
    """What identifies the input a 2-D weight reads: its layer, input group, module (the name less
    its own projection) and width."""
    module = name.rsplit(".", 2)[0] if name.endswith(".weight") else name.rsplit(".", 1)[0]
    return info.layer, info.group.value, module, int(shape[0] if info.stored_in_out else shape[1])


@lru_cache(maxsize=16)
def _weights_by_input(
    reference: str, model_type: str | None, naming: str
) -> dict[tuple[int, str, str, int], tuple[str, ...]]:
    found: dict[tuple[int, str, str, int], list[str]] = {}
    for other, shape in _shapes(reference, naming).items():
        info = classify(other, model_type, len(shape))
        if info is not None and len(shape) == 2 and info.group in POOLED and not info.experts:
            found.setdefault(_input_of(other, info, shape), []).append(other)
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
    from mergekit.io.tasks import LoadTensor

    device = group.base.tensor.device

    def load(model: object, name: str) -> torch.Tensor:  # converted on load as mergekit converts it
        return LoadTensor(model=model, tensor=name).execute().to(device=device, dtype=dtype)

    base = {name: load(group.base.id, name) for name in names}
    vectors = []
    for entry in tasks:
        parts = []
        for name in names:
            vector = load(entry.id, name) - base[name]
            parts.append(vector.T if transpose else vector)
        vectors.append(parts)
    return vectors
