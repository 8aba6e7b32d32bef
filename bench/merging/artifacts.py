"""What the stages hand each other: the artifacts built so far, the encoder loaded once, progress lines."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from bench.merging.encoder import load_encoder
from bench.merging.scoring import ScoredTask


def say(message: str) -> None:
    tqdm.write(message)


@dataclass
class Artifacts:
    """What the stages produced, by task name."""

    encoder: Path | None = None
    encoder_fingerprint: str = ""
    tasks: dict[str, ScoredTask] = field(default_factory=dict)
    experts: dict[str, Path] = field(default_factory=dict)
    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    anchors: dict[str, Path] = field(default_factory=dict)
    stats: Path | None = None


class EncoderHandle:
    """Loads the pretrained encoder at most once, and only when a stage needs it."""

    def __init__(self, folder: Path, threads: int) -> None:
        self.folder, self.threads = folder, threads
        self._loaded = None

    def __call__(self):
        if self._loaded is None:
            self._loaded = load_encoder(self.folder, self.threads)
        return self._loaded
