"""One factorisation of ``G + λ'I`` for the weights that read one input.

q, k and v (gate and up) read one input, so their activation Gram is one stored Gram (and under
``gram_sharing: input`` their data-free Grams are one pooled Gram) and, with one λ for their module
group, their ``G + λ'I`` is one matrix: it is factored once
(:class:`~mergekit_bmm.core.closed_form.RidgeFactor`) and kept for the weights merged after it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence

import torch
from mergekit.merge_methods.base import TensorEntry

from mergekit_bmm.core import closed_form
from mergekit_bmm.merge_methods.bmm_parameters import BMMSettings
from mergekit_bmm.merge_methods.pieces import statistics_name

_FACTORS: OrderedDict[Hashable, closed_form.RidgeFactor] = OrderedDict()
_KEEP = 2  # an input's factor serves its q, k and v (gate and up), merged one after the other
_lock = threading.Lock()


def shared_factor(key: Hashable | None, gram: torch.Tensor, ridge: float) -> closed_form.RidgeFactor | None:
    """The factor of ``G + λ'I`` for the input ``key`` (computed once, kept for the next weights)."""
    if key is None:
        return closed_form.ridge_factor(gram, ridge)
    # the Gram's content is part of the key: statistics collected again under the same name never
    # meet a factor of the old ones
    checksum = (float(gram.sum(dtype=torch.float64)), float(torch.diagonal(gram).sum(dtype=torch.float64)))
    full = (key, ridge, gram.dtype, str(gram.device), tuple(gram.shape), checksum)
    with _lock:
        found = _FACTORS.get(full)
        if found is not None:
            _FACTORS.move_to_end(full)
            return found
    factor = closed_form.ridge_factor(gram, ridge)
    if factor is not None:
        with _lock:
            _FACTORS[full] = factor
            while len(_FACTORS) > _KEEP:
                _FACTORS.popitem(last=False)
    return factor


def shared_input_key(settings: BMMSettings, name: str, tasks: Sequence[TensorEntry]) -> Hashable | None:
    """What identifies ``G`` across the weights that read one input: the statistics, the stored
    Gram's key and the experts (``gram: activations`` only; mix adds each weight's own rows)."""
    if settings.gram != "activations":
        return None
    from mergekit_bmm.stats.store import load_manifest

    manifest = load_manifest(settings.stats)
    key = manifest.stored_key(statistics_name(name))
    # only an input that several weights read is worth keeping a factor for (not o_proj, down_proj,
    # an expert's slice): a kept factor is d_in² numbers
    if key is None or key.endswith("]") or manifest.readers(key) < 2:
        return None
    return (str(settings.stats), key, tuple(str(t.id) for t in tasks))
