"""What an expert's label-free reference keeps and costs: the top-k KL against the full one, on a real LM.

The agreement evaluator keeps, per position, the expert's ``k`` most likely tokens and the rest's mass,
and takes the KL on those ``k + 1`` buckets: a lower bound of the full KL. This script measures how
tight that bound is at several ``k`` (the share of the full KL it recovers, and whether it ranks
candidate models the same way), with the reference's size and the time of one expert's forward pass.

    python bench/label_free_references.py --base BASE --expert EXPERT --candidate OTHER [--candidate ...] \\
        --data TASK.jsonl [--text-field query] [--samples 64] [--k 16,64,256]

Candidates are the models compared with the expert (the base, another expert, a merge). Prints a
table and writes it as JSON next to ``--out`` when given.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
import torch


def _texts(path: Path, field: str, samples: int) -> list[str]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [str(row[field]) for row in rows if row.get("split", "train") == "train"][:samples]


@torch.inference_mode()
def _log_probs(folder: str, rows: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = [torch.log_softmax(model(torch.tensor([row])).logits[0].double(), dim=-1) for row in rows]
    del model
    return out


@click.command()
@click.option("--base", required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--expert", required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--candidate", "candidates", multiple=True, required=True, type=click.Path(exists=True))
@click.option("--data", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--text-field", default="text", show_default=True)
@click.option("--samples", default=64, show_default=True)
@click.option("--max-length", default=256, show_default=True)
@click.option("--k", "ks", default="16,64,256", show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(base, expert, candidates, data, text_field, samples, max_length, ks, out) -> None:
    from transformers import AutoTokenizer

    from mergekit_bmm.evaluation.divergence import divergence, reference_of

    tokenizer = AutoTokenizer.from_pretrained(base)
    rows = [
        tokenizer(text, truncation=True, max_length=max_length)["input_ids"]
        for text in _texts(data, text_field, samples)
    ]
    positions = sum(len(row) for row in rows)
    started = time.perf_counter()
    reference = _log_probs(expert, rows)
    expert_seconds = time.perf_counter() - started
    vocabulary = reference[0].shape[-1]
    sizes = [int(k) for k in ks.split(",")]
    table = []
    for candidate in candidates:
        merged = _log_probs(candidate, rows)
        full = sum(float((p.exp() * (p - q)).sum(-1).sum()) for p, q in zip(reference, merged)) / positions
        entry = {"candidate": str(candidate), "full_kl": full}
        for k in sizes:
            coarse = sum(
                float(divergence(q.float(), reference_of(p.float(), k), "kl").sum())
                for p, q in zip(reference, merged)
            )
            entry[f"k{k}"] = coarse / positions
        table.append(entry)
    header = f"{'candidate':<48} {'full KL':>10}" + "".join(f" {'k=' + str(k):>14}" for k in sizes)
    print(
        f"{positions} positions of {len(rows)} texts, vocabulary {vocabulary}; "
        f"expert forward pass {expert_seconds:.1f} s"
    )
    print(header)
    print("-" * len(header))
    for entry in table:
        cells = "".join(
            f" {entry[f'k{k}']:>8.4f} ({100 * entry[f'k{k}'] / entry['full_kl']:3.0f}%)" for k in sizes
        )
        print(f"{Path(entry['candidate']).name[:48]:<48} {entry['full_kl']:>10.4f}{cells}")
    print(
        "reference size per position: "
        + ", ".join(f"k={k}: {8 * k + 4} B" for k in sizes)
        + f"; full float16: {2 * vocabulary} B"
    )
    if out is not None:
        out.write_text(
            json.dumps({"positions": positions, "vocabulary": vocabulary, "rows": table}, indent=2)
        )


if __name__ == "__main__":
    main()
