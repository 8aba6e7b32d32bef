"""Per-task frozen heads built from the *pretrained* encoder: zero-shot or logistic.

A zero-shot head (the paper's protocol, like CLIP's class-name heads in its vision track)
embeds one short description per class with the pretrained encoder and scores
``scale · cos(z, e_c)``; it learns nothing from the task's examples, so the experts have
the whole task left to learn. A logistic head is a strong probe instead: it is fitted
on the task's ``head`` split, which is disjoint from the examples the
expert is later fine-tuned on: a head fitted to the fine-tuning examples themselves would
already classify most of them right and leave the expert little to learn.

Either way the head is the benchmark's "Pretrained" baseline, the head every expert is
fine-tuned under, frozen, and every merged encoder is scored with. A logistic head's
regularisation ``C`` is chosen on the validation split.
Features are standardised for the solver; the scaling is folded back into the head, so
the stored head applies to raw pooled features (contract A).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.merging.cache import Stage, files_fingerprint, stable_key
from bench.merging.config import HeadSpec
from bench.merging.tasks import HEAD_SPLIT, TaskData
from mergekit_bmm.evaluation.classification import load_head, pooled_features, save_head
from mergekit_bmm.evaluation.zero_shot import class_descriptions, zero_shot_weight

HEAD_FILE = "head.safetensors"
FEATURES_FILE = "features.safetensors"
UNSEEN_CLASS_BIAS = -30.0  # classes absent from the training split are never predicted


def head_fingerprint(folder: Path) -> str:
    """Hash of the head's tensors and metadata, not of the file's bytes.

    safetensors writes metadata in hash-map order, so two identical heads can differ as
    files; keys built on the head must not.
    """
    import hashlib

    from safetensors import safe_open

    with safe_open(str(folder / HEAD_FILE), framework="pt") as handle:
        tensors = {
            name: hashlib.sha256(handle.get_tensor(name).numpy().tobytes()).hexdigest()
            for name in sorted(handle.keys())
        }
        metadata = dict(sorted((handle.metadata() or {}).items()))
    return stable_key({"tensors": tensors, "metadata": metadata}, length=32)


def fit_logistic_head(
    train_x: np.ndarray,
    train_y: np.ndarray,
    valid_x: np.ndarray,
    valid_y: np.ndarray,
    num_classes: int,
    spec: HeadSpec,
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """``(weight [C, H], bias [C], info)`` of the validation-best logistic regression."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression

    mean = train_x.mean(axis=0)
    std = train_x.std(axis=0) + 1e-6
    standard_train = (train_x - mean) / std
    standard_valid = (valid_x - mean) / std
    best = None
    tried = {}
    for c in spec.c_grid:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            model = LogisticRegression(C=c, max_iter=spec.max_iter).fit(standard_train, train_y)
        score = float((model.predict(standard_valid) == valid_y).mean())
        tried[str(c)] = round(score, 4)
        if best is None or score > best[0]:
            best = (score, c, model)
    assert best is not None
    score, c, model = best
    coef, intercept = model.coef_, model.intercept_
    if coef.shape[0] == 1 and len(model.classes_) == 2:  # binary: logit of class 1 vs 0
        coef = np.vstack([np.zeros_like(coef), coef])
        intercept = np.array([0.0, intercept[0]])
    weight = np.zeros((num_classes, train_x.shape[1]))
    bias = np.full(num_classes, UNSEEN_CLASS_BIAS)
    weight[model.classes_] = coef / std
    bias[model.classes_] = intercept - (coef / std) @ mean
    info = {
        "C": c,
        "validation_accuracy_by_C": tried,
        "validation_accuracy": round(score, 4),
        "unseen_classes": int(num_classes - len(model.classes_)),
        "iterations": int(np.max(model.n_iter_)),
    }
    return weight, bias, info


def pretrained_features(
    task: TaskData,
    split: str,
    encoder_fingerprint: str,
    pooling: str,
    max_length: int,
    batch_size: int,
    cache_dir: Path,
    encoder_loader,
) -> tuple[np.ndarray, np.ndarray]:
    """Pooled pretrained features and labels of one split, cached: refitting a head (another
    C grid) costs no encoder passes."""
    from safetensors.torch import load_file, save_file

    payload = {
        "task_data": task.sha256,
        "split": split,
        "encoder": encoder_fingerprint,
        "pooling": pooling,
        "max_length": max_length,
    }
    stage = Stage(cache_dir, "features", f"{task.name}-{split}", payload, files_fingerprint(FEATURES_FILE))

    def produce(folder: Path) -> dict[str, Any]:
        model, tokenizer = encoder_loader()
        texts, labels = task.examples(split)
        pooled = pooled_features(
            model, tokenizer, texts, max_length, batch_size, pooling, progress=f"{task.name} {split}"
        )
        save_file({"features": pooled, "labels": torch.tensor(labels)}, str(folder / FEATURES_FILE))
        return {"examples": len(labels)}

    stage.get(produce)
    tensors = load_file(str(stage.path / FEATURES_FILE))
    return tensors["features"].numpy().astype(np.float64), tensors["labels"].numpy()


def build_head(
    task: TaskData,
    encoder_dir: Path,
    encoder_fingerprint: str,
    spec: HeadSpec,
    max_length: int,
    batch_size: int,
    cache_dir: Path,
    encoder_loader,
    descriptions: dict[str, str] | None = None,
) -> tuple[Path, dict[str, Any], bool]:
    """``(head_file, record, cached)`` for one task; ``encoder_loader()`` loads lazily."""
    payload = {
        "task_data": task.sha256,
        "encoder": encoder_fingerprint,
        "head": spec.model_dump(mode="json"),
        "max_length": max_length,
    }
    if spec.kind == "zero_shot":
        texts = class_descriptions(task.labels, descriptions or {})
        payload["descriptions"] = texts
    stage = Stage(cache_dir, "heads", task.name, payload, head_fingerprint)

    def features_of(split: str) -> tuple[np.ndarray, np.ndarray]:
        return pretrained_features(
            task, split, encoder_fingerprint, spec.pooling, max_length, batch_size, cache_dir, encoder_loader
        )

    def produce_zero_shot(folder: Path) -> dict[str, Any]:
        model, tokenizer = encoder_loader()
        weight = zero_shot_weight(model, tokenizer, texts, spec.pooling, max_length, spec.scale)
        path = save_head(folder / HEAD_FILE, weight, torch.zeros(len(texts)), task.labels, spec.pooling, "l2")
        features, labels = features_of("validation")
        predicted = load_head(path).logits(torch.from_numpy(features).float()).argmax(-1).numpy()
        return {
            "kind": "zero_shot",
            "scale": spec.scale,
            "descriptions": dict(zip(task.labels, texts)),
            "validation_accuracy": round(float((predicted == labels).mean()), 4),
        }

    def produce(folder: Path) -> dict[str, Any]:
        features, labels = {}, {}
        for split in (HEAD_SPLIT, "validation"):
            features[split], labels[split] = features_of(split)
        weight, bias, info = fit_logistic_head(
            features[HEAD_SPLIT],
            labels[HEAD_SPLIT],
            features["validation"],
            labels["validation"],
            len(task.labels),
            spec,
        )
        path = save_head(
            folder / HEAD_FILE, torch.from_numpy(weight), torch.from_numpy(bias), task.labels, spec.pooling
        )
        # The stored float32 head must reproduce the fitted classifier on validation.
        head = load_head(path)
        for split, key in (
            (HEAD_SPLIT, "head_split_accuracy"),
            ("validation", "stored_head_validation_accuracy"),
        ):
            predicted = head.logits(torch.from_numpy(features[split]).float()).argmax(-1).numpy()
            info[key] = round(float((predicted == labels[split]).mean()), 4)
        info["train_examples"] = int(len(labels[HEAD_SPLIT]))
        return {"kind": "logistic", **info}

    record, cached = stage.get(produce_zero_shot if spec.kind == "zero_shot" else produce)
    return stage.path / HEAD_FILE, record, cached
