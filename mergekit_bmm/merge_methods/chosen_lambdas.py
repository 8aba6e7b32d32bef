"""The λ that ``lambda: auto`` chose for each weight of a merge, for its end-of-merge line,
merge record and card (:mod:`mergekit_bmm.core.evidence` chooses them)."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping

from mergekit_bmm.core.evidence import EvidenceChoice
from mergekit_bmm.core.module_map import matching_rule
from mergekit_bmm.merge_methods.tally import Tally

LOG = logging.getLogger("mergekit_bmm")

_chosen: Tally[dict] = Tally()  # weight name -> EvidenceChoice.record()

EDGES = {
    "low": "at the grid's low edge (the experts are fitted exactly: interpolation)",
    "high": "at the grid's high edge (the anchor explains the experts: kept near it)",
    "flat": "flat (the experts equal the anchor where the Gram sees them)",
}


def note(name: str, choice: EvidenceChoice) -> None:
    _chosen.add(name, choice.record())


def reset() -> None:
    _chosen.reset()


def drained() -> dict[str, dict]:
    """weight name -> {lambda, interval, edge, log_evidence}, in merge order; empties the record."""
    return _chosen.drained()


def group_of(name: str) -> str:
    """The module group a solved weight belongs to (as the search names them)."""
    base = name.split("[", 1)[0]  # an expert slice: its stack's group
    rule = matching_rule(base)
    return rule.group.value if rule is not None and rule.group is not None else "other"


def by_group(chosen: Mapping[str, Mapping]) -> dict[str, list[float]]:
    """The chosen λ of every weight, gathered per module group."""
    groups: dict[str, list[float]] = {}
    for name, choice in chosen.items():
        groups.setdefault(group_of(name), []).append(float(choice["lambda"]))
    return groups


def summary_lines(chosen: Mapping[str, Mapping]) -> list[str]:
    """One line per group (median and range of λ) and one per edge that was hit."""
    lines = []
    for group, values in by_group(chosen).items():
        lines.append(
            f"bmm: lambda auto chose, for {len(values)} {group} weight{'s' if len(values) != 1 else ''}, "
            f"median {statistics.median(values):.3g} (range {min(values):.3g} to {max(values):.3g})"
        )
    for edge, meaning in EDGES.items():
        hits = [name for name, choice in chosen.items() if choice.get("edge") == edge]
        if hits:
            lines.append(f"bmm: lambda auto: {len(hits)} weight(s) {meaning}, e.g. {hits[0]}")
    return lines


def log_summary(chosen: Mapping[str, Mapping]) -> None:
    """What the evidence chose, at warning level: shown by mergekit-yaml without ``-v``."""
    for line in summary_lines(chosen):
        LOG.warning(line)
