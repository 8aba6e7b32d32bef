"""Activation statistics at LLM shapes: collection under a memory budget, size on disk, a data-assisted merge.

Generates a Llama-shaped family with random weights (the tiny tokenizer, so the embeddings are
small and the body is the real shape) once, then runs the stock commands in fresh processes and
reads each one's peak RSS from the kernel (``wait4``):

    python bench/stats_scale.py --shape 1b --max-memory 6GB            # collection, one expert
    python bench/stats_scale.py --shape 3b --max-memory 6GB --experts 2 --merge
    python bench/stats_scale.py --shape 8b --layers 8 --device cuda --max-memory 40GB --merge

Wall time is the whole command (start-up included). ``--command`` runs another
``mergekit-bmm-stats`` (e.g. an earlier checkout's) on the same inputs, as a baseline.
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

import torch

SHAPES = {  # hidden, intermediate, layers, heads, kv heads (Llama 3.x)
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
    from mergekit_bmm.examples.tiny_models import _CORPUS

    with open(path, "w", encoding="utf-8") as handle:
        for index in range(samples):
            text = " ".join(_CORPUS[(index + offset + k) % len(_CORPUS)] for k in range(60))
            handle.write(json.dumps({"text": text}) + "\n")
    return path


def timed(command: list[str], env: dict | None = None) -> dict:
    """Run ``command``; its wall time, exit status and peak RSS (the kernel's, via wait4)."""
    start = time.perf_counter()
    process = subprocess.Popen(command, env={**os.environ, **(env or {})})
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    return {
        "command": " ".join(command),
        "seconds": round(seconds, 1),
        "exit": os.waitstatus_to_exitcode(status),
        "peak_rss_gb": round(usage.ru_maxrss * 1024 / 1e9, 2),
    }


def disk_gb(folder: Path) -> float:
    return round(sum(p.stat().st_size for p in folder.rglob("*.safetensors")) / 1e9, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's full depth")
    parser.add_argument("--experts", type=int, default=1)
    parser.add_argument("--samples", type=int, default=18, help="calibration samples per task")
    parser.add_argument("--max-length", type=int, default=256, help="tokens per sample")
    parser.add_argument("--max-memory", default=None, help="passed to mergekit-bmm-stats (default: its own)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--merge", action="store_true", help="also merge the experts with gram: activations")
    parser.add_argument(
        "--command", default=str(BIN / "mergekit-bmm-stats"), help="the stats command to time"
    )
    parser.add_argument("--label", default="", help="a name for this run in the JSON (e.g. 'unbounded')")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-stats-scale"))
    parser.add_argument("--json", type=Path, default=None, help="append this run's figures to a JSON list")
    args = parser.parse_args()

    layers = args.layers or SHAPES[args.shape][2]
    family = generate(args.work / f"{args.shape}-{layers}-{args.experts}", args.shape, layers, args.experts)
    run = args.work / f"run-{args.shape}-{layers}-{args.label or 'budgeted'}"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    tasks = [
        {
            "name": path.name,
            "model": str(path),
            "data": str(write_data(run / f"{path.name}.jsonl", args.samples, i)),
        }
        for i, path in enumerate(family["experts"])
    ]
    (run / "stats.yml").write_text(
        json.dumps(
            {"tasks": tasks, "max_samples": args.samples, "max_length": args.max_length, "batch_size": 2}
        )
    )
    command = [args.command, str(run / "stats.yml"), str(run / "stats"), "--device", args.device]
    if args.max_memory:
        command += ["--max-memory", args.max_memory]
    result = {
        "shape": args.shape,
        "layers": layers,
        "experts": args.experts,
        "tokens_per_task": args.samples * args.max_length,
        "max_memory": args.max_memory,
        "device": args.device,
        "label": args.label,
        "collect": timed(command, {"HF_HUB_OFFLINE": "1"}),
    }
    manifest = json.loads((run / "stats" / "manifest.json").read_text())
    result["passes"] = [task.get("passes", 1) for task in manifest["tasks"]]
    result["stats_gb"] = disk_gb(run / "stats")
    if args.merge:
        recipe = {
            "merge_method": "bmm",
            "base_model": str(family["base"]),
            "models": [{"model": str(p), "parameters": {"weight": 0.5}} for p in family["experts"]],
            "parameters": {
                "anchor_method": "task_arithmetic",
                "lambda": 0.05,
                "gram": "activations",
                "stats": str(run / "stats"),
            },
            "dtype": "bfloat16",
        }
        (run / "recipe.yml").write_text(json.dumps(recipe))
        merge = [
            str(BIN / "mergekit-yaml"),
            str(run / "recipe.yml"),
            str(run / "merged"),
            "--no-copy-tokenizer",
        ]
        merge += ["--cuda"] if args.device.startswith("cuda") else []
        result["merge"] = timed(merge, {"HF_HUB_OFFLINE": "1"})
    print(json.dumps(result, indent=2))
    if args.json:
        previous = json.loads(args.json.read_text()) if args.json.exists() else []
        args.json.write_text(json.dumps([*previous, result], indent=2) + "\n")


if __name__ == "__main__":
    main()
