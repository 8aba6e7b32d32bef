"""Per-expert activation statistics at a mixture-of-experts shape, against one forward pass.

A Mixtral-shaped model (``full``: hidden 4096, MLP 14336, 8 experts, top-2, one layer, 64 texts of
512 tokens, bfloat16 on a GPU; ``quick``: hidden 64, 4 experts, 2 layers; random weights made locally
with a small vocabulary) is collected by ``mergekit-bmm-stats``'s collector on made-up text,
alternating with one plain forward pass of the same model over the same tokens (the baseline), on the
harness's protocol (:mod:`bench.perf.harness`). Figures: peak device memory of a collection, the
passes the memory budget planned, the statistics' size on disk, and how many expert slices got no
token. Part ``moe`` of ``bench/gpu_check.py``.

    python -m bench.perf moe_statistics --set device=cuda        # the figure (a GPU)
    python -m bench.perf moe_statistics --quick                   # seconds on a CPU (tested)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from bench.common import write_corpus_texts
from bench.perf.harness import Group, Job, Workload

FORWARD = "one forward pass (same tokens)"
COLLECT = "per-expert statistics (collector)"


def make_model(folder: Path, parameters: dict[str, Any]) -> Path:
    """A random Mixtral-shaped checkpoint (bfloat16 on a GPU, float32 on a CPU) and a tokenizer."""
    import transformers

    from mergekit_bmm.examples.tiny_models import build_tokenizer

    if (folder / "config.json").is_file():
        return folder
    hidden, experts = parameters["hidden"], parameters["experts"]
    tokenizer = build_tokenizer()
    config = transformers.MixtralConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=parameters["intermediate"],
        num_hidden_layers=parameters["layers"],
        num_attention_heads=max(hidden // 128, 4),
        num_key_value_heads=max(hidden // 512, 2),
        num_local_experts=experts,
        num_experts_per_tok=parameters["top_k"],
        max_position_embeddings=max(parameters["tokens"], 128),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(parameters["device"]):
        model = transformers.MixtralForCausalLM(config).to(_dtype(parameters))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _dtype(parameters: dict[str, Any]) -> torch.dtype:
    return torch.bfloat16 if parameters["device"].startswith("cuda") else torch.float32


def _synchronised(parameters: dict[str, Any]) -> None:
    if parameters["device"].startswith("cuda"):
        torch.cuda.synchronize()


def build(parameters: dict[str, Any], root: Path) -> list[Group]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mergekit_bmm.stats.collect import collect_statistics
    from mergekit_bmm.stats.config import parse_stats_config

    device, cuda = parameters["device"], parameters["device"].startswith("cuda")
    model_dir = make_model(root / f"mixtral-{parameters['hidden']}-{parameters['experts']}", parameters)
    data = write_corpus_texts(
        root / "text.jsonl", parameters["sequences"], parameters["tokens"] // 4, stride=17
    )
    settings = parse_stats_config(
        {
            "tasks": [{"name": "moe", "model": str(model_dir), "data": str(data)}],
            "max_samples": parameters["sequences"],
            "max_length": parameters["tokens"],
            "dtype": "bfloat16" if cuda else "float32",
        }
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=_dtype(parameters)).to(device).eval()
    texts = [json.loads(line)["text"] for line in data.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = tokenizer(
        texts, truncation=True, max_length=parameters["tokens"], padding=True, return_tensors="pt"
    ).to(device)

    def forward(out: Path) -> None:
        with torch.inference_mode():
            model(**batch, use_cache=False)
        _synchronised(parameters)

    def collect(out: Path) -> None:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        collect_statistics(settings, out / "stats", device=device, force=True, progress=False)
        _synchronised(parameters)
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        (out / "peak.json").write_text(json.dumps({"peak_device_gib": peak}))

    return [Group([Job(FORWARD, forward), Job(COLLECT, collect, FORWARD)])]


def figures(parameters: dict[str, Any], root: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What the last collection planned and wrote (read from its folder, so a resumed run has it too)."""
    from mergekit_bmm.stats.collect import describe
    from mergekit_bmm.stats.store import load_manifest

    folder = root / "out" / "group-0" / "1"  # the collection's folder (the group's second job)
    if not (folder / "stats" / "manifest.json").is_file():
        return {}
    manifest = load_manifest(folder / "stats")
    task = manifest.tasks[0]
    peak = json.loads((folder / "peak.json").read_text())["peak_device_gib"]
    stored = sum(path.stat().st_size for path in folder.rglob("*.safetensors"))
    unreached = sum(1 for count in task.routed.values() if count == 0)
    return {
        "peak device memory": "–" if peak is None else f"{peak:.2f} GiB",
        "passes planned": task.passes,
        "statistics on disk": f"{stored / 1e6:.1f} MB",
        "expert slices without a token": f"{unreached} of {len(task.routed)}",
        "tokens": task.tokens,
        "summary": describe(manifest, folder / "stats"),
    }


WORKLOAD = Workload(
    name="moe_statistics",
    summary="per-expert activation statistics of a Mixtral-shaped model against one forward pass",
    sizes={
        "full": {
            "device": "cuda" if torch.cuda.is_available() else "cpu",
            "hidden": 4096,
            "intermediate": 14336,
            "layers": 1,
            "experts": 8,
            "top_k": 2,
            "sequences": 64,
            "tokens": 512,
            "rounds": 3,
        },
        "quick": {
            "device": "cpu",
            "hidden": 64,
            "intermediate": 128,
            "layers": 2,
            "experts": 4,
            "sequences": 8,
            "tokens": 64,
            "rounds": 1,
        },
    },
    build=build,
    figures=figures,
    notes=lambda p: (
        f"random Mixtral, hidden {p['hidden']}, MLP {p['intermediate']}, {p['layers']} layer(s), "
        f"{p['experts']} experts top-{p['top_k']}, {p['sequences']} x {p['tokens']} tokens, {p['device']}"
    ),
)
