"""Cost of data-assisted BMM: statistics collection, and merges with activation Grams against data-free.

Tiny Llama, GPT-2 and BERT families (3 experts each, at two depths), every job in a process forked
after the imports so that its memory is its own, alternating with the data-free merge of the same
model round by round (:mod:`bench.perf.harness`): collecting the experts' statistics, and the
``activations`` and ``mix`` merges. Figures: the tokens collected and the size of the Gram files.
mergekit 0.1.5 cannot plan BERT merges (tuple aliases in its plan.py): BERT's collection is timed alone.

    python -m bench.perf stats                              # hidden 128, 4 and 8 layers, CPU
    python -m bench.perf stats --set hidden=256 --set device=cuda
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import write_corpus_texts
from bench.perf.harness import Group, Job, Workload, fresh


def collect_job(config: dict[str, Any], device: str) -> Callable[[Path], object]:
    def run(out: Path) -> None:
        from mergekit_bmm.stats.collect import collect_statistics
        from mergekit_bmm.stats.config import parse_stats_config

        collect_statistics(parse_stats_config(config), out, device=device, progress=False)

    return run


def merge_job(config: dict[str, Any], device: str) -> Callable[[Path], object]:
    def run(out: Path) -> None:
        from mergekit.config import MergeConfiguration
        from mergekit.merge import run_merge
        from mergekit.options import MergeOptions

        options = MergeOptions(copy_tokenizer=False, quiet=True, write_model_card=False, device=device)
        run_merge(MergeConfiguration.model_validate(config), str(out), options=options)

    return run


def write_data(path: Path, lines: int, offset: int) -> Path:
    return write_corpus_texts(path, lines, lambda index: 1 + (index + offset) % 4, offset=offset)


def recipe(family, gram: str, stats: Path | None) -> dict:
    parameters = {"anchor_method": "task_arithmetic", "lambda": 0.05, "gram": gram}
    if stats is not None:
        parameters["stats"] = str(stats)
    return {
        "merge_method": "bmm",
        "base_model": str(family.base),
        "models": [{"model": str(p), "parameters": {"weight": 0.3}} for p in family.experts],
        "parameters": parameters,
        "dtype": "float32",
    }


def _cases(parameters: dict[str, Any], root: Path):
    from mergekit_bmm.examples.tiny_models import make_tiny_family

    for architecture in parameters["architectures"].split(","):
        for layers in (int(n) for n in str(parameters["layers"]).split(",")):
            case = root / f"{architecture}-{layers}"
            family = make_tiny_family(case / "models", architecture, 3, parameters["hidden"], layers)
            tasks = [
                {
                    "name": e.name,
                    "model": str(e),
                    "data": str(write_data(case / f"{e.name}.jsonl", parameters["samples"], 7 * index)),
                }
                for index, e in enumerate(family.experts)
            ]
            config = {
                "tasks": tasks,
                "max_samples": parameters["samples"],
                "max_length": parameters["max_length"],
            }
            yield f"{architecture}-{parameters['hidden']}x{layers}", case, family, config


def build(parameters: dict[str, Any], root: Path) -> list[Group]:
    from mergekit_bmm.plugin import activate

    activate()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the jobs run on every thread in their forked processes (see harness.Group)
    device, groups = parameters["device"], []
    for model, case, family, config in _cases(parameters, root):
        stats = case / "stats"  # what the data-assisted merges read, collected once (untimed)
        collect_job(config, device)(fresh(stats))
        df = f"{model}: merge data_free"
        jobs = [Job(f"{model}: collect statistics", collect_job(config, device))]
        if not model.startswith("bert"):
            jobs = [
                Job(df, merge_job(recipe(family, "data_free", None), device)),
                Job(jobs[0].label, jobs[0].run, df),
                Job(
                    f"{model}: merge activations", merge_job(recipe(family, "activations", stats), device), df
                ),
                Job(f"{model}: merge mix", merge_job(recipe(family, "mix", stats), device), df),
            ]
        groups.append(Group(jobs, fork=True, threads=threads))
    return groups


def figures(parameters: dict[str, Any], root: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for model, case, _, _ in _cases(parameters, root):
        manifest = json.loads((case / "stats" / "manifest.json").read_text())
        tokens = sum(task["tokens"] for task in manifest["tasks"])
        size = sum(p.stat().st_size for p in (case / "stats").rglob("*.safetensors")) / 2**20
        out[model] = f"{tokens} tokens collected, Gram files {size:.1f} MiB"
    return out


WORKLOAD = Workload(
    name="stats",
    summary="statistics collection and data-assisted merges against the data-free merge (time, memory)",
    sizes={
        "full": {
            "architectures": "llama,gpt2,bert",
            "hidden": 128,
            "layers": "4,8",
            "samples": 128,
            "max_length": 128,
            "device": "cpu",
            "rounds": 3,
        },
        "quick": {
            "architectures": "llama",
            "hidden": 32,
            "layers": "1",
            "samples": 4,
            "max_length": 16,
            "rounds": 1,
        },
    },
    build=build,
    figures=figures,
    notes=lambda p: (
        f"tiny {p['architectures']}, hidden {p['hidden']}, layers {p['layers']}, 3 experts, "
        f"{p['samples']} texts of <= {p['max_length']} tokens per task, {p['device']}"
    ),
)
