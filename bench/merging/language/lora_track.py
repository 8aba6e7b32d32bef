"""The language track with LoRA experts: BMM against PEFT's own adapter merges and mergekit's anchors.

One LoRA adapter per task (PEFT, on every linear module, the same answer-only loss as the dense
experts) on the language track's model. Compared on the same lm-eval tasks, every method tuned on
validation and scored on test:

* mergekit's Task Arithmetic and TIES over the ``BASE+ADAPTER`` experts, each with BMM over it (at its
  defaults, at ``lambda: auto`` and searched), as the dense track does (:mod:`.track`);
* PEFT's ``add_weighted_adapter`` (linear, cat, ties, dare_ties, svd, magnitude_prune, …), each over a
  grid of one weight for every adapter (and a density where the method takes one), merged into the
  base and saved as a model for lm-eval;
* KnOTS (:mod:`.knots`, the LoRA-specific peer: the adapters aligned by SVD, then TIES or DARE-TIES),
  tuned the same way;
* paired bootstrap intervals over the test documents: BMM against each PEFT method and each anchor.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.merging.cache import ScoreCache, Stage, model_folder_fingerprint, stable_key
from bench.merging.config import LoraTrackSpec, RunConfig
from bench.merging.finetune import deterministic
from bench.merging.intervals import paired_difference
from bench.merging.language.label_free import every_bmm_model, label_free_pairs
from bench.merging.language.lm_eval_runner import score_lm, summarize, test_documents
from bench.merging.language.lm_finetune import collate, encode_example
from bench.merging.language.mc_tasks import MCTask
from bench.merging.language.statistics import expert_statistics
from bench.merging.training import batch_order, expert_key, expert_seed, summary, train_loop

DENSITY_METHODS = {"ties", "dare_ties", "dare_linear", "magnitude_prune", "ties_svd", "dare_ties_svd"}


def say(message: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(message)


def train_lora(
    model_dir: Path, task: MCTask, spec: LoraTrackSpec, max_length: int, seed: int, out_dir: Path
) -> dict[str, Any]:
    """A LoRA adapter for ``task`` (resumable), saved with PEFT's ``save_pretrained``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    records = task.records("train")
    with deterministic(spec.finetune.threads):
        torch.manual_seed(seed)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        lora = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets))
        model = get_peft_model(base, lora)
        model.train()
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        examples = [
            encode_example(tokenizer, r["query"], r["choices"][r["label"]], max_length) for r in records
        ]

        def step_loss(rows):
            batch = collate([examples[i] for i in rows], pad_id)
            output = model(**batch)
            answer = batch["labels"][:, 1:] != -100
            correct = ((output.logits[:, :-1].argmax(-1) == batch["labels"][:, 1:]) | ~answer).all(dim=1)
            return output.loss, int(correct.sum())

        batches = batch_order(len(examples), spec.finetune.batch_size, spec.finetune.steps, seed)
        state = train_loop(model, spec.finetune, batches, step_loss, out_dir, 20, f"LoRA {task.name}")
        model.eval()
        model.save_pretrained(str(out_dir))
    return summary(state, spec.finetune, len(examples), seed)


def build_lora_expert(task: MCTask, model_dir: Path, model_fp: str, config: RunConfig, cache_dir: Path):
    """The task's adapter, trained once (a stage of the cache, resumable)."""
    spec, length = config.language.lora, config.language.max_length
    seed = expert_seed(spec.finetune, task.name)
    payload = expert_key(spec.finetune, length, seed, task_data=task.sha256, model=model_fp)
    payload.update(rank=spec.rank, alpha=spec.alpha, targets=list(spec.targets))
    stage = Stage(cache_dir, "language/lora-experts", task.name, payload, model_folder_fingerprint)

    def produce(folder: Path) -> dict[str, Any]:
        return train_lora(model_dir, task, spec, length, seed, folder)

    record, cached = stage.get(produce, resume=True)
    return stage.path, record, cached


def saved_model(out: Path, model_dir: Path, build: Callable[[], Any]) -> Path:
    """The model ``build()`` returns, saved with the base's tokenizer into ``out`` for lm-eval (once:
    written in a ``.partial`` sibling and renamed into place)."""
    if (out / "config.json").is_file():
        return out
    from transformers import AutoTokenizer

    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    build().save_pretrained(str(partial))
    AutoTokenizer.from_pretrained(str(model_dir)).save_pretrained(str(partial))
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return out


def peft_merge(
    model_dir: Path, adapters: list[Path], method: str, weight: float, density: float | None, out: Path
):
    """PEFT's ``add_weighted_adapter`` over the adapters, merged into the base and saved (once)."""

    def build():
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        names = [f"expert{i}" for i in range(len(adapters))]
        model = PeftModel.from_pretrained(model, str(adapters[0]), adapter_name=names[0])
        for name, adapter in zip(names[1:], adapters[1:]):
            model.load_adapter(str(adapter), adapter_name=name)
        extra = {"density": density} if density is not None else {}
        model.add_weighted_adapter(names, [weight] * len(names), "merged", combination_type=method, **extra)
        model.set_adapter("merged")
        return model.merge_and_unload(adapter_names=["merged"])

    return saved_model(out, model_dir, build)


@dataclass(frozen=True)
class Scoring:
    """Where and how the track's models are scored (lm-eval tasks, score cache, limits)."""

    tasks: list
    include: Path
    cache: ScoreCache
    batch: int
    limit: int | None

    def score(self, model_id: str, folder: Path, jobs) -> dict:
        return score_lm(model_id, folder, jobs, self.include, self.cache, self.batch, self.limit)[0]

    @property
    def every_job(self) -> list:
        return [(t, split) for t in self.tasks for split in ("validation", "test")]


def run_lora_track(
    config: RunConfig,
    cache_dir: Path,
    model_dir: Path,
    model_fp: str,
    tasks,
    include,
    tuned_anchor: Callable[..., dict[str, Any]],
    checkpoint: Callable[[dict[str, Any], str], None] | None = None,
) -> dict[str, Any]:
    """Everything the LoRA table needs (scores, tuned values, intervals), every stage cached;
    ``tuned_anchor`` is the dense track's (an anchor tuned on validation, with BMM over it);
    ``checkpoint`` is handed the table so far, with its intervals, after each anchor and method
    (a run of several sessions commits what it has)."""
    from mergekit_bmm.io.lora_experts import dense_model

    spec, language = config.language.lora, config.language
    scoring = Scoring(
        list(tasks), include, ScoreCache(cache_dir), language.eval_batch_size, language.eval_limit
    )
    os.environ["MERGEKIT_BMM_CACHE"] = str(cache_dir / "language" / "plugin-cache")  # merged LoRA copies
    out: dict[str, Any] = {"rank": spec.rank, "alpha": spec.alpha, "targets": list(spec.targets)}
    adapters, out["indiv"] = {}, {}
    for task in tasks:
        path, record, cached = build_lora_expert(task, model_dir, model_fp, config, cache_dir)
        adapters[task.name] = path
        dense = dense_model(f"{model_dir}+{path}")
        own = scoring.score(f"lora:{record['fingerprint']}", dense, [(task, "validation"), (task, "test")])
        out["indiv"][task.name] = summarize(own)[task.name]
        say(f"LoRA      {task.name:18s} {record['info']['steps']} steps {'(cached)' if cached else ''}")
    experts = [f"{model_dir}+{adapters[t.name]}" for t in tasks]
    models: dict[str, str] = {}
    label_free: list[tuple[str, str]] = []  # each search that read no labels against its peers
    out["anchors"] = {}

    def reached(note: str, more_models: dict[str, str] | None = None, more_pairs: Sequence = ()) -> None:
        """The table so far to ``checkpoint``, with the models and pairs of a cell still being filled."""
        if checkpoint is not None:
            found = {**models, **(more_models or {})}
            checkpoint({**out, "intervals": intervals(found, scoring, [*label_free, *more_pairs])}, note)

    search = spec.search or language.search
    stats = None  # the adapters' statistics: data-assisted and mix BMM, RegMean
    if set(search.settings) - {"data_free"} or any(a.method == "regmean" for a in spec.anchors):
        stats = expert_statistics(cache_dir, experts, tasks, language.max_length)
    for anchor_spec in spec.anchors:
        name = anchor_spec.name

        def partial(entry: dict[str, Any], name: str = name) -> None:
            """An anchor's cell so far (tuned, then each search over it), in the checkpoint's table."""
            out["anchors"][name] = entry
            cell_models = {name: entry["model_id"], **every_bmm_model(name, entry)}
            reached(f"LoRA: {name}, {searches_done(entry)}", cell_models, label_free_pairs(name, entry))

        progress = partial if checkpoint is not None else None
        anchor = tuned_anchor(
            config, cache_dir, anchor_spec, model_dir, experts, tasks, include, {}, search, stats, progress
        )
        out["anchors"][name] = anchor
        models[name] = anchor["model_id"]
        models.update(every_bmm_model(name, anchor))
        label_free += label_free_pairs(name, anchor)
        reached(f"LoRA: anchors up to {name}")
    out["peft"] = {}
    ordered = [adapters[t.name] for t in tasks]
    for method in spec.peft_methods:
        out["peft"][method] = tuned_peft(method, spec, model_dir, ordered, scoring, cache_dir)
        models[f"peft {method}"] = out["peft"][method]["model_id"]
        reached(f"LoRA: PEFT up to {method}")
    out["knots"] = {}
    for variant in spec.knots:
        out["knots"][variant] = tuned_knots(variant, spec, model_dir, ordered, scoring, cache_dir)
        models[f"knots {variant}"] = out["knots"][variant]["model_id"]
        reached(f"LoRA: KnOTS up to {variant}")
    out["intervals"] = intervals(models, scoring, label_free)
    return out


def searches_done(entry: dict[str, Any]) -> str:
    """Which searches over an anchor have finished (a checkpoint's note)."""
    done = ["data_free"] if "bmm" in entry else []
    done += [f"{objective} (no labels)" for objective in (entry.get("bmm") or {}).get("label_free", {})]
    done += list(entry.get("bmm_settings", {}))
    return f"searched {', '.join(done)}" if done else "tuned"


def tuned_peft(method: str, spec, model_dir: Path, adapters: list[Path], scoring: Scoring, cache_dir: Path):
    """One PEFT combination type tuned on validation over (weight, density); its best on test."""
    densities = spec.peft_densities if method in DENSITY_METHODS else [None]
    points = [{"weight": w, "density": d} for w in spec.peft_weights for d in densities]

    def make(point: dict, out: Path) -> Path:
        return peft_merge(model_dir, adapters, method, point["weight"], point["density"], out)

    return tuned(f"peft {method}", {"method": method}, points, make, model_dir, adapters, scoring, cache_dir)


def tuned_knots(variant: str, spec, model_dir: Path, adapters: list[Path], scoring: Scoring, cache_dir: Path):
    """KnOTS (:mod:`.knots`) tuned on validation: ``ties`` over (weight, top-K share), ``dare_ties``
    over (weight, drop rate) with every entry kept by TIES, as the authors' configurations do."""
    from bench.merging.language.knots import knots_model

    if variant == "ties":
        points = [{"weight": w, "top_k": k, "dare": 0.0} for w in spec.peft_weights for k in spec.knots_top_k]
    else:
        points = [
            {"weight": w, "top_k": 1.0, "dare": 1.0 - d}
            for w in spec.peft_weights
            for d in spec.peft_densities
        ]

    def make(point: dict, out: Path) -> Path:
        settings = (point["weight"], point["top_k"], point["dare"])
        return saved_model(out, model_dir, lambda: knots_model(model_dir, adapters, *settings))

    return tuned(
        f"knots {variant}", {"knots": variant}, points, make, model_dir, adapters, scoring, cache_dir
    )


def tuned(
    label: str,
    method: dict[str, Any],
    points: list[dict[str, Any]],
    make: Callable[[dict, Path], Path],
    model_dir: Path,
    adapters: list[Path],
    scoring: Scoring,
    cache_dir: Path,
) -> dict[str, Any]:
    """An adapter merge tuned on validation over ``points`` (each merged once by ``make`` and
    cached); the best point scored on test."""
    work = cache_dir / "language" / "peft-merges"
    validation = [(t, "validation") for t in scoring.tasks]
    fingerprints = [model_folder_fingerprint(a) for a in adapters]
    sweep, best = {}, None
    for point in points:
        payload = {**method, **point, "adapters": fingerprints, "base": str(model_dir)}
        key = "peft:" + stable_key(payload, 24)
        folder = make(point, work / key.split(":")[1])
        scores = scoring.score(key, folder, validation)
        score = sum(scores.values()) / len(scores)
        sweep["/".join(str(v) for v in point.values())] = round(score, 4)
        if best is None or score > best[0]:
            best = (score, key, folder, point)
    score, key, folder, point = best
    scores = scoring.score(key, folder, scoring.every_job)
    say(f"LoRA {label:22s} {point} validation {score:.4f}")
    return {"model_id": key, **point, "validation_sweep": sweep, "scores": summarize(scores)}


def intervals(
    models: dict[str, str], scoring: Scoring, extra: Sequence[tuple[str, str]] = ()
) -> dict[str, dict[str, float]]:
    """Paired bootstrap over test documents: each BMM against each PEFT method and each anchor, and
    the ``extra`` pairs (each search that read no labels against the labelled one and the defaults)."""
    documents = {
        name: test_documents(model_id, scoring.tasks, scoring.cache, scoring.limit)
        for name, model_id in models.items()
    }
    bmm = [name for name in models if name.startswith("bmm ")]
    others = [name for name in models if not name.startswith("bmm ")]
    pairs = [(first, second) for first in bmm for second in others]
    pairs += [pair for pair in extra if pair not in pairs and all(name in documents for name in pair)]
    out = {}
    for first, second in pairs:
        delta, low, high = (round(v, 4) for v in paired_difference(documents[first], documents[second]))
        out[f"{first} - {second}"] = {"delta": delta, "low": low, "high": high}
    return out
