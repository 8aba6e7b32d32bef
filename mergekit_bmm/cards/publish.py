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
from dataclasses import dataclass
from pathlib import Path

from mergekit_bmm.cards.merge_record import (
    RECORD_FILE,
    MergeRecord,
    read_record,
    recipe_digest,
    weight_hashes,
    weight_sizes,
)
from mergekit_bmm.errors import BMMError, PublishError
from mergekit_bmm.io.fingerprint import model_fingerprint

LOG = logging.getLogger("mergekit_bmm")

CARD_FILE = "README.md"
DEFAULT_BRANCH = "main"


def _load_card(folder: Path):
    from huggingface_hub import ModelCard

    path = folder / CARD_FILE
    if not path.is_file():
        raise PublishError(
            f"{folder} holds no model card ({CARD_FILE}); merge with mergekit-yaml (mergekit-bmm installed) "
            "or write one with mergekit_bmm.cards.card.write_merge_card"
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
    from mergekit_bmm.cards.recipe_view import local_folder

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
    """Every ``base_model`` entry must be a Hub id; all the ones that are not are named at once."""
    from mergekit_bmm.io.hub_ids import looks_like_repo_id

    local = [entry for entry in entries if not looks_like_repo_id(entry)]
    if len(local) == 1:
        raise PublishError(
            f"the card's base_model lists {local[0]!r}, which is not a Hub repo id (the Hub accepts "
            "only ids); "
            f"pass --base-model-id {local[0]}=ORG/NAME (or {local[0]}= to leave it out)"
        )
    if local:
        options = " ".join(f"--base-model-id {entry}=ORG/NAME" for entry in local)
        raise PublishError(
            f"the card's base_model lists {len(local)} local folders, which are not Hub repo ids (the Hub "
            f"accepts only ids): {', '.join(local)}; pass {options} (LOCAL= leaves one out)"
        )


def files_to_upload(folder: Path, allow_patterns: list[str] | None = None) -> list[str]:
    """Paths ``upload_folder`` sends: every file (or those ``allow_patterns`` match), minus
    huggingface_hub's default ignores."""
    from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects

    paths = sorted(path.relative_to(folder).as_posix() for path in folder.glob("**/*") if path.is_file())
    return list(
        filter_repo_objects(
            paths, allow_patterns=allow_patterns, ignore_patterns=list(DEFAULT_IGNORE_PATTERNS)
        )
    )


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
            f"repo id {repo_id!r} is not a valid Hub repo id ({error}); use user/name"
        ) from None
    if repo_id.count("/") != 1:
        raise PublishError(f"repo id {repo_id!r} must name the owner too: user/name or org/name")


def preflight(repo_id: str) -> None:
    """Refuse early what would stop an upload later (bad repo id, offline, no token)."""
    _check_repo_id(repo_id)
    _check_hub_access()


def hub_access_problem() -> str | None:
    """Why an upload could not reach the Hub now (offline mode, no token), or None."""
    import huggingface_hub
    from huggingface_hub import constants

    problems = []
    if constants.HF_HUB_OFFLINE:
        problems.append(
            "huggingface_hub is in offline mode (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE is set); unset it"
        )
    if huggingface_hub.get_token() is None:
        problems.append("no Hugging Face token found: an upload needs one (`hf auth login`, or HF_TOKEN)")
    return "; and ".join(problems) or None


def _check_hub_access(hint: str = "") -> None:
    problem = hub_access_problem()
    if problem is not None:
        raise PublishError(f"cannot publish: {problem}{hint}")


@dataclass
class PublishPlan:
    """What an upload sends: the files, the card as it will read on the Hub, and (for a dry run)
    what would stop a real upload now."""

    repo_id: str
    folder: Path
    paths: list[str]
    card_text: str
    problem: str | None = None

    @property
    def front_matter(self) -> str:
        return self.card_text.split("---", 2)[1].strip() if self.card_text.startswith("---") else ""

    def size(self, path: str) -> int:
        return len(self.card_text.encode()) if path == CARD_FILE else (self.folder / path).stat().st_size

    @property
    def total_bytes(self) -> int:
        return sum(self.size(path) for path in self.paths)


def _titled(text: str, title: str) -> str:
    """The card with its first heading (after the front matter) set to ``title``."""
    head, sep, body = text.partition("\n---\n") if text.startswith("---") else ("", "", text)
    lines = body.split("\n")
    for index, line in enumerate(lines):
        if line.startswith("# "):
            lines[index] = f"# {title}"
            break
    return head + sep + "\n".join(lines)


def publish_folder(
    folder: Path,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    dry_run: bool = False,
    base_model_ids: Mapping[str, str] | None = None,
    commit_message: str | None = None,
) -> PublishPlan:
    """Check ``folder`` and upload it to ``repo_id``; return what was (or, dry, would be) sent.

    With ``dry_run`` nothing is written or sent: the checks run and the plan is returned,
    with the card as it would read on the Hub and whatever would stop a real upload now (no
    token, offline). ``base_model_ids`` maps a local folder listed in the card's
    ``base_model`` to its Hub id ("" leaves it out); the card's title becomes the repo id.
    The card in ``folder`` is updated before the upload so that the folder and the repo agree.
    """
    folder = Path(folder)
    _check_repo_id(repo_id)
    card, _ = _checked(folder)
    base_models = _apply_base_model_ids(card, base_model_ids or {})
    _check_base_models(base_models)
    card.data.base_model = base_models
    plan = PublishPlan(repo_id, folder, files_to_upload(folder), _titled(str(card), repo_id))
    if dry_run:
        plan.problem = hub_access_problem()
        return plan

    _check_hub_access(" (or check the folder with --dry-run)")
    if plan.card_text != (folder / CARD_FILE).read_text(encoding="utf-8"):
        (folder / CARD_FILE).write_text(plan.card_text, encoding="utf-8")
    upload(
        folder,
        repo_id,
        private,
        revision,
        commit_message or f"Upload {folder.name} (BMM merge) with mergekit-bmm",
    )
    return plan


def upload(
    folder: Path,
    repo_id: str,
    private: bool,
    revision: str | None,
    commit_message: str,
    allow_patterns: list[str] | None = None,
) -> None:
    """Create the model repo (and branch) if needed and upload ``folder``; one line if it fails."""
    from huggingface_hub import HfApi

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
            commit_message=commit_message,
            allow_patterns=allow_patterns,
        )
    except Exception as error:
        text = " ".join(str(error).split())
        raise PublishError(f"upload of {folder} to {repo_id} failed: {text}") from None
