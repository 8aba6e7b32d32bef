"""A billion-parameter merge on this machine: stock ``mergekit-yaml``, bmm data-free vs Task Arithmetic.

A Llama-3.2-1B-shaped family (hidden 2048, 16 layers, MLP 8192, 32 heads / 8 KV heads, the
body's 0.97 B weights; a 320-token vocabulary keeps the embeddings out of the picture),
bfloat16, T = 3 random experts made locally. Every merge is a separate ``mergekit-yaml
--lazy-unpickle`` process (what a user runs), sampled every 50 ms for its peak RSS and peak
private (anonymous) memory. Rows:

* Task Arithmetic; bmm over it, data-free, λ = 0.1, without the cache;
* the same with ``cache:`` (the fill: an eigendecomposition per weight, factors written) and a
  cached merge with new λ and s; the cache's size on disk against the model's;
* the GEMM floors measured in this process: the data-free closed form's bare products
  (Grams, cross terms, float32 Cholesky and its solves) and a cached trial's products;
* depth: peak private memory of TA and bmm at 4 and 16 layers of the same width.

mergekit buffers each output shard in memory until it is full (``--out-shard-size``, default
5 B parameters: the whole model here); the runs pass ``--out-shard-size 250M`` so that buffer
is bounded (about 0.5 GB in bfloat16) and the private column shows what the merge itself holds.

Every finished row is kept in ``--out``/rows.json and skipped when the script runs again
(``--redo NAME`` reruns one); the table goes to ``--out``/billion.md. ``--cache-layers 4`` measures the
cache rows on the 4-layer family of the same width (a quarter of the fill), ``--cache-layers``
alone skips them.

    nice -n 5 python bench/billion_merge.py       # about 1.5 hours on 2 cores; ~10 GB of models
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
REPO = Path(__file__).resolve().parents[1]

import torch  # noqa: E402
import yaml  # noqa: E402

from bench.common import PeakSampler, ensure_llama_family, gemm_floor, solved_shapes  # noqa: E402
from bench.perf.merges import DEFAULT_CACHE, closed_form_floor, recipe  # noqa: E402

SHAPE = {"hidden": 2048, "intermediate": 8192, "heads": 32, "kv_heads": 8}
SHARD = "250M"


def family(models: Path, layers: int) -> dict:
    return ensure_llama_family(
        models,
        SHAPE["hidden"],
        SHAPE["intermediate"],
        layers,
        3,
        heads=SHAPE["heads"],
        kv_heads=SHAPE["kv_heads"],
    )


def run_mergekit(config: dict, out: Path, work: Path) -> dict:
    """One stock ``mergekit-yaml`` run: seconds, peak RSS and peak private memory (MiB)."""
    work.mkdir(parents=True, exist_ok=True)
    recipe_path = work / f"{out.name}.yml"
    recipe_path.write_text(yaml.safe_dump(config, sort_keys=False))
    shutil.rmtree(out, ignore_errors=True)
    command = [
        str(Path(sys.executable).with_name("mergekit-yaml")), str(recipe_path), str(out),
        "--lazy-unpickle", "--out-shard-size", SHARD, "--no-copy-tokenizer", "--quiet",
    ]  # fmt: skip
    started = time.perf_counter()
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    sampler = PeakSampler("VmRSS", "RssAnon", pid=process.pid, interval=0.05)
    _, errors = process.communicate()
    seconds = time.perf_counter() - started
    peaks = sampler.stop()
    if process.returncode != 0:
        raise SystemExit(f"mergekit-yaml failed on {recipe_path}:\n{errors[-3000:]}")
    return {
        "seconds": seconds,
        "peak_rss_mib": peaks["VmRSS"],
        "peak_private_mib": peaks["RssAnon"],
    }


def folder_gib(path: Path) -> float:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) / 2**30


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, default=DEFAULT_CACHE)
    parser.add_argument(
        "--work", type=Path, default=Path("/tmp/bmm-billion"), help="merged models and the cache"
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "billion-cpu")
    parser.add_argument("--redo", action="append", default=[], help="rerun the row of this name")
    parser.add_argument(
        "--cache-layers", type=int, nargs="*", default=[16],
        help="depths for the cache rows (default 16; none: skip them)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows_path = args.out / "rows.json"
    rows: dict[str, dict] = json.loads(rows_path.read_text()) if rows_path.is_file() else {}
    for name in args.redo:
        rows.pop(name, None)

    def row(name: str, measure) -> dict:
        if name not in rows:
            print(f"{name} ...", flush=True)
            rows[name] = measure()
            rows_path.write_text(json.dumps(rows, indent=1))
        print(f"  {name}: {json.dumps(rows[name])}", flush=True)
        return rows[name]

    deep = family(args.models, 16)
    merges = {
        "task_arithmetic": recipe(deep, "task_arithmetic"),
        "bmm data-free": recipe(deep, "bmm", "task_arithmetic"),
    }
    for name, config in merges.items():
        row(name, lambda c=config, n=name: run_mergekit(c, args.work / n.replace(" ", "-"), args.work))

    shapes = solved_shapes(Path(deep["base"]))
    row(
        "floors",
        lambda: {"closed_form_s": closed_form_floor(shapes, 3), "cached_trial_s": gemm_floor(shapes, 1)},
    )
    row("sizes", lambda: {"model_gib": folder_gib(deep["base"]), "weights": _weights(deep["base"])})
    shallow = family(args.models, 4)
    for name, method in (("depth 4: task_arithmetic", "task_arithmetic"), ("depth 4: bmm data-free", "bmm")):
        config = recipe(shallow, method, "task_arithmetic" if method == "bmm" else None)
        row(
            name,
            lambda c=config, n=name: run_mergekit(
                c, args.work / n.replace(" ", "-").replace(":", ""), args.work
            ),
        )
    for layers in args.cache_layers:
        cached_rows(row, family(args.models, layers), layers, args.work)
    if "bmm cache fill" not in rows:
        print("(the 16-layer cache rows are not measured yet: run without --cache-layers)")
        return
    text = report(rows)
    (args.out / "billion.md").write_text(text + "\n")
    print(text)


def cached_rows(row, models: dict, layers: int, work: Path) -> None:
    """The cache fill (a fresh cache: an eigendecomposition per weight) and a cached trial."""
    prefix = "" if layers == 16 else f"depth {layers}: "
    cache = work / f"cache-{layers}"

    def fill() -> dict:
        shutil.rmtree(cache, ignore_errors=True)
        config = recipe(models, "bmm", "task_arithmetic", cache=str(cache))
        measured = run_mergekit(config, work / f"fill-{layers}", work)
        return {**measured, "cache_gib": folder_gib(cache), "model_gib": folder_gib(models["base"])}

    row(f"{prefix}bmm cache fill", fill)
    trial = recipe(models, "bmm", "task_arithmetic", cache=str(cache), scale=1.1)
    trial["parameters"]["lambda"] = 0.05
    row(f"{prefix}bmm cached trial", lambda: run_mergekit(trial, work / f"trial-{layers}", work))


def _weights(base: Path) -> int:
    from mergekit_bmm.io.checkpoint import iter_tensors

    return sum(tensor.numel() for _, tensor in iter_tensors(Path(base)))


def report(rows: dict[str, dict]) -> str:
    ta, bmm = rows["task_arithmetic"], rows["bmm data-free"]
    fill, trial, floors, sizes = (
        rows["bmm cache fill"],
        rows["bmm cached trial"],
        rows["floors"],
        rows["sizes"],
    )
    lines = [
        f"Llama-3.2-1B-shaped body ({sizes['weights'] / 1e9:.2f} B weights, "
        f"{sizes['model_gib']:.2f} GiB in bfloat16), T = 3, stock mergekit-yaml --lazy-unpickle "
        f"--out-shard-size {SHARD}, torch threads {torch.get_num_threads()}",
        "",
        f"{'merge':<28} {'wall s':>8} {'x TA':>7} {'peak RSS MiB':>13} {'peak private MiB':>17}",
        "-" * 77,
    ]
    for name in ("task_arithmetic", "bmm data-free", "bmm cache fill", "bmm cached trial"):
        item = rows[name]
        lines.append(
            f"{name:<28} {item['seconds']:>8.1f} {item['seconds'] / ta['seconds']:>7.2f} "
            f"{item['peak_rss_mib']:>13.0f} {item['peak_private_mib']:>17.0f}"
        )
    lines += [
        "",
        f"GEMM floor of the closed form (measured): {floors['closed_form_s']:.1f} s; "
        f"bmm = TA + {(bmm['seconds'] - ta['seconds']) / floors['closed_form_s']:.2f} x floor",
        f"GEMM floor of a cached trial: {floors['cached_trial_s']:.1f} s; "
        f"cached trial = TA + {(trial['seconds'] - ta['seconds']) / floors['cached_trial_s']:.2f} "
        "x that floor",
        f"cache fill = {fill['seconds'] / bmm['seconds']:.2f} x the uncached bmm merge; cache on disk "
        f"{fill['cache_gib']:.2f} GiB = {fill['cache_gib'] / sizes['model_gib']:.2f} x the model",
        "",
        f"{'depth (peak private MiB)':<28} {'4 layers':>9} {'16 layers':>10} {'ratio':>7}",
        "-" * 57,
    ]
    for label, shallow, deep in (
        ("task_arithmetic", rows["depth 4: task_arithmetic"], ta),
        ("bmm data-free", rows["depth 4: bmm data-free"], bmm),
    ):
        ratio = deep["peak_private_mib"] / shallow["peak_private_mib"]
        lines.append(
            f"{label:<28} {shallow['peak_private_mib']:>9.0f} {deep['peak_private_mib']:>10.0f} {ratio:>7.2f}"
        )
    shallow_ta, shallow_bmm = rows["depth 4: task_arithmetic"], rows["depth 4: bmm data-free"]
    own = [
        shallow_bmm["peak_private_mib"] - shallow_ta["peak_private_mib"],
        bmm["peak_private_mib"] - ta["peak_private_mib"],
    ]
    lines.append(f"bmm's own private memory over TA's: {own[0]:.0f} MiB at 4 layers, {own[1]:.0f} MiB at 16")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
