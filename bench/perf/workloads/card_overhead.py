"""What the model-card step adds to a ``bmm`` merge, and what ``mergekit-bmm-publish`` checks cost.

The card hook fingerprints and SHA-256-hashes the merged weights and builds the card right after
mergekit writes them. A locally generated Llama-shaped family is merged in this process with the card
step off (mergekit's ``write_model_card=False``) and on, alternating round by round with the parts
timed on a merged folder: the merge record (fingerprint + SHA-256), the card text and the publish
checks, each against the merge without a card (:mod:`bench.perf.harness`).

    python -m bench.perf card_overhead [--set hidden=512] [--set layers=8] [--rounds 3]
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.perf.harness import Group, Job, Workload, fresh

PLAIN = "merge, card step off"


def _merge(config: dict[str, Any], text: str, write_card: bool) -> Callable[[Path], object]:
    def run(out: Path) -> None:
        from mergekit.config import MergeConfiguration
        from mergekit.merge import run_merge
        from mergekit.options import MergeOptions

        options = MergeOptions(copy_tokenizer=False, quiet=True, write_model_card=write_card)
        run_merge(MergeConfiguration.model_validate(copy.deepcopy(config)), str(out), options, text)

    return run


def build(parameters: dict[str, Any], root: Path) -> list[Group]:
    import yaml

    from mergekit_bmm.cards.card import merge_card, record_merge
    from mergekit_bmm.cards.publish import check_folder
    from mergekit_bmm.examples.tiny_models import make_tiny_family
    from mergekit_bmm.plugin import activate

    activate()
    family = make_tiny_family(
        root / "models", "llama", n_experts=3, hidden=parameters["hidden"], layers=parameters["layers"]
    )
    config = {
        "merge_method": "bmm",
        "base_model": str(family.base),
        "models": [{"model": str(p), "parameters": {"weight": 0.3}} for p in family.experts],
        "parameters": {"lambda": 0.05},
        "dtype": "float32",
    }
    text = yaml.safe_dump(config, sort_keys=False)
    merged = root / "merged"  # the folder the parts read (made once, untimed)
    _merge(config, text, True)(fresh(merged))
    return [
        Group(
            [
                Job(PLAIN, _merge(config, text, False)),
                Job("merge, card step on", _merge(config, text, True), PLAIN),
                Job("merge record (fingerprint + SHA-256)", lambda out: record_merge(merged, text), PLAIN),
                Job("card text", lambda out: merge_card(text, out_dir=merged), PLAIN),
                Job("publish checks (no upload)", lambda out: check_folder(merged), PLAIN),
            ]
        )
    ]


WORKLOAD = Workload(
    name="card_overhead",
    summary="the model card's merge record and text, and the publish checks, against a merge without them",
    sizes={
        "full": {"hidden": 512, "layers": 8, "rounds": 3},
        "quick": {"hidden": 32, "layers": 1, "rounds": 1},
    },
    build=build,
    notes=lambda p: f"tiny Llama, hidden {p['hidden']}, {p['layers']} layers, 3 experts, float32",
)
