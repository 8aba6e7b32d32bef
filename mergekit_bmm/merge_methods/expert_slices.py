"""One expert of a mixture-of-experts stack as its own weight, and whether data reached it.

Methods solve an (E, out, in) stack expert by expert; each slice is a :class:`TensorGroup` named
``stack[e]`` — the name its per-expert statistics are stored under
(:mod:`mergekit_bmm.stats.expert_hooks`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import replace

from mergekit.merge_methods.base import TensorEntry, TensorGroup


def expert_slice(group: TensorGroup, index: int) -> TensorGroup:
    """Expert ``index`` of a mixture-of-experts stack, as its own group (named ``stack[index]``)."""
    entries = tuple(TensorEntry(e.id, e.tensor[index], e.is_base) for e in group.entries)
    return TensorGroup(entries, replace(group.metadata, name=f"{group.metadata.name}[{index}]"))


def unreached(stats: str, name: str, models: Sequence[Hashable]) -> bool:
    """Whether ``name`` is a mixture-of-experts expert (a stack's slice, or a checkpoint's per-expert
    weight) that no calibration token of any task was routed to: it has no data to be solved with."""
    from mergekit_bmm.stats.store import activation_tokens_for, load_manifest

    key = load_manifest(stats).stored_key(name)
    if key is None or not key.endswith("]"):
        return False
    return sum(activation_tokens_for(stats, models, name)) == 0
