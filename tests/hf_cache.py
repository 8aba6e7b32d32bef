"""Lay a folder into a Hugging Face cache exactly as huggingface_hub lays out a download.

``<cache>/{models|datasets}--ORG--NAME/blobs/<digest>`` holds each file's bytes,
``snapshots/<commit>/<path>`` links to its blob, and ``refs/main`` names the commit; with
``HF_HUB_OFFLINE=1`` ``snapshot_download`` then answers from it without any network.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def lay_out(
    cache: Path, repo_id: str, source: Path, repo_type: str = "model", commit: str | None = None
) -> str:
    """Put every file under ``source`` into ``cache`` as ``repo_id`` at ``commit``; the commit."""
    commit = commit or hashlib.sha1(f"{repo_type}:{repo_id}".encode()).hexdigest()
    kind = {"model": "models", "dataset": "datasets"}[repo_type]
    repo = Path(cache) / f"{kind}--{repo_id.replace('/', '--')}"
    for file in sorted(p for p in Path(source).rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / file.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return commit
