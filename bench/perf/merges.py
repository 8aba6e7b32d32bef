"""Merges and floors that several performance workloads share: the recipes of a generated family, one
merge in this process or in a fresh one (on any device), and the GEMM floors of the data-free closed form."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mergekit-bmm" / "bench"


def recipe(family: dict, method: str, anchor: str | None = None, **parameters) -> dict:
    experts = family["experts"]
    if method == "bmm":
        models = [{"model": str(p), "parameters": {"weight": 1.0 / len(experts)}} for p in experts]
        if anchor == "ties":
            models = [{"model": str(p), "parameters": {"weight": 1.0, "density": 0.2}} for p in experts]
        settings = {"anchor_method": anchor, "lambda": 0.1, "gram": "data_free", **parameters}
        return {
            "merge_method": "bmm",
            "base_model": str(family["base"]),
            "models": models,
            "parameters": settings,
            "dtype": "bfloat16",
        }
    weights = {"weight": 1.0, "density": 0.2} if method == "ties" else {"weight": 1.0 / len(experts)}
    models = [{"model": str(p), "parameters": weights} for p in experts]
    return {"merge_method": method, "base_model": str(family["base"]), "models": models, "dtype": "bfloat16"}


def merge_here(recipe: dict, out: str, device: str, shard_bytes: int | None = None) -> None:
    """One merge of ``recipe`` in this process, through mergekit with the plugin (no card, no tokenizer)."""
    from mergekit_bmm.plugin.run import merge_options, merge_recipe_text
    from mergekit_bmm.recipes.parse import yaml_text

    options = merge_options(
        None,
        device=device,
        quiet=True,
        write_model_card=False,
        copy_tokenizer=False,
        out_shard_size=shard_bytes,
    )
    merge_recipe_text(yaml_text(recipe), out, options)


def child(spec: dict) -> None:
    """One merge of ``spec["recipe"]`` in this (fresh) process; on a GPU its peak memory (MiB) is
    written to ``spec["result"]``."""
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    device = spec.get("device", "cpu")
    merge_here(spec["recipe"], spec["out"], device, spec.get("shard_bytes"))
    if device.startswith("cuda"):
        Path(spec["result"]).write_text(json.dumps({"gpu": torch.cuda.max_memory_allocated() / 2**20}))


def child_job(recipe: dict, device: str, shard_bytes: int | None = None):
    """A harness job: one merge of ``recipe`` on ``device`` in a new interpreter (a GPU merge cannot
    run in a forked process, and a stock ``mergekit-yaml`` may not be installed where it runs); its
    peak RSS and private memory sampled by the harness, its peak GPU memory reported by the child."""
    from bench.perf.harness import command

    def run(out: Path) -> dict:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as scratch:
            spec, result = Path(scratch) / "spec.json", Path(scratch) / "result.json"
            spec.write_text(
                json.dumps(
                    {
                        "recipe": recipe,
                        "out": str(out),
                        "device": device,
                        "shard_bytes": shard_bytes,
                        "result": str(result),
                    }
                )
            )
            peaks = command([sys.executable, "-m", "bench.perf.merges", str(spec)])
            return {**peaks, **(json.loads(result.read_text()) if result.is_file() else {})}

    return run


def _clock(action, device: str, *args) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    action(*args)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - started


def _grams(vectors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    out_features, in_features = vectors[0].shape
    gram = sum(v.T @ v for v in vectors)
    cross = sum((v @ v.T) @ v if out_features < in_features else v @ (v.T @ v) for v in vectors)
    return gram, cross


def _solve(system: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    return torch.cholesky_solve(right.T, torch.linalg.cholesky(system))


def _factorise(system: torch.Tensor, cross: torch.Tensor, anchor: torch.Tensor) -> tuple:
    _, basis = torch.linalg.eigh(system.double())
    return cross.double() @ basis, anchor.double() @ basis


def closed_form_floor(shapes, tasks: int, device: str = "cpu", fill: bool = False) -> float:
    """Bare products of the data-free closed form for every solved weight (one-shot or fill)."""
    total = 0.0
    for _, out_features, in_features in shapes:
        vectors = [torch.randn(out_features, in_features, device=device) for _ in range(tasks)]
        anchor = torch.randn(out_features, in_features, device=device)
        gram, cross = _grams(vectors)
        total += _clock(_grams, device, vectors)
        system = gram + 0.1 * torch.eye(in_features, device=device)
        if fill:
            total += _clock(_factorise, device, system, cross, anchor)
        else:
            total += _clock(_solve, device, system, cross + 0.1 * anchor)
    return total


def _closed_form(vectors: list[torch.Tensor], anchor: torch.Tensor) -> torch.Tensor:
    from mergekit_bmm.core import closed_form, normal_equations

    return closed_form.merge_matrix(normal_equations.data_free_equations(vectors), anchor, 0.1)


if __name__ == "__main__":  # child_job's process
    child(json.loads(Path(sys.argv[1]).read_text()))
