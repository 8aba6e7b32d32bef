"""What every evaluator shares: the interface, the device, and loading a merged model.

An evaluator turns a merged model's folder into per-task scores (higher is better);
the search's score is their (weighted) mean, paper eq. 10. Raising or returning NaN
marks a trial failed; a :class:`~mergekit_bmm.errors.BMMError` (a misconfigured
evaluator) stops the search instead, since every later trial would fail the same way.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any, Protocol

import torch

from mergekit_bmm.errors import ConfigError


class Evaluator(Protocol):
    """Scores a merged model folder; ``weights`` weigh the tasks in the mean."""

    weights: dict[str, float]

    def evaluate(self, model_dir: Path) -> dict[str, float]: ...


def resolve_device(device: str | None) -> str:
    """``auto`` → ``cuda`` when available, else ``cpu``; anything else as given."""
    if device in (None, "", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(model_dir: Path, class_name: str, device: str, dtype: str = "float32") -> Any:
    """A transformers model from a local folder, in eval mode, on ``device``."""
    import transformers

    model_class = getattr(transformers, class_name, None)
    if model_class is None or not hasattr(model_class, "from_pretrained"):
        raise ConfigError(
            f"evaluator load_model: transformers has no model class {class_name!r}; "
            "use e.g. AutoModel, AutoModelForCausalLM or AutoModelForSequenceClassification"
        )
    model = model_class.from_pretrained(str(model_dir), dtype=_DTYPES[dtype])
    return model.to(device).eval()


def load_tokenizer(model_dir: Path) -> Any:
    """The tokenizer saved with the merged model (mergekit copies the base model's)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def release_memory() -> None:
    """Free a dropped model's memory now (call after deleting the references).

    A full collection costs up to a second in a process that imported torch,
    transformers and mergekit; it is worth it only after a model was loaded.
    """
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
