"""Helpers shared by the statistics tests: calibration data and float64 references."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import load_weights
from safetensors.torch import load_file

from mergekit_bmm.module_map import classify
from mergekit_bmm.tiny_models import _CORPUS


def write_calibration(path: Path, lines: int = 24, offset: int = 0) -> Path:
    """JSONL of texts of varying length (1 to 3 corpus sentences each)."""
    with open(path, "w", encoding="utf-8") as handle:
        for index in range(lines):
            count = 1 + (index + offset) % 3
            text = " ".join(_CORPUS[(index + offset + k) % len(_CORPUS)] for k in range(count))
            handle.write(json.dumps({"text": text, "split": "train" if index % 4 else "validation"}) + "\n")
    return path


def stored_grams(stats_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """{model path: {weight name: Gram}} read straight from the files (not via the store)."""
    manifest = json.loads((Path(stats_dir) / "manifest.json").read_text())
    grams = {}
    for task in manifest["tasks"]:
        tensors = load_file(str(Path(stats_dir) / "grams" / task["file"]))
        grams[task["model"]] = {name: tensors[key] for name, key in manifest["modules"].items()}
    return grams


def _solve(gram, cross, anchor, lam):
    d_in = gram.shape[0]
    ridge = lam * gram.trace().item() / d_in
    system = gram + ridge * torch.eye(d_in, dtype=torch.float64)
    return torch.linalg.solve(system, (cross + ridge * anchor).T).T


def _normalised(gram, cross):
    scale = gram.trace().item() / gram.shape[0]
    return gram / scale, cross / scale


def expected_merge(
    family, weights, lam, gram_mode, stats_dir=None, epsilon=0.5, experts=None, model_type="llama"
) -> dict[str, torch.Tensor]:
    """Every output tensor of a TA-anchored bmm merge, in float64 from the formulas.

    activations: ``G = Σ G_t``, ``C = Σ U_t G_t``; data_free: ``G = Σ U_tᵀU_t``,
    ``C = Σ U_t U_tᵀU_t``; mix: each divided by ``tr(G)/d_in``, then ``ε·few + (1-ε)·df``.
    """
    experts = list(experts or family.experts)
    base = load_weights(family.base)
    expert_weights = [load_weights(path) for path in experts]
    grams = stored_grams(stats_dir) if stats_dir is not None else {}
    expected = {}
    for name, w_pre in base.items():
        w_pre = w_pre.double()
        vectors = [e[name].double() - w_pre for e in expert_weights]
        anchor = sum(w * v for w, v in zip(weights, vectors))
        info = classify(name, model_type) if w_pre.ndim == 2 else None
        if info is None:
            expected[name] = w_pre + anchor
            continue
        flip = (lambda m: m.T) if info.stored_in_out else (lambda m: m)
        vectors = [flip(v) for v in vectors]
        anchor = flip(anchor)
        free_gram = sum(u.T @ u for u in vectors)
        free_cross = sum(u @ (u.T @ u) for u in vectors)
        if gram_mode == "data_free":
            gram, cross = free_gram, free_cross
        else:
            task_grams = [grams[str(path)][name].double() for path in experts]
            gram = sum(task_grams)
            cross = sum(u @ g for u, g in zip(vectors, task_grams))
            if gram_mode == "mix":
                few_g, few_c = _normalised(gram, cross)
                free_g, free_c = _normalised(free_gram, free_cross)
                gram = epsilon * few_g + (1 - epsilon) * free_g
                cross = epsilon * few_c + (1 - epsilon) * free_c
        expected[name] = w_pre + flip(_solve(gram, cross, anchor, lam))
    return expected
