"""``python -m mergekit_bmm.examples.make_tiny OUT``: a tiny base model and experts to try the commands on.

Writes ``OUT/base`` and ``OUT/expert-a``, ``OUT/expert-b``, ... (safetensors and a
tokenizer; nothing is downloaded), so the example configs run after replacing their
``/models/`` placeholders with ``OUT/``.
"""

from __future__ import annotations

import click


@click.command("make_tiny")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option(
    "--architecture",
    default="llama",
    show_default=True,
    type=click.Choice(["llama", "qwen2", "mistral", "gpt2", "bert"]),
)
@click.option("--experts", default=3, show_default=True, type=click.IntRange(1, 26))
@click.option("--hidden", default=64, show_default=True, type=click.IntRange(8))
@click.option("--layers", default=4, show_default=True, type=click.IntRange(1))
@click.option("--seed", default=0, show_default=True)
def main(out_dir: str, architecture: str, experts: int, hidden: int, layers: int, seed: int) -> None:
    """Generate a tiny base model and synthetic experts in OUT_DIR."""
    from mergekit_bmm.examples.tiny_models import make_tiny_family

    family = make_tiny_family(out_dir, architecture, experts, hidden, layers, seed)
    click.echo(f"base: {family.base}")
    for path in family.experts:
        click.echo(f"expert: {path}")


if __name__ == "__main__":
    main()
