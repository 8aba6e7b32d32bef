"""Publish a merged folder to the Hugging Face Hub, only if it is what its card says.

Before anything is uploaded the folder must hold a model card whose front matter parses,
the recipe, and a merge record whose weights fingerprint and recipe digest still match
the files (so the card describes these weights), and every ``base_model`` entry must be
a Hub repo id (local folders may be mapped to ids with ``base_model_ids``). Then
``create_repo`` (``exist_ok``), ``create_branch`` for a non-default ``revision``, and
``upload_folder`` — the token comes from ``huggingface_hub``'s usual places (``HF_TOKEN``,
``hf auth login``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from mergekit_bmm.errors import BMMError, PublishError
from mergekit_bmm.fingerprint import model_fingerprint
from mergekit_bmm.merge_record import (
    RECORD_FILE,
    MergeRecord,
    read_record,
    recipe_digest,
    weight_hashes,
    weight_sizes,
)

LOG = logging.getLogger("mergekit_bmm")

CARD_FILE = "README.md"
DEFAULT_BRANCH = "main"


def _load_card(folder: Path):
    from huggingface_hub import ModelCard

    path = folder / CARD_FILE
    if not path.is_file():
        raise PublishError(
            f"{folder} holds no model card ({CARD_FILE}); merge with mergekit-yaml (mergekit-bmm installed) "
            "or write one with mergekit_bmm.card.write_merge_card"
        )
    try:
        card = ModelCard.load(path)
    except Exception as error:
        raise PublishError(f"{path} is not a valid model card ({' '.join(str(error).split())})") from None
    if not card.data.to_dict():
        raise PublishError(f"{path} has no YAML front matter; it is not a Hub model card")
    return card


def _check_record(folder: Path) -> MergeRecord:
    try:
        record = read_record(folder)
    except BMMError as error:
        raise PublishError(str(error)) from None
    if record is None:
        raise PublishError(
            f"{folder} has no {RECORD_FILE} (the weights fingerprint recorded at merge time), so its weights "
            "cannot be checked; re-run the merge with mergekit-bmm installed"
        )
    recipe = folder / record.recipe_file
    if not recipe.is_file():
        raise PublishError(
            f"{folder} lacks its recipe {record.recipe_file}; restore it (the card embeds it) "
            "or re-run the merge"
        )
    if recipe_digest(recipe.read_text(encoding="utf-8")) != record.recipe_sha256:
        raise PublishError(
            f"{recipe} changed since the merge (digest differs from {RECORD_FILE}); "
            "restore it or re-run the merge"
        )
    changed = _changed_weights(folder, record)
    if changed:
        raise PublishError(
            f"the weights in {folder} do not match the fingerprint recorded at merge time "
            f"({record.weights_fingerprint}): {changed}; re-run the merge to publish them"
        )
    return record


def _changed_weights(folder: Path, record: MergeRecord) -> str:
    """What differs from the record ("" if nothing): files, sizes, then every byte."""
    sizes = weight_sizes(folder)
    if set(sizes) != set(record.weight_files):
        added = sorted(set(sizes) - set(record.weight_files))
        missing = sorted(set(record.weight_files) - set(sizes))
        return "; ".join(
            part
            for part in (
                f"added {', '.join(added)}" if added else "",
                f"missing {', '.join(missing)}" if missing else "",
            )
            if part
        )
    resized = [name for name, size in sizes.items() if record.weight_files[name] != size]
    if resized:
        return f"{', '.join(resized)} changed size"
    if model_fingerprint(folder) != record.weights_fingerprint:
        return "contents changed"
    large = sum(sizes.values()) > 256 << 20
    hashes = weight_hashes(folder, show_progress=large)
    edited = [name for name, digest in hashes.items() if record.weight_sha256.get(name) != digest]
    return f"{', '.join(edited)} changed" if edited else ""


def _apply_base_model_ids(card, mapping: Mapping[str, str]) -> list[str]:
    """``base_model`` with local folders replaced by the given ids ("" drops an entry)."""
    from mergekit_bmm.recipe_view import local_folder

    current = card.data.base_model or []
    if isinstance(current, str):
        current = [current]
    resolved = {}
    for local, repo in mapping.items():
        resolved[local] = repo
        folder = local_folder(local)
        if folder is not None:
            resolved[str(folder)] = repo
    unknown = [
        local for local in mapping if local not in current and str(local_folder(local) or "") not in current
    ]
    if unknown:
        raise PublishError(
            f"--base-model-id names {unknown[0]}, which the card's base_model does not list "
            f"(it lists: {', '.join(current) or 'nothing'})"
        )
    updated = []
    for entry in current:
        value = resolved.get(entry, entry)
        if value and value not in updated:
            updated.append(value)
    return updated


def _check_base_models(entries: list[str]) -> None:
    from mergekit_bmm.recipe_view import looks_like_repo_id

    for entry in entries:
        if not looks_like_repo_id(entry):
            raise PublishError(
                f"the card's base_model lists {entry!r}, which is not a Hub repo id (the Hub accepts "
                "only ids); "
                f"pass --base-model-id {entry}=ORG/NAME (or {entry}= to leave it out)"
            )


def files_to_upload(folder: Path) -> list[str]:
    """Paths ``upload_folder`` sends: every file, minus huggingface_hub's default ignores."""
    from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects

    paths = sorted(path.relative_to(folder).as_posix() for path in folder.glob("**/*") if path.is_file())
    return list(filter_repo_objects(paths, ignore_patterns=list(DEFAULT_IGNORE_PATTERNS)))


def _checked(folder: Path):
    if not folder.is_dir():
        raise PublishError(f"{folder} is not a folder")
    card = _load_card(folder)
    return card, _check_record(folder)


def check_folder(folder: str | Path) -> MergeRecord:
    """Raise PublishError unless ``folder`` holds a card, its recipe and unchanged weights."""
    return _checked(Path(folder))[1]


def _check_repo_id(repo_id: str) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise PublishError(
            f"--repo {repo_id!r} is not a valid Hub repo id ({error}); use user/name"
        ) from None
    if repo_id.count("/") != 1:
        raise PublishError(f"--repo {repo_id!r} must name the owner too: user/name or org/name")


def preflight(repo_id: str) -> None:
    """Refuse early what would stop an upload later (bad repo id, offline, no token)."""
    import huggingface_hub
    from huggingface_hub import constants

    _check_repo_id(repo_id)
    if constants.HF_HUB_OFFLINE:
        raise PublishError(
            "huggingface_hub is in offline mode (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE is set); "
            "unset it to publish"
        )
    if huggingface_hub.get_token() is None:
        raise PublishError("no Hugging Face token found; run `hf auth login` or set HF_TOKEN")


def publish_folder(
    folder: Path,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    dry_run: bool = False,
    base_model_ids: Mapping[str, str] | None = None,
    commit_message: str | None = None,
) -> list[str]:
    """Check ``folder`` and upload it to ``repo_id`` (contract C); return the paths sent.

    With ``dry_run`` nothing is written or sent: the checks run and the list of paths
    that would be uploaded is returned. ``base_model_ids`` maps a local folder listed in
    the card's ``base_model`` to its Hub id ("" leaves it out); the card in ``folder`` is
    updated before the upload so that the folder and the repo agree.
    """
    folder = Path(folder)
    _check_repo_id(repo_id)
    card, _ = _checked(folder)
    base_models = _apply_base_model_ids(card, base_model_ids or {})
    _check_base_models(base_models)
    paths = files_to_upload(folder)
    if dry_run:
        return paths

    import huggingface_hub
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE:
        raise PublishError(
            "huggingface_hub is in offline mode (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE is set); "
            "unset it to publish (or use --dry-run)"
        )
    if huggingface_hub.get_token() is None:
        raise PublishError("no Hugging Face token found; run `hf auth login` or set HF_TOKEN")
    current = card.data.base_model or []
    if base_models != (current if isinstance(current, list) else [current]):
        card.data.base_model = base_models
        card.save(folder / CARD_FILE)
    api = HfApi()
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        if revision and revision != DEFAULT_BRANCH:
            api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
        api.upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            repo_type="model",
            revision=revision,
            commit_message=commit_message or f"Upload {folder.name} (BMM merge) with mergekit-bmm",
        )
    except Exception as error:
        text = " ".join(str(error).split())
        raise PublishError(f"upload of {folder} to {repo_id} failed: {text}") from None
    return paths
