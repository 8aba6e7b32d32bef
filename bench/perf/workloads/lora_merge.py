"""LoRA experts: bmm's low-rank route against Task Arithmetic over the same adapters, and the full route.

A Llama-shaped base (``hidden``; ``intermediate``, default 2.75 × hidden; ``layers``), float32, and
``experts`` PEFT LoRA adapters of ``rank`` on every linear module (q, k, v, o, gate, up, down; or on
``targets`` only), made locally. Every merge is mergekit's ``run_merge`` in this process on
``BASE+ADAPTER`` experts, on the harness's protocol (:mod:`bench.perf.harness`):

* the adapters merged into dense copies of the base (mergekit does this before any method; the
  plugin's default LoRA cache keeps them), once;
* Task Arithmetic (weight 0.3) over the adapters, alternating with bmm over that Task Arithmetic,
  data-free, λ 0.1, by the low-rank route (the default);
* then, in rounds of their own with Task Arithmetic again (the full route and the adapter's fit,
  800 MiB at hidden 1024, left Task Arithmetic next in line up to a third faster): ``low_rank:
  false`` (the full route; ``full_route=false`` skips it) and ``mergekit-bmm-lora`` on the bmm recipe;
* last (the loaded model would count in the merges' memory): a resident search trial, new λ and s
  merged in place from the subspace's cached factors (its evaluation not included);
* figures: the low-rank and full routes against a float64 full solve of the adapters' exact updates,
  on the largest weight.

    python -m bench.perf lora_merge                                   # hidden 1024, 4 layers, 3 × rank 16
    python -m bench.perf lora_merge --set hidden=2048 --set intermediate=8192 --set layers=16 \
        --set full_route=false --rounds 3
    python -m bench.perf lora_merge --set gram=activations        # data-assisted (made-up Grams)
    python -m bench.perf lora_merge --set gram=activations --set rows=adapters   # its k × k variant
    python -m bench.perf lora_merge --set full_route=false --set statistics=64    # and the statistics' cost

With ``gram=activations`` (or ``mix``) the route forms ``C = B·Z`` from the adapters' factors and
made-up activation Grams (rank 256, every weight) and solves ``k`` rows over Task Arithmetic; the
full route forms ``C`` from the dense copies.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

from bench.common import llama_config, write_corpus_texts
from bench.perf.harness import Group, Job, Workload

ONCE_ROW = "adapters merged into the base (once)"
TA_ROW = "Task Arithmetic"
ROUTE_ROW = "bmm, low-rank route"
FULL_ROW = "bmm, full route (low_rank: false)"
ADAPTER_ROW = "mergekit-bmm-lora (the bmm merge as one adapter)"
REFERENCE_AGAIN = "Task Arithmetic, in the rounds of the rows below"
TRIAL_ROW = "resident search trial (new λ, s; no evaluation)"
DENSE_STATS_ROW = "statistics of one dense model (the base)"
LORA_STATS_ROW = "statistics of every LoRA expert (BASE+ADAPTER)"
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


def lora_stats(root: Path, base: Path, adapters: list[Path], seed: int = 0) -> Path:
    """Made-up activation Grams (rank 256) for each ``BASE+ADAPTER`` expert, one per input as
    ``mergekit-bmm-stats`` stores them: q, k and v share one, gate and up one."""
    from mergekit_bmm.core.module_map import classify
    from mergekit_bmm.examples.synthetic_stats import random_gram, write_stats
    from mergekit_bmm.io.checkpoint import load_state_dict

    folder = root / f"stats-{base.parent.name}-shared"
    if (folder / "manifest.json").is_file():
        return folder
    generator = torch.Generator().manual_seed(seed)
    shared = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
    modules, grams = {}, {}
    for name, tensor in load_state_dict(base).items():
        if tensor.ndim != 2 or classify(name, "llama") is None:
            continue
        projection = name.split(".")[-2]
        key = name.replace(projection, shared.get(projection, projection))
        modules[name] = key
        if key not in grams:
            grams[key] = [random_gram(tensor.shape[1], generator, tokens=256) for _ in adapters]
    return write_stats(folder, [f"{base}+{a}" for a in adapters], grams, modules)


def recipe(base: Path, adapters: list[Path], method: str, **parameters) -> str:
    models = [{"model": f"{base}+{a}", "parameters": {"weight": 0.3}} for a in adapters]
    body = {"merge_method": method, "base_model": str(base), "models": models, "dtype": "float32"}
    if method == "bmm":
        body["parameters"] = {"anchor_method": "task_arithmetic", "lambda": 0.1, **parameters}
    return yaml.safe_dump(body)


def merge_job(text: str, device: str) -> Callable[[Path], object]:
    """A merge through mergekit's ``run_merge`` in this process (with the plugin's record and card)."""
    from mergekit_bmm.plugin.run import merge_options, merge_recipe_text

    return lambda out: merge_recipe_text(text, out, merge_options(None, quiet=True, device=device))


def adapter_job(text: str, work: Path, device: str) -> Callable[[Path], object]:
    """``mergekit-bmm-lora RECIPE OUT_PATH`` in this process: the merge written as one PEFT adapter."""
    from mergekit_bmm.cli.lora import write_adapter
    from mergekit_bmm.plugin.run import merge_options

    path = work / "adapter-recipe.yml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    options = merge_options(None, quiet=True, device=device)
    return lambda out: write_adapter(path, out, options, None, force=True)


def resident_trial_job(text: str, work: Path, device: str) -> Callable[[Path], object]:
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
        "evaluator": {
            "type": "python",
            "callable": "bench.perf.workloads.search_throughput:mean_log_likelihood",
        },
    }
    experiment = prepare_experiment(parse_search_config(config, work), work / "cache")
    # two trials in turn (30 % and 70 % of each range), so every round moves every weight
    values = [
        {d.name: d.low + share * (d.high - d.low) for d in experiment.space.dimensions}
        for share in (0.3, 0.7)
    ]
    options = merge_options(None, quiet=True, device=device)
    resident = ResidentModel.load(
        experiment.recipes.text(values[0]),
        experiment.base_model,
        experiment.space,
        ModelLoading("auto", "float32"),
        options,
    )
    turn = iter(range(1 << 30))
    return lambda out: resident.apply(values[next(turn) % 2])


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


def _shape(parameters: dict[str, Any]) -> tuple[int, tuple[str, ...]]:
    intermediate = parameters.get("intermediate") or int(2.75 * parameters["hidden"])
    targets = LINEAR if parameters["targets"] == "all" else tuple(parameters["targets"].split(","))
    return intermediate, targets


def _family(parameters: dict[str, Any], root: Path) -> tuple[Path, list[Path]]:
    intermediate, targets = _shape(parameters)
    p = parameters
    return make_family(
        root / "models", p["hidden"], intermediate, p["layers"], p["experts"], p["rank"], targets
    )


def statistics_job(root: Path, models: list[str], samples: int, device: str) -> Callable[[Path], object]:
    """``mergekit-bmm-stats`` in this process: one task per model over the same made-up texts."""
    data = write_corpus_texts(root / f"calibration-{samples}.jsonl", samples, 96, stride=7)

    def run(out: Path) -> None:
        from mergekit_bmm.stats.collect import collect_statistics
        from mergekit_bmm.stats.config import parse_stats_config

        tasks = [{"name": f"task-{i}", "model": model, "data": str(data)} for i, model in enumerate(models)]
        config = {"tasks": tasks, "max_samples": samples, "max_length": 128}
        collect_statistics(parse_stats_config(config), out, device=device, force=True, progress=False)

    return run


def build(parameters: dict[str, Any], root: Path) -> list[Group | Callable[[], Group]]:
    """The adapters' dense copies once; the route against Task Arithmetic; the heavy rows against
    Task Arithmetic of their own rounds; a resident trial last."""
    os.environ["MERGEKIT_BMM_CACHE"] = str(root / "plugin-cache")
    base, adapters = _family(parameters, root)
    data = {"gram_sharing": parameters["sharing"]}  # stated: the tables' rows name it
    if parameters["gram"] != "data_free":  # data-assisted: C = B·Z from the factors and the Grams
        data |= {"gram": parameters["gram"], "stats": str(lora_stats(root / "models", base, adapters))}
        if parameters["rows"] == "adapters":  # the update's rows kept in the span of the A_t: k × k solves
            data["low_rank_rows"] = "adapters"
    device = parameters["device"]
    ta, route = recipe(base, adapters, "task_arithmetic"), recipe(base, adapters, "bmm", **data)
    heavy = [Job(REFERENCE_AGAIN, merge_job(ta, device))]
    if parameters["full_route"]:
        full = recipe(base, adapters, "bmm", low_rank=False, **data)
        heavy.append(Job(FULL_ROW, merge_job(full, device), REFERENCE_AGAIN))
    heavy.append(Job(ADAPTER_ROW, adapter_job(route, root / "work", device), REFERENCE_AGAIN))
    groups: list[Group | Callable[[], Group]] = [
        Group([Job(ONCE_ROW, merge_job(ta, device))], rounds=1, warmup=0),
        Group([Job(TA_ROW, merge_job(ta, device)), Job(ROUTE_ROW, merge_job(route, device), TA_ROW)]),
        Group(heavy),
    ]
    if "low_rank_rows" not in data:  # the k × k variant solves directly: its trials run on disk
        trial = resident_trial_job
        groups.append(lambda: Group([Job(TRIAL_ROW, trial(route, root / "search", device))]))
    if parameters["statistics"]:  # what collecting the adapters' statistics costs against dense models'
        dense = statistics_job(root, [str(base)], parameters["statistics"], device)
        lora = statistics_job(root, [f"{base}+{a}" for a in adapters], parameters["statistics"], device)
        groups.append(Group([Job(DENSE_STATS_ROW, dense), Job(LORA_STATS_ROW, lora, DENSE_STATS_ROW)]))
    return groups


def figures(parameters: dict[str, Any], root: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each route's relative error against a float64 full solve (the last rounds' outputs; data-free),
    and the statistics of one LoRA expert against those of a dense model."""
    found = {}
    lora = next((row for row in rows if row["label"] == LORA_STATS_ROW), None)
    if lora is not None and lora.get("ratio") is not None:
        experts = parameters["experts"]
        found["statistics per LoRA expert, × a dense model's"] = f"{lora['ratio'] / experts:.2f}"
    if parameters["gram"] != "data_free":
        return found
    return {**found, **_route_errors(parameters, root)}


def _route_errors(parameters: dict[str, Any], root: Path) -> dict[str, Any]:
    """Each route's relative error against a float64 full solve (the last rounds' outputs)."""
    _, targets = _shape(parameters)
    base, adapters = _family(parameters, root)
    module = "down_proj" if "down_proj" in targets else targets[-1]
    checked = f"{'mlp' if module in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{module}"
    outputs = {ROUTE_ROW: root / "out" / "group-1" / "1"}
    if parameters["full_route"]:
        outputs[FULL_ROW] = root / "out" / "group-2" / "1"
    errors = accuracy(base, adapters, outputs, parameters["layers"], checked)
    return {f"relative error vs float64, {label}": f"{error:.1e}" for label, error in errors.items()}


def notes(parameters: dict[str, Any]) -> str:
    intermediate, targets = _shape(parameters)
    where = "every linear module" if targets == LINEAR else ", ".join(targets)
    return (
        f"hidden {parameters['hidden']}, MLP {intermediate}, {parameters['layers']} layers, "
        f"{parameters['experts']} adapters of rank {parameters['rank']} on {where}, float32, "
        f"gram {parameters['gram']}, {parameters['device']}"
        + (", low_rank_rows adapters" if parameters["rows"] == "adapters" else "")
        + f", gram_sharing {parameters['sharing']}"
    )


SHAPE = {
    "intermediate": None,
    "experts": 3,
    "rank": 16,
    "targets": "all",
    "full_route": True,
    "gram": "data_free",
    "rows": "dense",  # with a data-assisted gram: `adapters` for `low_rank_rows: adapters`
    "sharing": "weight",  # bmm's gram_sharing (input: each Gram pools q/k/v's, gate/up's adapters)
    "statistics": 0,  # > 0: also time mergekit-bmm-stats on this many texts, adapters against dense models
    "device": "cpu",  # cuda: every merge, trial and statistic on the GPU, in this process
}
WORKLOAD = Workload(
    name="lora_merge",
    summary="LoRA experts: bmm's low-rank and full routes and mergekit-bmm-lora against Task Arithmetic",
    sizes={
        "full": {**SHAPE, "hidden": 1024, "layers": 4, "rounds": 7},
        "quick": {"experts": 2, "rank": 4, "statistics": 4, "hidden": 64, "layers": 1, "rounds": 1},
    },
    build=build,
    figures=figures,
    notes=notes,
)
