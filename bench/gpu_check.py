"""The GPU check: bmm on an accelerator, measured, in one command (its default parts: minutes on an H200).

Parts, each printed as a table and kept in ``--out`` (JSON); the timed ones run performance workloads
(``python -m bench.perf``) on ``--device``, on the harness's protocol:

1. **accuracy** — bmm data-free, activations and mix, over ACE, and with ``task_balance:
   frobenius`` in the mix, merged on ``--device`` (float32 compute)
   against the float64 CPU merge of the same recipe: the largest relative error of any
   solved tensor's update ``W − W_pre`` (tiny Llama families; with ``--size full`` also
   the SmolLM2-135M shape). Activation statistics are random Grams in the real format.
2. **speed** — the ``merge_speed`` workload on the device (SmolLM2-135M shape, random weights): Task
   Arithmetic and TIES, bmm over each, the cache fill and a cached trial, against the GEMM floors.
3. **search** — a resident search (one worker per GPU) scored by the mean log-likelihood
   of a few texts: trials per hour.
4. **billion** — the ``billion_merge`` workload on the device: a Llama-3.2-1B-shaped family (hidden
   2048, 16 layers, MLP 8192, 32 heads / 8 KV heads, bfloat16, T = 3, random weights made locally),
   Task Arithmetic and bmm data-free against the floors, peak GPU memory and RSS.
5. **search3b** — part 3 on a Llama-3.2-3B-shaped family (hidden 3072, 28 layers, MLP 8192,
   24 heads / 8 KV heads, T = 3): the start-up (model load and factor-cache fill) and one
   resident trial's merge and evaluation, against the paper's ≈ 8 s of closed form per trial.
6. **moe** — the ``moe_statistics`` workload (per-expert activation statistics at Mixtral's shape) on
   ``--device``: time against one forward, peak device memory, passes, size on disk.
7. **label_free** — a resident search with no labels (``evaluator: {type: agreement}``, three experts,
   32 texts each) on the 1B shape: the experts' references, the start-up and each trial's merge and
   evaluation.
8. **lora** — the ``lora_merge`` workload, two layers, three rank-16 adapters: the low-rank route
   data-free and data-assisted at the Llama-3-8B shape (hidden 4096, MLP 14336), data-assisted at the
   1B shape, against Task Arithmetic of the adapters, and a resident trial.
9. **eight_b** — the ``billion_merge`` workload at full Llama-3-8B depth (hidden 4096, MLP 14336, 32
   layers, 32 / 8 heads, T = 2: base, experts and one output fit a 64 GiB disk; each output deleted once
   timed): Task Arithmetic and bmm data-free, peak GPU memory.

    python bench/gpu_check.py --device cuda --out bench/results/gpu-check.json     # on a GPU
    python bench/gpu_check.py --device cuda --parts label_free,lora,moe,eight_b    # wave 6's list
    python bench/gpu_check.py --device cpu --size small                            # the CPU run (tested)

``--parts`` picks parts and their order; ``--out`` is rewritten after each part, so a check cut
short keeps what it finished. ``--size small`` shrinks every shape (hidden 64, 2 layers; the
workloads' quick sizes) so the whole check runs on a CPU in a few minutes; the tables say which
sizes they used. ``bench/gpu/`` holds the one command for a bare GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]

import torch  # noqa: E402

from bench.common import ensure_llama_family, write_corpus_texts  # noqa: E402
from bench.perf.merges import DEFAULT_CACHE, merge_here, recipe  # noqa: E402
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
EIGHT_B = {"hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8}  # Llama-3-8B's body
BILLION = {"hidden": 2048, "intermediate": 8192, "heads": 32, "kv_heads": 8}  # Llama-3.2-1B's
CASES = (  # name, anchor, gram, extra bmm parameters: the three Grams, the ACE anchor, task balance
    ("data_free", "task_arithmetic", "data_free", {}),
    ("activations", "task_arithmetic", "activations", {}),
    ("mix", "task_arithmetic", "mix", {"epsilon": 0.5}),
    ("ace anchor", "ace", "data_free", {}),
    ("balance mix", "task_arithmetic", "mix", {"epsilon": 0.5, "task_balance": "frobenius"}),
)
PARTS = ("accuracy", "speed", "search", "billion", "search3b", "moe", "label_free", "lora", "eight_b")
DEFAULT_PARTS = PARTS[:4]  # the others (families of 3–45 GB) are asked for by name


def family(models: Path, shape: tuple[int, int, int, int, int], device: str = "cpu") -> dict:
    """Base + three experts of ``shape``, made on ``device`` (a GPU makes a 3B family in seconds)."""
    hidden, intermediate, layers, heads, kv_heads = shape
    made_on = device if device.startswith("cuda") else "cpu"
    return ensure_llama_family(
        models, hidden, intermediate, layers, 3, heads=heads, kv_heads=kv_heads, device=made_on
    )


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


# -- 2. speed, 4. billion, 6. moe, 8. lora, 9. eight_b: performance workloads on the device --------
def workload(name: str, scratch: Path, device: str, size: str, full: dict | None = None, warmup: int = 1,
             tag: str = "", **always) -> dict:  # fmt: skip
    """``python -m bench.perf NAME`` on ``device`` in a process of its own (nothing it holds, on the
    GPU or in OpenMP's pool, reaches the next part): its full size with the shape ``full``, or its
    quick size with ``small``; ``always``: settings of either size. Its folder (families, outputs) is
    deleted when it ends: the next part needs the disk (the 8B family takes 42 GB)."""
    import subprocess
    import sys

    folder = scratch / "-".join([name, tag, *map(str, always.values())])
    settings = {"device": device, **always, **((full or {}) if size == "full" else {})}
    command = [sys.executable, "-m", "bench.perf", name, "--warmup", str(warmup), "--out", str(folder)]
    command += [*(["--quick"] if size != "full" else []), *(f"--set={k}={v}" for k, v in settings.items())]
    try:
        with subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO
        ) as run:
            tail = []
            for line in run.stdout:
                print(f"  {name}: {line}", end="", flush=True)
                tail = [*tail[-20:], line]
        if run.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{''.join(tail)}")
        return json.loads((folder / f"{name}.json").read_text())
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def speed(scratch: Path, device: str, size: str) -> dict:
    return workload(
        "merge_speed", scratch, device, size, {"real_model": False, "depth": False, "wide": False}
    )


def billion(scratch: Path, device: str, size: str) -> dict:
    return workload("billion_merge", scratch, device, size, {"depth": False, "cache_layers": 0}, warmup=0)


def eight_b(scratch: Path, device: str, size: str) -> dict:
    """Full-depth Llama-3-8B body, T = 2, made on the device; no warm-up (a run is minutes)."""
    shape = {**EIGHT_B, "layers": 32, "experts": 2, "depth": False, "cache_layers": 0}
    return workload("billion_merge", scratch, device, size, shape, warmup=0)


def lora(scratch: Path, device: str, size: str) -> dict:
    """The LoRA routes, two layers: data-free and data-assisted at the 8B shape, data-assisted at the 1B
    shape (where issue 60 sets its bar: ≤ 1.5 × Task Arithmetic of the adapters)."""
    runs = {"8B": (EIGHT_B, ("data_free", "activations")), "1B": (BILLION, ("activations",))}
    found, done = {}, {}
    for label, (shape, grams) in runs.items():
        full = {"hidden": shape["hidden"], "intermediate": shape["intermediate"], "layers": 2, "rounds": 2}
        for gram in grams:
            key = (label if size == "full" else "", gram)  # the small size has one shape: run it once
            if key not in done:
                done[key] = workload(
                    "lora_merge",
                    scratch,
                    device,
                    size,
                    full,
                    tag=label,
                    gram=gram,
                    full_route=False,
                    statistics=0,
                )
            found[f"{label} {gram}"] = done[key]
    return found


def moe(scratch: Path, device: str, size: str) -> dict:
    return workload("moe_statistics", scratch, device, size)


# -- 3. search, 5. search3b, 7. label_free --------------------------------------------------
def _agreement(fam: dict, folder: Path) -> dict:
    """No labels: each expert's agreement with the merge on 32 texts of its own (made-up) task."""
    folder.mkdir(parents=True, exist_ok=True)
    tasks = [
        {"name": f"task-{i}", "model": str(expert),
         "data": str(write_corpus_texts(folder / f"task-{i}.jsonl", 32, 200, stride=7, offset=50 * i))}
        for i, expert in enumerate(fam["experts"])
    ]  # fmt: skip
    return {"type": "agreement", "tasks": tasks, "max_samples": 32, "max_length": 256}


def search(
    models: Path, scratch: Path, device: str, size: str, budget: int, shape: str = "smollm2",
    label_free: bool = False,
) -> dict:  # fmt: skip
    from bench.perf.workloads.search_throughput import texts
    from mergekit_bmm.search.config import parse_search_config
    from mergekit_bmm.search.loop import SearchOptions, run_search

    fam = family(models, SHAPES[size][shape] or SHAPES[size]["tiny"], device)
    workers = max(1, torch.cuda.device_count()) if device.startswith("cuda") else 1
    evaluator = {
        "type": "python",
        "callable": "bench.perf.workloads.search_throughput:mean_log_likelihood",
        "python_path": [str(REPO)],
        "args": {"texts": texts(16)},
    }
    if label_free:
        evaluator = _agreement(fam, scratch / f"texts-{shape}")
    config = parse_search_config(
        {
            "recipe": recipe(fam, "bmm", "task_arithmetic"),
            "blocks": 1,
            "budget": budget,
            "n_initial": min(4, budget),
            "parallel": {"workers": workers},
            "evaluator": evaluator,
        },
        REPO,
    )
    options = SearchOptions(device=device, progress=False, plots=False, skip_best=True)
    started = time.perf_counter()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    result = run_search(config, scratch / f"search-{shape}{'-label-free' if label_free else ''}", options)
    wall = time.perf_counter() - started
    trials = sum(record.time.get("total", 0.0) for record in result.records)
    return {
        "shape": SHAPES[size][shape] or SHAPES[size]["tiny"],
        "objective": "agreement (no labels)" if label_free else "mean log-likelihood",
        "startup_seconds": result.summary.startup_seconds,
        "before_trials_seconds": wall - trials,  # references, model load, factors
        "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else None,
        "workers": workers,
        "trials": len(result.records),
        "trials_mode": result.summary.trials,
        "wall_seconds": wall,
        "trials_per_hour": 3600 * len(result.records) / wall,
        "mean_seconds": result.summary.mean_seconds,
    }


# -- the report ---------------------------------------------------------------------------
def report(result: dict) -> str:
    """The tables of the parts that ran; a part that failed or did not run says so in one line."""
    lines = [f"GPU check on {result['machine']}, device {result['device']}, sizes {result['size']}"]
    tables = {"accuracy": _accuracy_table, "search": _search_table, "search3b": _search_table,
              "label_free": _search_table, "lora": _workload_tables}  # fmt: skip
    for part in PARTS:
        found = result.get(part)
        if found is None:
            lines += ["", f"{part}: not run"]
        elif isinstance(found, dict) and "error" in found:
            lines += ["", f"{part}: failed: {found['error'].strip().splitlines()[-1]}"]
        else:
            lines += ["", *tables.get(part, _workload_table)(found)]
    return "\n".join(lines)


def _accuracy_table(rows: list[dict]) -> list[str]:
    lines = [f"{'accuracy (vs float64 CPU)':<34}{'case':<13}{'tensors':>8}{'max rel. error':>16}", "-" * 71]
    for row in rows:
        lines.append(
            f"{row['family']:<34}{row['case']:<13}{row['tensors']:>8}{row['max_relative_error']:>16.2e}"
        )
    return lines


def _search_table(found: dict) -> list[str]:
    lines = [
        f"search ({found.get('objective', 'mean log-likelihood')}): {found['trials']} resident trials "
        f"({found['trials_mode']}) on {found['workers']} worker(s): "
        f"{found['trials_per_hour']:.0f} trials/hour"
    ]
    if "startup_seconds" in found:  # figures recorded since the 3B part
        hidden, intermediate, layers, _, _ = found["shape"]
        mean = found["mean_seconds"]
        lines.append(
            f"  (hidden {hidden}, intermediate {intermediate}, {layers} layers, T = 3) start-up "
            f"{found['startup_seconds']:.1f} s; per trial: merge {mean.get('merge', 0):.2f} s, "
            f"evaluation {mean.get('evaluate', 0):.2f} s, GP {mean.get('surrogate', 0):.2f} s"
            + (
                f"; before the first trial {found['before_trials_seconds']:.1f} s"
                if "before_trials_seconds" in found
                else ""
            )
            + (f"; peak GPU {found['peak_gpu_mib']:.0f} MiB" if found.get("peak_gpu_mib") else "")
        )
    return lines


def _workload_table(found: dict) -> list[str]:
    """A performance workload's table and figures, as ``python -m bench.perf`` prints them."""
    from bench.perf.harness import table

    notes = [f"{found['workload']} ({found['size']}): {found['parameters']}"]
    return [*notes, table(found["rows"]), *(f"{key}: {value}" for key, value in found["figures"].items())]


def _workload_tables(found: dict) -> list[str]:
    return [line for one in found.values() for line in [*_workload_table(one), ""]]


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
    parser.add_argument("--speed-cases", default=None, help=argparse.SUPPRESS)  # gone: one line says so
    args = parser.parse_args(argv)
    parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    if args.speed_cases is not None:
        parser.error(
            "--speed-cases is gone: the speed part is the merge_speed workload; time some of its cases "
            "with `python -m bench.perf merge_speed --set device=...` (docs/performance.md)"
        )
    size = args.size or ("full" if args.device.startswith("cuda") else "small")
    result: dict = {"device": args.device, "size": size, "machine": machine(args.device), "seconds": {}}
    with tempfile.TemporaryDirectory(prefix="bmm-gpu-check-") as scratch:
        scratch = Path(scratch)
        device, models = args.device, args.models
        runners = {
            "accuracy": lambda: accuracy(models, scratch, device, size),
            "speed": lambda: speed(scratch, device, size),
            "search": lambda: search(models, scratch, device, size, args.budget),
            "search3b": lambda: search(models, scratch, device, size, args.budget, "3b"),
            "billion": lambda: billion(scratch, device, size),
            "moe": lambda: moe(scratch, device, size),
            "label_free": lambda: search(
                models, scratch, device, size, args.budget, "billion", label_free=True
            ),
            "lora": lambda: lora(scratch, device, size),
            "eight_b": lambda: eight_b(scratch, device, size),
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
