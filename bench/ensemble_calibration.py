"""Accuracy vs ECE of posterior-sampled BMM ensembles against the i.i.d. baseline (paper Fig. 3 in kind).

For each β (posterior sampling, App. B) and each σ (the MAP merge perturbed with i.i.d.
Gaussian noise on the same tensors), ``mergekit-bmm-sample`` writes S merged models, the
ensemble (average of softmax probabilities) is scored on classification tasks with fixed
heads, and accuracy and ECE (20 bins) are recorded. The MAP merge (β = ∞, σ = 0) is the
baseline every row is compared with. Output: a table (printed, and ``calibration.md``),
``calibration.json`` and the Pareto plot ``calibration.png``.

The noise grid is set by *relative noise* r = rms std of (U − U_MAP) / rms(U_MAP) on the
sampled tensor: the posterior's β for r comes from its std at β = 1 (``samples.json``),
σ = r·rms(U_MAP), so both methods are compared at equal noise energy and differ only in
its shape (covariance β⁻¹(G + λ'I)⁻¹ vs σ²I).

Two setups, both scored by the search's classification scorer
(``mergekit_bmm.evaluation.classification.task_logits`` through
``mergekit_bmm.ensemble.scoring.classification_logits_fn``):

- ``--smoke``: a tiny generated encoder (Llama by default), two synthetic experts, and for
  each a synthetic 3-class task whose labels come from a noisy teacher on that expert's
  features, with a logistic-regression head fitted on the expert's features.
- ``--recipe R --tasks T --target SUBSTR``: any real ``bmm`` recipe and a classification
  evaluator config (heads + JSONL data, e.g. the merging benchmark's MiniLM heads), sampling
  the tensors whose name contains SUBSTR (the paper: the last MLP output matrix).

    python bench/ensemble_calibration.py --smoke
    python bench/ensemble_calibration.py --recipe R.yml --tasks tasks.yml --target layer.5.output.dense \
        --results bench/results/calibration-minilm6
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import resource
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache" / "calibration-smoke"
RESULTS = HERE / "results" / "calibration-smoke"
WORDS = (
    "the quick brown fox jumps over lazy dog model merging combines experts fine tuned from one "
    "pretrained bayesian solves ridge regression anchored at existing merge gaussian process proposes "
    "next strengths calibration data gives activation statistics linear module positive reviews praise "
    "acting negative complain about plot chat dort sur canapé perro corre parque hund schläft"
).split()


# ----------------------------------------------------------------------------- tasks and heads
@dataclass(frozen=True)
class HeadTask:
    """A classification task: a head safetensors file and a JSONL data file (``split`` selects lines)."""

    name: str
    head: Path
    data: Path
    split: str = "test"


def evaluator_config(tasks: list[HeadTask]):
    """The classification evaluator config of the smoke tasks (scored like search trials)."""
    from mergekit_bmm.evaluation.config import ClassificationEvaluatorConfig

    return ClassificationEvaluatorConfig(
        type="classification",
        max_length=64,
        batch_size=64,
        tasks=[{"name": t.name, "head": str(t.head), "data": str(t.data), "split": t.split} for t in tasks],
    )


# ----------------------------------------------------------------------------- the smoke setup
def fit_head(
    features: torch.Tensor, labels: torch.Tensor, classes: int, l2: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multinomial logistic regression (L-BFGS, float64) on standardised features, folded back."""
    mean, std = features.mean(0), features.std(0).clamp_min(1e-6)
    x = ((features - mean) / std).double()
    weight = torch.zeros(classes, x.shape[1], dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(classes, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=500, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ weight.T + bias, labels) + l2 * weight.pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    folded = (weight.detach() / std.double()).float()
    return folded, (bias.detach() - (weight.detach() / std.double()) @ mean.double()).float()


def build_smoke(
    work: Path, architecture: str, experts: int, strength: float, seed: int = 0
) -> tuple[dict, list[HeadTask], str]:
    """Generate base, experts, tasks and heads (cached in ``work``); return (recipe, tasks, filter)."""
    from safetensors.torch import save_file

    from mergekit_bmm.evaluation.classification import pooled_features
    from mergekit_bmm.examples.tiny_models import make_base, perturb_as_expert

    layers = 4
    marker = work / "ready.json"
    names = [f"task{t}" for t in range(experts)]
    tasks = [HeadTask(n, work / "heads" / f"{n}.safetensors", work / "data" / f"{n}.jsonl") for n in names]
    target = "layers.3.mlp.down_proj" if architecture != "bert" else "layer.3.output.dense"
    recipe = {
        "merge_method": "bmm",
        "base_model": str(work / "base"),
        "models": [
            {"model": str(work / f"expert{t}"), "parameters": {"weight": 0.5}} for t in range(experts)
        ],
        "parameters": {"anchor_method": "task_arithmetic", "lambda": 0.1, "scale": 1.0, "gram": "data_free"},
        "dtype": "float32",
    }
    settings = {"architecture": architecture, "experts": experts, "strength": strength, "seed": seed, "v": 2}
    if marker.exists() and json.loads(marker.read_text()) == settings:
        return recipe, tasks, target
    shutil.rmtree(work, ignore_errors=True)
    (work / "heads").mkdir(parents=True)
    (work / "data").mkdir()
    base, tokenizer = make_base(architecture, hidden=64, layers=layers, seed=seed)
    base.save_pretrained(work / "base")
    tokenizer.save_pretrained(work / "base")
    generator = torch.Generator().manual_seed(seed)
    texts = [
        " ".join(
            WORDS[i]
            for i in torch.randint(
                len(WORDS), (int(torch.randint(6, 16, (1,), generator=generator)),), generator=generator
            )
        )
        for _ in range(1000)
    ]
    split = ["train"] * 500 + ["test"] * 500
    for t, task in enumerate(tasks):
        expert = copy.deepcopy(base)
        perturb_as_expert(expert, seed=1000 * (seed + 1) + t, strength=strength)
        expert.save_pretrained(work / f"expert{t}")
        tokenizer.save_pretrained(work / f"expert{t}")
        features = pooled_features(expert.base_model, tokenizer, texts, max_length=64, batch_size=64)
        standardised = (features - features.mean(0)) / features.std(0).clamp_min(1e-6)
        teacher = torch.randn(standardised.shape[1], 3, generator=generator) / standardised.shape[1] ** 0.5
        logits = 3.0 * standardised @ teacher
        labels = torch.multinomial(torch.softmax(logits, 1), 1, generator=generator).squeeze(1)
        with open(task.data, "w", encoding="utf-8") as handle:
            for text, label, part in zip(texts, labels.tolist(), split):
                handle.write(json.dumps({"text": text, "label": label, "split": part}) + "\n")
        train = torch.tensor([s == "train" for s in split])
        weight, bias = fit_head(features[train], labels[train], 3, l2=1e-4)
        save_file(
            {"weight": weight.contiguous(), "bias": bias.contiguous()},
            str(task.head),
            metadata={"pooling": "mean", "labels": json.dumps(["a", "b", "c"])},
        )
    marker.write_text(json.dumps(settings))
    return recipe, tasks, target


# ----------------------------------------------------------------------------- the sweep
@dataclass
class Point:
    method: str
    parameter: float
    relative_noise: float
    accuracy: float
    ece: float
    nll: float
    member_accuracy: float
    seconds: float
    pareto: bool = False


def evaluate_point(
    recipe, out: Path, request, logits_fn, method: str, relative: float, quiet: bool
) -> tuple[Point, object]:
    from mergekit.options import MergeOptions

    from mergekit_bmm.ensemble.scoring import evaluate_ensemble, mean_over_tasks
    from mergekit_bmm.sampling.run import sample_models

    start = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    summary = sample_models(recipe, out, request, MergeOptions(quiet=True, write_model_card=False))
    scores = mean_over_tasks(
        evaluate_ensemble([out / m for m in summary.members], logits_fn, progress=not quiet)
    )
    parameter = request.beta if request.beta is not None else request.iid_sigma
    point = Point(
        method,
        parameter,
        relative,
        scores["accuracy"],
        scores["ece"],
        scores["nll"],
        scores["member_accuracy"],
        time.perf_counter() - start,
    )
    return point, summary


def expert_scores(recipe: dict, task_names: list[str], logits_fn) -> str:
    """Expert i on task i (the recipe's order): the ceiling a merge is judged against."""
    from mergekit_bmm.ensemble.metrics import accuracy, expected_calibration_error, softmax_probabilities

    experts = [m for m in recipe["models"] if not (m.get("parameters") or {}).get("anchor")]
    if len(experts) != len(task_names):
        return "n/a (experts and tasks are not paired one to one)"
    cells = []
    for model, name in zip(experts, task_names):
        logits, labels = logits_fn(Path(model["model"]))[name]
        probabilities = softmax_probabilities(logits)
        accuracy_value = accuracy(probabilities, labels)
        ece = expected_calibration_error(probabilities, labels)
        cells.append(f"{name} acc {accuracy_value:.3f} ECE {ece:.3f}")
    return ", ".join(cells)


def mark_pareto(points: list[Point]) -> None:
    """Within each method: not dominated (higher accuracy and lower ECE) by another point."""
    for point in points:
        rivals = [p for p in points if p.method == point.method and p is not point]
        point.pareto = not any(
            p.accuracy >= point.accuracy
            and p.ece <= point.ece
            and (p.accuracy > point.accuracy or p.ece < point.ece)
            for p in rivals
        )


def plot(points: list[Point], map_point: Point, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5.2, 4.0))
    styles = {
        "posterior": ("#4C72B0", "o", "BMM posterior samples (β)"),
        "iid": ("#DD8452", "s", "MAP + i.i.d. noise (σ)"),
    }
    for method, (color, marker, label) in styles.items():
        mine = sorted((p for p in points if p.method == method), key=lambda p: p.ece)
        axis.scatter(
            [p.ece for p in mine], [p.accuracy for p in mine], color=color, marker=marker, alpha=0.45
        )
        front = [p for p in mine if p.pareto]
        axis.plot(
            [p.ece for p in front], [p.accuracy for p in front], color=color, marker=marker, label=label
        )
    axis.scatter([map_point.ece], [map_point.accuracy], color="k", zorder=4, label="BMM (MAP)")
    axis.set_xlabel("ECE (20 bins) ↓")
    axis.set_ylabel("accuracy ↑")
    axis.set_title(title, fontsize=9)
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=130)
    plt.close(figure)


def table(points: list[Point], map_point: Point) -> str:
    header = (
        "| method | β or σ | noise/‖U_MAP‖ | accuracy | Δacc vs MAP | ECE | ECE / MAP | NLL | member acc | "
        "Pareto | time (s) |"
    )
    lines = [header, "|" + "---|" * 11]
    for p in [map_point, *points]:
        lines.append(
            f"| {p.method} | {p.parameter:.3g} | {p.relative_noise:.3f} | {p.accuracy:.4f} | "
            f"{p.accuracy - map_point.accuracy:+.4f} | {p.ece:.4f} | {p.ece / map_point.ece:.2f} | "
            f"{p.nll:.4f} | "
            f"{p.member_accuracy:.4f} | {'*' if p.pareto else ''} | {p.seconds:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="Build and use the tiny synthetic setup.")
    parser.add_argument("--recipe", type=Path, help="A bmm recipe to sample (instead of --smoke).")
    parser.add_argument(
        "--tasks", type=Path, help="Classification evaluator config (or a search.yml) for --recipe."
    )
    parser.add_argument("--split", default="test", help="Split of --tasks to score (default: test).")
    parser.add_argument("--target", help="Sample tensors whose name contains this (with --recipe).")
    parser.add_argument("--label", default=None, help="Plot title for --recipe runs.")
    parser.add_argument("--architecture", choices=["llama", "bert"], default="llama")
    parser.add_argument("--experts", type=int, default=2)
    parser.add_argument("--strength", type=float, default=0.3, help="Size of the synthetic experts' updates.")
    parser.add_argument("--samples", type=int, default=10, help="Ensemble size S (the paper: 10).")
    parser.add_argument(
        "--ratios",
        default="0.5,1,2,4,8,16,32",
        help="Relative noise levels r (comma-separated), mapped to β and σ.",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--work", type=Path, default=CACHE, help="Models, tasks and samples (large; git-ignored)."
    )
    parser.add_argument("--results", type=Path, default=RESULTS, help="Table, JSON and plot.")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (tiny models gain nothing).")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke == bool(args.recipe):
        parser.error("give either --smoke or --recipe (with --tasks and --target)")
    if args.recipe and not (args.tasks and args.target):
        parser.error("--recipe needs --tasks and --target")
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)

    from mergekit_bmm.plugin import activate

    activate()
    from mergekit_bmm.ensemble.scoring import classification_logits_fn
    from mergekit_bmm.ensemble.tasks import load_classification_tasks
    from mergekit_bmm.evaluation.classification import load_examples
    from mergekit_bmm.sampling.run import SamplingRequest

    started = time.perf_counter()
    if args.smoke:
        recipe, tasks, target = build_smoke(
            args.work / "setup", args.architecture, args.experts, args.strength, args.seed
        )
        config = evaluator_config(tasks)
        title = f"smoke: tiny {args.architecture}, {args.experts} synthetic tasks, S={args.samples}"
    else:
        import yaml

        recipe = yaml.safe_load(args.recipe.read_text(encoding="utf-8"))
        config = load_classification_tasks(args.tasks, args.split)
        target = args.target
        title = f"{args.label or args.recipe.stem}: {len(config.tasks)} tasks, S={args.samples}"
    task_names = [task.name for task in config.tasks]
    logits_fn = classification_logits_fn(config)
    samples_dir = args.work / "samples"
    print(
        f"setup ready in {time.perf_counter() - started:.1f} s; sampling {target!r}, S = {args.samples}",
        flush=True,
    )

    # MAP (β = ∞ draws nothing; β = 1 with S = 1 also gives the posterior scale at β = 1)
    from mergekit.options import MergeOptions

    from mergekit_bmm.sampling.run import sample_models

    shutil.rmtree(samples_dir / "probe", ignore_errors=True)
    probe = sample_models(
        recipe,
        samples_dir / "probe",
        SamplingRequest(1, beta=1.0, name_filter=target),
        MergeOptions(quiet=True, write_model_card=False),
    )
    record = probe.tensors[0]
    map_point, _ = evaluate_point(
        recipe,
        samples_dir / "map",
        SamplingRequest(1, beta=math.inf, name_filter=target),
        logits_fn,
        "MAP",
        0.0,
        True,
    )
    map_point.parameter = math.inf
    experts_line = expert_scores(recipe, task_names, logits_fn)
    print(f"MAP: acc {map_point.accuracy:.4f}  ECE {map_point.ece:.4f}; experts on own tasks: {experts_line}")
    points = []
    for ratio in [float(r) for r in args.ratios.split(",")]:
        beta = (record.posterior_std_at_beta_1 / (ratio * record.map_rms)) ** 2
        sigma = ratio * record.map_rms
        for method, request in (
            ("posterior", SamplingRequest(args.samples, beta=beta, name_filter=target, seed=args.seed)),
            ("iid", SamplingRequest(args.samples, iid_sigma=sigma, name_filter=target, seed=args.seed)),
        ):
            point, _ = evaluate_point(
                recipe, samples_dir / f"{method}-{ratio}", request, logits_fn, method, ratio, args.quiet
            )
            points.append(point)
            print(
                f"  {method:<9} r={ratio:<5} acc {point.accuracy:.4f}  ECE {point.ece:.4f}"
                f"  ({point.seconds:.1f} s)",
                flush=True,
            )
    mark_pareto(points)

    args.results.mkdir(parents=True, exist_ok=True)
    title += f"\nsampled: {target}"
    plot(points, map_point, args.results / "calibration.png", title)
    text = table(points, map_point)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    examples = len(load_examples(config.tasks[0])[1])
    footer = (
        "\nMAP: β = ∞ (no noise). noise/‖U_MAP‖ = r: rms std of U − U_MAP over rms(U_MAP) on the sampled "
        f"tensor; posterior std at β = 1 is {record.posterior_std_at_beta_1:.4g}, rms(U_MAP) "
        f"{record.map_rms:.4g}.\nAccuracy and ECE are unweighted means over {len(task_names)} tasks "
        f"({examples} {args.split} examples in the first); each expert on its own task: {experts_line}.\n"
        f"Total {time.perf_counter() - started:.0f} s, peak RSS {peak_mb:.0f} MB."
    )
    (args.results / "calibration.md").write_text(
        f"# {title.replace(chr(10), '; ')}\n\n{text}\n{footer}\n", encoding="utf-8"
    )
    (args.results / "calibration.json").write_text(
        json.dumps(
            {
                "setup": vars(args)
                | {"work": str(args.work), "results": str(args.results), "target": target},
                "map": map_point.__dict__,
                "points": [p.__dict__ for p in points],
                "posterior_std_at_beta_1": record.posterior_std_at_beta_1,
                "map_rms": record.map_rms,
            },
            indent=2,
            default=str,
        ),
        encoding="utf-8",
    )
    print("\n" + text + footer)
    print(f"\nwrote {args.results / 'calibration.png'}, calibration.md and calibration.json")


if __name__ == "__main__":
    sys.exit(main())
