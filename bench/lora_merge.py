"""LoRA experts: bmm's low-rank route against Task Arithmetic over the same adapters, and the full route.

A Llama-shaped base (``--hidden``, default 1024; ``--intermediate``, default 2.75 × hidden;
``--layers``), float32, and ``--experts`` PEFT LoRA adapters of ``--rank`` on every linear module
(q, k, v, o, gate, up, down; or on ``--targets`` only), made locally. Every merge is mergekit's
``run_merge`` in this process on ``BASE+ADAPTER`` experts, timed with its peak private memory. The
rows run in turn, ``--repeats`` rounds, and each ratio is the median of the rounds' own ratios (a slow
spell of the machine falls on every row of its round):

* the adapters merged into dense copies of the base (mergekit does this before any method; the
  plugin's default LoRA cache keeps them), measured once and reported apart;
* Task Arithmetic (weight 0.3) over the adapters, alternating with bmm over that Task Arithmetic,
  data-free, λ 0.1, by the low-rank route (the default);
* then, in rounds of their own with Task Arithmetic again: ``low_rank: false`` (the full route;
  ``--no-full`` skips it) and ``mergekit-bmm-lora`` on the bmm recipe (the same merge written as one
  PEFT adapter);
* apart, after those (the loaded model would count in their memory): a resident search trial, new λ
  and s merged in place from the subspace's cached factors (its evaluation not included);
* accuracy: the low-rank and full routes against a float64 full solve of the adapters' exact updates,
  on the largest weight.

    nice -n 5 python bench/lora_merge.py                     # hidden 1024, 4 layers, 3 × rank 16
    nice -n 5 python bench/lora_merge.py --hidden 2048 --intermediate 8192 --layers 16 --no-full --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# OpenMP's default wait policy (threads spin between parallel regions), as a user's merge has it:
# sleeping waits (OMP_WAIT_POLICY=PASSIVE, which other benchmarks here set to share the CPU) cost
# the route, whose many k-sized products each wake the threads, 0.13 s a merge at hidden 1024.

import torch  # noqa: E402
import yaml  # noqa: E402

from bench.common import PeakSampler, llama_config, reset_peak_rss  # noqa: E402

ADAPTER_ROW = "mergekit-bmm-lora (the bmm merge as one adapter)"
REFERENCE_AGAIN = "Task Arithmetic, in the rounds of the rows below"
TRIAL_ROW = "resident search trial (new λ, s; no evaluation)"
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_family(
    root: Path, hidden: int, intermediate: int, layers: int, experts: int, rank: int, targets: tuple[str, ...]
) -> tuple[Path, list[Path]]:
    """The base and its adapters, generated once under ``root`` (reused when the spec matches)."""
    import transformers

    from mergekit_bmm.examples.tiny_models import build_tokenizer, make_lora_adapter

    spec = {
        "hidden": hidden,
        "intermediate": intermediate,
        "layers": layers,
        "experts": experts,
        "rank": rank,
        **({} if targets == LINEAR else {"targets": list(targets)}),
    }
    folder = root / "family-{hidden}-{intermediate}-{layers}-{experts}-r{rank}".format(**spec)
    if targets != LINEAR:
        folder = folder.with_name(folder.name + "-" + "-".join(targets))
    base, adapters = folder / "base", [folder / f"adapter-{i}" for i in range(experts)]
    marker = folder / "family.json"
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return base, adapters
    print(f"generating the base and {experts} rank-{rank} adapters in {folder} (once) ...", flush=True)
    tokenizer = build_tokenizer()
    heads = max(hidden // 64, 1)
    config = llama_config(len(tokenizer), hidden, intermediate, layers, heads, max(heads // 4, 1))
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(base)
    tokenizer.save_pretrained(base)
    for index, adapter in enumerate(adapters):
        make_lora_adapter(base, adapter, seed=index, rank=rank, targets=targets, spread=0.02)
    marker.write_text(json.dumps(spec))
    return base, adapters


def recipe(base: Path, adapters: list[Path], method: str, **parameters) -> str:
    models = [{"model": f"{base}+{a}", "parameters": {"weight": 0.3}} for a in adapters]
    body = {"merge_method": method, "base_model": str(base), "models": models, "dtype": "float32"}
    if method == "bmm":
        body["parameters"] = {"anchor_method": "task_arithmetic", "lambda": 0.1, **parameters}
    return yaml.safe_dump(body)


def timed_runs(
    jobs: dict[str, Callable[[], object]], repeats: int, outputs: dict[str, Path] | None = None
) -> dict[str, dict]:
    """``repeats`` rounds of one run per job, in turn (so a slow spell of the machine falls on every
    row alike): each row's median wall time, its times per round, and the peaks over its runs.

    Before each run, untimed, the job's previous output (``outputs``) is deleted and every write is
    flushed: a merge writes into a new folder, as a user's usually does, and pays neither for freeing
    the last round's blocks (slow on a disk mounted with ``discard``) nor for another job's writes."""
    rows: dict[str, dict] = {label: {"runs": [], "private_mib": 0, "rss_mib": 0} for label in jobs}
    for round_index in range(repeats):
        for label, job in jobs.items():
            if outputs and label in outputs:
                shutil.rmtree(outputs[label], ignore_errors=True)
            os.sync()
            reset_peak_rss()
            sampler = PeakSampler("RssAnon", "VmHWM")
            started = time.perf_counter()
            job()
            rows[label]["runs"].append(round(time.perf_counter() - started, 3))
            peaks = sampler.stop()
            rows[label]["private_mib"] = max(rows[label]["private_mib"], round(peaks["RssAnon"]))
            rows[label]["rss_mib"] = max(rows[label]["rss_mib"], round(peaks["VmHWM"]))
        print(
            f"round {round_index + 1}/{repeats}: "
            + ", ".join(f"{label} {row['runs'][-1]} s" for label, row in rows.items()),
            flush=True,
        )
    for row in rows.values():
        row["seconds"] = round(statistics.median(row["runs"]), 2)
    return rows


def merge_job(text: str, out: Path) -> Callable[[], object]:
    """A merge through mergekit's ``run_merge`` in this process (with the plugin's record and card)."""
    from mergekit_bmm.plugin.run import merge_recipe_text

    return lambda: merge_recipe_text(text, out)


def adapter_job(text: str, out: Path) -> Callable[[], object]:
    """``mergekit-bmm-lora RECIPE OUT_PATH`` in this process: the merge written as one PEFT adapter."""
    from mergekit_bmm.cli.lora import write_adapter
    from mergekit_bmm.plugin.run import merge_options

    path = out.with_suffix(".yml")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    options = merge_options(None, quiet=True, device="cpu")
    return lambda: write_adapter(path, out, options, None, force=True)


def resident_trial_job(text: str, work: Path) -> Callable[[], object]:
    """One resident search trial: new λ and s merged in place into a loaded model from the factors
    of the adapters' subspace (the search's default when the model fits). Loading and the first
    merge (which fills the factor cache) happen here, once, untimed."""
    from mergekit_bmm.evaluation.base import ModelLoading
    from mergekit_bmm.plugin.run import merge_options
    from mergekit_bmm.search import parse_search_config
    from mergekit_bmm.search.experiment import prepare_experiment
    from mergekit_bmm.search.resident import ResidentModel

    config = {
        "recipe": yaml.safe_load(text),
        "blocks": 1,
        "groups": ["attn_in", "attn_out", "mlp_in", "mlp_out"],
        "lambda_range": [1e-3, 10.0],
        "scale_range": [0.5, 1.5],
        # never called here: a trial's merge is timed without its evaluation
        "evaluator": {"type": "python", "callable": "bench.search_throughput:mean_log_likelihood"},
    }
    experiment = prepare_experiment(parse_search_config(config, Path(__file__).parent), work / "cache")
    # two trials in turn (30 % and 70 % of each range), so every round moves every weight
    values = [
        {d.name: d.low + share * (d.high - d.low) for d in experiment.space.dimensions}
        for share in (0.3, 0.7)
    ]
    options = merge_options(None, quiet=True, device="cpu")
    resident = ResidentModel.load(
        experiment.recipes.text(values[0]),
        experiment.base_model,
        experiment.space,
        ModelLoading("auto", "float32"),
        options,
    )
    turn = iter(range(1 << 30))
    return lambda: resident.apply(values[next(turn) % 2])


def paired_ratio(row: dict, reference: dict) -> float:
    """The median over rounds of this row's time over the reference's in the same round."""
    return statistics.median(a / b for a, b in zip(row["runs"], reference["runs"]))


def accuracy(
    base: Path, adapters: list[Path], outputs: dict[str, Path], layers: int, module: str
) -> dict[str, float]:
    """Each route's relative error against a float64 full solve, on the last layer's ``module``."""
    from safetensors import safe_open

    from mergekit_bmm.core import closed_form, normal_equations
    from mergekit_bmm.io.lora_adapters import adapter_for

    name = f"model.layers.{layers - 1}.{module}.weight"

    def tensor(folder: Path) -> torch.Tensor:
        for path in sorted(folder.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as handle:
                if name in handle.keys():
                    return handle.get_tensor(name).double()
        raise KeyError(name)

    vectors = []
    for adapter in adapters:
        left, right = adapter_for(adapter).update(name)
        vectors.append(left @ right)
    pre = tensor(base)
    anchor = 0.3 * sum(vectors)
    equations = normal_equations.data_free_equations(vectors, torch.float64)
    expected = closed_form.merge_matrix(equations, anchor, 0.1)
    return {
        label: float((tensor(folder) - pre - expected).norm() / expected.norm())
        for label, folder in outputs.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=None, help="MLP width (default 2.75 × hidden)")
    parser.add_argument("--no-full", action="store_true", help="skip the full route (slow at large shapes)")
    parser.add_argument("--experts", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("/tmp/mergekit-bmm-lora-bench"))
    parser.add_argument("--repeats", type=int, default=7, help="rounds of merges; medians are shown")
    parser.add_argument(
        "--targets",
        default=",".join(LINEAR),
        help="modules the adapters train, comma-separated (PEFT's default for Llama: q_proj,v_proj)",
    )
    args = parser.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    os.environ["MERGEKIT_BMM_CACHE"] = str(args.out / "plugin-cache")
    intermediate = args.intermediate or int(2.75 * args.hidden)
    targets = tuple(args.targets.split(","))
    base, adapters = make_family(
        args.out / "models", args.hidden, intermediate, args.layers, args.experts, args.rank, targets
    )

    def keep(label: str) -> bool:
        return not (args.no_full and "full route" in label)

    once = "adapters merged into the base (once)"
    merged = args.out / "merged"
    runs = {
        "Task Arithmetic": recipe(base, adapters, "task_arithmetic"),
        "bmm, low-rank route": recipe(base, adapters, "bmm"),
        "bmm, full route (low_rank: false)": recipe(base, adapters, "bmm", low_rank=False),
    }
    outputs = {label: merged / slug for label, slug in zip(runs, ("ta", "low-rank", "full"))}
    rows = timed_runs({once: merge_job(runs["Task Arithmetic"], merged / "once")}, 1)
    print(f"{once}: {rows[once]}", flush=True)
    jobs = {label: merge_job(text, outputs[label]) for label, text in runs.items() if keep(label)}
    outputs[ADAPTER_ROW] = merged / "adapter"
    jobs[ADAPTER_ROW] = adapter_job(runs["bmm, low-rank route"], outputs[ADAPTER_ROW])
    # Two phases. A merge inherits the process's state from the one before (the allocator's free
    # lists, the page cache): the full route and the adapter's fit (800 MiB at hidden 1024) left
    # Task Arithmetic, next in line, up to a third faster than the route. So the route alternates
    # with Task Arithmetic alone, as one merge per process would meet them; the heavy rows follow,
    # each against the Task Arithmetic of its own rounds.
    light = ("Task Arithmetic", "bmm, low-rank route")
    rows.update(timed_runs({label: jobs[label] for label in light}, args.repeats, outputs))
    heavy = {REFERENCE_AGAIN: jobs["Task Arithmetic"]} | {k: v for k, v in jobs.items() if k not in light}
    rows.update(timed_runs(heavy, args.repeats, outputs | {REFERENCE_AGAIN: outputs["Task Arithmetic"]}))
    # apart, after the merges: the resident model stays loaded and would count in their memory
    print("loading the resident model and filling the factor cache (once) ...", flush=True)
    rows.update(
        timed_runs(
            {TRIAL_ROW: resident_trial_job(runs["bmm, low-rank route"], args.out / "search")}, args.repeats
        )
    )
    module = "down_proj" if "down_proj" in targets else targets[-1]
    checked = f"{'mlp' if module in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{module}"
    solved = {k: outputs[k] for k in list(runs)[1:] if keep(k)}
    errors = accuracy(base, adapters, solved, args.layers, checked)
    reference = rows["Task Arithmetic"]
    heavy_rows = set(heavy) - {REFERENCE_AGAIN}
    where = "every linear module" if targets == LINEAR else ", ".join(targets)
    print(
        f"\nLoRA merge: hidden {args.hidden}, MLP {intermediate}, {args.layers} layers, {args.experts} "
        f"adapters of rank {args.rank} on {where}, float32, {torch.get_num_threads()} threads, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}\n"
    )
    print(f"(median of {args.repeats} rounds; the ratio is the median of each round's ratio)\n")
    print("| merge | seconds | × Task Arithmetic | peak private MiB | peak RSS MiB | rel. error vs float64 |")
    print("|---|---|---|---|---|---|")
    for label, row in rows.items():
        error = f"{errors[label]:.1e}" if label in errors else "—"
        beside = rows[REFERENCE_AGAIN] if label in heavy_rows else reference
        ratio = "—" if label == once else f"{paired_ratio(row, beside):.2f}"
        if label == TRIAL_ROW:  # timed in its own rounds: medians
            ratio = f"{row['seconds'] / reference['seconds']:.2f}"
        print(f"| {label} | {row['seconds']} | {ratio} | {row['private_mib']} | {row['rss_mib']} | {error} |")
    (args.out / "rows.json").write_text(json.dumps({"rows": rows, "errors": errors}, indent=2))


if __name__ == "__main__":
    main()
