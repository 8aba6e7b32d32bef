"""Cheap-then-full evaluation against full evaluation: trials per hour and the model each finds.

Runs one search several times from the same ``search.yml`` and seed — with ``--full-eval``,
and cheap-then-full with early stopping for each ``--cheap`` share (the default ``fidelity:``
otherwise) — each in its own process, then scores every search's ``best/`` on the test split
with the test evaluator (every example, one per-example score each) and prints, side by side:
wall time, trials per hour, trials per CPU-hour (each trial's ``time.cpu`` in ``trials.jsonl``:
the CPU time of the process that ran it, so a busy machine or a resumed run does not skew it),
evaluation seconds per trial, the share of validation examples scored,
promotions, the best validation score, the test score with its 95 % bootstrap interval, and the
paired test difference (staged − full) with its interval. ``--concurrent`` runs the arms at
once, one core's share each, so a machine busy with other work slows them alike. An arm whose
folder under ``--out`` holds a finished search (e.g. a full arm copied from an earlier run of the
same search) resumes as finished, so only the other arms run. Writes
``fidelity.json`` and ``fidelity.png`` (best validation score against wall time) into ``--out``.

The classification benchmark (after its ``task_arithmetic`` stage)::

    nice -n 10 python bench/search_fidelity.py --run /work/bench-cache/runs/zeroshot8 \\
        --out /work/bench-fidelity/zeroshot8 --budget 40 --threads 1 --cheap 0.25 --cheap 0.125

Any search, e.g. the language track's lm-eval search (its ``search.yml`` is kept in its folder)::

    python bench/search_fidelity.py --search-yml RUN/search.yml --test-evaluator test.yml --out DIR

The language track's lm-eval search (after the benchmark's ``language`` stage; Task Arithmetic at
``--anchor-weight``, lm-eval ``acc`` on each task's validation and test documents)::

    python bench/search_fidelity.py --language-run /work/bench-cache/runs/zeroshot8 --anchor-weight 0.5 \
        --tasks rt_sentiment_mc,subjectivity_mc,election_tweets_mc --out DIR --budget 40 --concurrent
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
FULL = "full"


def search_from_run(run: Path, anchor_weight: float, groups: list[str]) -> tuple[dict, dict]:
    """(search.yml, test evaluator) for data-free BMM over Task Arithmetic on a benchmark run."""
    manifest = json.loads((run / "manifest.json").read_text(encoding="utf-8"))
    validation = yaml.safe_load((run / "evaluator-validation.yml").read_text(encoding="utf-8"))
    test = yaml.safe_load((run / "evaluator-test.yml").read_text(encoding="utf-8"))
    recipe = {
        "merge_method": "bmm",
        "base_model": manifest["base"],
        "models": [
            {"model": path, "parameters": {"weight": anchor_weight}} for path in manifest["experts"].values()
        ],
        "parameters": {"anchor_method": "task_arithmetic"},
        "dtype": "float32",
    }
    search = {"recipe": recipe, "blocks": 1, "groups": groups, **validation}
    return search, test["evaluator"]


def search_from_language_run(
    run: Path, anchor_weight: float, groups: list[str], tasks: list[str] | None
) -> tuple[dict, dict]:
    """(search.yml, test evaluator) for data-free BMM over Task Arithmetic of the language track's
    SmolLM2 experts, scored by lm-eval (``<cache>/runs/<name>/language.json``, written by the track)."""
    track = json.loads((run / "language.json").read_text(encoding="utf-8"))
    names = tasks or list(track["tasks"])
    unknown = sorted(set(names) - set(track["tasks"]))
    if unknown:
        raise SystemExit(
            f"--tasks: {unknown} are not tasks of this language track; it has {list(track['tasks'])}"
        )
    recipe = {
        "merge_method": "bmm",
        "base_model": track["base"],
        "models": [
            {"model": track["experts"][name], "parameters": {"weight": anchor_weight}} for name in names
        ],
        "parameters": {"anchor_method": "task_arithmetic"},
        "dtype": "float32",
    }

    def evaluator(split: str) -> dict:
        return {
            "type": "lm_eval",
            "tasks": [{"name": track["tasks"][name][split], "metric": "acc"} for name in names],
            "include_path": track["lm_eval_include_path"],
            "batch_size": 16,
            "dtype": "float32",
        }

    search = {"recipe": recipe, "blocks": 1, "groups": groups, "evaluator": evaluator("validation")}
    return search, evaluator("test")


def arm_name(cheap: float | None) -> str:
    return FULL if cheap is None else f"cheap {cheap:g}"


def start_search(search: dict, out: Path, cheap: float | None, threads: int) -> dict:
    """One arm's search in its own process (``cheap`` None: full evaluation)."""
    out.mkdir(parents=True, exist_ok=True)
    if cheap is not None:
        search = {**search, "fidelity": {**search.get("fidelity", {}), "cheap": cheap}}
    search_yml = out.with_name(out.name + ".yml")
    search_yml.write_text(yaml.safe_dump(search, sort_keys=False), encoding="utf-8")
    command = [str(BIN / "mergekit-bmm-search"), str(search_yml), str(out), "--quiet", "-j", str(threads)]
    if cheap is None:
        command.append("--full-eval")
    log = (out.with_name(out.name + ".log")).open("w", encoding="utf-8")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
    return {"out": out, "process": process, "started": time.perf_counter(), "log": log}


def wait_all(arms) -> None:
    """Note when each concurrent arm ends (they end in any order)."""
    running = list(arms)
    while running:
        for arm in [a for a in running if a["process"].poll() is not None]:
            arm["ended"] = time.perf_counter()
            running.remove(arm)
        time.sleep(1.0)


def finish_search(arm: dict) -> dict:
    """Wait for an arm; its summary, records and wall time (to its own end: see ``wait_all``)."""
    arm["process"].wait()
    wall = arm.get("ended", time.perf_counter()) - arm["started"]
    arm["log"].close()
    out = arm["out"]
    if arm["process"].returncode != 0:
        tail = out.with_name(out.name + ".log").read_text(encoding="utf-8")[-3000:]
        raise SystemExit(f"search {out} failed:\n{tail}")
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    records = [
        json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines() if '"trial"' in line
    ]
    return {"summary": summary, "records": records, "wall_seconds": wall}


def test_values(evaluator_block: dict, model_dir: Path) -> dict[str, list[float]]:
    """Per task, the per-example test scores of a merged model (every test example)."""
    from pydantic import TypeAdapter

    from mergekit_bmm.evaluation import make_evaluator
    from mergekit_bmm.evaluation.base import load_model, load_tokenizer
    from mergekit_bmm.evaluation.config import EvaluatorConfig

    config = TypeAdapter(EvaluatorConfig).validate_python(evaluator_block, context={"base_dir": REPO})
    evaluator = make_evaluator(config, "cpu")
    if not getattr(evaluator, "scores_examples", False):
        raise SystemExit(
            "the test evaluator cannot score single examples (use classification or a mean metric)"
        )
    loading = evaluator.loading
    model = load_model(model_dir, loading.class_name, "cpu", loading.dtype)
    score = evaluator.example_scorer(model, load_tokenizer(model_dir))
    return {task: score(task, range(spec.count)) for task, spec in evaluator.examples().items()}


def measure(run: dict, values: dict[str, list[float]]) -> dict:
    from bench.merging.intervals import interval
    from bench.merging.searches import search_clock, search_seconds

    records, summary = run["records"], run["summary"]
    evaluate = sum(r["time"].get("evaluate", 0.0) for r in records)
    cpu = sum(r["time"].get("cpu", 0.0) + r["time"].get("surrogate", 0.0) for r in records)
    scored = sum((r.get("fidelity") or {}).get("scored", 0) for r in records)
    total = sum((r.get("fidelity") or {}).get("total", 0) for r in records)
    estimate, low, high = interval(values)
    return {
        "trials": len(records),
        "wall_seconds": round(run["wall_seconds"], 1),
        # the search's own clock: a finished arm reused from an earlier run keeps its time
        "trials_per_hour": round(3600 * len(records) / search_seconds(records), 1),
        "cpu_seconds": round(cpu, 1),
        "trials_per_cpu_hour": round(3600 * len(records) / cpu, 1) if cpu else None,
        "evaluate_seconds_per_trial": round(evaluate / max(len(records), 1), 2),
        "examples_scored_share": round(scored / total, 4) if total else 1.0,
        "fidelity": summary.get("fidelity"),
        "best_validation": summary["best_score"],
        "best_values": summary["best_values"],
        "test": [round(estimate, 4), round(low, 4), round(high, 4)],
        "end_seconds": round(search_seconds(records), 1),
        "curve": [
            [round(seconds, 1), r["score"]]
            for seconds, r in search_clock(records)
            if r.get("status") == "ok" and (r.get("fidelity") or {}).get("level", "full") == "full"
        ],
    }


def table(results: dict) -> str:
    header = (
        f"{'evaluation':<16}{'K':>4}{'wall s':>9}{'trials/h':>10}{'trials/CPU-h':>14}"
        f"{'eval s/trial':>14}{'examples':>10}"
        f"{'full/promoted/stopped':>23}{'best val':>10}{'test [95% CI]':>24}"
    )
    lines = [header, "-" * len(header)]
    for mode in results["arms"]:
        row = results[mode]
        fidelity = row["fidelity"] or {}
        counts = "/".join(
            str(fidelity.get(key, default))
            for key, default in (("full", row["trials"]), ("promoted", 0), ("stopped_early", 0))
        )
        test = row["test"]
        lines.append(
            f"{mode:<16}{row['trials']:>4}{row['end_seconds']:>9.0f}{row['trials_per_hour']:>10.1f}"
            f"{row['trials_per_cpu_hour']:>14.1f}"
            f"{row['evaluate_seconds_per_trial']:>14.2f}"
            f"{100 * row['examples_scored_share']:>9.0f}%{counts:>23}"
            f"{100 * row['best_validation']:>10.2f}"
            f"{f'{100 * test[0]:.2f} [{100 * test[1]:.2f}, {100 * test[2]:.2f}]':>24}"
        )
    lines.append("")
    for mode in results["arms"]:
        if mode == FULL:
            continue
        row, delta = results[mode], results[mode]["test_delta"]
        lines.append(
            f"{mode} over full: trials/hour {row['speedup']:.2f}x, trials/CPU-hour "
            f"{row['cpu_speedup']:.2f}x; test, {mode} - full (paired): {100 * delta[0]:+.2f} "
            f"[{100 * delta[1]:.2f}, {100 * delta[2]:.2f}] points"
        )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for mode in results["arms"]:
        best, xs, ys = None, [], []
        for elapsed, score in results[mode]["curve"]:
            best = score if best is None else max(best, score)
            xs.append(elapsed / 60)
            ys.append(100 * best)
        end = results[mode].get("end_seconds")
        if end and ys:  # the best so far holds until the last trial ends
            xs.append(end / 60)
            ys.append(ys[-1])
        ax.step(xs, ys, where="post", label=f"{mode} ({results[mode]['trials_per_hour']:.0f} trials/h)")
    ax.set_xlabel("wall time of the trials (min)")
    ax.set_ylabel("best validation score (%)")
    ax.set_title("Cheap-then-full against full evaluation, same search and seed")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    from bench.merging.intervals import paired_difference
    from mergekit_bmm.search.config import FidelityConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, help="a benchmark run folder (<cache>/runs/<name>)")
    parser.add_argument(
        "--language-run",
        type=Path,
        help="a benchmark run folder whose language track has run (lm-eval search)",
    )
    parser.add_argument("--tasks", help="--language-run: the tasks (comma-separated; default: all)")
    parser.add_argument("--search-yml", type=Path, help="any search.yml (instead of --run)")
    parser.add_argument("--test-evaluator", type=Path, help="a YAML with the `evaluator:` on the test split")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--cheap",
        type=float,
        action="append",
        help="a staged arm with this cheap share (repeatable; default: the search's own fidelity)",
    )
    parser.add_argument("--concurrent", action="store_true", help="run the arms at once")
    parser.add_argument("--anchor-weight", type=float, default=0.3, help="--run: Task Arithmetic's weight")
    parser.add_argument("--groups", default="attn_in,attn_out,mlp_in,mlp_out", help="--run: searched groups")
    args = parser.parse_args(argv)
    if args.run:
        search, test = search_from_run(args.run, args.anchor_weight, args.groups.split(","))
    elif args.language_run:
        tasks = args.tasks.split(",") if args.tasks else None
        search, test = search_from_language_run(
            args.language_run, args.anchor_weight, args.groups.split(","), tasks
        )
    elif args.search_yml and args.test_evaluator:
        search = yaml.safe_load(args.search_yml.read_text(encoding="utf-8"))
        test = yaml.safe_load(args.test_evaluator.read_text(encoding="utf-8"))["evaluator"]
    else:
        parser.error("give --run, --language-run, or --search-yml with --test-evaluator")
    search["budget"] = args.budget
    search.setdefault("n_initial", min(10, args.budget))
    default_cheap = search.get("fidelity", {}).get("cheap", FidelityConfig().cheap)
    cheaps = [None, *(args.cheap or [default_cheap])]
    arms = {arm_name(cheap): cheap for cheap in cheaps}
    results: dict = {
        "budget": args.budget,
        "search": search,
        "arms": list(arms),
        "concurrent": args.concurrent,
    }
    folder = {name: args.out / name.replace(" ", "-") for name in arms}
    runs = {}
    if args.concurrent:
        started = {
            name: start_search(search, folder[name], cheap, args.threads) for name, cheap in arms.items()
        }
        wait_all(started.values())
        runs = {name: finish_search(arm) for name, arm in started.items()}
    else:
        for name, cheap in arms.items():
            runs[name] = finish_search(start_search(search, folder[name], cheap, args.threads))
    values = {}
    for name in arms:
        values[name] = test_values(test, folder[name] / "best")
        results[name] = measure(runs[name], values[name])
        print(
            f"{name}: {results[name]['trials']} trials in {results[name]['wall_seconds']:.0f} s", flush=True
        )
    for name in arms:
        if name != FULL:
            row, full = results[name], results[FULL]
            row["speedup"] = round(row["trials_per_hour"] / full["trials_per_hour"], 3)
            row["cpu_speedup"] = round(row["trials_per_cpu_hour"] / full["trials_per_cpu_hour"], 3)
            row["test_delta"] = [round(v, 4) for v in paired_difference(values[name], values[FULL])]
    (args.out / "fidelity.json").write_text(
        json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8"
    )
    plot(results, args.out / "fidelity.png")
    print(table(results))


if __name__ == "__main__":
    main()
