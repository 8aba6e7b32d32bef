"""``mergekit-bmm-demo``: experts made locally, merged, searched, and their test accuracy.

The job itself is :mod:`mergekit_bmm.examples.demo_run`; ``--weights`` keeps the earlier
demo, a weight-space comparison of ``task_arithmetic`` and ``bmm`` on random tiny experts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import torch
import yaml

from mergekit_bmm.cli.options import command, output_path


def _recipe(family, method: str) -> dict:
    models = [{"model": str(path), "parameters": {"weight": 0.3}} for path in family.experts]
    recipe = {"merge_method": method, "base_model": str(family.base), "models": models, "dtype": "float32"}
    if method == "bmm":
        recipe["parameters"] = {
            "anchor_method": "task_arithmetic",
            "lambda": 0.05,
            "scale": 1.0,
            "gram": "data_free",
        }
    return recipe


def _merge(recipe_path: Path, out_dir: Path) -> float:
    command = [
        str(Path(sys.executable).parent / "mergekit-yaml"),
        str(recipe_path),
        str(out_dir),
        "--quiet",
    ]
    start = time.perf_counter()
    result = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    if result.returncode != 0:
        raise click.ClickException(f"mergekit-yaml failed on {recipe_path}:\n{result.stderr[-2000:]}")
    return time.perf_counter() - start


def _metrics(merged: dict, base: dict, experts: list[dict], rank: int = 4) -> dict[str, list[float]]:
    """Per module group, per expert: weight distance and error on the expert's directions.

    * ``dist``: ‖W_merged − W_t‖ / ‖W_t‖ (weight space);
    * ``task``: ‖(W_merged − W_t) V_t‖ / ‖U_t V_t‖ with V_t the top right singular vectors
      of U_t = W_t − W_pre: how well the merge keeps what expert t does on the inputs it
      was tuned for (the quantity BMM's regression targets).
    """
    from mergekit_bmm.core.module_map import classify

    sums: dict[str, list[float]] = {}
    counts: dict[str, int] = {}
    for name, tensor in merged.items():
        info = classify(name) if tensor.ndim == 2 else None
        if info is None:
            continue
        flip = (lambda m: m.T) if info.stored_in_out else (lambda m: m)
        merged_w = flip(tensor.double())
        values = []
        for expert in experts:
            target = flip(expert[name].double())
            delta = target - flip(base[name].double())
            directions = torch.linalg.svd(delta, full_matrices=False).Vh[:rank].T
            values.append(((merged_w - target).norm() / target.norm()).item())
            values.append(
                ((merged_w - target) @ directions).norm().item() / (delta @ directions).norm().item()
            )
        for key in (info.group.value, "all"):
            row = sums.setdefault(key, [0.0] * len(values))
            sums[key] = [a + b for a, b in zip(row, values)]
            counts[key] = counts.get(key, 0) + 1
    return {key: [value / counts[key] for value in row] for key, row in sums.items()}


@command("mergekit-bmm-demo")
@output_path(required=False)
@click.option(
    "--weights",
    is_flag=True,
    help="Instead: the weight-space comparison of task_arithmetic and bmm on random tiny experts (16 s).",
)
@click.option(
    "--architecture",
    type=click.Choice(["llama", "qwen2", "mistral", "gpt2", "bert"]),
    default=None,
    help="Architecture of the --weights comparison's random models (llama; implies --weights).",
)
@click.option("--small", is_flag=True, help="A reduced run (under 30 s): its accuracies mean nothing.")
def main(out_path: str | None, weights: bool, architecture: str | None, small: bool) -> None:
    """Make four experts locally, merge them (Task Arithmetic, TIES, bmm), search bmm's λ and s,
    and print test accuracy; models, recipes, merges and the search go to OUT_PATH (default: a new
    temporary folder)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    root = Path(out_path) if out_path else Path(tempfile.mkdtemp(prefix="bmm-demo-"))
    if root.exists() and any(root.iterdir()):
        raise click.UsageError(f"{root} is not empty; pass a new OUT_PATH folder (nothing is overwritten)")
    if weights or architecture:
        _weight_space(root, architecture or "llama")
        return
    from mergekit_bmm.examples.demo_run import run_demo, table, what_next
    from mergekit_bmm.examples.demo_training import FULL, SMALL

    result = run_demo(root, SMALL if small else FULL, say=click.echo)
    click.echo("")
    click.echo(table(result))
    click.echo(
        f"\n(wall time {result.seconds['total']:.0f} s; held-out test split, "
        f"{'reduced run' if small else f'{FULL.test} examples per task'})"
    )
    click.echo(what_next(result))


def _weight_space(root: Path, architecture: str) -> None:
    """The weight-space comparison: how far each merge is from every expert, per module group."""
    from mergekit_bmm.examples.tiny_models import make_tiny_family
    from mergekit_bmm.io.checkpoint import load_state_dict

    click.echo(f"[1/3] generating a tiny {architecture} base and 3 experts in {root}/models ...")
    family = make_tiny_family(root / "models", architecture, n_experts=3)
    base = load_state_dict(family.base)
    experts = [load_state_dict(path) for path in family.experts]

    results = {}
    for step, method in enumerate(("task_arithmetic", "bmm"), start=2):
        recipe_path = root / f"{method}.yml"
        recipe_path.write_text(yaml.safe_dump(_recipe(family, method), sort_keys=False))
        click.echo(f"[{step}/3] mergekit-yaml {recipe_path.name} -> {root / method} ...")
        seconds = _merge(recipe_path, root / method)
        results[method] = (seconds, _metrics(load_state_dict(root / method), base, experts))

    _print_table(results, [path.name for path in family.experts])
    folders = ", ".join(f"{path.name}/" for path in [family.base, *family.experts])
    click.echo(f"\nmodels (with tokenizers): {root / 'models'}/ ({folders})")
    click.echo(f"recipes: {root}/task_arithmetic.yml, {root}/bmm.yml")
    click.echo(f"merged:  {root}/task_arithmetic/, {root}/bmm/")
    click.echo("Merge again, or edit a recipe first: mergekit-yaml <recipe> <new folder>")


def _print_table(results: dict, names: list[str]) -> None:
    columns = [f"{kind} {name[-1]}" for name in names for kind in ("dist", "task")]
    header = f"{'method':<16} {'group':<9} " + " ".join(f"{c:>8}" for c in columns) + f" {'time (s)':>9}"
    click.echo("\ndist X: ||W_merged - W_X|| / ||W_X||   (weight space)")
    click.echo(
        "task X: ||(W_merged - W_X) V_X|| / ||(W_X - W_pre) V_X||   (on expert X's top-4 input directions)"
    )
    click.echo("Means over the 2D body weights of each module group; lower is better.\n")
    click.echo(header)
    click.echo("-" * len(header))
    for method, (seconds, table) in results.items():
        for group in ("attn_in", "attn_out", "mlp_in", "mlp_out", "all"):
            cells = " ".join(f"{value:>8.4f}" for value in table[group])
            timing = f"{seconds:>9.2f}" if group == "all" else ""
            click.echo(f"{method:<16} {group:<9} {cells} {timing}".rstrip())
    click.echo("\ntime: wall time of the whole mergekit-yaml command (mostly start-up on tiny models).")


if __name__ == "__main__":
    main()
