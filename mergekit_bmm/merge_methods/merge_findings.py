"""What a ``bmm`` merge found out while solving, gathered for its end-of-merge lines and its record:
the tensors kept at the anchor, the λ ``lambda: auto`` chose, the weights solved in a LoRA subspace.

Each tally is per process and emptied when a merge starts (:func:`reset`), so a search's trials do
not pile up; :func:`drained` hands a finished merge's findings over.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from mergekit_bmm.merge_methods import chosen_lambdas, kept_at_anchor
from mergekit_bmm.merge_methods.tally import Tally

LOG = logging.getLogger("mergekit_bmm")

_low_rank: Tally[int] = Tally()  # weight name -> the subspace's dimension k = Σ r_t
_averaged: Tally[str] = Tally()  # regmean: experts no calibration token reached -> their stack
_silenced = 0  # > 0 inside a search's trials: their merges say nothing the first merge and report did not


@contextmanager
def summaries_silenced() -> Iterator[None]:
    """Merges inside this block log no end-of-merge lines (a search's trials: the report has them)."""
    global _silenced
    _silenced += 1
    try:
        yield
    finally:
        _silenced -= 1


@dataclass
class MergeFindings:
    kept_at_anchor: dict[str, list[str]] = field(default_factory=dict)
    lambda_auto: dict[str, dict] = field(default_factory=dict)
    low_rank: dict[str, int] = field(default_factory=dict)
    averaged: list[str] = field(default_factory=list)  # regmean's experts with no routed token


def note_low_rank(name: str, rank: int) -> None:
    """``name`` was solved from its LoRA experts' factors, in a ``rank``-dimensional subspace."""
    _low_rank.add(name, rank)


def note_averaged(name: str) -> None:
    """regmean had no statistics for the expert ``name`` (no token routed to it) and averaged it."""
    _averaged.add(name, name)


def reset() -> None:
    kept_at_anchor.reset()
    chosen_lambdas.reset()
    _low_rank.reset()
    _averaged.reset()


def drained() -> MergeFindings:
    return MergeFindings(
        kept_at_anchor.drained(), chosen_lambdas.drained(), _low_rank.drained(), list(_averaged.drained())
    )


def log_summary(findings: MergeFindings) -> None:
    """One line per kind of finding, at warning level (shown by mergekit-yaml without ``-v``)."""
    if _silenced:
        return
    kept_at_anchor.log_summary(findings.kept_at_anchor)
    chosen_lambdas.log_summary(findings.lambda_auto)
    if findings.low_rank:
        ranks = sorted(set(findings.low_rank.values()))
        LOG.warning(
            "bmm: %d weights of LoRA experts solved in their subspace (dimension %s; `low_rank: false` "
            "for the full route)",
            len(findings.low_rank),
            ranks[0] if len(ranks) == 1 else f"{ranks[0]} to {ranks[-1]}",
        )
    if findings.averaged:
        LOG.warning(
            "regmean: %d mixture-of-experts experts no calibration token was routed to are the experts' "
            "mean (e.g. %s)",
            len(findings.averaged),
            findings.averaged[0],
        )
