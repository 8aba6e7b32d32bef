"""Multiple-choice tasks for lm-eval, built from the benchmark's text corpora.

Each example becomes ``{"query", "choices", "label", "split"}``: ``query`` is the prompt
(the example's text inserted into the task's question), ``choices`` the answer words,
``label`` the index of the right one. lm-eval scores the log-likelihood of each answer
after ``query`` + " " (``output_type: multiple_choice``, metric ``acc``); fine-tuning
uses exactly that continuation as its target.

Data live in the cache as ``train/validation/test.jsonl``. The task YAMLs that lm-eval
reads hold *absolute* ``data_files`` paths (lm-eval resolves relative ones against the
working directory), so they are generated at run time next to the data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.merging import corpora
from bench.merging.cache import Stage, files_fingerprint, read_json
from bench.merging.config import LanguageTaskSpec
from bench.merging.tasks import SPLITS, read_local_jsonl, split_corpus
from mergekit_bmm.errors import ConfigError

FORMAT_VERSION = 1


@dataclass(frozen=True)
class MCTask:
    name: str
    folder: Path
    choices: tuple[str, ...]
    counts: dict[str, int]
    sha256: str

    def file(self, split: str) -> Path:
        return self.folder / f"{split}.jsonl"

    def records(self, split: str) -> list[dict[str, Any]]:
        with open(self.file(split), encoding="utf-8") as handle:
            return [json.loads(line) for line in handle]

    def lm_eval_name(self, split: str) -> str:
        return f"bmm_{self.name}_{split}"


def shorten(text: str, max_chars: int) -> str:
    """At most ``max_chars`` characters, cut at a word boundary."""
    if len(text) <= max_chars:
        return text
    cut = text[:max_chars].rsplit(" ", 1)[0]
    return (cut or text[:max_chars]) + " …"


def build_mc_task(spec: LanguageTaskSpec, cache_dir: Path, seed: int) -> tuple[MCTask, bool]:
    """Build (or reuse) a multiple-choice task's JSONL files."""
    if "{text}" not in spec.prompt:
        raise ConfigError(f"language task {spec.name}: `prompt` must contain {{text}}")
    corpus = read_local_jsonl(spec) if spec.jsonl is not None else corpora.load_builtin(spec.loader)
    unknown = sorted(set(spec.choices) - set(corpus.labels))
    if unknown:
        raise ConfigError(
            f"language task {spec.name}: {unknown} are not labels of {spec.loader or spec.jsonl}; "
            f"labels: {corpus.labels}"
        )
    payload = {
        "format": FORMAT_VERSION,
        "task": spec.model_dump(mode="json"),
        "seed": seed,
        "sources": corpora.sources_fingerprint(corpus.sources),
    }
    stage = Stage(
        cache_dir, "language/data", spec.name, payload, files_fingerprint(*(f"{s}.jsonl" for s in SPLITS))
    )
    labels = list(spec.choices)
    answers = [spec.choices[label] for label in labels]

    def produce(folder: Path) -> dict[str, Any]:
        kept = {
            split: [(text, label) for text, label in examples if label in spec.choices]
            for split, examples in corpus.splits.items()
        }
        splits = split_corpus(corpora.Corpus(corpus.name, kept, corpus.sources), spec, seed)
        for split in SPLITS:
            with open(folder / f"{split}.jsonl", "w", encoding="utf-8") as handle:
                for text, label in splits[split]:
                    record = {
                        "query": spec.prompt.replace("{text}", shorten(text, spec.max_chars)),
                        "choices": answers,
                        "label": labels.index(label),
                        "split": split,
                    }
                    handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        (folder / "choices.json").write_text(json.dumps(answers) + "\n", encoding="utf-8")
        return {"counts": {split: len(splits[split]) for split in SPLITS}}

    record, cached = stage.get(produce)
    task = MCTask(
        name=spec.name,
        folder=stage.path,
        choices=tuple(read_json(stage.path / "choices.json")),
        counts=record["info"]["counts"],
        sha256=record["fingerprint"],
    )
    return task, cached


def write_lm_eval_yamls(tasks: list[MCTask], folder: Path) -> Path:
    """One lm-eval task per (task, split) with absolute ``data_files``; returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("bmm_*.yaml"):
        old.unlink()
    for task in tasks:
        for split in ("validation", "test"):
            document = {
                "task": task.lm_eval_name(split),
                "dataset_path": "json",
                "dataset_kwargs": {"data_files": {split: str(task.file(split).resolve())}},
                ("validation_split" if split == "validation" else "test_split"): split,
                "output_type": "multiple_choice",
                "doc_to_text": "query",
                "doc_to_choice": "choices",
                "doc_to_target": "label",
                "target_delimiter": " ",
                "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
                "metadata": {"version": FORMAT_VERSION},
            }
            (folder / f"{task.lm_eval_name(split)}.yaml").write_text(
                yaml.safe_dump(document, sort_keys=False), encoding="utf-8"
            )
    return folder
