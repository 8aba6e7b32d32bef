"""What can be checked before mergekit starts a merge, checked, with one line for each problem.

mergekit reads a missing local folder as a Hub repo id (and fails on its form), finds an
unknown ``merge_method`` only once it plans, and writes over whatever is in the output
folder. :func:`check_merge` runs first, in ``mergekit-bmm-yaml`` and (through the plugin's
``run_merge`` patch) in the stock ``mergekit-yaml``:

* the merge method is registered;
* every model that names a local folder exists and holds a ``config.json``, and the models'
  hidden sizes agree (otherwise they are not fine-tunes of one base);
* the output path is a folder that can be written, and it holds nothing a merge did not
  write: a folder with other files is refused unless the user forces it, and even then the
  files the merge will replace are named.
"""

from __future__ import annotations

import contextvars
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mergekit_bmm.errors import ConfigError, shown

# What a merge writes into its folder: mergekit's weights, index, config, recipe and card,
# the tokenizer it copies, and the plugin's merge record and card plots.
MERGE_OUTPUT = re.compile(
    r"(config\.json|generation_config\.json|mergekit_config\.yml|README\.md|mergekit_bmm_merge\.json"
    r"|.*\.safetensors|.*\.safetensors\.index\.json|pytorch_model.*\.bin(\.index\.json)?"
    r"|tokenizer(_config)?\.json|tokenizer\.model|special_tokens_map\.json|added_tokens\.json"
    r"|vocab\.(json|txt)|merges\.txt|chat_template\.(jinja|json)|convergence\.png|lambdas\.png)"
)
PREVIOUS_MERGE_MARKER = "mergekit_config.yml"
_checked: contextvars.ContextVar[bool] = contextvars.ContextVar("mergekit_bmm_preflight_done", default=False)


@contextmanager
def already_checked() -> Iterator[None]:
    """Within this block the ``run_merge`` patch skips its checks: the caller made them."""
    token = _checked.set(True)
    try:
        yield
    finally:
        _checked.reset(token)


def checks_pending() -> bool:
    return not _checked.get()


@contextmanager
def discarded_on_failure(out: str | Path) -> Iterator[None]:
    """A merge into a folder that did not exist leaves nothing behind when it fails."""
    out = Path(out)
    existed = out.exists()
    try:
        yield
    except BaseException:
        if not existed and out.is_dir():
            shutil.rmtree(out, ignore_errors=True)
        raise


def check_merge(config: Any, out_path: str | Path, *, guard_folder: bool, force: bool = False) -> None:
    """Every check above, in the order a user would fix them; raises :class:`ConfigError`."""
    check_method(config.merge_method)
    check_base(config)
    check_models(config)
    check_output(Path(out_path), guard_folder=guard_folder, force=force)


def check_method(name: str) -> None:
    from mergekit.merge_methods import registered_methods

    names = sorted(method.spec.name for method in registered_methods())
    if name not in names:
        raise ConfigError(
            f"unknown merge_method {shown(name)}; use one of: {', '.join(names)} "
            "(the plugin's methods need mergekit-bmm installed in the same environment)"
        )


def check_base(config: Any) -> None:
    """A method that needs a base model (task vectors) gets one."""
    from mergekit.merge_methods import get
    from mergekit.merge_methods.base import BasePolicy

    contract = getattr(get(config.merge_method).spec, "contract", None)
    if getattr(contract, "base", None) == BasePolicy.REQUIRED and config.base_model is None:
        raise ConfigError(
            f"merge_method {config.merge_method} needs `base_model:` (the model the others were "
            "fine-tuned from); add it to the recipe"
        )


def looks_local(path: str) -> bool:
    """Whether a model reference names a folder rather than a Hub repo id (``org/name``)."""
    return (
        os.path.isabs(path)
        or path.startswith((".", "~"))
        or path.count("/") > 1
        or os.path.exists(path)
        or os.sep != "/"
        and os.sep in path
    )


def check_models(config: Any) -> None:
    """Local model folders exist, are model folders, and share one hidden size."""
    from mergekit_bmm.io.model_folder import model_config

    sizes: dict[str, int] = {}
    for reference in config.referenced_models():
        for role, path in (("model", reference.model.path), ("LoRA", getattr(reference.lora, "path", None))):
            if path is None or not looks_local(path):
                continue
            folder = Path(path).expanduser()
            if not folder.is_dir():
                what = "is a file, not a folder" if folder.exists() else "does not exist"
                raise ConfigError(f"{role} folder {folder} in the recipe {what}; fix its path in the recipe")
            marker = "adapter_config.json" if role == "LoRA" else "config.json"
            if not (folder / marker).is_file():
                raise ConfigError(
                    f"{role} folder {folder} has no {marker}: it is not a saved {role.lower()}; "
                    "point the recipe at the folder save_pretrained wrote"
                )
            if role == "model":
                size = getattr(model_config(folder), "hidden_size", None)
                if isinstance(size, int):
                    sizes[str(folder)] = size
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{path} ({size})" for path, size in sizes.items())
        raise ConfigError(
            f"the models' hidden sizes differ: {listed}; they are not fine-tunes of one base model, "
            "so their weights cannot be merged: check the paths"
        )


def foreign_files(folder: Path) -> list[str]:
    """Files in ``folder`` that no merge wrote (everything, when no merge was ever written there)."""
    names = sorted(entry.name for entry in folder.iterdir())
    if PREVIOUS_MERGE_MARKER not in names:
        return names
    return [name for name in names if not MERGE_OUTPUT.fullmatch(name)]


def check_output(out: Path, *, guard_folder: bool, force: bool) -> None:
    """``out`` is a writable folder (created if missing) holding nothing a merge did not write."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"OUT_PATH {out} is a file; give a folder for the merged model")
    if out.is_dir() and guard_folder:
        foreign = foreign_files(out)
        replaced = [name for name in foreign if MERGE_OUTPUT.fullmatch(name)]
        if foreign and not force:
            listed = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise ConfigError(
                f"OUT_PATH {out} holds files a merge did not write ({listed}); give a new or empty "
                "folder, or pass --force (mergekit-bmm-yaml) to write the merge next to them"
            )
        if replaced:  # said on stderr whatever the logging setup: the user asked for it, once
            print(
                f"mergekit-bmm: note: --force: replacing {', '.join(replaced)} in {out}, which a merge "
                "did not write",
                file=sys.stderr,
            )
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        raise ConfigError(
            f"cannot write to OUT_PATH {out}: {error.strerror or error}; choose a folder you can write"
        ) from None
