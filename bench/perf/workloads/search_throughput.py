"""Search throughput: trials on disk against resident trials, and one worker against several.

Each case runs one search per trial mode — same seed, same points (checked) — in a fresh process, on
the harness's protocol (:mod:`bench.perf.harness`), after an untimed one-trial search (in the harness's
process) that fills bmm's factor cache (the searches share it, so neither pays for the fill inside its
trials). The figures give, per trial, the median seconds of the merge, the evaluation, the surrogate
(GP) and the rest (writing the recipe and the log, the progress bar), the private memory after the first
and the last trial, and the ratios the design targets:

* the resident trial's merge against the disk trial's merge + write + reload (reload = the disk
  trial's evaluation minus the resident one's, which score the same model);
* everything except evaluation and GP as a share of a resident trial.

Cases: ``encoder`` — the merging benchmark's MiniLM experts and heads when its cache exists
(``minilm_cache``), else a MiniLM-shaped BERT family (hidden 384, 6 layers, 6 experts) with random
heads; ``llama`` — a SmolLM2-135M-shaped Llama family (hidden 576, intermediate 1536, 30 layers, 9 heads
/ 3 KV heads, T = 3, bfloat16; ``hidden`` and ``intermediate`` change its width) scored by the mean
log-likelihood of a few texts.

With ``workers=1,2`` it also runs the search with resident trials on one worker (one device: one CPU
core, or one GPU), on one worker using the whole CPU, and on two workers with the local and the Ray
backend (one device each): trials per hour, the speed-up over one device, the best validation score
each reached by the time the slowest finished, and Ray's overhead per trial.

    python -m bench.perf search_throughput --set budget=8
    python -m bench.perf search_throughput --set case=encoder --set budget=12 --set workers=1,2
    python -m bench.perf search_throughput --set case=llama --set device=cuda     # the GPU table
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import ensure_encoder_family, ensure_llama_family, gemm_floor, solved_shapes, status_mib
from bench.perf.harness import Group, Job, Workload, command

REPO = Path(__file__).resolve().parents[3]
CALLABLE = "bench.perf.workloads.search_throughput:mean_log_likelihood"
SENTENCES = [
    "Model merging combines experts fine-tuned from one pretrained model.",
    "A Gaussian process proposes the next regularisation strengths to try.",
    "Positive reviews praise the acting; negative reviews complain about the plot.",
    "The quick brown fox jumps over the lazy dog.",
]


def texts(count: int) -> list[str]:
    """``count`` validation texts of three to four sentences each."""
    return [" ".join(SENTENCES[(i + k) % 4] for k in range(3 + i % 2)) for i in range(count)]


# -- the cases ----------------------------------------------------------------------------
def llama_case(root: Path, layers: int, eval_texts: int, hidden: int = 576, intermediate: int = 1536) -> dict:
    heads = 9 if hidden % 9 == 0 else 4
    family = ensure_llama_family(root, hidden, intermediate, layers, 3, heads=heads, kv_heads=heads // 3 or 1)
    evaluator = {
        "type": "python",
        "callable": CALLABLE,
        "python_path": [str(REPO)],
        "args": {"texts": texts(eval_texts)},
    }
    title = (
        f"Llama (hidden {hidden}, intermediate {intermediate}, {layers} layers, T = 3, bfloat16), "
        f"scored on {eval_texts} texts"
    )
    blocks = min(3, layers)
    return {
        "title": title,
        "recipe": _recipe(family, "bfloat16"),
        "evaluator": evaluator,
        "blocks": blocks,
        "base": family["base"],
    }


def encoder_case(root: Path, minilm_cache: Path | None) -> dict:
    manifest = minilm_cache / "runs" / "minilm6" / "manifest.json" if minilm_cache else None
    if manifest is not None and manifest.is_file():
        import yaml

        data = json.loads(manifest.read_text())
        family = {"base": Path(data["base"]), "experts": [Path(p) for p in data["experts"].values()]}
        block = yaml.safe_load((manifest.parent / "evaluator-validation.yml").read_text())["evaluator"]
        title = f"all-MiniLM-L6-v2, {len(family['experts'])} benchmark experts, heads on 6 validation sets"
    else:
        family, block = ensure_encoder_family(root / "minilm-shaped")
        title = "MiniLM-shaped BERT (hidden 384, 6 layers, 6 experts, random heads)"
    recipe = _recipe(family, "float32")
    return {"title": title, "recipe": recipe, "evaluator": block, "blocks": 1, "base": family["base"]}


def _recipe(family: dict, dtype: str) -> dict:
    experts = family["experts"]
    return {
        "merge_method": "bmm",
        "base_model": str(family["base"]),
        "models": [{"model": str(p), "parameters": {"weight": 0.3}} for p in experts],
        "parameters": {"anchor_method": "task_arithmetic", "gram": "data_free"},
        "dtype": dtype,
    }


def mean_log_likelihood(model, tokenizer, texts) -> float:
    """Mean token log-likelihood of ``texts`` under the live model (the llama case's score)."""
    import torch

    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    batch = tokenizer(list(texts), return_tensors="pt", padding=True)
    device = next(model.parameters()).device
    with torch.inference_mode():
        logits = model(**{k: v.to(device) for k, v in batch.items()}).logits.float()
    log_probs = torch.log_softmax(logits[:, :-1], dim=-1)
    targets = batch["input_ids"][:, 1:].to(device)
    mask = batch["attention_mask"][:, 1:].to(device).float()
    picked = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return float((picked * mask).sum() / mask.sum())


# -- one search per process ---------------------------------------------------------------
def child(spec: dict) -> dict:
    """Run one search; report its trial times and memory (runs in a fresh process)."""
    import torch

    from mergekit_bmm.search import SearchOptions, parse_search_config, run_search

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    private_after: list[float] = []  # after each finished trial
    config = parse_search_config(spec["config"], REPO)
    options = SearchOptions(
        progress=False,
        plots=False,
        skip_best=True,
        device=spec["device"],
        trials=spec["mode"],
        cache_dir=Path(spec["cache"]),
        workers=spec.get("workers", 1),
        backend=spec.get("backend", "local"),
        on_trial=lambda record: private_after.append(status_mib("RssAnon")),
    )
    started = time.perf_counter()
    result = run_search(config, Path(spec["out"]), options, echo=lambda line: None)
    found = {
        "wall": time.perf_counter() - started,
        "startup": result.summary.startup_seconds,
        "plan": result.summary.memory_plan,
        "records": [
            {"values": r.values, "score": r.score, "time": r.time, "ok": r.ok} for r in result.records
        ],
        "peak_rss_mib": status_mib("VmHWM"),
        "private_after_mib": private_after,
    }
    Path(spec["result"]).write_text(json.dumps(found))
    return found


def child_job(spec: dict[str, Any]):
    """A job: one search in a fresh interpreter (its peak memory is the process's); its trial records
    land in the run's folder as ``result.json`` for the figures."""

    def run(out: Path) -> dict[str, float]:
        out.mkdir(parents=True, exist_ok=True)
        path = out / "spec.json"
        path.write_text(json.dumps({**spec, "out": str(out / "search"), "result": str(out / "result.json")}))
        return command([sys.executable, "-m", "bench.perf.workloads.search_throughput", str(path)])

    return run


def fill_cache(spec: dict[str, Any], out: Path) -> None:
    """The untimed one-trial search that fills the shared factor cache, in this process (its imports
    are already paid for here; a fresh interpreter's were a third of the quick size's time)."""
    import torch

    threads = torch.get_num_threads()
    out.mkdir(parents=True, exist_ok=True)
    try:
        child({**spec, "out": str(out / "search"), "result": str(out / "result.json")})
    finally:
        torch.set_num_threads(threads)


# -- the table ----------------------------------------------------------------------------
def median_time(result: dict, key: str) -> float:
    return statistics.median(r["time"].get(key, 0.0) for r in result["records"])


def describe(case: dict, runs: dict, fill_seconds: float, floor: float, device: str) -> str:
    rows = []
    for mode, result in runs.items():
        merge, evaluate = median_time(result, "merge"), median_time(result, "evaluate")
        gp, total = median_time(result, "surrogate"), median_time(result, "total")
        private = result["private_after_mib"]
        rows.append((mode, merge, evaluate, gp, total - merge - evaluate - gp, total, result, private))
    lines = [
        f"{case['title']}, K = {len(runs['memory']['records'])}, device {device}",
        f"factor cache filled once in {fill_seconds:.1f} s (shared by both searches); "
        f"resident start-up {runs['memory']['startup']:.1f} s",
        "",
        f"{'trials':<8} {'merge s':>9} {'evaluate s':>11} {'GP s':>7} {'other s':>8} {'trial s':>8} "
        f"{'peak RSS MiB':>13} {'private MiB 1st/last':>21}",
        "-" * 92,
    ]
    for mode, merge, evaluate, gp, other, total, result, private in rows:
        lines.append(
            f"{mode:<8} {merge:>9.3f} {evaluate:>11.3f} {gp:>7.3f} {other:>8.3f} {total:>8.3f} "
            f"{result['peak_rss_mib']:>13.0f} {private[0]:>10.0f}/{private[-1]:<10.0f}"
        )
    disk, memory = runs["disk"], runs["memory"]
    reload = max(median_time(disk, "evaluate") - median_time(memory, "evaluate"), 0.0)
    disk_cost = median_time(disk, "merge") + reload
    memory_merge = median_time(memory, "merge")
    memory_total = median_time(memory, "total")
    overhead = memory_total - median_time(memory, "evaluate") - median_time(memory, "surrogate")
    same = [r["values"] for r in disk["records"]] == [r["values"] for r in memory["records"]]
    scores = [(a["score"], b["score"]) for a, b in zip(disk["records"], memory["records"])]
    same_scores = all(a == b for a, b in scores)
    lines += [
        "",
        f"disk trial: merge + write {median_time(disk, 'merge'):.3f} s, reload {reload:.3f} s "
        "(its evaluation minus the resident one's)",
        f"resident merge / (disk merge + write + reload) = {memory_merge / disk_cost:.4f} "
        f"(1/{disk_cost / max(memory_merge, 1e-9):.1f}; target <= 1/20)",
        f"GEMM floor of one trial (the bare products, this process): {floor:.3f} s; resident merge = "
        f"{memory_merge / floor:.2f}x the floor, disk merge + write + reload = {disk_cost / floor:.2f}x",
        f"resident trial minus evaluation and GP = {100 * overhead / memory_total:.1f}% of the trial "
        "(target <= 10%)",
        f"trials per hour: disk {3600 / median_time(disk, 'total'):.0f}, memory {3600 / memory_total:.0f} "
        f"({median_time(disk, 'total') / memory_total:.2f}x)",
        f"same points: {'yes' if same else 'NO'}; same scores: {'yes' if same_scores else 'NO'}",
    ]
    return "\n".join(lines)


def describe_workers(case: dict, runs: dict[str, dict], device: str) -> str:
    """Trials per hour, speed-up over one device, best score at equal wall time, Ray's overhead."""
    finish = {label: run["records"][-1]["time"]["elapsed"] for label, run in runs.items()}
    equal = min(finish.values())
    single = "1 worker, 1 device"
    lines = [
        f"{case['title']}, K = {len(next(iter(runs.values()))['records'])}, resident trials, device {device}",
        "",
        f"{'workers':<28} {'wall s':>8} {'trials/hour':>12} {'vs 1 device':>12} "
        f"{f'best at {equal:.0f} s':>14} {'best at end':>12} {'overhead/trial':>15}",
        "-" * 107,
    ]
    for label, run in runs.items():
        records = run["records"]
        per_hour = 3600 * len(records) / finish[label]
        by_then = [r["score"] for r in records if r["ok"] and r["time"]["elapsed"] <= equal + 1e-9]
        overheads = [
            r["time"]["total"] - r["time"]["surrogate"] - r["time"]["merge"] - r["time"]["evaluate"]
            for r in records
        ]
        share = statistics.median(o / max(r["time"]["total"], 1e-9) for o, r in zip(overheads, records))
        lines.append(
            f"{label:<28} {finish[label]:>8.1f} {per_hour:>12.0f} "
            f"{per_hour / (3600 * len(runs[single]['records']) / finish[single]):>11.2f}x "
            f"{max(by_then) if by_then else float('nan'):>14.4f} "
            f"{max(r['score'] for r in records if r['ok']):>12.4f} {100 * share:>14.1f}%"
        )
    lines += [
        "",
        "overhead/trial: a trial's round trip to its worker minus the worker's merge and evaluation,",
        "as a share of the trial (median). Targets: >= 1.7x trials/hour with 2 workers on 2 devices;",
        "Ray's overhead <= 5% of a trial.",
    ]
    return "\n".join(lines)


def case_config(case: dict, parameters: dict[str, Any]) -> dict:
    return {
        "recipe": case["recipe"],
        "blocks": case["blocks"],
        "groups": ["attn_in", "attn_out", "mlp_in", "mlp_out"],
        "lambda_range": [1e-3, 10.0],
        "scale_range": [0.5, 1.5],
        "budget": parameters["budget"],
        "n_initial": min(parameters["n_initial"], parameters["budget"]),
        "seed": 0,
        "acq_optimizer": "sampling",
        # trial mechanics with every example scored (bench/search_fidelity.py measures the other)
        "fidelity": {"enabled": False},
        "evaluator": case["evaluator"],
    }


def _cases(parameters: dict[str, Any], root: Path) -> dict[str, dict]:
    models, chosen = root / "models", parameters["case"]
    cases = {}
    if chosen in ("encoder", "all"):
        minilm = Path(parameters["minilm_cache"]) if parameters["minilm_cache"] else None
        cases["encoder"] = encoder_case(models, minilm)
    if chosen in ("llama", "all"):
        width = parameters["hidden"], parameters["intermediate"]  # SmolLM2-135M's at the full size
        cases["llama"] = llama_case(models, parameters["layers"], parameters["eval_texts"], *width)
    return cases


def _layouts(parameters: dict[str, Any]) -> list[tuple[str, int, str, int]]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    layouts = [("1 worker, 1 device", 1, "local", 1), (f"1 worker, {cores} threads", 1, "local", cores)]
    for count in (int(c) for c in str(parameters["workers"]).split(",")):
        if count > 1:
            layouts += [
                (f"{count} workers, local", count, "local", 0),
                (f"{count} workers, ray", count, "ray", 0),
            ]
    return [
        layout
        for layout in layouts
        if not (parameters["device"].startswith("cuda") and "threads" in layout[0])
    ]


def build(parameters: dict[str, Any], root: Path) -> list[Group]:
    groups = []
    for name, case in _cases(parameters, root).items():
        config = case_config(case, parameters)
        base = {
            "config": config,
            "device": parameters["device"],
            "threads": parameters["threads"],
            "cache": str(root / f"cache-{name}"),
        }
        fill = root / f"fill-{name}"  # the shared factor cache, filled once (untimed)
        fill_cache({**base, "mode": "memory", "config": {**config, "budget": 1, "n_initial": 1}}, fill)
        disk = f"{name}: search, trials on disk"
        resident = Job(f"{name}: search, resident trials", child_job({**base, "mode": "memory"}), disk)
        groups.append(Group([Job(disk, child_job({**base, "mode": "disk"})), resident], rounds=1))
        layouts = _layouts(parameters)
        if len(layouts) > 2:
            jobs = [
                Job(
                    f"{name}: {label}",
                    child_job({**base, "mode": "memory", "workers": n, "backend": b, "threads": t}),
                )
                for label, n, b, t in layouts
            ]
            groups.append(Group(jobs, rounds=1))
    return groups


def figures(parameters: dict[str, Any], root: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    import torch

    out = {}
    for number, (name, case) in enumerate(_cases(parameters, root).items()):
        group = 2 * number if len(_layouts(parameters)) > 2 else number
        runs = {
            mode: json.loads((root / "out" / f"group-{group}" / str(i) / "result.json").read_text())
            for i, mode in enumerate(("disk", "memory"))
        }
        fill = json.loads((root / f"fill-{name}" / "result.json").read_text())
        if parameters["threads"]:
            torch.set_num_threads(parameters["threads"])
        floor = gemm_floor(solved_shapes(Path(case["base"])), repeats=3, device=parameters["device"])
        out[name] = "\n" + describe(case, runs, fill["startup"], floor, parameters["device"])
        layouts = _layouts(parameters)
        if len(layouts) > 2:
            folder = root / "out" / f"group-{group + 1}"
            workers = {
                label: json.loads((folder / str(i) / "result.json").read_text())
                for i, (label, *_) in enumerate(layouts)
            }
            out[f"{name}, workers"] = "\n" + describe_workers(case, workers, parameters["device"])
    return out


WORKLOAD = Workload(
    name="search_throughput",
    summary="search trials on disk against resident, and one worker against several (local, Ray)",
    sizes={
        "full": {
            "case": "all",
            "budget": 8,
            "n_initial": 4,
            "device": "cpu",
            "threads": 0,
            "layers": 30,
            "hidden": 576,
            "intermediate": 1536,
            "eval_texts": 64,
            "workers": "1",
            "minilm_cache": "/work/bench-cache",
            "rounds": 1,
        },
        "quick": {
            "case": "llama",
            "budget": 2,
            "n_initial": 1,
            "threads": 1,
            "layers": 1,
            "hidden": 64,  # the suite's 30 s: a trial's merge and evaluation at SmolLM2's width cost more
            "intermediate": 128,
            "eval_texts": 2,
            "minilm_cache": "",
        },
    },
    build=build,
    figures=figures,
    notes=lambda p: f"case {p['case']}, K = {p['budget']}, device {p['device']}, workers {p['workers']}",
)


if __name__ == "__main__":  # child_job's process: one search
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    child(json.loads(Path(sys.argv[1]).read_text()))
