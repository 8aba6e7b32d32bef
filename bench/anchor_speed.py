"""Wall time and peak memory of every anchor merge, standalone and as bmm's anchor.

Generates a tiny model family (``mergekit_bmm.examples.tiny_models``), then merges it with each
method through mergekit's ``run_merge``. Every measurement runs in a process forked after all
imports and warm-ups, so times exclude Python start-up; peak memory is the growth of that
process's peak RSS during the merge (Linux ``VmHWM``, reset at the start). Ratios are against
``task_arithmetic`` measured in the same run. RegMean reads a statistics directory of random
Grams (its cost does not depend on their values).

    python bench/anchor_speed.py                       # hidden 256, 4 layers, 3 experts
    python bench/anchor_speed.py --hidden 64 --repeats 5 --out bench-out/
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from bench.common import reset_peak_rss, status_mib

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


def _merge_in_child(connection, config: dict, out_dir: str, threads: int) -> None:
    torch.set_num_threads(threads)
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    try:
        reset_peak_rss()
        start_rss = status_mib("VmRSS")
        start = time.perf_counter()
        run_merge(
            MergeConfiguration.model_validate(config),
            out_dir,
            options=MergeOptions(copy_tokenizer=False, quiet=True, write_model_card=False),
        )
        elapsed = time.perf_counter() - start
        connection.send(("ok", elapsed, max(status_mib("VmHWM") - start_rss, 0)))
    except Exception as error:  # reported by the parent
        connection.send(("error", f"{type(error).__name__}: {error}", 0.0))
    finally:
        connection.close()


def measure(config: dict, out_dir: Path, threads: int) -> tuple[float, float]:
    """(seconds, peak RSS growth in MiB) of one merge in a forked process on ``threads`` threads.

    The parent runs torch on one thread only: a forked child of a process whose OpenMP pool
    has started can hang in its first parallel region (GNU OpenMP is not fork-safe).
    """
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_merge_in_child, args=(send, config, str(out_dir), threads))
    process.start()
    send.close()
    status, value, memory = receive.recv()
    process.join()
    if status != "ok":
        raise RuntimeError(f"merge failed: {value}")
    return value, memory


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


def table(rows: list[dict]) -> str:
    base = next(row for row in rows if row["method"] == BASELINE)
    width = max(len(row["method"]) for row in rows)
    lines = [
        f"{'method':<{width}}  {'time (s)':>9}  {'× TA':>7}  {'peak Δ MiB':>10}  {'× TA':>7}",
        "-" * (width + 43),
    ]
    for row in rows:
        time_ratio = row["seconds"] / base["seconds"]
        memory_ratio = row["peak_mib"] / base["peak_mib"] if base["peak_mib"] > 0 else float("nan")
        lines.append(
            f"{row['method']:<{width}}  {row['seconds']:>9.3f}  {time_ratio:>7.2f}  "
            f"{row['peak_mib']:>10.1f}  {memory_ratio:>7.2f}"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = next(row for row in rows if row["method"] == BASELINE)["seconds"]
    labels = [row["method"] for row in rows]
    ratios = [row["seconds"] / base for row in rows]
    figure, axis = plt.subplots(figsize=(8, 0.35 * len(rows) + 1))
    axis.barh(labels[::-1], ratios[::-1], color="tab:blue")
    axis.axvline(1.0, color="gray", linestyle="--", linewidth=1)
    axis.set_xscale("log")
    axis.set_xlabel(f"wall time relative to {BASELINE} (log scale)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--architecture", default="llama")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="merges per method; the median is reported")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--only", nargs="*", help="labels to run (task_arithmetic always runs)")
    parser.add_argument("--out", type=Path, help="also write results.json and anchors.png here")
    args = parser.parse_args(argv)

    from tqdm import tqdm

    from mergekit_bmm.examples.synthetic_stats import stats_for_family
    from mergekit_bmm.examples.tiny_models import make_tiny_family

    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(1)  # the merges run on ``threads`` in their own processes (see measure)
    warm_up()
    with tempfile.TemporaryDirectory(prefix="bench-anchors-") as scratch:
        work = Path(scratch)
        family = make_tiny_family(
            work / "models", args.architecture, n_experts=args.experts, hidden=args.hidden, layers=args.layers
        )
        stats_dir, _ = stats_for_family(work / "stats", family)
        selected = cases(stats_dir)
        if args.only:
            unknown = sorted(set(args.only) - set(selected))
            if unknown:
                parser.error(f"unknown labels {unknown}; choose from {sorted(selected)}")
            selected = {label: selected[label] for label in selected if label in {BASELINE, *args.only}}
        anchors = {}
        if any("anchor_input" in fragment for fragment in selected.values()):
            anchors["wudi"] = work / "wudi-anchor"
            measure(recipe(family, standalone("wudi"), {}), anchors["wudi"], threads)
        rows = []
        progress = tqdm(total=len(selected) * args.repeats, desc="merges", file=sys.stderr)
        for label, fragment in selected.items():
            config = recipe(family, fragment, anchors)
            times, peaks = [], []
            for repeat in range(args.repeats):
                seconds, peak = measure(config, work / "out" / f"{len(rows)}-{repeat}", threads)
                times.append(seconds)
                peaks.append(peak)
                progress.update()
            rows.append({"method": label, "seconds": statistics.median(times), "peak_mib": max(peaks)})
        progress.close()

    print(
        f"{args.architecture}, hidden {args.hidden}, {args.layers} layers, {args.experts} experts, "
        f"float32, {threads} torch threads, median of {args.repeats}"
    )
    print(table(rows))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(
            json.dumps({"settings": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=2)
        )
        plot(rows, args.out / "anchors.png")
        print(f"wrote {args.out / 'results.json'} and {args.out / 'anchors.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
