"""The alignment check of Theorem 1: does the data-free Gram stand in for the activation Gram?

Data-free BMM replaces each task's activation Gram ``G_t = E[x xᵀ]`` by ``U_tᵀU_t``
(paper Sec. 4.3). Theorem 1 says the two are positively aligned,
``cos_F(E[x xᵀ], U_tᵀU_t) > α_t > 0``, with the Frobenius cosine
``cos_F(A, B) = tr(AᵀB) / (‖A‖_F ‖B‖_F)``. Given activation statistics (``mergekit-bmm-stats``)
and a recipe's experts, this module measures it per task and per module, reading one
weight at a time, and summarises, plots and saves the values (paper Fig. 1, right).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from mergekit_bmm.core.module_map import GROUP_NAMES, classify
from mergekit_bmm.errors import ConfigError, StatisticsError, TensorInputError


def frobenius_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """``tr(AᵀB)/(‖A‖_F‖B‖_F)`` in float64; NaN when either matrix is zero."""
    if a.shape != b.shape:
        raise TensorInputError(
            f"cos_F needs matrices of one shape; got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    a, b = a.double(), b.double()
    norms = float(a.norm()) * float(b.norm())
    return float((a * b).sum()) / norms if norms > 0 else math.nan


def gram_alignment(activation_gram: torch.Tensor, task_vector: torch.Tensor) -> float:
    """``cos_F(A, UᵀU)`` without forming the ``in × in`` matrix ``UᵀU`` when ``out < in``.

    ``tr(AᵀUᵀU) = Σ U ∘ (U Aᵀ)`` and ``‖UᵀU‖_F = ‖UUᵀ‖_F``.
    """
    a = activation_gram.double()
    u = task_vector.double()
    d_in = u.shape[1]
    if a.shape != (d_in, d_in):
        raise StatisticsError(
            f"activation Gram of shape {tuple(a.shape)} does not fit a weight with {d_in} inputs: "
            "the statistics were collected for another model"
        )
    inner = float((u * (u @ a.T)).sum())
    small = u @ u.T if u.shape[0] < d_in else u.T @ u
    norms = float(a.norm()) * float(small.norm())
    return inner / norms if norms > 0 else math.nan


@dataclass(frozen=True)
class ModuleAlignment:
    task: str
    model: str
    module: str
    layer: int
    group: str
    cosine: float


@dataclass(frozen=True)
class TaskSummary:
    task: str
    model: str
    modules: int
    mean: float
    std: float
    min: float
    max: float
    by_group: dict[str, float] = field(default_factory=dict)
    undefined: int = 0  # modules where the expert did not change the weight (U_t = 0)


def recipe_inputs(recipe: str | Path) -> tuple[str, list[str]]:
    """(base model, experts) of a mergekit recipe; inputs marked ``anchor: true`` are not tasks."""
    from mergekit_bmm.recipes.parse import load_recipe

    path = Path(recipe)
    config = load_recipe(path).config
    if config.base_model is None:
        raise ConfigError(f"{path} has no `base_model:`; task vectors need one")
    base = config.base_model.model.path
    anchors = set()
    sources = list(config.models or [])
    for piece in config.slices or []:
        sources.extend(piece.sources)
    for source in sources:
        if (source.parameters or {}).get("anchor") is True:
            anchors.add(source.model.model.path)
    experts = []
    ordered = [source.model for source in sources] or list(config.referenced_models())
    for model in ordered:
        path_of = model.model.path
        if path_of != base and path_of not in anchors and path_of not in experts:
            experts.append(path_of)
    if not experts:
        raise ConfigError(f"{path} names no expert besides the base model")
    return base, experts


def _loader(model_dir: str):
    from mergekit.io.lazy_tensor_loader import LazyTensorLoader, ShardedTensorIndex

    from mergekit_bmm.io.lora_experts import dense_model

    try:  # a Hub id from the cache, BASE+ADAPTER from its merged copy
        return LazyTensorLoader(
            ShardedTensorIndex.from_disk(str(dense_model(model_dir))), lazy_unpickle=False
        )
    except (RuntimeError, FileNotFoundError):
        raise ConfigError(f"{model_dir} is not a local model folder with weights") from None


def alignment_rows(
    stats_dir: str | Path, base: str, experts: Sequence[str], progress: bool = True, device: str = "cpu"
) -> list[ModuleAlignment]:
    """``cos_F(G_t, U_tᵀU_t)`` for every expert and every module the statistics cover (the Gram
    products on ``device``, in float64)."""
    from mergekit_bmm.io.model_folder import model_type_of
    from mergekit_bmm.stats.store import activation_grams_for, load_manifest

    manifest = load_manifest(stats_dir)
    tasks = [manifest.task_for_model(expert, Path(stats_dir)) for expert in experts]
    model_type = model_type_of(base)
    base_loader = _loader(base)
    expert_loaders = [_loader(expert) for expert in experts]
    modules = []
    for name in sorted(manifest.modules):
        info = classify(name, model_type)
        if info is None:
            continue
        if name not in base_loader.index.tensor_paths:
            raise StatisticsError(
                f"statistics in {stats_dir} cover {name}, which base model {base} lacks: they were "
                "collected for another model"
            )
        modules.append((name, info))
    if not modules:
        raise StatisticsError(f"statistics in {stats_dir} cover no weight that bmm solves in {base}")

    rows = []
    for name, info in tqdm(modules, desc="Alignment per module", disable=not progress):
        w_pre = base_loader.get_tensor(name).to(device=device, dtype=torch.float64)
        if w_pre.ndim != 2:
            continue
        d_in = w_pre.shape[0] if info.stored_in_out else w_pre.shape[1]
        grams = activation_grams_for(stats_dir, name, experts, d_in=d_in)
        for task, expert, loader, gram in zip(tasks, experts, expert_loaders, grams):
            w_t = loader.get_tensor(name).to(device=device, dtype=torch.float64)
            if w_t.shape != w_pre.shape:
                raise TensorInputError(
                    f"{name} has shape {tuple(w_t.shape)} in {expert}, {tuple(w_pre.shape)} in the base"
                )
            task_vector = w_t - w_pre
            if info.stored_in_out:
                task_vector = task_vector.T
            cosine = gram_alignment(gram.to(device), task_vector)
            rows.append(ModuleAlignment(task.name, expert, name, info.layer, info.group.value, cosine))
    return rows


def _stats(values: list[float]) -> tuple[float, float, float, float]:
    tensor = torch.tensor(values, dtype=torch.float64)
    std = float(tensor.std(unbiased=False)) if len(values) > 1 else 0.0
    return float(tensor.mean()), std, float(tensor.min()), float(tensor.max())


def summarize(rows: Sequence[ModuleAlignment]) -> list[TaskSummary]:
    """Per task: mean, spread and extremes over modules, and the mean per module group."""
    summaries = []
    for task in dict.fromkeys(row.task for row in rows):
        mine = [row for row in rows if row.task == task]
        defined = [row for row in mine if not math.isnan(row.cosine)]
        if not defined:
            summaries.append(TaskSummary(task, mine[0].model, 0, *([math.nan] * 4), undefined=len(mine)))
            continue
        by_group = {}
        for group in GROUP_NAMES:
            values = [row.cosine for row in defined if row.group == group]
            if values:
                by_group[group] = sum(values) / len(values)
        summaries.append(
            TaskSummary(
                task,
                mine[0].model,
                len(defined),
                *_stats([row.cosine for row in defined]),
                by_group=by_group,
                undefined=len(mine) - len(defined),
            )
        )
    return summaries


def summary_table(summaries: Sequence[TaskSummary]) -> str:
    groups = [g for g in GROUP_NAMES if any(g in s.by_group for s in summaries)]
    header = f"{'task':<20} {'modules':>7} {'mean':>7} {'std':>7} {'min':>7} {'max':>7} " + " ".join(
        f"{g:>8}" for g in groups
    )
    lines = [header, "-" * len(header)]
    for s in summaries:
        cells = " ".join(f"{s.by_group.get(g, math.nan):>8.3f}" for g in groups)
        lines.append(
            f"{s.task:<20} {s.modules:>7} {s.mean:>7.3f} {s.std:>7.3f} {s.min:>7.3f} {s.max:>7.3f} {cells}"
        )
    means = [s.mean for s in summaries if not math.isnan(s.mean)]
    if means:
        lines.append(f"{'mean over tasks':<20} {'':>7} {sum(means) / len(means):>7.3f}")
    return "\n".join(lines)


def write_report(
    rows: Sequence[ModuleAlignment], summaries: Sequence[TaskSummary], out_dir: Path
) -> dict[str, Path]:
    """``alignment.csv`` (per module), ``alignment.json`` (summary + rows), ``alignment.png``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {kind: out_dir / f"alignment.{kind}" for kind in ("csv", "json", "png")}
    with open(paths["csv"], "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(ModuleAlignment.__dataclass_fields__))
        writer.writeheader()
        writer.writerows(asdict(row) for row in rows)
    payload: dict[str, Any] = {
        "definition": "cos_F(A, B) = tr(A^T B) / (|A|_F |B|_F), A = mean activation Gram of task t, "
        "B = U_t^T U_t (paper Theorem 1)",
        "tasks": [asdict(s) for s in summaries],
        "modules": [asdict(row) for row in rows],
    }
    paths["json"].write_text(json.dumps(payload, indent=2, allow_nan=True), encoding="utf-8")
    plot_alignment(summaries, paths["png"])
    return paths


def plot_alignment(summaries: Sequence[TaskSummary], path: Path) -> None:
    """Bars: each task's mean cos_F over modules (± std), group means as markers, overall mean dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s.task for s in summaries]
    means = [s.mean for s in summaries]
    stds = [s.std for s in summaries]
    figure, axis = plt.subplots(figsize=(max(4.0, 1.1 * len(names) + 1) + 2.2, 3.6))
    positions = range(len(names))
    axis.bar(
        positions, means, yerr=stds, capsize=4, color="#4C72B0", alpha=0.85, label="mean over modules ± std"
    )
    markers = {"attn_in": "o", "attn_out": "s", "mlp_in": "^", "mlp_out": "v"}
    for offset, (group, marker) in zip((-0.27, -0.09, 0.09, 0.27), markers.items()):
        xs = [i for i, s in enumerate(summaries) if group in s.by_group]
        if xs:
            axis.scatter(
                [x + offset for x in xs],
                [summaries[i].by_group[group] for i in xs],
                marker=marker,
                color="k",
                s=18,
                zorder=3,
                label=f"{group} mean",
            )
    defined = [m for m in means if not math.isnan(m)]
    if defined:
        overall = sum(defined) / len(defined)
        axis.axhline(
            overall, color="#C44E52", linestyle="--", linewidth=1, label=f"mean over tasks {overall:.2f}"
        )
    axis.axhline(0, color="grey", linewidth=0.8)
    axis.set_xticks(list(positions))
    axis.set_xticklabels(names, rotation=20, ha="right")
    axis.set_ylabel(r"$\cos_F(\mathbb{E}[xx^\top],\ U_t^\top U_t)$")
    axis.set_title("Activation Gram vs task-vector Gram (Theorem 1)")
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=130)
    plt.close(figure)
