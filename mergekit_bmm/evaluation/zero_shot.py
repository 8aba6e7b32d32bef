"""Zero-shot classification heads: each class's description, embedded by the pretrained model.

A ``type: classification`` evaluator reads a fixed linear head per task. Without labelled
data to fit one, embed one short description per class with the *pretrained* encoder
(pooled, unit length) and score ``scale · cos(z, e_c)``: the head learns nothing from the
task, like CLIP's class-name heads in the paper's vision track, and the merged models are
scored by how well they serve it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from mergekit_bmm.errors import ConfigError
from mergekit_bmm.evaluation.classification import pooled_features, save_head

DEFAULT_SCALE = 20.0  # cosine logits times this: a softmax as sharp as a trained head's


def class_descriptions(labels: Sequence[str], descriptions: Mapping[str, str] | None = None) -> list[str]:
    """One text per class: its description, or the class name itself (``_`` as spaces)."""
    descriptions = dict(descriptions or {})
    unknown = sorted(set(descriptions) - set(labels))
    if unknown:
        raise ConfigError(
            f"descriptions name classes the task does not have: {unknown[:3]}; classes: {list(labels)}"
        )
    return [descriptions.get(label, label.replace("_", " ")) for label in labels]


def zero_shot_weight(
    model,
    tokenizer,
    texts: Sequence[str],
    pooling: str = "mean",
    max_length: int = 64,
    scale: float = DEFAULT_SCALE,
) -> torch.Tensor:
    """``scale ·`` the unit-length pooled embeddings of ``texts``, one row per class."""
    embedded = pooled_features(model, tokenizer, list(texts), max_length, max(1, len(texts)), pooling)
    return scale * torch.nn.functional.normalize(embedded.double(), dim=-1)


def build_zero_shot_head(
    model_dir: str | Path,
    path: str | Path,
    labels: Sequence[str],
    descriptions: Mapping[str, str] | None = None,
    pooling: str = "mean",
    scale: float = DEFAULT_SCALE,
    max_length: int = 64,
    device: str = "cpu",
) -> Path:
    """Write a head file for ``labels`` from the pretrained model in ``model_dir`` (``AutoModel``)."""
    from transformers import AutoModel, AutoTokenizer

    texts = class_descriptions(labels, descriptions)
    model = AutoModel.from_pretrained(model_dir).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    weight = zero_shot_weight(model, tokenizer, texts, pooling, max_length, scale)
    return save_head(path, weight, torch.zeros(len(texts)), list(labels), pooling, "l2")
