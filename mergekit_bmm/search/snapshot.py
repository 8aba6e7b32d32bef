"""The proposer as it stood after the last finished batch, so that a resume needs no surrogate fit.

Replaying ``trials.jsonl`` reproduces the optimiser exactly but refits the Gaussian process
once per logged batch (seconds each once there are a hundred points). After every batch the
search also writes ``proposer.pkl``: the proposer's state, the number of trials it was told and
a digest of those trials. A resume restores it when the log's finished batches match the digest
and the libraries are the versions that wrote it; otherwise it replays, which is always right.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from mergekit_bmm.io.atomic import replacing
from mergekit_bmm.search.log import TrialRecord
from mergekit_bmm.search.strategies import Proposer

SNAPSHOT_FILE = "proposer.pkl"
FORMAT = "mergekit-bmm-proposer/1"
LIBRARIES = ("scikit-optimize", "scikit-learn", "scipy", "numpy")


@dataclass(frozen=True)
class Snapshot:
    trials: int  # trials told, in order: the finished batches of the log
    digest: str
    state: bytes


def log_digest(records: Sequence[TrialRecord]) -> str:
    """What the proposer was told: each trial's index, values and score (None when it failed)."""
    told = [[r.trial, sorted(r.values.items()), r.score if r.ok else None] for r in records]
    return hashlib.sha256(json.dumps(told).encode()).hexdigest()


def _versions() -> dict[str, str]:
    found = {}
    for name in LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = ""
    return found


def save_snapshot(path: Path, proposer: Proposer, records: Sequence[TrialRecord]) -> None:
    """Write the proposer's state after ``records`` (nothing for proposers that replay for free)."""
    state = proposer.state()
    if state is None:
        return
    payload = {
        "format": FORMAT,
        "versions": _versions(),
        "trials": len(records),
        "digest": log_digest(records),
        "state": state,
    }
    with replacing(path, fsync=False) as temporary:
        temporary.write_bytes(pickle.dumps(payload))


def load_snapshot(path: Path) -> Snapshot | None:
    """The snapshot in ``path`` if it is readable and was written by these library versions."""
    try:
        payload = pickle.loads(path.read_bytes())
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError):
        return None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        return None
    if payload.get("versions") != _versions():
        return None
    return Snapshot(payload["trials"], payload["digest"], payload["state"])
