"""Activation statistics at LLM shapes: collection under a memory budget, size on disk, a data-assisted merge.

Generates a Llama-shaped family with random weights (the tiny tokenizer, so the embeddings are small
and the body is the real shape) once, then runs the stock commands as whole processes on the harness's
protocol (:mod:`bench.perf.harness`; wall time includes start-up, memory is each command's peak RSS from
the kernel): ``mergekit-bmm-stats`` (against ``baseline_command``, another ``mergekit-bmm-stats`` such
as an earlier checkout's, when given) and, with ``merge=true``, ``mergekit-yaml`` with ``gram:
activations`` over what the collection wrote. Figures: passes per task and the statistics' size.

    python -m bench.perf stats_scale --set shape=1b --set max_memory=6GB            # one expert
    python -m bench.perf stats_scale --set shape=3b --set max_memory=6GB --set experts=2 --set merge=true
    python -m bench.perf stats_scale --set shape=8b --set layers=8 --set device=cuda --set max_memory=40GB
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from bench.common import write_corpus_texts
from bench.perf.harness import Group, Job, Workload, command

SHAPES = {  # hidden, intermediate, layers, heads, kv heads (Llama 3.x; "tiny" for the test suite)
    "tiny": (64, 128, 2, 4, 2),
    "1b": (2048, 8192, 16, 32, 8),
    "3b": (3072, 8192, 28, 24, 8),
    "8b": (4096, 14336, 32, 32, 8),
}
BIN = Path(sys.executable).parent


def generate(folder: Path, shape: str, layers: int, experts: int) -> dict:
    """Base and experts as bfloat16 safetensors; one model in memory at a time."""
    spec = {"shape": shape, "layers": layers, "experts": experts, "v": 1}
    marker = folder / "family.json"
    paths = {"base": folder / "base", "experts": [folder / f"expert-{i}" for i in range(experts)]}
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return paths
    import transformers

    from bench.common import llama_config
    from mergekit_bmm.examples.tiny_models import build_tokenizer, perturb_as_expert

    shutil.rmtree(folder, ignore_errors=True)
    hidden, intermediate, _, heads, kv_heads = SHAPES[shape]
    tokenizer = build_tokenizer()
    config = llama_config(len(tokenizer), hidden, intermediate, layers, heads, kv_heads, positions=1024)
    print(
        f"generating a {shape}-shaped family ({layers} layers, {experts} experts) in {folder} ...", flush=True
    )
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = transformers.LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(paths["base"])
    tokenizer.save_pretrained(paths["base"])
    del model
    for index, path in enumerate(paths["experts"]):
        expert = transformers.LlamaForCausalLM.from_pretrained(paths["base"], dtype=torch.bfloat16)
        perturb_as_expert(expert, seed=1000 + index)
        expert.save_pretrained(path)
        tokenizer.save_pretrained(path)
        del expert
    marker.write_text(json.dumps(spec))
    return paths


def write_data(path: Path, samples: int, offset: int) -> Path:
    """Long texts (each well over ``max_length`` tokens) from the tiny corpus."""
    return write_corpus_texts(path, samples, 60, offset=offset)


def disk_gb(folder: Path) -> float:
    return round(sum(p.stat().st_size for p in folder.rglob("*.safetensors")) / 1e9, 3)


ENV = {"HF_HUB_OFFLINE": "1"}


def _family(parameters: dict[str, Any], root: Path) -> dict:
    layers = parameters["layers"] or SHAPES[parameters["shape"]][2]
    name = f"{parameters['shape']}-{layers}-{parameters['experts']}"
    return generate(root / "models" / name, parameters["shape"], layers, parameters["experts"])


def build(parameters: dict[str, Any], root: Path) -> list[Group]:
    family, work = _family(parameters, root), root / "inputs"
    work.mkdir(parents=True, exist_ok=True)
    tasks = [
        {
            "name": path.name,
            "model": str(path),
            "data": str(write_data(work / f"{path.name}.jsonl", parameters["samples"], i)),
        }
        for i, path in enumerate(family["experts"])
    ]
    config = {"tasks": tasks, "max_samples": parameters["samples"], "max_length": parameters["max_length"]}
    (work / "stats.yml").write_text(json.dumps({**config, "batch_size": 2}))

    def collect(executable: str):
        def run(out: Path) -> dict[str, float]:
            argv = [executable, str(work / "stats.yml"), str(out), "--device", parameters["device"]]
            return command(
                argv + (["--max-memory", parameters["max_memory"]] if parameters["max_memory"] else []), ENV
            )

        return run

    label = "mergekit-bmm-stats (collection)"
    jobs = [Job(label, collect(str(BIN / "mergekit-bmm-stats")))]
    if parameters["baseline_command"]:
        baseline = Job("baseline stats command", collect(parameters["baseline_command"]))
        jobs = [baseline, Job(label, jobs[0].run, baseline.label)]
    collected = root / "out" / "group-0" / str(len(jobs) - 1)  # the harness's folder of the collection
    if parameters["merge"]:
        recipe = {
            "merge_method": "bmm",
            "base_model": str(family["base"]),
            "models": [{"model": str(p), "parameters": {"weight": 0.5}} for p in family["experts"]],
            "parameters": {
                "anchor_method": "task_arithmetic",
                "lambda": 0.05,
                "gram": "activations",
                "stats": str(collected),
            },
            "dtype": "bfloat16",
        }
        (work / "recipe.yml").write_text(json.dumps(recipe))
        cuda = ["--cuda"] if parameters["device"].startswith("cuda") else []
        merge = [str(BIN / "mergekit-yaml"), str(work / "recipe.yml")]
        jobs.append(
            Job(
                "mergekit-yaml, gram: activations",
                lambda out: command([*merge, str(out), "--no-copy-tokenizer", *cuda], ENV),
            )
        )
    return [Group(jobs)]


def figures(parameters: dict[str, Any], root: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    collected = root / "out" / "group-0" / ("1" if parameters["baseline_command"] else "0")
    manifest = json.loads((collected / "manifest.json").read_text())
    return {
        "tokens per task": parameters["samples"] * parameters["max_length"],
        "passes per task": [task.get("passes", 1) for task in manifest["tasks"]],
        "statistics on disk": f"{disk_gb(collected)} GB",
    }


WORKLOAD = Workload(
    name="stats_scale",
    summary="mergekit-bmm-stats at LLM shapes under a memory budget (and a data-assisted mergekit-yaml)",
    sizes={
        "full": {
            "shape": "1b",
            "layers": 0,
            "experts": 1,
            "samples": 18,
            "max_length": 256,
            "max_memory": "",
            "device": "cpu",
            "merge": False,
            "baseline_command": "",
            "rounds": 1,
        },
        "quick": {"shape": "tiny", "samples": 2, "max_length": 16, "merge": True},
    },
    build=build,
    figures=figures,
    notes=lambda p: (
        f"{p['shape']}-shaped Llama, {p['layers'] or 'all'} layers, {p['experts']} experts, "
        f"{p['samples']} texts of {p['max_length']} tokens, budget {p['max_memory'] or 'the default'}, "
        f"{p['device']}"
    ),
)
