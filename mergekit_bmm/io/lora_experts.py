"""LoRA experts (``BASE+ADAPTER``, as mergekit writes them) as dense checkpoints.

mergekit merges each adapter into its base (PEFT's ``merge_and_unload``) in a LoRA merge cache before
any method runs, and stops when none is given. The plugin's commands use one by default,
``$MERGEKIT_BMM_CACHE/lora-merges/<digest>`` (``~/.cache/mergekit-bmm`` unless set), the digest over
the base's and the adapters' content: mergekit names its merged copies by path alone, so a changed
adapter must land in another folder to be merged again rather than reused stale.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path


def cache_root() -> Path:
    """Where the plugin keeps what it may rebuild: ``$MERGEKIT_BMM_CACHE``, else the user cache."""
    root = os.environ.get("MERGEKIT_BMM_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "mergekit-bmm"


def default_lora_cache(references: Sequence[str]) -> Path:
    """The LoRA merge cache for these ``BASE+ADAPTER`` references (keyed by their content)."""
    from mergekit_bmm.io.fingerprint import reference_fingerprint

    content = "\n".join(f"{ref}={reference_fingerprint(ref)}" for ref in sorted(references))
    return cache_root() / "lora-merges" / hashlib.sha256(content.encode()).hexdigest()[:16]


def is_lora_reference(reference: str) -> bool:
    return "+" in str(reference)


def dense_model(reference: str) -> Path:
    """The folder to read a model from: a folder or Hub id as is (the Hub's from the cache), a
    ``BASE+ADAPTER`` merged into its base once, through mergekit, in :func:`default_lora_cache`."""
    from mergekit_bmm.io.model_folder import local_model_dir

    if not is_lora_reference(reference):
        return local_model_dir(reference)
    from mergekit.common import ModelReference

    base, _, adapter = str(reference).partition("+")
    base_dir, adapter_dir = local_model_dir(base), local_model_dir(adapter)  # Hub: cache, or one line
    merged = ModelReference.parse(str(reference)).merged(cache_dir=str(default_lora_cache([reference])))
    folder = Path(merged.model.path)
    _copy_tokenizer(adapter_dir if _tokenizer_files(adapter_dir) else base_dir, folder)
    return folder


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)


def _tokenizer_files(folder: Path) -> list[Path]:
    return [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]


def _copy_tokenizer(source: Path, folder: Path) -> None:
    """The tokenizer beside a merged copy (mergekit saves the weights and config only): the adapter's
    when it ships one, else the base's."""
    import shutil

    if _tokenizer_files(folder):
        return
    for path in _tokenizer_files(source):
        shutil.copyfile(path, folder / path.name)
