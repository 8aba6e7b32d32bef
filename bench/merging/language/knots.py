"""KnOTS (Stoica et al., ICLR 2025): LoRA updates aligned by one SVD per module, then merged by TIES.

As the authors' public code does it (github.com/gstoica27/KnOTS: ``SVDMerger`` and ``masking_ops``):
per module the tasks' updates are concatenated along the input axis and decomposed once,
``[ΔW_1 | … | ΔW_T] = U S [V_1 | … | V_T]`` (components with singular value ≤ 1e-5 dropped), so every
task is a ``k × d_in`` block ``S V_t`` in one shared basis ``U``. Each task's blocks over all modules,
flattened into one vector, are merged by TIES: optionally DARE first (drop with probability ``p``,
rescale by ``1/(1−p)``), keep each task's top ``top_k`` share by magnitude, elect every entry's sign by
the sum of values, average the entries that agree (disjoint mean), all scaled by one coefficient. The
merged update of a module is ``U · (merged S V)``.

The decomposition goes through the factors: ``[B_1A_1 | … | B_TA_T] = [B_1 … B_T]·blockdiag(A_t)``, and
with ``[B_1 … B_T] = Q R`` the SVD of the ``k × T·d_in`` matrix ``R·blockdiag(A_t)`` gives the same
``S`` and ``V`` (``U = Q U_R``), never a ``d_out × T·d_in`` one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mergekit_bmm.io.lora_adapters import Adapter, adapter_for

SUPPORT = 1e-5  # singular values at or below it are dropped (the authors' threshold)


@dataclass(frozen=True)
class Aligned:
    """One module's shared basis ``U`` (``d_out × k``) and each task's ``S V_t`` (``k × d_in``)."""

    basis: torch.Tensor
    tasks: list[torch.Tensor]


def align(updates: list[tuple[torch.Tensor, torch.Tensor]]) -> Aligned:
    """The SVD of the tasks' updates concatenated along the input axis, from their factors ``(B_t, A_t)``
    (float64)."""
    lefts = torch.cat([left for left, _ in updates], dim=1)  # d_out × k
    q, r = torch.linalg.qr(lefts)
    reduced = r @ torch.block_diag(*[right for _, right in updates])  # k × T·d_in
    u, s, vh = torch.linalg.svd(reduced, full_matrices=False)
    kept = s > SUPPORT
    basis, weighted = q @ u[:, kept], s[kept, None] * vh[kept]
    return Aligned(basis, list(torch.split(weighted, updates[0][1].shape[1], dim=1)))


def ties_masked_mean(
    vectors: torch.Tensor, weight: float, top_k: float, dare: float = 0.0, seed: int = 0
) -> torch.Tensor:
    """TIES over the rows of ``vectors`` (one per task) as KnOTS applies it: DARE with drop rate
    ``dare`` first, each row's top ``top_k`` share by magnitude (counted as the authors' code does:
    ``k = d − int(d·top_k)``, entries at least the k-th smallest magnitude kept, one more than the
    share), the sign of the summed values (a zero sum takes the majority sign), the mean of the kept
    entries that agree, times ``weight``."""
    if dare > 0.0:
        generator = torch.Generator().manual_seed(seed)
        keep = torch.rand(vectors.shape, generator=generator, dtype=vectors.dtype) >= dare
        vectors = vectors * keep / (1.0 - dare)
    if top_k < 1.0:
        size = vectors.shape[1]
        rank = min(max(size - int(size * top_k), 1), size)
        threshold = vectors.abs().kthvalue(rank, dim=1, keepdim=True).values
        vectors = vectors * (vectors.abs() >= threshold)
    sign = torch.sign(vectors.sum(dim=0))
    sign[sign == 0] = torch.sign(sign.sum())
    agree = torch.where(sign > 0, vectors > 0, vectors < 0)
    kept = vectors * agree * weight
    count = (kept != 0).sum(dim=0).clamp_min(1)
    return kept.sum(dim=0) / count


def knots_updates(
    adapters: list[Adapter], weight: float, top_k: float, dare: float = 0.0, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Every module's merged update ``ΔW`` (float64) from the adapters' factors."""
    modules = sorted(adapters[0].factors)
    if any(sorted(adapter.factors) != modules for adapter in adapters[1:]):
        raise ValueError("KnOTS needs adapters on the same modules")
    aligned = {}
    for module in modules:
        updates = [adapter.update(f"{module}.weight") for adapter in adapters]
        aligned[module] = align(updates)
    rows = torch.stack(
        [torch.cat([aligned[m].tasks[t].flatten() for m in modules]) for t in range(len(adapters))]
    )
    merged = ties_masked_mean(rows, weight, top_k, dare, seed)
    out, start = {}, 0
    for module in modules:
        shape = aligned[module].tasks[0].shape
        block = merged[start : start + shape.numel()].reshape(shape)
        start += shape.numel()
        out[module] = aligned[module].basis @ block
    return out


def knots_model(model_dir: Path, adapters: list[Path], weight: float, top_k: float, dare: float):
    """The base with the KnOTS merge of ``adapters`` added (in memory, float32)."""
    from transformers import AutoModelForCausalLM

    read = [adapter_for(path) for path in adapters]
    if any(adapter is None for adapter in read):
        raise ValueError("KnOTS reads plain LoRA adapters only")
    updates = knots_updates(read, weight, top_k, dare)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        for module, delta in updates.items():
            target = model.get_submodule(module).weight
            target.copy_((target.double() + delta).to(target.dtype))
    return model
