"""What the model-card step adds to a ``bmm`` merge, and what ``mergekit-bmm-publish`` checks cost.

The card hook fingerprints and SHA-256-hashes the merged weights and builds the card right
after mergekit writes them. This script merges a locally generated Llama-shaped family
in-process with the card step off (mergekit's ``write_model_card=False``) and on, and
times the parts: merge record (fingerprint + SHA-256), card text, and the publish checks.

    python bench/card_overhead.py [--hidden 512] [--layers 8] [--repeats 3]
"""

from __future__ import annotations

import copy
import resource
import statistics
import tempfile
import time
from pathlib import Path

import click


def _merge(config: dict, out: Path, write_card: bool, text: str) -> float:
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    start = time.perf_counter()
    run_merge(
        MergeConfiguration.model_validate(copy.deepcopy(config)),
        str(out),
        options=MergeOptions(copy_tokenizer=False, quiet=True, write_model_card=write_card),
        config_source=text,
    )
    return time.perf_counter() - start


def _timed(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@click.command()
@click.option("--hidden", default=512, show_default=True, help="hidden size of the generated models")
@click.option("--layers", default=8, show_default=True, help="layers of the generated models")
@click.option("--repeats", default=3, show_default=True, help="runs per measurement (median)")
def main(hidden: int, layers: int, repeats: int) -> None:
    import yaml

    from mergekit_bmm.plugin import activate

    activate()
    from mergekit_bmm.cards.card import merge_card, record_merge
    from mergekit_bmm.cards.publish import check_folder
    from mergekit_bmm.examples.tiny_models import make_tiny_family
    from mergekit_bmm.io.fingerprint import weight_files

    with tempfile.TemporaryDirectory() as root:
        root = Path(root)
        family = make_tiny_family(root / "models", "llama", n_experts=3, hidden=hidden, layers=layers)
        config = {
            "merge_method": "bmm",
            "base_model": str(family.base),
            "models": [{"model": str(p), "parameters": {"weight": 0.3}} for p in family.experts],
            "parameters": {"lambda": 0.05},
            "dtype": "float32",
        }
        text = yaml.safe_dump(config, sort_keys=False)
        _merge(config, root / "warmup", True, text)  # imports, loader cache
        plain = statistics.median(_merge(config, root / f"off{i}", False, text) for i in range(repeats))
        carded = statistics.median(_merge(config, root / f"on{i}", True, text) for i in range(repeats))
        out = root / "on0"
        size = sum(p.stat().st_size for p in weight_files(out)) / 1e6
        record = _timed(lambda: record_merge(out, text), repeats)
        card = _timed(lambda: merge_card(text, out_dir=out), repeats)
        checks = _timed(lambda: check_folder(out), repeats)

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    click.echo(f"tiny Llama, hidden {hidden}, {layers} layers, 3 experts: {size:.1f} MB of merged weights")
    click.echo(f"{'step':<34}{'time (s)':>10}{'vs merge':>10}")
    rows = [
        ("merge, card step off", plain),
        ("merge, card step on", carded),
        ("  merge record (fingerprint+sha)", record),
        ("  card text", card),
        ("publish checks (no upload)", checks),
    ]
    for name, seconds in rows:
        click.echo(f"{name:<34}{seconds:>10.3f}{seconds / plain:>9.2f}x")
    click.echo(f"peak RSS {peak:.0f} MB")


if __name__ == "__main__":
    main()
