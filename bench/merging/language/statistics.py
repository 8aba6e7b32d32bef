"""Activation statistics of the language track's experts (dense or ``BASE+ADAPTER``) on their tasks'
training prompts: what data-assisted BMM and RegMean read (``mergekit-bmm-stats``, cached, resumed)."""

from __future__ import annotations

from pathlib import Path

from bench.merging.cache import stable_key

MAX_SAMPLES = 128  # prompts per task, as the encoder track's statistics


def expert_statistics(cache_dir: Path, experts: list, tasks, max_length: int) -> Path:
    """The statistics directory of ``experts`` (one per task, in order) on each task's training
    prompts (its ``query`` field; no answer, no label). Collected once; a rerun resumes or reuses it."""
    from mergekit_bmm.stats.collect import collect_statistics
    from mergekit_bmm.stats.config import parse_stats_config

    entries = [
        {
            "name": task.name,
            "model": str(expert),
            "data": str(task.file("train")),
            "text_field": "query",
            "split": "train",
        }
        for task, expert in zip(tasks, experts)
    ]
    settings = {"tasks": entries, "max_samples": MAX_SAMPLES, "max_length": max_length}
    folder = cache_dir / "language" / "stats" / stable_key(settings, 16)
    config = parse_stats_config(settings)
    print(f"LM stats  {len(entries)} experts on their training prompts -> {folder}", flush=True)
    collect_statistics(config, folder, progress=False)
    return folder
