"""Task data: deterministic train/validation/test splits written as contract-A JSONL.

One ``data.jsonl`` per task holds every split (``{"text", "label", "split"}`` per line,
``label`` an index into ``labels.json``), so an evaluator picks a split by name.

Splits: the corpus's official test split where it has one, otherwise a held-out pool of
``test_fraction`` of the examples; validation is carved out of the training pool; each
split is then subsampled to its budget. Every shuffle uses a generator seeded with the
run seed and the task name, so a task's data do not depend on which other tasks run.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.merging import corpora
from bench.merging.cache import Stage, files_fingerprint, read_json
from bench.merging.config import LanguageTaskSpec, TaskSpec
from mergekit_bmm.errors import ConfigError

SPLITS = ("train", "validation", "test")
HEAD_SPLIT = "head"  # examples the head is fitted on, disjoint from the experts' training examples
FORMAT_VERSION = 2


@dataclass(frozen=True)
class TaskData:
    """A built task: its JSONL file, class names and split sizes."""

    name: str
    data: Path
    labels: tuple[str, ...]
    counts: dict[str, int]
    sha256: str

    def examples(self, split: str) -> tuple[list[str], list[int]]:
        texts, labels = [], []
        with open(self.data, encoding="utf-8") as handle:
            for line in handle:
                record = json.loads(line)
                if record["split"] == split:
                    texts.append(record["text"])
                    labels.append(record["label"])
        return texts, labels


def task_generator(seed: int, name: str, purpose: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode()), zlib.crc32(purpose.encode())])


def _shuffled(items: list, rng: np.random.Generator) -> list:
    return [items[i] for i in rng.permutation(len(items))]


def read_local_jsonl(spec: TaskSpec | LanguageTaskSpec) -> corpora.Corpus:
    """A local JSONL task (``text``, ``label`` int or str, optional ``split``) as a corpus."""
    path = spec.jsonl
    assert path is not None
    if not path.is_file():
        raise ConfigError(f"task {spec.name}: jsonl file {path} does not exist")
    splits: dict[str, list[tuple[str, str]]] = {}
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as error:
                raise ConfigError(f"task {spec.name}: {path} line {number} is not JSON: {error}") from error
            text, label = record.get("text"), record.get("label")
            split = record.get("split", "all")
            if not isinstance(text, str) or label is None or isinstance(label, bool):
                raise ConfigError(f"task {spec.name}: {path} line {number} needs `text` (str) and `label`")
            if split not in (*SPLITS, HEAD_SPLIT, "all"):
                raise ConfigError(
                    f"task {spec.name}: {path} line {number} has split {split!r}; "
                    "use train, validation or test"
                )
            labels = getattr(spec, "labels", None)
            if isinstance(label, int):
                if labels is not None and not 0 <= label < len(labels):
                    raise ConfigError(
                        f"task {spec.name}: {path} line {number} label {label} is outside `labels`"
                    )
                label = labels[label] if labels is not None else str(label)
            splits.setdefault(split, []).append((text, str(label)))
    if not splits:
        raise ConfigError(f"task {spec.name}: {path} holds no examples")
    if "all" in splits and len(splits) > 1:
        raise ConfigError(f"task {spec.name}: {path} mixes lines with and without `split`; label every line")
    return corpora.Corpus(spec.name, splits, [path], f"local JSONL {path}")


def split_corpus(
    corpus: corpora.Corpus, spec: TaskSpec | LanguageTaskSpec, seed: int
) -> dict[str, list[tuple[str, str]]]:
    """Official or carved splits, each subsampled to its budget (deterministic).

    With a ``head`` budget, the head's examples are carved out of the training pool too,
    so the experts fine-tune on examples their frozen head has never been fitted to.
    """
    head_budget = getattr(spec, "head", 0)
    parts = dict(corpus.splits)
    mapping = class_map(spec, corpus.labels, corpus.name) if isinstance(spec, TaskSpec) else None
    if "test" not in parts:
        # a carved task holds out the test pool of its whole corpus, as the task over that corpus does
        # (named like its loader): none of its test texts is in the other's training data
        name = spec.loader if mapping is not None and spec.loader else spec.name
        pool = _shuffled(parts.pop("all", []) + parts.pop("train", []), task_generator(seed, name, "test"))
        n_test = max(1, int(round(spec.test_fraction * len(pool))))
        parts = {"test": pool[:n_test], "train": pool[n_test:], **parts}
    parts = carve(parts, mapping)
    if "validation" not in parts:
        pool = _shuffled(parts.get("train", []), task_generator(seed, spec.name, "validation"))
        n_validation = min(spec.validation, len(pool) // 5)
        parts["validation"], parts["train"] = pool[:n_validation], pool[n_validation:]
    if head_budget and HEAD_SPLIT not in parts:
        pool = _shuffled(parts.get("train", []), task_generator(seed, spec.name, HEAD_SPLIT))
        n_head = min(head_budget, len(pool) // 2)
        parts[HEAD_SPLIT], parts["train"] = pool[:n_head], pool[n_head:]
    budgets = {"train": spec.train, HEAD_SPLIT: head_budget, "validation": spec.validation, "test": spec.test}
    out = {}
    for split in data_splits(spec):
        pool = _shuffled(parts.get(split, []), task_generator(seed, spec.name, f"subsample-{split}"))
        out[split] = pool[: budgets[split]]
        if not out[split]:
            raise ConfigError(f"task {spec.name}: the {split} split is empty; give the task more examples")
    return out


def data_splits(spec: TaskSpec | LanguageTaskSpec) -> tuple[str, ...]:
    """The splits a task's data file holds, in file order."""
    return ("train", HEAD_SPLIT, "validation", "test") if getattr(spec, "head", 0) else SPLITS


def label_order(corpus: corpora.Corpus, spec: TaskSpec) -> tuple[list[str], list[str]]:
    """``(keys, names)``: the corpus label of class i is ``keys[i]``, shown as ``names[i]``.

    Built-in corpora and string labels use sorted names; integer labels of a local file
    keep their numbers (0..max), named by ``labels`` when given.
    """
    present = corpus.labels
    if spec.labels is not None:
        unknown = sorted(set(present) - set(spec.labels))
        if unknown:
            raise ConfigError(f"task {spec.name}: labels {unknown[:3]} are not in the task's `labels` list")
        return list(spec.labels), list(spec.labels)
    if spec.jsonl is not None and all(name.isdigit() for name in present):
        names = [str(i) for i in range(max(int(name) for name in present) + 1)]
        return names, names
    return present, present


def class_map(spec: TaskSpec, labels: list[str], corpus_name: str) -> dict[str, str] | None:
    """Corpus label -> class of a carved task (``spec.classes``); None for a task that is not carved."""
    classes = getattr(spec, "classes", None)
    if not classes:
        return None
    mapping: dict[str, str] = {}
    for new, olds in classes.items():
        for old in olds:
            if old in mapping:
                raise ConfigError(f"task {spec.name}: corpus label {old!r} is in two classes")
            mapping[old] = new
    unknown = sorted(set(mapping) - set(labels))
    if unknown:
        raise ConfigError(
            f"task {spec.name}: {unknown[:3]} are not labels of {corpus_name} ({labels[:8]} ...)"
        )
    return mapping


def carve(parts: dict[str, list[tuple[str, str]]], mapping: dict[str, str] | None) -> dict[str, list]:
    """Examples relabelled by ``mapping``; those of labels it does not name dropped."""
    if mapping is None:
        return parts
    return {
        split: [(text, mapping[label]) for text, label in examples if label in mapping]
        for split, examples in parts.items()
    }


def build_task_data(spec: TaskSpec, cache_dir: Path, seed: int) -> tuple[TaskData, bool]:
    """Build (or reuse) the task's JSONL; return it and whether it came from the cache."""
    corpus = read_local_jsonl(spec) if spec.jsonl is not None else corpora.load_builtin(spec.loader)
    payload: dict[str, Any] = {
        "format": FORMAT_VERSION,
        # a task that is not carved keeps the key it had before `classes` existed (its data stays cached)
        "task": spec.model_dump(mode="json", exclude=set() if spec.classes else {"classes"}),
        "seed": seed,
        "sources": corpora.sources_fingerprint(corpus.sources),
    }
    stage = Stage(cache_dir, "data", spec.name, payload, files_fingerprint("data.jsonl", "labels.json"))

    def produce(folder: Path) -> dict[str, Any]:
        mapping = class_map(spec, corpus.labels, corpus.name)
        carved = corpora.Corpus(
            corpus.name, carve(corpus.splits, mapping), corpus.sources, corpus.description
        )
        keys, names = label_order(carved, spec)
        index = {key: i for i, key in enumerate(keys)}
        splits = split_corpus(corpus, spec, seed)
        with open(folder / "data.jsonl", "w", encoding="utf-8") as handle:
            for split in data_splits(spec):
                for text, label in splits[split]:
                    line = {"text": text, "label": index[label], "split": split}
                    handle.write(json.dumps(line, ensure_ascii=False) + "\n")
        counts = {split: len(splits[split]) for split in data_splits(spec)}
        majority = {}
        for split in data_splits(spec):
            labels = [index[label] for _, label in splits[split]]
            majority[split] = round(float(max(np.bincount(labels))) / len(labels), 4)
        (folder / "labels.json").write_text(
            json.dumps({"labels": names, "description": corpus.description}, indent=2) + "\n",
            encoding="utf-8",
        )
        return {"counts": counts, "classes": len(names), "majority": majority}

    record, cached = stage.get(produce)
    labels = read_json(stage.path / "labels.json")["labels"]
    task = TaskData(
        name=spec.name,
        data=stage.path / "data.jsonl",
        labels=tuple(labels),
        counts=record["info"]["counts"],
        sha256=record["fingerprint"],
    )
    return task, cached
