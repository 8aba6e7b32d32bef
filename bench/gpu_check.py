"""The GPU check: bmm on an accelerator, measured, in one command (6.5 minutes on an H200).

Six parts (the first four by default), each printed as a table and kept in ``--out`` (JSON):

1. **accuracy** — bmm data-free, activations and mix, over ACE, and with ``task_balance:
   frobenius`` in the mix, merged on ``--device`` (float32 compute)
   against the float64 CPU merge of the same recipe: the largest relative error of any
   solved tensor's update ``W − W_pre`` (tiny Llama families; with ``--size full`` also
   the SmolLM2-135M shape). Activation statistics are random Grams in the real format.
2. **speed** — the ``merge_speed`` workload's cases on the device: Task Arithmetic and TIES,
   bmm over each, the cache fill and a cached trial, against the GEMM floors measured on the
   same device in the same run.
3. **search** — a resident search (one worker per GPU) scored by the mean log-likelihood
   of a few texts: trials per hour.
4. **billion** — a Llama-3.2-1B-shaped family (hidden 2048, 16 layers, MLP 8192, 32 heads /
   8 KV heads, bfloat16, T = 3, random weights made locally): Task Arithmetic and bmm
   data-free, wall time, peak GPU memory and peak RSS.
5. **search3b** — part 3 on a Llama-3.2-3B-shaped family (hidden 3072, 28 layers, MLP 8192,
   24 heads / 8 KV heads, T = 3): the start-up (model load and factor-cache fill) and one
   resident trial's merge and evaluation, against the paper's ≈ 8 s of closed form per trial.
6. **moe** — the ``moe_statistics`` workload (per-expert activation statistics at Mixtral's shape,
   ``--size small``: its quick shape) on ``--device``: time against one forward, peak device memory,
   passes, size on disk.

    python bench/gpu_check.py --device cuda --out bench/results/gpu-check.json     # on a GPU
    python bench/gpu_check.py --device cpu --size small                            # the CPU run (tested)

``--parts`` picks parts and their order; ``--out`` is rewritten after each part, so a check cut
short keeps what it finished. ``--size small`` shrinks every shape (hidden 64, 2 layers; the "1B"
family becomes hidden 256) so the whole check runs on a CPU in about a minute; the tables say which
sizes they used.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]

import torch  # noqa: E402

from bench.common import ensure_llama_family, gemm_floor, solved_shapes  # noqa: E402
from bench.perf.merges import DEFAULT_CACHE, closed_form_floor, merge_here, recipe, run_child  # noqa: E402
from mergekit_bmm.io.atomic import atomic_write_text  # noqa: E402

SHAPES = {  # hidden, intermediate, layers, heads, kv heads
    "small": {
        "tiny": (64, 128, 2, 4, 2),
        "smollm2": None,
        "billion": (256, 1024, 2, 8, 2),
        "3b": (96, 192, 2, 6, 2),
    },
    "full": {
        "tiny": (64, 128, 2, 4, 2),
        "smollm2": (576, 1536, 30, 9, 3),
        "billion": (2048, 8192, 16, 32, 8),
        "3b": (3072, 8192, 28, 24, 8),
    },
}
CASES = (  # name, anchor, gram, extra bmm parameters: the three Grams, the ACE anchor, task balance
    ("data_free", "task_arithmetic", "data_free", {}),
    ("activations", "task_arithmetic", "activations", {}),
    ("mix", "task_arithmetic", "mix", {"epsilon": 0.5}),
    ("ace anchor", "ace", "data_free", {}),
    ("balance mix", "task_arithmetic", "mix", {"epsilon": 0.5, "task_balance": "frobenius"}),
)
PARTS = ("accuracy", "speed", "search", "billion", "search3b", "moe")
DEFAULT_PARTS = PARTS[:4]  # search3b (a 23 GB family) and moe (3 GB) are asked for by name


def family(models: Path, shape: tuple[int, int, int, int, int]) -> dict:
    hidden, intermediate, layers, heads, kv_heads = shape
    return ensure_llama_family(models, hidden, intermediate, layers, 3, heads=heads, kv_heads=kv_heads)


def machine(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} GPU), torch {torch.__version__}"
    return f"CPU ({os.cpu_count()} cores), torch {torch.__version__}"


# -- 1. accuracy --------------------------------------------------------------------------
def _stats(fam: dict, folder: Path) -> Path:
    """Random activation Grams for every expert, in the statistics store's format."""
    from types import SimpleNamespace

    from mergekit_bmm.examples.synthetic_stats import stats_for_family

    described = SimpleNamespace(base=fam["base"], experts=fam["experts"], architecture="llama")
    return stats_for_family(folder, described)[0]


def _updates(out: Path, base: Path) -> dict[str, torch.Tensor]:
    from mergekit_bmm.io.checkpoint import iter_tensors

    before = dict(iter_tensors(base))
    return {
        name: tensor.double() - before[name].double() for name, tensor in iter_tensors(out) if name in before
    }


def accuracy(models: Path, scratch: Path, device: str, size: str) -> list[dict]:
    rows = []
    for label, shape in (("tiny", SHAPES[size]["tiny"]), ("SmolLM2-135M shape", SHAPES[size]["smollm2"])):
        if shape is None:
            continue
        fam = family(models, shape)
        stats = _stats(fam, scratch / f"stats-{label.replace(' ', '_')}")
        for case, anchor, gram, extra in CASES:
            extra = {**extra, "stats": str(stats)} if gram != "data_free" else dict(extra)
            spec = recipe(fam, "bmm", anchor, gram=gram, **extra)
            spec["dtype"] = "float32"  # compare the solves, not bfloat16 rounding
            reference = {**spec, "parameters": {**spec["parameters"], "compute_dtype": "float64"}}
            outs = {}
            for name, run_recipe, run_device in (("device", spec, device), ("reference", reference, "cpu")):
                out = scratch / f"accuracy-{label.replace(' ', '_')}-{case.replace(' ', '_')}-{name}"
                merge_here(run_recipe, str(out), run_device)  # no memory measured: no child start-up
                outs[name] = _updates(out, Path(fam["base"]))
            errors = [
                float(
                    (outs["device"][name] - reference_update).norm()
                    / reference_update.norm().clamp_min(1e-30)
                )
                for name, reference_update in outs["reference"].items()
                if reference_update.norm() > 0
            ]
            rows.append(
                {
                    "family": label,
                    "case": case,
                    "gram": gram,
                    "tensors": len(errors),
                    "max_relative_error": max(errors),
                }
            )
            print(f"  accuracy {label} {case}: {max(errors):.2e}", flush=True)
    return rows


# -- 2. speed -----------------------------------------------------------------------------
def speed(models: Path, scratch: Path, device: str, size: str, only: list[str] | None = None) -> dict:
    fam = family(models, SHAPES[size]["smollm2"] or SHAPES[size]["tiny"])
    cases = {
        "task_arithmetic": recipe(fam, "task_arithmetic"),
        "ties": recipe(fam, "ties"),
        "bmm over task_arithmetic": recipe(fam, "bmm", "task_arithmetic"),
        "bmm over ties": recipe(fam, "bmm", "ties"),
        "cache fill": recipe(fam, "bmm", "task_arithmetic", cache=str(scratch / "cache")),
        "cached trial": recipe(fam, "bmm", "task_arithmetic", cache=str(scratch / "cache"), scale=1.1),
    }
    cases["cached trial"]["parameters"]["lambda"] = 0.05
    unknown = sorted(set(only or ()) - set(cases))
    if unknown:
        raise SystemExit(
            f"--speed-cases: unknown case(s) {', '.join(unknown)}; choose from {', '.join(cases)}"
        )
    rows = {}
    for name, spec in cases.items():
        if only and name not in only:
            continue
        print(f"  speed: {name} ...", flush=True)
        rows[name] = run_child(
            {"recipe": spec, "out": str(scratch / f"speed-{name.replace(' ', '_')}"), "device": device}
        )
    shapes = solved_shapes(Path(fam["base"]))
    return {
        "rows": rows,
        "closed_form_floor_seconds": closed_form_floor(shapes, 3, device),
        "fill_floor_seconds": closed_form_floor(shapes, 3, device, fill=True),
        "gemm_floor_seconds": gemm_floor(shapes, 3, device),
    }


# -- 3. search ----------------------------------------------------------------------------
def search(models: Path, scratch: Path, device: str, size: str, budget: int, shape: str = "smollm2") -> dict:
    from bench.perf.workloads.search_throughput import texts
    from mergekit_bmm.search.config import parse_search_config
    from mergekit_bmm.search.loop import SearchOptions, run_search

    fam = family(models, SHAPES[size][shape] or SHAPES[size]["tiny"])
    workers = max(1, torch.cuda.device_count()) if device.startswith("cuda") else 1
    config = parse_search_config(
        {
            "recipe": recipe(fam, "bmm", "task_arithmetic"),
            "blocks": 1,
            "budget": budget,
            "n_initial": min(4, budget),
            "parallel": {"workers": workers},
            "evaluator": {
                "type": "python",
                "callable": "bench.perf.workloads.search_throughput:mean_log_likelihood",
                "python_path": [str(REPO)],
                "args": {"texts": texts(16)},
            },
        },
        REPO,
    )
    options = SearchOptions(device=device, progress=False, plots=False, skip_best=True)
    started = time.perf_counter()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    result = run_search(config, scratch / f"search-{shape}", options)
    wall = time.perf_counter() - started
    return {
        "shape": SHAPES[size][shape] or SHAPES[size]["tiny"],
        "startup_seconds": result.summary.startup_seconds,
        "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else None,
        "workers": workers,
        "trials": len(result.records),
        "trials_mode": result.summary.trials,
        "wall_seconds": wall,
        "trials_per_hour": 3600 * len(result.records) / wall,
        "mean_seconds": result.summary.mean_seconds,
    }


# -- 4. billion ---------------------------------------------------------------------------
def billion(models: Path, scratch: Path, device: str, size: str) -> dict:
    fam = family(models, SHAPES[size]["billion"])
    rows = {}
    for name, spec in (
        ("task_arithmetic", recipe(fam, "task_arithmetic")),
        ("bmm data-free over task_arithmetic", recipe(fam, "bmm", "task_arithmetic")),
    ):
        print(f"  billion: {name} ...", flush=True)
        rows[name] = run_child(
            {"recipe": spec, "out": str(scratch / f"billion-{len(rows)}"), "device": device}
        )
    return {"shape": SHAPES[size]["billion"], "rows": rows}


def moe(scratch: Path, device: str, size: str) -> dict:
    """The ``moe_statistics`` workload on ``device`` (its full shape, or its quick one with ``small``)."""
    from bench.perf.harness import run_workload
    from bench.perf.workloads import workload

    return run_workload(
        workload("moe_statistics"),
        "full" if size == "full" else "quick",
        out_root=scratch / "moe",
        overrides={"device": device},
        echo=lambda line: print(f"  moe: {line}", flush=True),
    )


# -- the report ---------------------------------------------------------------------------
def report(result: dict) -> str:
    """The tables of the parts that ran; a part that failed or did not run says so in one line."""
    lines = [f"GPU check on {result['machine']}, device {result['device']}, sizes {result['size']}"]
    tables = {"accuracy": _accuracy_table, "speed": _speed_table, "search": _search_table,
              "billion": _billion_table, "search3b": _search_table, "moe": _moe_table}  # fmt: skip
    for part in PARTS:
        found = result.get(part)
        if found is None:
            lines += ["", f"{part}: not run"]
        elif isinstance(found, dict) and "error" in found:
            lines += ["", f"{part}: failed: {found['error'].strip().splitlines()[-1]}"]
        else:
            lines += ["", *tables[part](found)]
    return "\n".join(lines)


def _accuracy_table(rows: list[dict]) -> list[str]:
    lines = [f"{'accuracy (vs float64 CPU)':<34}{'case':<13}{'tensors':>8}{'max rel. error':>16}", "-" * 71]
    for row in rows:
        lines.append(
            f"{row['family']:<34}{row['case']:<13}{row['tensors']:>8}{row['max_relative_error']:>16.2e}"
        )
    return lines


def _speed_table(speed_part: dict) -> list[str]:
    floor = speed_part["closed_form_floor_seconds"]
    lines = [f"{'speed':<34}{'seconds':>10}{'peak RSS MiB':>14}{'peak GPU MiB':>14}", "-" * 72]
    for name, row in speed_part["rows"].items():
        gpu = f"{row['peak_gpu_mib']:.0f}" if "peak_gpu_mib" in row else "-"
        lines.append(f"{name:<34}{row['seconds']:>10.2f}{row['peak_rss_mib']:>14.0f}{gpu:>14}")
    rows = speed_part["rows"]
    lines.append(
        f"closed-form floor {floor:.3f} s, fill floor {speed_part['fill_floor_seconds']:.3f} s, "
        f"GEMM floor of a cached trial {speed_part['gemm_floor_seconds']:.3f} s"
    )
    if {"bmm over task_arithmetic", "task_arithmetic"} <= set(rows):  # both timed (--speed-cases)
        extra = rows["bmm over task_arithmetic"]["seconds"] - rows["task_arithmetic"]["seconds"]
        lines.append(f"bmm over TA = TA + {extra / floor:.2f} x floor")
    return lines


def _search_table(found: dict) -> list[str]:
    lines = [
        f"search: {found['trials']} resident trials ({found['trials_mode']}) on {found['workers']} "
        f"worker(s): {found['trials_per_hour']:.0f} trials/hour"
    ]
    if "startup_seconds" in found:  # figures recorded since the 3B part
        hidden, intermediate, layers, _, _ = found["shape"]
        mean = found["mean_seconds"]
        lines.append(
            f"  (hidden {hidden}, intermediate {intermediate}, {layers} layers, T = 3) start-up "
            f"{found['startup_seconds']:.1f} s; per trial: merge {mean.get('merge', 0):.2f} s, "
            f"evaluation {mean.get('evaluate', 0):.2f} s, GP {mean.get('surrogate', 0):.2f} s"
        )
    return lines


def _billion_table(big: dict) -> list[str]:
    hidden, intermediate, layers, _, _ = big["shape"]
    lines = [f"{'1B-shaped merge':<40}{'seconds':>10}{'peak RSS MiB':>14}{'peak GPU MiB':>14}", "-" * 78]
    for name, row in big["rows"].items():
        gpu = f"{row['peak_gpu_mib']:.0f}" if "peak_gpu_mib" in row else "-"
        lines.append(f"{name:<40}{row['seconds']:>10.2f}{row['peak_rss_mib']:>14.0f}{gpu:>14}")
    lines.append(f"(hidden {hidden}, intermediate {intermediate}, {layers} layers, T = 3, bfloat16)")
    return lines


def _moe_table(found: dict) -> list[str]:
    from bench.perf.harness import table

    return [table(found["rows"]), *(f"{key}: {value}" for key, value in found["figures"].items())]


def _listed(text: str | None) -> list[str] | None:
    return [item.strip() for item in text.split(",") if item.strip()] if text else None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=["small", "full"], default=None, help="default: full on a GPU")
    parser.add_argument("--models", type=Path, default=DEFAULT_CACHE, help="where model families are kept")
    parser.add_argument("--budget", type=int, default=8, help="trials of the search part")
    parser.add_argument("--out", type=Path, default=None, help="JSON with every figure")
    parser.add_argument(
        "--parts",
        default=",".join(DEFAULT_PARTS),
        help=f"which parts to run, in this order (comma-separated; default: {','.join(DEFAULT_PARTS)})",
    )
    parser.add_argument(
        "--speed-cases",
        default=None,
        help="comma-separated cases of the speed part (default: all; `cached trial` reads the cache "
        "that `cache fill` writes)",
    )
    args = parser.parse_args(argv)
    parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    size = args.size or ("full" if args.device.startswith("cuda") else "small")
    result: dict = {"device": args.device, "size": size, "machine": machine(args.device), "seconds": {}}
    with tempfile.TemporaryDirectory(prefix="bmm-gpu-check-") as scratch:
        scratch = Path(scratch)
        runners = {
            "accuracy": lambda: accuracy(args.models, scratch, args.device, size),
            "speed": lambda: speed(args.models, scratch, args.device, size, _listed(args.speed_cases)),
            "search": lambda: search(args.models, scratch, args.device, size, args.budget),
            "search3b": lambda: search(args.models, scratch, args.device, size, args.budget, "3b"),
            "billion": lambda: billion(args.models, scratch, args.device, size),
            "moe": lambda: moe(scratch, args.device, size),
        }
        for part in parts:
            print(f"== {part}", flush=True)
            started = time.perf_counter()
            try:
                result[part] = runners[part]()
            except (Exception, SystemExit) as error:  # a failed merge child exits; keep the other parts
                result[part] = {"error": f"{type(error).__name__}: {error}"[-3000:]}
                print(f"  {part} failed: {result[part]['error']}", flush=True)
            result["seconds"][part] = round(time.perf_counter() - started, 1)
            save(result, args.out)  # a check cut short keeps the parts it finished
    print(report(result))
    return result


def save(result: dict, out: Path | None) -> None:
    """Replace ``out`` whole: a check killed mid-write leaves the previous parts readable."""
    if out is not None:
        atomic_write_text(out, json.dumps({**result, "report": report(result)}, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
