"""Calibration samples: read a task's texts and tokenise them with the expert's tokenizer.

Data is a JSONL file (one object per line) or a folder written by ``datasets``'
``save_to_disk``. The first ``max_samples`` non-empty samples are used, in file order,
so a run is reproducible and reading stops early on large files. With
``chat_template: true`` each sample is rendered by the tokenizer's own chat template
(a string becomes one user message; a list of ``{role, content}`` messages is used as
is) and tokenised without adding special tokens again, since the template writes them.
Without it, text is tokenised with the tokenizer's default special tokens (BOS, or
[CLS]/[SEP] for BERT), exactly as the expert sees text in use.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mergekit_bmm.errors import ConfigError
from mergekit_bmm.io.fingerprint import file_fingerprint

Sample = str | list[dict[str, Any]]


def data_fingerprint(data: str | Path) -> str:
    """Fingerprint of a data file or of every file in a saved dataset folder."""
    path = Path(data)
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
        file_fingerprint(file, digest)
    return "sha256:" + digest.hexdigest()[:32]


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as error:
                raise ConfigError(f"line {number} of {path} is not valid JSON ({error})") from None
            if not isinstance(row, dict):
                raise ConfigError(f"line {number} of {path} is not a JSON object")
            yield f"line {number} of {path}", row


def _dataset_rows(path: Path, split: str | None) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"{path} is a folder, which needs the `datasets` package (pip install datasets)"
        ) from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(
            f"{path} is not a dataset saved with datasets' save_to_disk ({first}); "
            "give a JSONL file or such a folder"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        if split is None and len(loaded) == 1:
            split = next(iter(loaded))
        if split not in loaded:
            raise ConfigError(
                f"{path} holds the splits {', '.join(loaded)}; choose one with `split:` in stats.yml"
            )
        loaded = loaded[split]
    elif split is not None and "split" not in loaded.column_names:
        raise ConfigError(f"{path} holds a single dataset without a `split` column; remove `split:`")
    for index, row in enumerate(loaded):
        yield f"row {index} of {path}", row


def read_samples(
    data: str | Path, text_field: str, max_samples: int, split: str | None = None, chat: bool = False
) -> list[Sample]:
    """The first ``max_samples`` non-empty samples of a task's local data."""
    path = Path(data)
    if path.is_dir():
        rows = _dataset_rows(path, split)
        row_split = None if split is None or _is_dataset_dict(path) else split
    elif path.is_file():
        rows = _jsonl_rows(path)
        row_split = split
    else:
        raise ConfigError(f"calibration data {path} does not exist")
    return samples_from_rows(rows, text_field, max_samples, row_split, chat, str(path), split)


def dataset_samples(dataset: Any, name: str, text_field: str, max_samples: int, chat: bool) -> list[Sample]:
    """The first ``max_samples`` non-empty samples of a loaded ``datasets.Dataset`` (a Hub data set)."""
    rows = ((f"row {index} of {name}", row) for index, row in enumerate(dataset))
    return samples_from_rows(rows, text_field, max_samples, None, chat, name, None)


def samples_from_rows(
    rows: Iterator[tuple[str, dict[str, Any]]],
    text_field: str,
    max_samples: int,
    row_split: str | None,
    chat: bool,
    path: str,
    split: str | None,
) -> list[Sample]:
    """The first ``max_samples`` non-empty ``text_field`` values of ``rows`` (``(where, row)`` pairs)."""
    samples: list[Sample] = []
    for where, row in rows:
        if row_split is not None and row.get("split") != row_split:
            continue
        if text_field not in row:
            raise ConfigError(
                f"{where} has no field {text_field!r} (it has {', '.join(map(str, row)) or 'none'}); "
                "set `text_field:` in stats.yml"
            )
        sample = _sample(row[text_field], where, text_field, chat)
        if sample:
            samples.append(sample)
            if len(samples) >= max_samples:
                break
    if not samples:
        which = f" in split {split!r}" if split else ""
        raise ConfigError(f"calibration data {path} has no non-empty {text_field!r} samples{which}")
    return samples


def _is_dataset_dict(path: Path) -> bool:
    return (path / "dataset_dict.json").exists()


def _sample(value: Any, where: str, field: str, chat: bool) -> Sample:
    if isinstance(value, str):
        return value if value.strip() else ""
    messages = isinstance(value, list) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in value
    )
    if messages and chat:
        return value
    if messages:
        raise ConfigError(f"{where}: field {field!r} holds chat messages; set `chat_template: true`")
    raise ConfigError(
        f"{where}: field {field!r} must be a string (or chat messages); got {type(value).__name__}"
    )


def tokenize_samples(tokenizer: Any, samples: list[Sample], chat: bool, max_length: int) -> list[list[int]]:
    """Token ids per sample, truncated to ``max_length``; empty results are dropped."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"`chat_template: true` but the tokenizer of {tokenizer.name_or_path} has no chat template; "
                "set `chat_template: false`"
            )
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": s}] if isinstance(s, str) else s, tokenize=False
            )
            for s in samples
        ]
        encoded = tokenizer(texts, add_special_tokens=False, truncation=True, max_length=max_length)
    else:
        encoded = tokenizer(list(samples), truncation=True, max_length=max_length)
    return [list(ids) for ids in encoded["input_ids"] if len(ids) > 0]
