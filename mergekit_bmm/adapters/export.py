"""A merge of LoRA experts written as one PEFT LoRA adapter (``mergekit-bmm-lora``).

Every expert of the recipe is ``BASE+ADAPTER`` on the recipe's base, so each merged weight's update
``ΔW = W − W_pre`` lies in the span of the adapters' ``A`` factors for that module whenever the anchor
does (Task Arithmetic of the adapters, the base): with ``Q`` an orthonormal basis of the stacked
``A`` (``k = Σ r_t`` columns), ``ΔW = (ΔW Q) Qᵀ`` exactly, an adapter of rank ``k`` with
``lora_B = ΔW Q`` and ``lora_A = Qᵀ`` (scale 1). A data-assisted merge's update lies in the span of the
``B`` factors instead (``ΔW = P (Pᵀ ΔW)``, ``P`` their orthonormal basis): exact at rank ``k`` too.
When the anchor reaches outside that span, or
``rank`` asks for fewer, the adapter is the best fit of that rank (a truncated SVD of ``ΔW``) and its
relative error is reported per module. The merge itself runs in memory through mergekit (any
method: ``bmm`` or one of its anchors); nothing but the adapter is written.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mergekit_bmm.errors import ConfigError
from mergekit_bmm.io.lora_adapters import CONFIG_FILE, WEIGHTS_FILE, Adapter, adapter_for
from mergekit_bmm.io.model_folder import local_model_dir

EXACT = 1e-6  # ΔW outside the adapters' span below this share counts as rounding
UNCHANGED = 1e-6  # a tensor outside the adapters' modules that moved more than this is refused


@dataclass
class ModuleExport:
    name: str
    rank: int
    error: float  # ‖ΔW − B A‖ / ‖ΔW‖ of the written factors
    exact: bool  # ΔW lay in the adapters' span (rank ≤ k, no truncation asked)


@dataclass
class ExportReport:
    out_dir: Path
    modules: list[ModuleExport] = field(default_factory=list)

    @property
    def worst(self) -> float:
        return max((m.error for m in self.modules), default=0.0)


def recipe_adapters(config: Any) -> tuple[str, list[Adapter]]:
    """The recipe's base and its experts' adapters; one line for anything that is not LoRA on it."""
    base = config.base_model
    if base is None:
        raise ConfigError("mergekit-bmm-lora needs a recipe with base_model: the base the adapters are for")
    adapters = []
    for reference in config.referenced_models():
        if reference == base:
            continue
        if reference.lora is None or str(reference.model) != str(base.model):
            raise ConfigError(
                f"mergekit-bmm-lora merges LoRA experts of the base {base}: {reference} is not "
                f"`{base}+ADAPTER`; write dense merges with mergekit-yaml"
            )
        adapter = adapter_for(local_model_dir(str(reference.lora)))
        if adapter is None:
            raise ConfigError(
                f"{reference.lora} is not a plain LoRA adapter (DoRA, fan_in_fan_out, biases, "
                "target_parameters, activated LoRA or extra trained modules); write the merge as a full "
                "model with mergekit-yaml"
            )
        adapters.append(adapter)
    if not adapters:
        raise ConfigError("the recipe names no LoRA expert (`model: BASE+ADAPTER`)")
    return str(base), adapters


def span_basis(adapters: Sequence[Adapter], weight_name: str) -> torch.Tensor | None:
    """An orthonormal basis (``d_in × k``) of the adapters' ``A`` rows for this weight."""
    rights = [update[1] for a in adapters if (update := a.update(weight_name)) is not None]
    if not rights:
        return None
    q, _ = torch.linalg.qr(torch.cat(rights, dim=0).T)
    return q


def output_basis(adapters: Sequence[Adapter], weight_name: str) -> torch.Tensor | None:
    """An orthonormal basis (``d_out × k``) of the adapters' ``B`` columns: a data-assisted merge's
    update ``B·[(Z + λ'c⊙A)(G + λ'I)⁻¹]`` lies there (its rows do not lie in the ``A`` span)."""
    lefts = [update[0] for a in adapters if (update := a.update(weight_name)) is not None]
    if not lefts:
        return None
    q, _ = torch.linalg.qr(torch.cat(lefts, dim=1).to(torch.float64))
    return q


def factors_of(
    delta: torch.Tensor, basis: torch.Tensor, rank: int | None, outputs: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, float, bool]:
    """``(B, A, error, exact)`` with ``B A ≈ ΔW`` (float64) and ``error = ‖ΔW − B A‖ / ‖ΔW‖``: exact
    through the adapters' input span (``basis``) or output span (``outputs``) when one holds ``ΔW`` and
    no smaller ``rank`` is asked, else the truncated SVD of ``ΔW`` (the best fit of that rank, its error
    from the dropped singular values). One residual product per span tried."""
    size = max(float(delta.norm()), 1e-300)
    left = delta @ basis
    outside = float((delta - left @ basis.T).norm()) / size
    k = basis.shape[1]
    if outside <= EXACT and (rank is None or rank >= k):
        return left, basis.T.contiguous(), outside, True
    if outputs is not None and (rank is None or rank >= outputs.shape[1]):
        right = outputs.T @ delta
        outside = float((delta - outputs @ right).norm()) / size
        if outside <= EXACT:
            return outputs.contiguous(), right.contiguous(), outside, True
    target = min(rank or k, min(delta.shape))
    u, s, vh = torch.linalg.svd(delta, full_matrices=False)
    error = float(s[target:].norm()) / size
    return u[:, :target] * s[:target], vh[:target].contiguous(), error, False


def export_adapter(
    recipe_text: str,
    out_dir: str | Path,
    options: Any,
    rank: int | None = None,
    source: str = "the recipe",
    progress: bool = True,
) -> ExportReport:
    """Merge ``recipe_text`` in memory and write it to ``out_dir`` as one PEFT LoRA adapter."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from mergekit_bmm.plugin.run import merge_recipe_in_memory
    from mergekit_bmm.recipes.parse import parse_recipe

    if rank is not None and rank < 1:
        raise ConfigError(f"--rank must be at least 1; got {rank}")
    config = parse_recipe(recipe_text, source).config
    base, adapters = recipe_adapters(config)
    modules = sorted({module for adapter in adapters for module in adapter.factors})
    base_dir = local_model_dir(base)
    files = sorted(base_dir.glob("*.safetensors"))
    where = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            where.update(dict.fromkeys(handle.keys(), path))
    report = ExportReport(Path(out_dir))
    tensors: dict[str, torch.Tensor] = {}
    moved: list[str] = []
    from tqdm.auto import tqdm

    bar = tqdm(total=len(modules), desc="Merging into LoRA factors", unit="module", disable=not progress)

    def on_tensor(name: str, tensor: torch.Tensor, _dtype: str | None) -> None:
        if name not in where:
            return
        with safe_open(str(where[name]), framework="pt") as handle:
            pre = handle.get_tensor(name).to(torch.float64)
        delta = tensor.detach().to("cpu", torch.float64) - pre
        module = name.removesuffix(".weight")
        if module not in modules or delta.ndim != 2:
            if float(delta.norm()) > UNCHANGED * max(float(pre.norm()), 1e-30):
                moved.append(name)
            return
        bases = (span_basis(adapters, name), rank, output_basis(adapters, name))
        left, right, error, exact = factors_of(delta, *bases)
        key = f"base_model.model.{module}"
        tensors[f"{key}.lora_A.weight"] = right.to(torch.float32).contiguous()
        tensors[f"{key}.lora_B.weight"] = left.to(torch.float32).contiguous()
        report.modules.append(ModuleExport(name, right.shape[0], error, exact))
        bar.update()

    with bar:
        merge_recipe_in_memory(recipe_text, options, on_tensor, source=source)
    if moved:
        raise ConfigError(
            f"the merge changed {len(moved)} tensor(s) no adapter touches (e.g. {moved[0]}), which a LoRA "
            "adapter cannot hold; write the merge as a full model with mergekit-yaml"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(adapter_config(base, adapters, report), indent=2) + "\n")
    return report


def adapter_config(base: str, adapters: Sequence[Adapter], report: ExportReport) -> dict[str, Any]:
    """PEFT's ``adapter_config.json``: one rank per module (``rank_pattern``), α equal to it (scale 1)."""
    first = json.loads((adapters[0].folder / CONFIG_FILE).read_text(encoding="utf-8"))
    ranks = {m.name.removesuffix(".weight"): m.rank for m in report.modules}
    top = max(ranks.values(), default=1)
    return {
        "peft_type": "LORA",
        "task_type": first.get("task_type"),
        "base_model_name_or_path": base,
        "r": top,
        "lora_alpha": top,
        "rank_pattern": {module: r for module, r in ranks.items() if r != top},
        "alpha_pattern": {module: r for module, r in ranks.items() if r != top},
        "target_modules": sorted(ranks),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }
