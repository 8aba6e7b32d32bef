"""Does a better agreement mean a better language model? A label-free search's trials, re-merged and scored.

The language track's version of :mod:`bench.merging.label_free_trace`: each traced trial's recipe is
merged again, scored on test with lm-eval, and read by the label-free evaluator under every objective,
at every token of the prompts and at the answer's position only (``positions: all`` and ``last``, each
with references of its own): across the trials, each objective's rank correlation with the test
average says which reading transfers. Cached per trial model.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from bench.merging.cache import ScoreCache, read_json, stable_key, write_json
from bench.merging.config import LabelFreeSpec, RunConfig
from bench.merging.label_free_trace import OBJECTIVES, correlations, traced_trials, trial_row
from bench.merging.language.label_free import label_free_evaluator
from bench.merging.language.lm_eval_runner import score_lm
from bench.merging.merging import run_mergekit

POSITIONS = ("all", "last")


def _evaluator(
    config: RunConfig, spec: LabelFreeSpec, positions: str, tasks, experts, base: str, cache_dir: Path
):
    """The search's evaluator on raw divergences (``scale: none``) reading ``positions``, its experts'
    references kept per setting under the cache (computed once, checked against the experts)."""
    from mergekit_bmm.evaluation import make_evaluator
    from mergekit_bmm.evaluation.config import AgreementEvaluatorConfig

    language = config.language
    reading = spec.model_copy(update={"scale": "none", "positions": positions})
    block = label_free_evaluator(reading, tasks, experts, language.max_length, language.eval_batch_size)
    block.update(objective="kl", base_model=base)
    references = cache_dir / "language" / "trace-references" / stable_key(block)
    evaluator = make_evaluator(
        AgreementEvaluatorConfig.model_validate({**block, "references": str(references)}), "cpu"
    )
    evaluator.prepare()
    return evaluator


def trace_lm_search(
    config: RunConfig,
    cache_dir: Path,
    spec: LabelFreeSpec,
    folder: Path,
    template: dict[str, Any],
    tasks,
    experts,
    include: Path,
) -> dict[str, Any]:
    """Per traced trial of the search in ``folder``: its search score, test average and each reading's
    raw divergences per task; then, per reading, each objective's rank correlation with the test."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = str(template["base_model"])
    readers = {p: _evaluator(config, spec, p, tasks, experts, base, cache_dir) for p in POSITIONS}
    gaps = {p: {o: reader.base_divergence(o) for o in OBJECTIVES} for p, reader in readers.items()}
    cache, work = ScoreCache(cache_dir), cache_dir / "language" / "merges" / "trace-work"
    language = config.language
    trials = []
    for record, recipe, key, stored in traced_trials(folder, cache_dir, spec.trace_trials, template):
        if not stored.is_file():
            out = run_mergekit(recipe, work / key.split(":")[1])
            model = AutoModelForCausalLM.from_pretrained(out).eval()
            tokenizer = AutoTokenizer.from_pretrained(out)
            divergences = {p: r.divergences(model, tokenizer, OBJECTIVES) for p, r in readers.items()}
            jobs = [(t, "test") for t in tasks]
            scores, _ = score_lm(
                key, out, jobs, include, cache, language.eval_batch_size, language.eval_limit
            )
            test = {t.name: scores[(t.name, "test")] for t in tasks}
            write_json(stored, {"positions": divergences, "test": test})
            shutil.rmtree(work, ignore_errors=True)
        trials.append(trial_row(record, read_json(stored), "positions"))
    return {
        "trials": trials,
        "base_divergence": gaps,
        "correlations": {
            positions: correlations(
                [{**trial, "divergences": trial["positions"][positions]} for trial in trials], gaps[positions]
            )
            for positions in POSITIONS
        },
    }
