"""Cheap, content-sensitive fingerprints of checkpoints and files.

Statistics, caches and published folders must never be used with weights they were
not made from. Hashing every byte of a multi-GB checkpoint is too slow to do on every
merge, so a fingerprint hashes each weight file's size, its safetensors header, and 64
evenly spaced 4 KiB chunks of its data: two different fine-tunes differ in (almost)
every chunk, while the cost stays at a few MB read per model.
"""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_CHUNKS = 64
_CHUNK_BYTES = 4096


def file_fingerprint(path: str | Path, digest=None) -> str:
    """Fingerprint of one file (size + header + sampled chunks)."""
    path = Path(path)
    own = digest is None
    digest = digest or hashlib.sha256()
    size = path.stat().st_size
    digest.update(f"{path.name}:{size}".encode())
    with open(path, "rb") as handle:
        head = handle.read(8)
        digest.update(head)
        if path.suffix == ".safetensors" and len(head) == 8:
            header_len = int.from_bytes(head, "little")
            if header_len < size:
                digest.update(handle.read(header_len))
        if size <= _CHUNKS * _CHUNK_BYTES:
            handle.seek(0)
            digest.update(handle.read())
        else:
            step = (size - _CHUNK_BYTES) // (_CHUNKS - 1)
            for index in range(_CHUNKS):
                handle.seek(index * step)
                digest.update(handle.read(_CHUNK_BYTES))
    return digest.hexdigest() if own else ""


def weight_files(model_dir: str | Path) -> list[Path]:
    directory = Path(model_dir)
    return sorted(p for p in directory.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


@lru_cache(maxsize=256)
def _model_fingerprint(resolved: str, stamp: tuple) -> str:
    digest = hashlib.sha256()
    for path in weight_files(resolved):
        file_fingerprint(path, digest)
    return "sha256:" + digest.hexdigest()[:32]


def model_fingerprint(model_dir: str | Path) -> str:
    """Fingerprint of a local model folder's weights ("" if it is not a local folder)."""
    directory = Path(model_dir)
    if not directory.is_dir():
        return ""
    files = weight_files(directory)
    stamp = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return _model_fingerprint(str(directory.resolve()), stamp)


def same_path(left: str | os.PathLike, right: str | os.PathLike) -> bool:
    """Whether two model references name the same local folder (or the same repo id)."""
    try:
        return Path(left).resolve() == Path(right).resolve()
    except OSError:
        return str(left) == str(right)


def _local(part: str) -> Path | None:
    """The folder one part of a reference names here: a folder, or a Hub id's cached snapshot."""
    from mergekit_bmm.io.hub_models import cached_folder

    folder = Path(part).expanduser()
    if folder.is_dir():
        return folder
    repo_id, _, revision = part.partition("@")
    return cached_folder(repo_id, revision or None)


def adapter_fingerprint(folder: str | Path) -> str:
    """Fingerprint of a PEFT adapter folder: its weights and its ``adapter_config.json`` (rank, α
    and target modules change the update as much as the weights do)."""
    directory = Path(folder)
    digest = hashlib.sha256()
    for path in weight_files(directory) + sorted(directory.glob("adapter_config.json")):
        file_fingerprint(path, digest)
    return "sha256:" + digest.hexdigest()[:32]


def reference_fingerprint(reference: str) -> str:
    """Fingerprint of a model reference as a recipe writes it: a folder, a Hub id (its snapshot in
    the cache) or ``BASE+ADAPTER`` (the base's and the adapter's together, so each adapter of one
    base is told apart); "" when a part is not on this machine."""
    base, _, adapter = str(reference).partition("+")
    folder = _local(base)
    fingerprint = model_fingerprint(folder) if folder is not None else ""
    if not adapter or not fingerprint:
        return fingerprint
    adapter_folder = _local(adapter)
    if adapter_folder is None:
        return ""
    combined = hashlib.sha256(f"{fingerprint}+{adapter_fingerprint(adapter_folder)}".encode())
    return "sha256:" + combined.hexdigest()[:32]
