"""The tensors a ``bmm`` merge keeps at the anchor, counted by kind.

BMM solves the 2-D weights of the transformer body (and each expert of a mixture-of-experts
stack); every other tensor gets the anchor's value. That is the method, not a failure, but
a user must be able to see it: the merge ends with one line per kind
(:func:`summary_lines`) and the merge record lists the names (:func:`drained`). The tally is
per process and starts empty at each merge (:func:`reset`), so it does not grow over a
search's trials.
"""

from __future__ import annotations

import logging

from mergekit_bmm.core.module_map import layer_index, matching_rule
from mergekit_bmm.merge_methods.tally import Tally

LOG = logging.getLogger("mergekit_bmm")

# kind -> what the line says about it
KINDS: dict[str, str] = {
    "outside_layers": "outside the transformer layers (embeddings, heads, final norms)",
    "vectors": "1-D (norms, biases, scalars)",
    "routers": "mixture-of-experts routers and gates",
    "no_group": "2-D weights in a layer that no module group covers",
    "other_shapes": "tensors of 3 or more dimensions that are not expert stacks",
    "no_experts": "weights every expert leaves unchanged (no task vector)",
    "no_routed_tokens": "mixture-of-experts experts that no calibration token was routed to",
}

_kept: Tally[str] = Tally()  # tensor name -> kind


def kind_of(name: str, ndim: int) -> str:
    """Why ``name`` (a tensor of ``ndim`` dimensions) is not solved."""
    if ndim < 2:
        return "vectors"
    if layer_index(name) is None:
        return "outside_layers"
    rule = matching_rule(name)
    if rule is not None and rule.group is None:
        return "routers"
    return "no_group" if ndim == 2 else "other_shapes"


def note(name: str, kind: str) -> None:
    """Count ``name`` as kept at the anchor for ``kind`` (once per name)."""
    _kept.add(name, kind)


def reset() -> None:
    """Start a new merge's tally."""
    _kept.reset()


def drained() -> dict[str, list[str]]:
    """The tally so far (kind -> names, in merge order), and a fresh one."""
    kept: dict[str, list[str]] = {}
    for name, kind in _kept.drained().items():
        kept.setdefault(kind, []).append(name)
    return kept


def summary_lines(kept: dict[str, list[str]]) -> list[str]:
    """One line per kind: how many tensors, what they are, an example."""
    return [
        f"bmm: {len(names)} tensor{'s' if len(names) != 1 else ''} {KINDS.get(kind, kind)} kept the "
        f"anchor's value (e.g. {names[0]})"
        for kind, names in kept.items()
    ]


def log_summary(kept: dict[str, list[str]]) -> None:
    """Say what was kept at the anchor, at warning level: shown by mergekit-yaml without ``-v``."""
    for line in summary_lines(kept):
        LOG.warning(line)
