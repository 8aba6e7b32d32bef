"""Helpers shared by the parallel-search tests (local workers, Ray, interrupts): a tiny family and
a search over it scored by an objective of ``search_objectives.py``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mergekit_bmm.search import SearchOptions, parse_search_config, run_search

TESTS = Path(__file__).parent
BIN = Path(sys.executable).parent


def make_family(root: Path):
    from mergekit_bmm.examples.tiny_models import make_tiny_family

    return make_tiny_family(root, "llama", n_experts=3, hidden=16, layers=2)


def config_dict(
    family, function: str = "per_task_scores", workers: int = 2, backend: str = "local", **fields
):
    return {
        "recipe": {
            "merge_method": "bmm",
            "base_model": str(family.base),
            "models": [{"model": str(p), "parameters": {"weight": 0.3}} for p in family.experts],
            "parameters": {"anchor_method": "task_arithmetic"},
            "dtype": "float32",
        },
        "blocks": 1,
        "evaluator": {
            "type": "python",
            "callable": f"search_objectives:{function}",
            "python_path": [str(TESTS)],
            "args": fields.pop("args", {}),
        },
        "parallel": {"workers": workers, "backend": backend},
        **fields,
    }


def search(family, out: Path, **fields):
    config = parse_search_config(config_dict(family, **fields), TESTS)
    return run_search(config, out, SearchOptions(progress=False, device="cpu", plots=False, skip_best=True))


def serial_search(family, out: Path):
    """The serial random search every parallel one is compared with."""
    return search(family, out, strategy="random", budget=6, workers=1)


def by_point(records):
    return {json.dumps(r.values, sort_keys=True): r.per_task for r in records}
