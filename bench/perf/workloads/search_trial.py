"""What one search trial costs with and without bmm's λ-independent cache.

On a Llama-shaped model with realistic module sizes (default: hidden 1024, intermediate 2816, 8 layers,
16 heads / 4 KV heads, T = 8 synthetic experts, bfloat16 checkpoints generated locally), on the harness's
protocol (:mod:`bench.perf.harness`):

* the uncached merge (direct route: Grams, cross terms, Cholesky solve per module), alternating with
  mergekit's I/O floor: the same recipe with a kernel that returns ``W_pre`` untouched (plan + load
  every input + write), which no kernel can go below;
* per cache precision: the first trial with ``cache:`` (the same plus an eigendecomposition, and
  writing factors), then a cached trial with new λ/s each round (reads the factors, one
  ``out × in × in`` product per module), alternating with its GEMM floor: the bare products for every
  solved module, in this process with the same threads;
* figures: the cache's size per weight, and the error of cached factors against a float64 and the
  float32 direct route on layer 0's modules.

Every merge runs in this process through ``mergekit.merge.run_merge``, what a search does per trial.

    python -m bench.perf search_trial                  # ~15 min on 2 cores once the model exists
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from mergekit.merge_methods.base import TensorGroup

from bench.common import ensure_llama_family, gemm_floor, solved_shapes
from bench.perf.harness import Group, Job, Workload


def recipe(family: dict, **parameters) -> dict:
    experts = family["experts"]
    return {
        "merge_method": "bmm",
        "base_model": str(family["base"]),
        "models": [{"model": str(p), "parameters": {"weight": 1.0 / len(experts)}} for p in experts],
        "parameters": {"anchor_method": "task_arithmetic", "gram": "data_free", **parameters},
        "dtype": "bfloat16",
    }


def merge(config: dict, out: Path) -> None:
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    options = MergeOptions(quiet=True, copy_tokenizer=False, write_model_card=False)
    run_merge(MergeConfiguration.model_validate(copy.deepcopy(config)), str(out), options=options)


def register_io_floor() -> None:
    """A kernel that returns ``W_pre``: what mergekit itself costs per trial."""
    from mergekit.merge_methods import register
    from mergekit.merge_methods.base import BasePolicy, InputContract
    from mergekit.merge_methods.easy_define import merge_method

    from mergekit_bmm.merge_methods.registry import registered_names

    if "bench_io_floor" in registered_names():
        return

    @merge_method(name="bench_io_floor", contract=InputContract(base=BasePolicy.REQUIRED, min_non_base=1))
    def io_floor(group: TensorGroup) -> torch.Tensor:
        return group.base.tensor

    register(io_floor)


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*.safetensors"))


def accuracy(family: dict, shapes, precisions: list[str], scratch: Path) -> dict[str, tuple[float, float]]:
    """Worst relative error over layer 0's modules at the default λ = 0.1, float32 compute.

    For the direct route and for each cache precision: (error vs a float64 direct solve,
    error vs the float32 direct route), as ‖W − W_ref‖ / ‖W_ref − W_pre‖.
    """
    from mergekit.merge_methods.api import merge_tensors
    from safetensors import safe_open

    from mergekit_bmm.io.checkpoint import safetensors_files

    def read(model_dir: Path, name: str) -> torch.Tensor:
        for path in safetensors_files(model_dir):
            with safe_open(str(path), framework="pt") as handle:
                if name in handle.keys():
                    return handle.get_tensor(name).float()
        raise KeyError(name)

    def error(value: torch.Tensor, reference: torch.Tensor, base: torch.Tensor) -> float:
        return float((value.double() - reference).norm() / (reference - base.double()).norm())

    worst = {label: (0.0, 0.0) for label in ["direct", *precisions]}
    for name, _, _ in shapes:
        if ".layers.0." not in name:
            continue
        tensors = [read(family["base"], name)] + [read(p, name) for p in family["experts"]]
        weights = [1.0 / len(family["experts"])] * len(family["experts"])

        def bmm(tensors=tensors, name=name, weights=weights, **parameters) -> torch.Tensor:
            parameters = {"weight": weights, "lambda": 0.1, **parameters}
            return merge_tensors(tensors, "bmm", base_index=0, name=name, parameters=parameters)

        reference = bmm(compute_dtype="float64").double()
        direct = bmm()
        results = {"direct": direct}
        for precision in precisions:
            results[precision] = bmm(cache=str(scratch / precision), cache_dtype=precision)
        for label, value in results.items():
            errors = (error(value, reference, tensors[0]), error(value, direct.double(), tensors[0]))
            worst[label] = tuple(max(a, b) for a, b in zip(worst[label], errors))
    shutil.rmtree(scratch, ignore_errors=True)
    return worst


IO_ROW = "mergekit I/O floor (kernel returns W_pre)"
UNCACHED_ROW = "uncached merge (direct route)"
GEMM_ROW = "GEMM floor of one cached trial (bare products)"


def _family(parameters: dict[str, Any], root: Path) -> dict:
    p = parameters
    return ensure_llama_family(root / "models", p["hidden"], p["intermediate"], p["layers"], p["experts"])


def _fill_folder(root: Path, index: int) -> Path:
    """Where the fill of precision ``index`` left its cache: its group's only run (harness layout)."""
    return root / "out" / f"group-{1 + 2 * index}" / "0"


def build(parameters: dict[str, Any], root: Path) -> list[Group | Callable[[], Group]]:
    from mergekit_bmm.plugin import activate

    activate()
    register_io_floor()
    family = _family(parameters, root)
    shapes = solved_shapes(family["base"])
    io_config = {**recipe(family), "merge_method": "bench_io_floor"}
    merge(io_config, root / "warm")  # the page cache and mergekit's loaders
    turn = iter(range(1 << 30))

    def uncached(out: Path) -> None:
        merge(recipe(family, **{"lambda": 0.1 + 0.05 * (next(turn) % 4)}), out)

    groups: list[Group | Callable[[], Group]] = [
        Group([Job(IO_ROW, lambda out: merge(io_config, out)), Job(UNCACHED_ROW, uncached, IO_ROW)])
    ]
    for index, precision in enumerate(parameters["precisions"].split(",")):
        cache = _fill_folder(root, index) / "cache"
        config = recipe(family, cache=str(cache), cache_dtype=precision)
        # the fill writes its cache inside its own (fresh) folder, which its one run leaves in place
        fill = Job(
            f"first trial with cache ({precision}: fills it)", lambda out, c=config: merge(c, out / "model")
        )
        groups.append(Group([fill], rounds=1, warmup=0))
        rounds = iter(range(1 << 30))

        def cached(out: Path, config=config, rounds=rounds) -> None:
            step = next(rounds)
            trial = copy.deepcopy(config)
            trial["parameters"].update({"lambda": 10 ** (-3 + step % 5), "scale": 0.8 + 0.1 * (step % 5)})
            merge(trial, out)

        gemm = Job(GEMM_ROW + f" ({precision})", lambda out: gemm_floor(shapes, 1))
        groups.append(Group([gemm, Job(f"cached trial ({precision} factors)", cached, gemm.label)]))
    return groups


def figures(parameters: dict[str, Any], root: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The cache's size per solved weight, and each route's worst error on layer 0's modules."""
    family = _family(parameters, root)
    shapes = solved_shapes(family["base"])
    elements = sum(o * i for _, o, i in shapes)
    precisions = parameters["precisions"].split(",")
    out: dict[str, Any] = {}
    for index, precision in enumerate(precisions):
        size = directory_bytes(_fill_folder(root, index) / "cache")
        out[f"cache ({precision})"] = f"{size / 1e9:.3f} GB, {size / elements:.2f} bytes per solved weight"
    for label, (versus64, versus32) in accuracy(family, shapes, precisions, root / "accuracy").items():
        out[f"worst error on layer 0, {label}"] = (
            f"{versus64:.1e} vs float64, {versus32:.1e} vs the direct route"
        )
    return out


WORKLOAD = Workload(
    name="search_trial",
    summary="one search trial with and without bmm's factor cache, against mergekit's I/O and GEMM floors",
    sizes={
        "full": {
            "hidden": 1024,
            "intermediate": 2816,
            "layers": 8,
            "experts": 8,
            "precisions": "float32,float16",
            "rounds": 5,
        },
        "quick": {
            "hidden": 64,
            "intermediate": 128,
            "layers": 1,
            "experts": 2,
            "precisions": "float32",
            "rounds": 1,
        },
    },
    build=build,
    figures=figures,
    notes=lambda p: (
        f"Llama, hidden {p['hidden']}, intermediate {p['intermediate']}, {p['layers']} layers, "
        f"T = {p['experts']} experts, bfloat16 checkpoints"
    ),
)
