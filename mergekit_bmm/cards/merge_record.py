"""The merge record: what a merged folder's weights and recipe were when they were written.

A published model must be the model its card describes. Right after the weights are
written, the card step records, in ``mergekit_bmm_merge.json`` next to the card, the
weights' fingerprint (the project's cheap one, as statistics use), the full SHA-256 of
every weight file, and a digest of the recipe; ``mergekit-bmm-publish`` recomputes them
and refuses a folder whose weights or recipe changed since. Hashing every byte costs
about a second per GB, little next to the merge or the upload, and makes the check
exact. The record also lists each input's own fingerprint, so a reader can tell which
checkpoints were merged.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field

from mergekit_bmm.errors import ConfigError
from mergekit_bmm.io.fingerprint import model_fingerprint, reference_fingerprint, weight_files
from mergekit_bmm.io.versioned_json import read_versioned, write_versioned
from mergekit_bmm.merge_methods.merge_findings import MergeFindings

RECORD_FILE = "mergekit_bmm_merge.json"
RECIPE_FILE = "mergekit_config.yml"  # mergekit writes the recipe under this name
if TYPE_CHECKING:  # publishing reads records without loading mergekit
    from mergekit_bmm.cards.recipe_view import RecipeView

FORMAT_NAME = "mergekit-bmm-merge-record"
FORMAT_VERSION = 1


class InputRecord(BaseModel):
    model: str  # as the recipe names it: a folder, a Hub id, or BASE+ADAPTER
    role: Literal["base", "expert", "anchor"]
    fingerprint: str = ""  # of the weights (a Hub id's cached snapshot; base and adapter together)
    revision: str = ""  # the commit a Hub id resolved to


class MergeRecord(BaseModel):
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    package_version: str
    mergekit_version: str = ""
    created: str
    merge_method: str
    weights_fingerprint: str
    weight_files: dict[str, int] = Field(description="weight file name -> size in bytes")
    weight_sha256: dict[str, str] = Field(description="weight file name -> SHA-256 of its bytes")
    recipe_file: str = RECIPE_FILE
    recipe_sha256: str
    inputs: list[InputRecord] = Field(default_factory=list)
    kept_at_anchor: dict[str, list[str]] = Field(
        default_factory=dict,
        description="why -> names of the tensors bmm did not solve (they hold the anchor's value)",
    )
    lambda_auto: dict[str, dict] = Field(
        default_factory=dict,
        description="weight name -> the λ `lambda: auto` chose (lambda, interval, edge, log_evidence)",
    )
    low_rank: dict[str, int] = Field(
        default_factory=dict,
        description="weight name -> dimension of the LoRA subspace it was solved in (Σ of adapter ranks)",
    )


def recipe_digest(text: str) -> str:
    """Digest of a recipe's text (newlines normalised, as text-mode files read back)."""
    normalised = text.replace("\r\n", "\n").replace("\r", "\n")
    return "sha256:" + hashlib.sha256(normalised.encode("utf-8")).hexdigest()


def weight_sizes(folder: Path) -> dict[str, int]:
    return {path.name: path.stat().st_size for path in weight_files(folder)}


def file_sha256(path: Path, progress=None) -> str:
    """SHA-256 of a file's bytes, hashed from a read-only memory map in 4 MiB blocks (no copies;
    ``progress.update`` per block)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            return digest.hexdigest()
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
            for start in range(0, len(view), 4 << 20):
                block = view[start : start + (4 << 20)]
                digest.update(block)
                if progress is not None:
                    progress.update(len(block))
                block.release()
    return digest.hexdigest()


def weight_hashes(folder: Path, show_progress: bool = False) -> dict[str, str]:
    """SHA-256 of every weight file in ``folder`` (a byte-level bar if asked); the shards of a large
    model are hashed side by side (hashlib releases the GIL), one per core."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    files = weight_files(folder)
    total = sum(path.stat().st_size for path in files)
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="Hashing weights", disable=not show_progress
    ) as bar:
        if len(files) < 2:
            return {path.name: file_sha256(path, bar) for path in files}
        with ThreadPoolExecutor(max_workers=min(len(files), os.cpu_count() or 1)) as pool:
            digests = pool.map(lambda path: file_sha256(path, bar), files)
            return {path.name: digest for path, digest in zip(files, digests)}


def _versions() -> tuple[str, str]:
    from mergekit_bmm.io.versions import versions

    found = versions()
    return found["mergekit_bmm"], found["mergekit"]


def make_record(
    folder: str | Path,
    recipe_text: str,
    merge_method: str,
    inputs: Sequence[InputRecord] = (),
    findings: MergeFindings | None = None,
) -> MergeRecord:
    """The record of ``folder`` as it is now (call it right after the weights are written)."""
    folder = Path(folder)
    fingerprint = model_fingerprint(folder)
    if not fingerprint or not weight_files(folder):
        raise ConfigError(f"{folder} holds no weight files to record")
    package_version, mergekit_version = _versions()
    return MergeRecord(
        package_version=package_version,
        mergekit_version=mergekit_version,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        merge_method=merge_method,
        weights_fingerprint=fingerprint,
        weight_files=weight_sizes(folder),
        weight_sha256=weight_hashes(folder),
        recipe_sha256=recipe_digest(recipe_text),
        inputs=list(inputs),
        **(asdict(findings) if findings is not None else {}),
    )


def write_record(folder: str | Path, record: MergeRecord) -> Path:
    """Atomically write ``RECORD_FILE`` into ``folder``."""
    return write_versioned(Path(folder) / RECORD_FILE, record)


def read_record(folder: str | Path) -> MergeRecord | None:
    """The folder's record, or None if it has none."""
    try:
        return read_versioned(
            Path(folder) / RECORD_FILE,
            MergeRecord,
            "re-run the merge to rewrite it",
            label="a merge record of",
        )
    except FileNotFoundError:
        return None


def input_records(view: RecipeView) -> list[InputRecord]:
    """Each input of the recipe with its weights' fingerprint as they are now (and, for a Hub id,
    the commit of the snapshot that was merged)."""
    from mergekit_bmm.io.hub_models import hub_commit

    return [
        InputRecord(
            model=model.reference,
            role=model.role,
            fingerprint=reference_fingerprint(model.reference),
            revision=hub_commit(model.reference) if model.local_path is None else "",
        )
        for model in view.inputs
    ]


def record_merge(
    out_dir: str | Path,
    recipe_text: str,
    view: RecipeView | None = None,
    findings: MergeFindings | None = None,
) -> MergeRecord:
    """Fingerprint the just-written weights and recipe into ``out_dir/mergekit_bmm_merge.json``.

    What the merge itself found is taken from the folder's earlier record of the same weights when
    not given (a card rewritten after the merge)."""
    from mergekit_bmm.cards.recipe_view import view_of

    out_dir = Path(out_dir)
    view = view or view_of(recipe_text, out_dir)
    findings = findings if findings is not None else _same_weights_findings(out_dir)
    record = make_record(out_dir, recipe_text, view.merge_method, input_records(view), findings)
    write_record(out_dir, record)
    return record


def _same_weights_findings(folder: Path) -> MergeFindings | None:
    """The merge's findings from ``folder``'s record, if it describes the weights there now."""
    try:
        earlier = read_record(folder)
    except ConfigError:
        return None
    if earlier is None or earlier.weights_fingerprint != model_fingerprint(folder):
        return None
    return MergeFindings(earlier.kept_at_anchor, earlier.lambda_auto, earlier.low_rank)
