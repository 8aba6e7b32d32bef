"""Statistics directories with made-up Grams, written with the real store format.

Tests and benchmarks of methods that read activation statistics (``regmean``, data-assisted
``bmm``) need Grams for given experts without running a calibration pass.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from mergekit_bmm import __version__
from mergekit_bmm.io.fingerprint import model_fingerprint, reference_fingerprint
from mergekit_bmm.stats.gram_storage import from_mean
from mergekit_bmm.stats.store import StatsManifest, TaskStats, write_manifest, write_part


def random_gram(size: int, generator: torch.Generator, tokens: int | None = None) -> torch.Tensor:
    """A mean Gram ``XᵀX/N`` of random activations with uneven feature scales."""
    tokens = tokens or 4 * size
    x = torch.randn(tokens, size, generator=generator, dtype=torch.float64)
    x = x * torch.linspace(0.3, 2.0, size, dtype=torch.float64)
    return (x.T @ x / tokens).float()


def write_stats(
    stats_dir: Path,
    experts: Sequence[str | Path],
    grams: Mapping[str, Sequence[torch.Tensor]],
    modules: Mapping[str, str] | None = None,
) -> Path:
    """Write ``grams`` (stored key → one Gram per expert, in order) as a statistics directory;
    ``modules`` maps each weight name to its key (default: each key serves the weight of its name)."""
    stats_dir = Path(stats_dir)
    tasks = []
    for index, expert in enumerate(experts):
        folder = f"task{index}"
        stored = {name: from_mean(per_task[index], 64) for name, per_task in grams.items()}
        part = write_part(stats_dir, folder, 1, stored)
        tasks.append(
            TaskStats(
                name=folder,
                model=str(expert),
                fingerprint=_fingerprint(expert),
                file=folder,
                samples=8,
                tokens=64,
                parts=dict.fromkeys(grams, part),
                passes=1,
            )
        )
    modules = dict(modules) if modules is not None else {name: name for name in grams}
    manifest = StatsManifest(package_version=__version__, tasks=tasks, modules=modules)
    write_manifest(stats_dir, manifest)
    return stats_dir


def _fingerprint(expert: str | Path) -> str:
    """A checkpoint's fingerprint; a LoRA expert's (``BASE+ADAPTER``) covers both."""
    if "+" in str(expert):
        return reference_fingerprint(str(expert))
    return model_fingerprint(expert)


def input_size(name: str, tensor: torch.Tensor, stored_in_out: bool) -> int:
    return tensor.shape[0] if stored_in_out else tensor.shape[1]


def stats_for_family(stats_dir: Path, family, seed: int = 0) -> tuple[Path, dict[str, list[torch.Tensor]]]:
    """Random Grams for every body weight of a family's experts (``family``: ``base``,
    ``experts``, ``architecture``, as :func:`~mergekit_bmm.examples.tiny_models.make_tiny_family`
    returns)."""
    from mergekit_bmm.core.module_map import classify
    from mergekit_bmm.io.checkpoint import load_state_dict

    generator = torch.Generator().manual_seed(seed)
    grams: dict[str, list[torch.Tensor]] = {}
    for name, tensor in load_state_dict(family.base).items():
        info = classify(name, family.architecture) if tensor.ndim == 2 else None
        if info is None:
            continue
        size = input_size(name, tensor, info.stored_in_out)
        grams[name] = [random_gram(size, generator) for _ in family.experts]
    return write_stats(stats_dir, family.experts, grams), grams
