"""Wall time and peak memory of every anchor merge, standalone and as bmm's anchor.

A tiny model family (``mergekit_bmm.examples.tiny_models``) merged with each method through
mergekit's ``run_merge``, every run in a process forked after all imports and warm-ups (times exclude
Python start-up; memory is the run's own), all methods alternating with Task Arithmetic round by round
(:mod:`bench.perf.harness`). RegMean reads a statistics directory of random Grams (its cost does not
depend on their values). Writes ``anchor_speed.png``: each method's time relative to Task Arithmetic.

    python -m bench.perf anchor_speed                        # hidden 256, 4 layers, 3 experts
    python -m bench.perf anchor_speed --set hidden=64 --rounds 5
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.perf.harness import Group, Job, Workload, fresh

BASELINE = "task_arithmetic"


def standalone(method: str, **parameters) -> dict:
    return {"merge_method": method, "parameters": parameters}


def over(anchor: str, **parameters) -> dict:
    return {"merge_method": "bmm", "parameters": {"anchor_method": anchor, "lambda": 0.05, **parameters}}


def cases(stats_dir: Path) -> dict[str, dict]:
    """Label → recipe fragment. Per-model parameters: ``weight`` 0.3 / ``density`` 0.2 where used."""
    stats = str(stats_dir)
    return {
        BASELINE: standalone(BASELINE, weight=0.3),
        "ties": standalone("ties", weight=1.0, density=0.2),
        "tsv": standalone("tsv"),
        "iso_c": standalone("iso_c"),
        "iso_cts": standalone("iso_cts"),
        "wudi": standalone("wudi"),
        "wudi (closed_form)": standalone("wudi", solver="closed_form"),
        "regmean": standalone("regmean", stats=stats),
        "bmm / pretrained": over("pretrained"),
        "bmm / task_arithmetic": over(BASELINE, weight=0.3),
        "bmm / ties": over("ties", weight=1.0, density=0.2),
        "bmm / tsv": over("tsv"),
        "bmm / iso_c": over("iso_c"),
        "bmm / iso_cts": over("iso_cts"),
        "bmm / wudi": over("wudi"),
        "bmm / wudi (closed_form)": over("wudi", solver="closed_form"),
        "bmm / regmean": over("regmean", stats=stats),
        "bmm / wudi materialised": {
            "merge_method": "bmm",
            "parameters": {"lambda": 0.05},
            "anchor_input": "wudi",
        },
    }


def recipe(family, fragment: dict, anchors: dict[str, Path]) -> dict:
    parameters = dict(fragment["parameters"])
    per_model = {key: parameters.pop(key) for key in ("weight", "density") if key in parameters}
    models = [{"model": str(path), "parameters": dict(per_model)} for path in family.experts]
    if "anchor_input" in fragment:
        models.append({"model": str(anchors[fragment["anchor_input"]]), "parameters": {"anchor": True}})
    return {
        "merge_method": fragment["merge_method"],
        "base_model": str(family.base),
        "models": models,
        "parameters": parameters,
        "dtype": "float32",
    }


def warm_up() -> None:
    """Import everything a merge touches once, so forked children do not pay for it."""
    import mergekit.merge  # noqa: F401

    from mergekit_bmm.plugin import activate

    activate()
    from mergekit_bmm.core import iso_cts_merge, regmean_merge, tsv_merge, wudi_merge

    vectors = [torch.randn(8, 6) for _ in range(2)]
    wudi_merge(vectors, iterations=2)  # first Adam step imports torch's compiler stack
    tsv_merge(vectors)
    iso_cts_merge(vectors)
    regmean_merge(vectors, [torch.eye(6)] * 2)


def picture(rows: list[dict[str, Any]], path: Path) -> Path:
    """Each method's wall time relative to Task Arithmetic's, log scale."""
    from bench.merging.report.plots import _pyplot, _save

    plt = _pyplot()
    labels = [row["label"] for row in rows]
    ratios = [row.get("ratio", 1.0) for row in rows]
    figure, axis = plt.subplots(figsize=(8, 0.35 * len(rows) + 1))
    axis.barh(labels[::-1], ratios[::-1], color="tab:blue")
    axis.axvline(1.0, color="gray", linestyle="--", linewidth=1)
    axis.set_xscale("log")
    axis.set_xlabel(f"wall time relative to {BASELINE} (log scale; median of the rounds' ratios)")
    return _save(figure, path, 120)


def merge_job(config: dict[str, Any]) -> Callable[[Path], object]:
    """One ``run_merge`` of ``config`` into the run's folder (no tokenizer, no card)."""

    def run(out: Path) -> None:
        from mergekit.config import MergeConfiguration
        from mergekit.merge import run_merge
        from mergekit.options import MergeOptions

        options = MergeOptions(copy_tokenizer=False, quiet=True, write_model_card=False)
        run_merge(MergeConfiguration.model_validate(config), str(out), options=options)

    return run


def build(parameters: dict[str, Any], root: Path) -> list[Group]:
    """Every method (``only``: a comma-separated few) alternating with Task Arithmetic, forked runs."""
    from mergekit_bmm.examples.synthetic_stats import stats_for_family
    from mergekit_bmm.examples.tiny_models import make_tiny_family

    threads = parameters["threads"] or torch.get_num_threads()
    torch.set_num_threads(1)  # the merges run on ``threads`` in their own processes
    warm_up()
    family = make_tiny_family(
        root / "models",
        "llama",
        n_experts=parameters["experts"],
        hidden=parameters["hidden"],
        layers=parameters["layers"],
    )
    stats_dir, _ = stats_for_family(root / "stats", family)
    selected = cases(stats_dir)
    if parameters["only"]:
        wanted = {BASELINE, *parameters["only"].split(",")}
        selected = {label: fragment for label, fragment in selected.items() if label in wanted}
    anchors = {}
    if any("anchor_input" in fragment for fragment in selected.values()):
        anchors["wudi"] = root / "wudi-anchor"
        merge_job(recipe(family, standalone("wudi"), {}))(fresh(anchors["wudi"]))
    jobs = [
        Job(label, merge_job(recipe(family, fragment, anchors)), None if label == BASELINE else BASELINE)
        for label, fragment in selected.items()
    ]
    return [Group(jobs, fork=True, threads=threads)]


WORKLOAD = Workload(
    name="anchor_speed",
    summary="every anchor merge, alone and as bmm's anchor, against Task Arithmetic (time, memory)",
    sizes={
        "full": {"hidden": 256, "layers": 4, "experts": 3, "threads": 0, "only": "", "rounds": 3},
        "quick": {
            "hidden": 32,
            "layers": 1,
            "experts": 2,
            "threads": 1,
            "only": "ties,bmm / task_arithmetic",
            "rounds": 1,
        },
    },
    build=build,
    notes=lambda p: (
        f"tiny Llama, hidden {p['hidden']}, {p['layers']} layers, {p['experts']} experts, float32"
    ),
    picture=picture,
)
