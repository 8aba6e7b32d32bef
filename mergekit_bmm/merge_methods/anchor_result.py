"""The anchor's value for a tensor BMM does not solve (embeddings, heads, norms, …), cached where that
saves work.

What the merge recomputes cheaply — a copy (the base, a marked input), Task Arithmetic (a weighted sum of
tensors mergekit loads for this merge anyway) — and 1-D tensors cost less to recompute than to read back;
anything else another method computes (TIES' sorts, TSV's SVDs) is stored in the factor cache once, in the
model's dtype (what the merge writes), so a search's trials do not compute it again.
"""

from __future__ import annotations

import torch

from mergekit_bmm.merge_methods.bmm_anchor import AnchorSource
from mergekit_bmm.merge_methods.bmm_parameters import BMMSettings
from mergekit_bmm.merge_methods.factor_cache import key as cache_key
from mergekit_bmm.merge_methods.factor_cache.store import FactorCache
from mergekit_bmm.merge_methods.finite import check_finite, checked_base
from mergekit_bmm.merge_methods.lora_route import keeps_base


def anchor_result(settings: BMMSettings, source: AnchorSource, cache: FactorCache | None) -> torch.Tensor:
    """``W_anchor`` for this tensor: computed, or read from the cache when it is worth storing."""
    group = source.group
    if keeps_base(source):  # LoRA experts leave it alone: no pass over their dense copies
        return checked_base(group)

    def compute() -> torch.Tensor:
        check_finite(group)
        return source.weight(settings.compute_dtype)

    if cache is None or source.recomputed_cheaply or group.base.tensor.ndim < 2:
        return compute()
    name = group.metadata.name or ""
    key = cache_key.anchor_key(settings, source)
    stored = cache.load_tensor(name, key, tuple(group.base.tensor.shape))
    if stored is not None:
        return stored.to(group.base.tensor.device)
    result = compute().to(group.base.tensor.dtype)  # what the merge writes: stored as such
    cache.store_tensor(name, key, result)
    return result
