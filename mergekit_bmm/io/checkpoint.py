"""Reading local safetensors checkpoints, whole or one tensor at a time."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch


def safetensors_files(model_dir: str | Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    return files


def iter_tensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time: memory stays at one tensor."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def load_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a (small) checkpoint."""
    return dict(iter_tensors(model_dir))
