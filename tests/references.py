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


def balance(task_grams: Sequence[torch.Tensor], mode: str) -> list[float]:
    """Task weights ``mean(n)/n_t`` with ``n_t`` the trace or Frobenius norm of each task's Gram;
    ``adaptive``: trace weights when ``Var(log tr)/mean(log tr)² > 0.3`` (unbiased), else ones."""
    traces = torch.tensor([float(g.trace()) for g in task_grams], dtype=torch.float64)
    if mode == "none":
        return [1.0] * len(task_grams)
    if mode == "adaptive":
        logs = torch.log(traces + 1e-12)
        if len(task_grams) < 2 or float(logs.var() / (logs.mean() ** 2 + 1e-12)) <= 0.3:
            return [1.0] * len(task_grams)
        mode = "trace"
    sizes = (
        traces if mode == "trace" else torch.tensor([float(torch.linalg.matrix_norm(g)) for g in task_grams])
    )
    return [float(sizes.mean() / size) for size in sizes]


def normal_equations(
    vectors: Sequence[torch.Tensor],
    gram_mode: str = "data_free",
    task_grams: Sequence[torch.Tensor] | None = None,
    epsilon: float = 0.5,
    task_balance: str = "none",
    free_grams: Sequence[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G, C)``: data_free ``Σ w_t U_tᵀU_t, Σ w_t U_t U_tᵀU_t``; activations ``Σ w_t G_t, Σ w_t U_t G_t``;
    mix: each divided by ``tr(G)/d_in``, then ``ε·few + (1-ε)·df`` (``w_t``: :func:`balance`).
    ``free_grams``: each task's data-free Gram pooled over the weights that read the input."""
    free_grams = free_grams if free_grams is not None else [u.T @ u for u in vectors]
    w = balance(free_grams, task_balance)
    free = (
        sum(a * g for a, g in zip(w, free_grams)),
        sum(a * u @ g for a, u, g in zip(w, vectors, free_grams)),
    )
    if gram_mode == "data_free":
        return free
    w = balance(task_grams, task_balance)
    few = sum(a * g for a, g in zip(w, task_grams)), sum(a * u @ g for a, u, g in zip(w, vectors, task_grams))
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


def logical_rows(name: str, config, rows: int) -> list[torch.Tensor]:
    """The output rows of each logical weight a fused weight stores (one part when not fused), as
    each architecture's attention or MLP code cuts its output."""
    index = torch.arange(rows)
    heads, hidden = config.num_attention_heads, config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    if "gate_up_proj" in name:
        return list(index.chunk(2))
    if "qkv_proj" in name:
        kv = config.num_key_value_heads * head_dim
        return list(index.split([heads * head_dim, kv, kv]))
    if "c_attn" in name:  # GPT-2: q, k, v side by side; GPT-BigCode (multi-query): one k and v head
        kv = (rows - hidden) // 2
        return list(index.split([hidden, kv, kv]))
    if "query_key_value" in name:  # Falcon's new decoder: per kv group, its q heads, then k, then v
        groups = index.view(config.num_kv_heads, -1, head_dim)
        return [groups[:, :-2].reshape(-1), groups[:, -2].reshape(-1), groups[:, -1].reshape(-1)]
    return [index]


def shared_input_grams(
    base: dict[str, torch.Tensor], experts: Sequence[dict[str, torch.Tensor]], model_type: str
) -> dict[str, list[torch.Tensor]]:
    """``gram_sharing: input``: per weight of an input group (q/k/v, gate/up; not an expert stack),
    each task's ``Σ U_t^sᵀU_t^s`` over the weights of its layer and group, oriented (out, in)."""
    by_input: dict[tuple[int, str], list[str]] = {}
    for name, tensor in base.items():
        info = classify(name, model_type) if tensor.ndim == 2 else None
        if info is not None and not info.experts and info.group.value in ("attn_in", "mlp_in"):
            by_input.setdefault((info.layer, info.group.value), []).append(name)
    pooled = {}
    for names in by_input.values():
        grams = []
        for expert in experts:
            gram = 0
            for name in names:
                vector = expert[name].double() - base[name].double()
                vector = vector.T if classify(name, model_type).stored_in_out else vector
                gram = gram + vector.T @ vector
            grams.append(gram)
        pooled |= dict.fromkeys(names, grams)
    return pooled


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
    task_balance: str = "none",
    gram_sharing: str = "input",
) -> dict[str, torch.Tensor]:
    """Every output tensor of a Task-Arithmetic-anchored bmm merge of ``family``, in float64.

    ``lam`` and ``scale`` are numbers or functions of the tensor name; ``grams`` maps each
    expert's path to its activation Grams by weight name (``gram_mode`` activations/mix);
    ``gram_sharing`` as bmm's (the data-free Gram per input, or per logical weight).
    """
    experts = list(experts or family.experts)
    base = load_weights(family.base)
    expert_weights = [load_weights(path) for path in experts]
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(family.base)
    shared = shared_input_grams(base, expert_weights, model_type) if gram_sharing == "input" else {}
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
        prior = flip(anchor)
        merged = torch.empty_like(prior)
        # gram_sharing: weight: each logical weight of a fused one its own data-free Gram; input: one
        # Gram for the weights that read the input (a fused weight's parts pool their rows)
        by_part = gram_mode != "activations" and gram_sharing == "weight"
        parts = logical_rows(name, config, prior.shape[0]) if by_part else [slice(None)]
        for rows in parts:
            part = [v[rows] for v in vectors]
            free = shared.get(name)
            gram, cross = normal_equations(part, gram_mode, task_grams, epsilon, task_balance, free)
            merged[rows] = ridge_solve(gram, cross, prior[rows], _value(lam, name))
        expected[name] = w_pre + _value(scale, name) * flip(merged)
    return expected
