"""Why BMM moves away from its anchor, or keeps it: the evidence behind a small Δ.

A BMM search over a strong anchor can end near the anchor itself (large λ, s near 1), and then
its test score cannot differ from the anchor's. Two measurements say whether that happened and
why:

- **moved**: per module group, ``‖W_bmm − W_anchor‖ / ‖W_anchor − W_pre‖`` over the group's
  body weights (the distance BMM went from its anchor, against the anchor's own task vector);
  0 means the search kept the anchor.
- **task norms**: per expert, ``‖U_t‖_F`` and its share of ``Σ_t tr(U_tᵀU_t)`` — the weight
  the data-free Gram gives its task (``task_balance:`` evens it out).
- **task cosines**: per pair of experts, ``cos(U_s, U_t)`` over the solved weights — how far the
  experts pull the model apart (interference), the figure a task set is chosen by.
- **alignment**: per expert, ``cos_F(G_t, U_tᵀU_t)`` between its activation Gram and the Gram
  of its task vector (Theorem 1, ``mergekit-bmm-align``): data-free BMM stands on it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from bench.merging.cache import read_json, stable_key, write_json
from mergekit_bmm.core.module_map import classify
from mergekit_bmm.io.checkpoint import iter_tensors, load_state_dict
from mergekit_bmm.io.fingerprint import model_fingerprint
from mergekit_bmm.io.model_folder import model_type_of


def moved_from_anchor(merged: Path, anchor: Path, base: Path) -> dict[str, float]:
    """Per module group, how far ``merged`` is from ``anchor``, relative to the anchor's task vector."""
    model_type = model_type_of(base)
    pre = load_state_dict(base)
    theirs = load_state_dict(anchor)
    moved: dict[str, float] = {}
    own: dict[str, float] = {}
    for name, weight in iter_tensors(merged):
        info = classify(name, model_type)
        if info is None or weight.ndim != 2 or name not in pre or name not in theirs:
            continue
        w_anchor = theirs[name].double()
        group = info.group.value
        moved[group] = moved.get(group, 0.0) + float((weight.double() - w_anchor).square().sum())
        own[group] = own.get(group, 0.0) + float((w_anchor - pre[name].double()).square().sum())
    return {group: round(math.sqrt(moved[group] / own[group]), 4) for group in moved if own.get(group)}


def cached_moved_from_anchor(merged: Path, anchor: Path, base: Path, cache_dir: Path) -> dict[str, float]:
    """:func:`moved_from_anchor`, kept under ``cache_dir/moved`` by the recipe that made ``merged``
    (its ``mergekit_config.yml`` names every input and value): three full state dicts are read
    once per merge, not once per report."""
    recipe = merged / "mergekit_config.yml"
    if not recipe.is_file():
        return moved_from_anchor(merged, anchor, base)
    key = stable_key({"recipe": recipe.read_text(encoding="utf-8"), "anchor": str(anchor), "base": str(base)})
    path = cache_dir / "moved" / f"{key}.json"
    if path.is_file():
        return read_json(path)
    moved = moved_from_anchor(merged, anchor, base)
    write_json(path, moved)
    return moved


def expert_alignment(stats: Path, base: Path, experts: list[Path], cache_dir: Path) -> dict[str, Any]:
    """Per expert (by its statistics' task name), mean ``cos_F`` over modules and per group; cached."""
    from mergekit_bmm.stats.alignment import alignment_rows, summarize

    key = stable_key(
        {
            "stats": str(stats),
            "base": model_fingerprint(base),
            "experts": [model_fingerprint(e) for e in experts],
        }
    )
    path = cache_dir / "alignment" / f"{key}.json"
    if path.is_file():
        return read_json(path)
    rows = alignment_rows(stats, str(base), [str(expert) for expert in experts], progress=False)
    out = {
        summary.task: {
            "mean": round(summary.mean, 4),
            "min": round(summary.min, 4),
            "groups": {group: round(value, 4) for group, value in summary.by_group.items()},
        }
        for summary in summarize(rows)
    }
    write_json(path, out)
    return out


def _per_checkpoints(folder: Path, base: Path, experts: dict[str, Path]) -> Path:
    """Where a figure of these checkpoints is kept: keyed by their fingerprints, so a retrained
    expert is measured again."""
    key = stable_key(
        {"base": model_fingerprint(base), "experts": {t: model_fingerprint(e) for t, e in experts.items()}}
    )
    return folder / f"{key}.json"


def task_update_norms(base: Path, experts: dict[str, Path], cache_dir: Path) -> dict[str, Any]:
    """Per task, ``‖U_t‖_F`` over the solved weights and per group, and its share of the data-free
    Gram's trace; cached by the checkpoints' fingerprints."""
    from bench.task_vector_norms import squared_norms

    path = _per_checkpoints(cache_dir / "task_norms", base, experts)
    if path.is_file():
        return read_json(path)
    pre, model_type = load_state_dict(base), model_type_of(base)
    squares = {task: squared_norms(pre, expert, model_type) for task, expert in experts.items()}
    total = sum(row["all"] for row in squares.values()) or 1.0
    out = {
        task: {
            "norm": round(math.sqrt(row["all"]), 4),
            "trace_share": round(row["all"] / total, 4),
            "groups": {group: round(math.sqrt(value), 4) for group, value in row.items() if group != "all"},
        }
        for task, row in squares.items()
    }
    write_json(path, out)
    return out


def task_vector_cosines(base: Path, experts: dict[str, Path], cache_dir: Path) -> dict[str, Any]:
    """How far the experts pull the model apart: the cosine between each pair of task vectors
    ``U_s``, ``U_t`` over every solved weight (0: orthogonal updates, little interference for Task
    Arithmetic to average away; negative: updates that undo each other), their mean, the most
    aligned and the most opposed pair; cached by the checkpoints' fingerprints."""
    path = _per_checkpoints(cache_dir / "task_cosines", base, experts)
    if path.is_file():
        return read_json(path)
    pre, model_type = load_state_dict(base), model_type_of(base)
    names = [
        name for name, tensor in pre.items() if tensor.ndim == 2 and classify(name, model_type) is not None
    ]
    tasks = list(experts)
    inner = torch.zeros(len(tasks), len(tasks), dtype=torch.float64)
    states = {task: load_state_dict(folder) for task, folder in experts.items()}
    for name in names:
        stacked = torch.stack([(states[t][name].double() - pre[name].double()).flatten() for t in tasks])
        inner += stacked @ stacked.T
    norms = inner.diagonal().sqrt().clamp_min(1e-300)
    cosine = inner / norms[:, None] / norms[None, :]
    pairs = {
        f"{tasks[i]} / {tasks[j]}": round(float(cosine[i, j]), 4)
        for i in range(len(tasks))
        for j in range(i + 1, len(tasks))
    }
    out: dict[str, Any] = {"mean": round(sum(pairs.values()) / len(pairs), 4) if pairs else None}
    for label, pick in (("most_aligned", max), ("most_opposed", min)):
        if pairs:
            pair, value = pick(pairs.items(), key=lambda item: item[1])
            out[label] = {"pair": pair, "cosine": value}
    out["pairs"] = pairs
    write_json(path, out)
    return out
