"""Cost of data-assisted BMM: statistics collection, and merges with activation Grams vs data-free.

Every job runs in a fresh process so that its peak memory is its own: the table shows
wall time of the job itself (imports excluded), the process's peak RSS, and the peak
above the RSS right after imports. Ratios are against the data-free merge of the same
model, measured in the same run.

    python bench/stats.py                       # tiny Llama/GPT-2/BERT, 3 experts, CPU
    python bench/stats.py --hidden 256 --layers 4 8 --device cuda
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench.common import status_mib


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _job(kind: str, spec: dict, queue) -> None:
    """Runs in a child process: import, note RSS, run the job, report time and peaks."""
    import torch  # noqa: F401
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions
    from transformers.utils import logging as hf_logging

    from mergekit_bmm.plugin import activate

    activate()
    from mergekit_bmm.stats.collect import collect_statistics
    from mergekit_bmm.stats.config import parse_stats_config

    hf_logging.disable_progress_bar()
    baseline = status_mib("VmRSS")
    start = time.perf_counter()
    if kind == "stats":
        config = parse_stats_config(spec["config"])
        collect_statistics(config, spec["out"], device=spec["device"], progress=False)
    else:
        options = MergeOptions(
            copy_tokenizer=False, quiet=True, write_model_card=False, device=spec["device"]
        )
        run_merge(MergeConfiguration.model_validate(spec["recipe"]), spec["out"], options=options)
    seconds = time.perf_counter() - start
    queue.put({"seconds": seconds, "peak_mb": _peak_mb(), "above_imports_mb": _peak_mb() - baseline})


def measure(kind: str, spec: dict) -> dict | None:
    """The job's figures, or None when its process failed (its traceback is on stderr)."""
    import queue as queues

    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_job, args=(kind, spec, queue))
    process.start()
    result = None
    while result is None and (process.is_alive() or not queue.empty()):
        try:
            result = queue.get(timeout=1.0)
        except queues.Empty:
            continue
    process.join()
    return result if process.exitcode == 0 else None


def write_data(path: Path, lines: int, offset: int) -> Path:
    from mergekit_bmm.examples.tiny_models import _CORPUS

    with open(path, "w", encoding="utf-8") as handle:
        for index in range(lines):
            count = 1 + (index + offset) % 4
            text = " ".join(_CORPUS[(index + offset + k) % len(_CORPUS)] for k in range(count))
            handle.write(json.dumps({"text": text}) + "\n")
    return path


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--architectures", nargs="+", default=["llama", "gpt2", "bert"])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--experts", type=int, default=3)
    parser.add_argument("--samples", type=int, default=128, help="calibration sequences per task")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="work folder (default: a temporary one)")
    args = parser.parse_args()

    from tqdm import tqdm

    from mergekit_bmm.examples.tiny_models import make_tiny_family

    root = args.out or Path(tempfile.mkdtemp(prefix="bench-stats-"))
    cases = [(a, n) for a in args.architectures for n in args.layers]
    rows = []
    for architecture, layers in tqdm(cases, desc="models", unit="model"):
        case = root / f"{architecture}-{layers}"
        family = make_tiny_family(case / "models", architecture, args.experts, args.hidden, layers)
        tasks = [
            {
                "name": expert.name,
                "model": str(expert),
                "data": str(write_data(case / f"{expert.name}.jsonl", args.samples, 7 * index)),
            }
            for index, expert in enumerate(family.experts)
        ]
        stats = case / "stats"
        config = {"tasks": tasks, "max_samples": args.samples, "max_length": args.max_length}
        jobs = [
            ("collect stats", "stats", {"config": config, "out": str(stats), "device": args.device}),
            ("merge data_free", "merge", {"recipe": recipe(family, "data_free", None)}),
            ("merge activations", "merge", {"recipe": recipe(family, "activations", stats)}),
            ("merge mix", "merge", {"recipe": recipe(family, "mix", stats)}),
        ]
        if architecture == "bert":
            # mergekit 0.1.5 cannot plan BERT merges (plan.py concatenates bert.json's tuple
            # aliases to a list); only collection is measured.
            jobs = jobs[:1]
        results = {}
        for label, kind, spec in jobs:
            if kind == "merge":
                spec = {**spec, "out": str(case / label.split()[-1]), "device": args.device}
            results[label] = measure(kind, spec)
        manifest_path = stats / "manifest.json"
        manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"tasks": []}
        tokens = sum(task["tokens"] for task in manifest["tasks"])
        gram_mb = sum(p.stat().st_size for p in (stats / "grams").glob("*")) / 2**20 if stats.exists() else 0
        baseline = results.get("merge data_free")
        for label, result in results.items():
            note = f"{tokens} tok, Gram files {gram_mb:.1f} MB" if label == "collect stats" else ""
            rows.append((f"{architecture}-{args.hidden}x{layers}", label, result, baseline, note))

    header = (
        f"{'model':<14} {'job':<18} {'time (s)':>9} {'peak RSS (MB)':>14} {'above imports (MB)':>19} "
        f"{'time / df':>10} {'mem / df':>9}  note"
    )
    print(
        f"\n{args.experts} experts, {args.samples} samples x <= {args.max_length} tokens per task, "
        f"device {args.device}, {os.cpu_count()} CPU cores; df = data-free merge of the same model."
    )
    print(header)
    print("-" * len(header))
    for model, job, result, baseline, note in rows:
        if result is None:
            print(f"{model:<14} {job:<18} {'failed (see the traceback above)':>40}")
            continue
        ratios = ("-", "-")
        if baseline is not None:
            ratios = (
                f"{result['seconds'] / baseline['seconds']:.2f}",
                f"{result['above_imports_mb'] / max(baseline['above_imports_mb'], 1e-9):.2f}",
            )
        print(
            f"{model:<14} {job:<18} {result['seconds']:>9.2f} {result['peak_mb']:>14.0f} "
            f"{result['above_imports_mb']:>19.0f} {ratios[0]:>10} {ratios[1]:>9}  {note}"
        )
    if "bert" in args.architectures:
        print("bert: collection only (mergekit 0.1.5 cannot plan BERT merges: tuple aliases in plan.py).")
    print(f"\nwork folder: {root}")


if __name__ == "__main__":
    sys.exit(main())
