"""Content-addressed, resumable stage outputs.

A stage output is a folder ``<cache>/<stage>/<name>-<key>`` where ``key`` hashes
everything the output depends on (config values, seeds, fingerprints of the inputs).
It is built in a ``.partial`` sibling and renamed into place only after its
``done.json`` (the key's inputs, a fingerprint of the outputs, timings) is written, so an
interrupted run leaves no half-built folder that looks finished. On reuse the outputs'
fingerprint is checked again: a folder that was modified is rebuilt, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mergekit_bmm.io.atomic import atomic_write_text

DONE = "done.json"


def stable_key(payload: Any, length: int = 12) -> str:
    """A short hash of a JSON-serialisable payload (key order does not matter)."""
    text = json.dumps(payload, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_json(path: str | Path, data: Any) -> None:
    """Write JSON atomically (temporary file, then rename), keys sorted."""
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: str | Path) -> Any:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


class Stage:
    """One cached output folder: ``cached()`` if finished and intact, else ``build()``."""

    def __init__(
        self,
        cache_dir: Path,
        stage: str,
        name: str,
        payload: dict[str, Any],
        fingerprint: Callable[[Path], str],
    ) -> None:
        self.payload = payload
        self.key = stable_key(payload)
        self.path = Path(cache_dir) / stage / f"{name}-{self.key}"
        self._fingerprint = fingerprint

    def cached(self) -> dict[str, Any] | None:
        """The ``done.json`` record if the folder is complete, matches the key and is unmodified."""
        done = self.path / DONE
        if not done.is_file():
            return None
        try:
            record = read_json(done)
        except (OSError, ValueError):
            return None
        if record.get("key") != self.key:
            return None
        try:
            if record.get("fingerprint") != self._fingerprint(self.path):
                return None
        except OSError:
            return None
        return record

    def build(self, produce: Callable[[Path], dict[str, Any]], resume: bool = False) -> dict[str, Any]:
        """Run ``produce(partial_dir) -> info`` and install the result; return its record.

        With ``resume``, a ``.partial`` folder left by an interrupted build (same key, so
        same inputs) is kept for ``produce`` to continue from; otherwise it is discarded.
        """
        partial = self.path.with_name(self.path.name + ".partial")
        if partial.exists() and not resume:
            shutil.rmtree(partial)
        partial.mkdir(parents=True, exist_ok=True)
        started = time.time()
        info = produce(partial)
        record = {
            "key": self.key,
            "inputs": self.payload,
            "info": info,
            "seconds": round(time.time() - started, 2),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "fingerprint": self._fingerprint(partial),
        }
        write_json(partial / DONE, record)
        if self.path.exists():  # an incomplete or modified earlier attempt with this key
            shutil.rmtree(self.path)
        os.replace(partial, self.path)
        return record

    def get(
        self, produce: Callable[[Path], dict[str, Any]], resume: bool = False
    ) -> tuple[dict[str, Any], bool]:
        """``(record, was_cached)``."""
        record = self.cached()
        if record is not None:
            return record, True
        return self.build(produce, resume), False


def files_fingerprint(*names: str) -> Callable[[Path], str]:
    """Fingerprint = sha256 of the named files in the folder."""

    def fingerprint(folder: Path) -> str:
        return stable_key({name: file_sha256(folder / name) for name in names}, length=32)

    return fingerprint


def model_folder_fingerprint(folder: Path) -> str:
    """Fingerprint of a model folder's weights (mergekit-bmm's sampled content hash)."""
    from mergekit_bmm.io.fingerprint import model_fingerprint

    return model_fingerprint(folder)


class ScoreCache:
    """Accuracies keyed by (model identity, task data, head, split, length), one JSON each."""

    def __init__(self, cache_dir: Path) -> None:
        self.root = Path(cache_dir) / "scores"

    def _path(self, key: dict[str, Any]) -> Path:
        return self.root / f"{stable_key(key, 24)}.json"

    def get(self, key: dict[str, Any]) -> dict[str, Any] | None:
        key = json.loads(json.dumps(key, default=str))
        path = self._path(key)
        if not path.is_file():
            return None
        try:
            record = read_json(path)
        except (OSError, ValueError):
            return None
        return record if record.get("key") == key else None

    def put(self, key: dict[str, Any], value: dict[str, Any]) -> None:
        key = json.loads(json.dumps(key, default=str))
        write_json(self._path(key), {"key": key, **value})
