"""Float64 references of whole bmm merges, straight from the paper's formulas (TA anchor)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from conftest import load_weights

from mergekit_bmm.core.module_map import classify

PerTensor = float | Callable[[str], float]


def _value(setting: PerTensor, name: str) -> float:
    return setting(name) if callable(setting) else float(setting)


def _normalised(gram: torch.Tensor, cross: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = gram.trace().item() / gram.shape[0]
    return gram / scale, cross / scale


def normal_equations(
    vectors: Sequence[torch.Tensor],
    gram_mode: str = "data_free",
    task_grams: Sequence[torch.Tensor] | None = None,
    epsilon: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G, C)``: data_free ``Σ U_tᵀU_t, Σ U_t U_tᵀU_t``; activations ``Σ G_t, Σ U_t G_t``; mix:
    each divided by ``tr(G)/d_in``, then ``ε·few + (1-ε)·df``."""
    free = sum(u.T @ u for u in vectors), sum(u @ (u.T @ u) for u in vectors)
    if gram_mode == "data_free":
        return free
    few = sum(task_grams), sum(u @ g for u, g in zip(vectors, task_grams))
    if gram_mode == "activations":
        return few
    (few_g, few_c), (free_g, free_c) = _normalised(*few), _normalised(*free)
    return epsilon * few_g + (1 - epsilon) * free_g, epsilon * few_c + (1 - epsilon) * free_c


def ridge_solve(gram: torch.Tensor, cross: torch.Tensor, anchor: torch.Tensor, lam: float) -> torch.Tensor:
    """``U = (C + λ'U0)(G + λ'I)⁻¹`` with the relative ridge ``λ' = λ·tr(G)/d_in``."""
    d_in = gram.shape[0]
    ridge = lam * gram.trace().item() / d_in
    system = gram + ridge * torch.eye(d_in, dtype=torch.float64)
    return torch.linalg.solve(system, (cross + ridge * anchor).T).T


def expected_bmm_merge(
    family,
    weights: Sequence[float],
    lam: PerTensor,
    scale: PerTensor = 1.0,
    model_type: str = "llama",
    gram_mode: str = "data_free",
    grams: dict[str, dict[str, torch.Tensor]] | None = None,
    epsilon: float = 0.5,
    experts: Sequence[Path] | None = None,
) -> dict[str, torch.Tensor]:
    """Every output tensor of a Task-Arithmetic-anchored bmm merge of ``family``, in float64.

    ``lam`` and ``scale`` are numbers or functions of the tensor name; ``grams`` maps each
    expert's path to its activation Grams by weight name (``gram_mode`` activations/mix).
    """
    experts = list(experts or family.experts)
    base = load_weights(family.base)
    expert_weights = [load_weights(path) for path in experts]
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
        task_grams = [grams[str(path)][name].double() for path in experts] if grams is not None else None
        gram, cross = normal_equations(vectors, gram_mode, task_grams, epsilon)
        merged = ridge_solve(gram, cross, flip(anchor), _value(lam, name))
        expected[name] = w_pre + _value(scale, name) * flip(merged)
    return expected
