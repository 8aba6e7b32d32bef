"""A billion-parameter merge on this machine: stock ``mergekit-yaml``, bmm data-free vs Task Arithmetic.

A Llama-3.2-1B-shaped family (hidden 2048, 16 layers, MLP 8192, 32 heads / 8 KV heads, the body's
0.97 B weights; a 320-token vocabulary keeps the embeddings out of the picture), bfloat16, T = 3
random experts made locally. Every merge is a separate ``mergekit-yaml --lazy-unpickle`` process
(what a user runs), sampled every 50 ms for its peak RSS and peak private memory, on the harness's
protocol (:mod:`bench.perf.harness`; a run resumes from its finished groups); a merge's output is
deleted once it is measured. Groups:

* Task Arithmetic, and bmm over it (data-free, λ = 0.1, no cache) against it;
* the GEMM floors measured in this process: the closed form's bare products (Grams, cross terms,
  float32 Cholesky and its solves) and a cached trial's products;
* depth: Task Arithmetic and bmm at 4 layers of the same width (the figures: private memory, 16 over 4);
* with ``cache_layers`` (16, or 4 for a quarter of the fill, 0 to skip): the fill (a fresh cache, an
  eigendecomposition per weight) and a cached merge with new λ and s; the cache's size against the model.

mergekit buffers each output shard in memory until it is full (``--out-shard-size``, default 5 B
parameters: the whole model here); the runs pass ``--out-shard-size 250M`` so that buffer is bounded
(about 0.5 GB in bfloat16) and the private column shows what the merge itself holds.

    python -m bench.perf billion_merge --out /work/perf-billion      # about 1.5 hours on 2 cores

With ``device=cuda`` the family is made on the GPU and every merge is a fresh interpreter merging on
it through mergekit's ``run_merge`` (a GPU machine may have no ``mergekit-yaml`` installed), with its
peak GPU memory; ``experts`` sets T. A full-depth Llama-3-8B shape (the GPU check's part ``eight_b``):

    python -m bench.perf billion_merge --set device=cuda --set hidden=4096 --set intermediate=14336 \
        --set layers=32 --set experts=2 --set depth=false --set cache_layers=0
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from bench.common import ensure_llama_family, gemm_floor, solved_shapes
from bench.perf.harness import Group, Job, Workload, command
from bench.perf.merges import child_job, closed_form_floor, recipe

SHAPE = {"hidden": 2048, "intermediate": 8192, "heads": 32, "kv_heads": 8}
SHARD = "250M"


def family(models: Path, layers: int, shape: dict[str, Any]) -> dict:
    return ensure_llama_family(
        models,
        shape["hidden"],
        shape["intermediate"],
        layers,
        shape["experts"],
        heads=shape["heads"],
        kv_heads=shape["kv_heads"],
        device=shape["device"],
    )


def mergekit_yaml(config: dict, work: Path, name: str, into: str = "", device: str = "cpu"):
    """A job: one stock ``mergekit-yaml`` run of ``config`` into the run's folder (or ``into`` in it);
    on a GPU, or where mergekit is not installed as a command, the same merge in a fresh interpreter."""
    executable = Path(sys.executable).with_name("mergekit-yaml")
    if device != "cpu" or not executable.is_file():
        job = child_job(config, device, shard_bytes=250_000_000)
        return lambda out: job(out / into if into else out)
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"{name}.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    flags = ["--lazy-unpickle", "--out-shard-size", SHARD, "--no-copy-tokenizer", "--quiet"]
    return lambda out: command([str(executable), str(path), str(out / into if into else out), *flags])


def folder_gib(path: Path) -> float:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) / 2**30


def _weights(base: Path) -> int:
    from mergekit_bmm.io.checkpoint import iter_tensors

    return sum(tensor.numel() for _, tensor in iter_tensors(Path(base)))


def _shape(parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        key: parameters[key] for key in ("hidden", "intermediate", "heads", "kv_heads", "experts", "device")
    }


def build(parameters: dict[str, Any], root: Path) -> list[Group]:
    models, work, shape = root / "models", root / "recipes", _shape(parameters)
    device = shape["device"]
    deep = family(models, parameters["layers"], shape)
    shapes = solved_shapes(Path(deep["base"]))
    ta = "task_arithmetic"

    def merge(config: dict, name: str, into: str = ""):
        return mergekit_yaml(config, work, name, into, device)

    merges = [
        Job(ta, merge(recipe(deep, ta), "ta")),
        Job("bmm data-free", merge(recipe(deep, "bmm", ta), "bmm"), ta),
    ]
    if parameters["weight_rule"]:  # bmm's earlier default rule, every figure before it changed
        earlier = recipe(deep, "bmm", ta, gram_sharing="weight")
        merges.append(Job("bmm data-free, gram_sharing: weight", merge(earlier, "bmm-weight"), ta))
    groups = [
        Group(merges, rounds=1, discard=True),
        Group(
            [
                Job("GEMM floor of the closed form", lambda out: closed_form_floor(shapes, 3, device)),
                Job("GEMM floor of a cached trial", lambda out: gemm_floor(shapes, 1, device)),
            ],
            rounds=1,
        ),
    ]
    if parameters["depth"]:
        shallow, label = family(models, 4, shape), "depth 4: task_arithmetic"
        groups.append(
            Group(
                [
                    Job(label, merge(recipe(shallow, ta), "ta-4")),
                    Job("depth 4: bmm data-free", merge(recipe(shallow, "bmm", ta), "bmm-4"), label),
                ],
                rounds=1,
                discard=True,
            )
        )
    if parameters["cache_layers"]:
        cached = family(models, parameters["cache_layers"], shape)
        cache = (
            root / "out" / f"group-{len(groups)}" / "0" / "cache"
        )  # the fill's own folder (harness layout)
        trial = recipe(cached, "bmm", ta, cache=str(cache), scale=1.1)
        trial["parameters"]["lambda"] = 0.05
        fill = recipe(cached, "bmm", ta, cache=str(cache))  # its cache lands in its own (fresh) folder
        groups.append(
            Group(
                [
                    Job("bmm cache fill", merge(fill, "fill", into="model")),
                    Job("bmm cached trial", merge(trial, "trial"), "bmm cache fill"),
                ],
                rounds=1,
                warmup=0,
            )
        )
    return groups


def figures(parameters: dict[str, Any], root: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """bmm and a cached trial against TA plus their floors; the cache against the model; private memory
    against depth."""
    by = {row["label"]: row for row in rows}
    deep = family(root / "models", parameters["layers"], _shape(parameters))
    ta, bmm = by["task_arithmetic"], by["bmm data-free"]
    floor = by["GEMM floor of the closed form"]["seconds"]
    out = {
        "body": f"{_weights(deep['base']) / 1e9:.2f} B weights, {folder_gib(deep['base']):.2f} GiB",
        "bmm data-free": f"TA + {(bmm['seconds'] - ta['seconds']) / floor:.2f} × the closed form's floor",
    }
    for label, shallow, full in (
        ("task_arithmetic", "depth 4: task_arithmetic", ta),
        ("bmm data-free", "depth 4: bmm data-free", bmm),
    ):
        if shallow not in by:
            continue
        a, b = by[shallow]["private_mib"], full["private_mib"]
        out[f"private memory, {label}"] = (
            f"{a} MiB at 4 layers, {b} at {parameters['layers']} ({b / max(a, 1):.2f}×)"
        )
    if "bmm cache fill" in by:
        cache = folder_gib(root / "out" / f"group-{2 + int(parameters['depth'])}" / "0" / "cache")
        model = folder_gib(family(root / "models", parameters["cache_layers"], _shape(parameters))["base"])
        out["cache"] = f"{cache:.2f} GiB = {cache / model:.2f} × the model"
        trial_floor = by["GEMM floor of a cached trial"]["seconds"]
        out["bmm cached trial"] = (
            f"TA + {(by['bmm cached trial']['seconds'] - ta['seconds']) / trial_floor:.2f} × its floor"
        )
        layers = parameters["cache_layers"]  # the fill against an uncached merge of the same depth
        same = bmm if layers == parameters["layers"] else by.get(f"depth {layers}: bmm data-free")
        if same is not None:
            out["bmm cache fill"] = (
                f"{by['bmm cache fill']['seconds'] / same['seconds']:.2f} × the uncached bmm merge"
            )
    return out


WORKLOAD = Workload(
    name="billion_merge",
    summary="a Llama-3.2-1B-shaped merge by stock mergekit-yaml: bmm and its cache against TA and the floors",
    sizes={
        "full": {
            "hidden": 2048,
            "intermediate": 8192,
            "heads": 32,
            "kv_heads": 8,
            "layers": 16,
            "cache_layers": 16,
            "depth": True,
            "weight_rule": False,
            "experts": 3,
            "device": "cpu",
            "rounds": 1,
        },
        "quick": {
            "hidden": 64,
            "intermediate": 128,
            "heads": 4,
            "kv_heads": 2,
            "layers": 2,
            "cache_layers": 0,
            "depth": False,
        },
    },
    build=build,
    figures=figures,
    notes=lambda p: (
        f"Llama body, hidden {p['hidden']}, MLP {p['intermediate']}, {p['layers']} layers, "
        f"T = {p['experts']}, bfloat16, "
        + (
            f"stock mergekit-yaml --lazy-unpickle --out-shard-size {SHARD}"
            if p["device"] == "cpu"
            else f"run_merge on {p['device']} in a fresh interpreter, {SHARD} shards"
        )
    ),
)
