"""Per-expert activation statistics at a mixture-of-experts shape: time, memory, passes.

A Mixtral-shaped model (``--size full``: hidden 4096, MLP 14336, 8 experts, top-2, one layer,
bfloat16, random weights made locally with a small vocabulary) is collected by
``mergekit-bmm-stats`` on made-up text, against one plain forward pass over the same tokens in the
same run. Printed: the collection's wall time and its ratio to the forward, peak device memory,
the passes the memory budget planned, the statistics' size on disk and how many expert slices got
no token. Part ``moe`` of ``bench/gpu_check.py``; ``--size small`` (hidden 64, 4 experts, 2 layers)
runs on a CPU in seconds (tested).

    python -m bench.moe_statistics --device cuda --size full
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

SHAPES = {  # hidden, intermediate, layers, experts, top-k, sequences, tokens per sequence
    "small": (64, 128, 2, 4, 2, 8, 64),
    "full": (4096, 14336, 1, 8, 2, 64, 512),
}


def make_model(folder: Path, size: str, device: str) -> Path:
    """A random Mixtral-shaped checkpoint (bfloat16 on a GPU, float32 on a CPU) and a tokenizer."""
    import transformers

    from mergekit_bmm.examples.tiny_models import build_tokenizer

    if (folder / "config.json").is_file():
        return folder
    hidden, intermediate, layers, experts, top_k, _, tokens = SHAPES[size]
    tokenizer = build_tokenizer()
    config = transformers.MixtralConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 128, 4),
        num_key_value_heads=max(hidden // 512, 2),
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        max_position_embeddings=max(tokens, 128),
        tie_word_embeddings=False,
    )
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.MixtralForCausalLM(config).to(dtype)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_text(path: Path, sequences: int, tokens: int) -> Path:
    """JSONL of made-up texts long enough for ``tokens`` tokens each."""
    from mergekit_bmm.examples.tiny_models import _CORPUS

    words = " ".join(_CORPUS)
    with open(path, "w", encoding="utf-8") as handle:
        for index in range(sequences):
            start = (17 * index) % len(_CORPUS)
            text = " ".join(_CORPUS[(start + k) % len(_CORPUS)] for k in range(tokens // 4))
            handle.write(json.dumps({"text": text or words}) + "\n")
    return path


def measure(work: Path, size: str, device: str) -> dict:
    """Collect the statistics and time one plain forward over the same tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mergekit_bmm.stats.collect import collect_statistics, describe
    from mergekit_bmm.stats.config import parse_stats_config

    hidden, intermediate, layers, experts, top_k, sequences, tokens = SHAPES[size]
    model_dir = make_model(work / f"mixtral-{size}", size, device)
    data = write_text(work / "text.jsonl", sequences, tokens)
    settings = {
        "tasks": [{"name": "moe", "model": str(model_dir), "data": str(data)}],
        "max_samples": sequences,
        "max_length": tokens,
        "dtype": "bfloat16" if device.startswith("cuda") else "float32",
    }
    out = work / "stats"
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    manifest = collect_statistics(
        parse_stats_config(settings), out, device=device, force=True, progress=False
    )
    collected = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    task = manifest.tasks[0]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if cuda else torch.float32)
    model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [json.loads(line)["text"] for line in data.read_text().splitlines()]
    batch = tokenizer(texts, truncation=True, max_length=tokens, padding=True, return_tensors="pt").to(device)
    with torch.inference_mode():
        model(**batch, use_cache=False)  # warm-up
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        model(**batch, use_cache=False)
        if cuda:
            torch.cuda.synchronize()
        forward = time.perf_counter() - started
    return {
        "shape": {
            "hidden": hidden,
            "intermediate": intermediate,
            "layers": layers,
            "experts": experts,
            "top_k": top_k,
            "sequences": sequences,
            "tokens": task.tokens,
        },  # fmt: skip
        "collect_seconds": round(collected, 2),
        "forward_seconds": round(forward, 3),
        "ratio_to_forward": round(collected / max(forward, 1e-9), 1),
        "peak_device_gib": None if peak is None else round(peak, 2),
        "passes": task.passes,
        "stats_bytes": sum(p.stat().st_size for p in out.rglob("*.safetensors")),
        "expert_slices": len(task.routed),
        "slices_without_tokens": sum(1 for count in task.routed.values() if count == 0),
        "summary": describe(manifest, out),
    }


def table(found: dict) -> list[str]:
    if "error" in found:
        return [f"moe statistics failed: {found['error']}"]
    shape = found["shape"]
    peak = "–" if found["peak_device_gib"] is None else f"{found['peak_device_gib']} GiB"
    return [
        "| per-expert statistics | seconds | × one forward | peak device memory | passes | on disk |",
        "|---|---|---|---|---|---|",
        f"| {shape['experts']} experts, top-{shape['top_k']}, {shape['tokens']} tokens | "
        f"{found['collect_seconds']} | {found['ratio_to_forward']} | {peak} | {found['passes']} | "
        f"{found['stats_bytes'] / 1e9:.2f} GB |",
        f"(hidden {shape['hidden']}, MLP {shape['intermediate']}, {shape['layers']} layer(s); "
        f"{found['slices_without_tokens']} of {found['expert_slices']} expert slices got no token)",
    ]


def main(argv: list[str] | None = None) -> dict:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=sorted(SHAPES), default=None, help="default: full on a GPU")
    args = parser.parse_args(argv)
    size = args.size or ("full" if args.device.startswith("cuda") else "small")
    with tempfile.TemporaryDirectory(prefix="bmm-moe-stats-") as work:
        found = measure(Path(work), size, args.device)
    print("\n".join(table(found)))
    return found


if __name__ == "__main__":
    main()
