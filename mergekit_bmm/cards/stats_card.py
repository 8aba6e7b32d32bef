"""A statistics folder as a Hub repo: its card, the checks before upload, and the upload.

Model authors can publish the activation statistics of their fine-tunes once; anyone can then
run RegMean or data-assisted BMM with ``stats: hf://ORG/NAME`` and no data. Only the manifest,
the part files and the card are sent (never a progress file or anything else in the folder),
after the same kind of checks as a merged model: the manifest must validate, every part file
must exist and declare, in its header, Grams of the shape and dtype the reader accepts.
"""

from __future__ import annotations

from pathlib import Path

from mergekit_bmm.cards.publish import (
    CARD_FILE,
    PublishPlan,
    _check_hub_access,
    _check_repo_id,
    files_to_upload,
    hub_access_problem,
    upload,
)
from mergekit_bmm.errors import BMMError, PublishError
from mergekit_bmm.io.hub_ids import looks_like_repo_id
from mergekit_bmm.stats import gram_storage
from mergekit_bmm.stats.store import GRAM_DIR, MANIFEST, StatsManifest, TaskStats, load_manifest

UPLOADED = [MANIFEST, f"{GRAM_DIR}/*.safetensors", CARD_FILE]


def is_statistics_folder(folder: Path) -> bool:
    return (Path(folder) / MANIFEST).is_file() and "mergekit-bmm-stats" in (folder / MANIFEST).read_text(
        encoding="utf-8", errors="replace"
    )


def check_statistics(folder: Path) -> StatsManifest:
    """The folder's manifest, once every task's part files exist and their headers are sound."""
    try:
        manifest = load_manifest(folder)
    except BMMError as error:
        raise PublishError(str(error)) from None
    if not manifest.tasks:
        raise PublishError(f"{folder} holds no finished task; run mergekit-bmm-stats to the end first")
    for task in manifest.tasks:
        for key, part in (task.parts or {}).items():
            where = f"statistics in {folder}, task {task.name!r}"
            try:
                gram_storage.check_part_gram(folder / GRAM_DIR / task.file / part, key, where)
            except BMMError as error:
                raise PublishError(str(error)) from None
        if not task.parts and not (folder / GRAM_DIR / task.file).is_file():
            raise PublishError(f"{folder}: task {task.name!r} lacks its file {GRAM_DIR}/{task.file}")
    return manifest


def _expert(task: TaskStats) -> str:
    if looks_like_repo_id(task.model) and not Path(task.model).exists():
        return f"[`{task.model}`](https://huggingface.co/{task.model})" + (
            f" @ `{task.revision[:12]}`" if task.revision else ""
        )
    return f"a local folder (weights `{task.fingerprint}`)"


def _data(task: TaskStats) -> str:
    settings = task.settings
    if str(settings.get("data_fingerprint", "")).startswith("hub:"):
        commit = settings["data_fingerprint"][4:]
        parts = [f"[`{task.data}`](https://huggingface.co/datasets/{task.data})"]
        parts += [f"config `{settings['data_config']}`"] if settings.get("data_config") else []
        parts += [f"split `{settings['split']}`"] if settings.get("split") else []
        return ", ".join(parts) + (f" @ `{commit[:12]}`" if commit else "")
    return f"`{Path(task.data).name}` (local, `{settings.get('data_fingerprint', '')}`)"


def statistics_card(manifest: StatsManifest, repo_id: str) -> str:
    """The README a statistics repo gets: what was measured, from which experts and data, how to use it."""
    import yaml

    experts = [t.model for t in manifest.tasks if looks_like_repo_id(t.model) and not Path(t.model).exists()]
    datasets = [
        t.data for t in manifest.tasks if str(t.settings.get("data_fingerprint", "")).startswith("hub:")
    ]
    front = {"tags": ["mergekit-bmm", "activation-statistics", "regmean", "model-merging"]}
    if experts:
        front["base_model"] = experts
    if datasets:
        front["datasets"] = sorted(set(datasets))
    rows = [
        f"| {t.name} | {_expert(t)} | {_data(t)} | {t.samples} | {t.tokens} | {t.passes or 1} |"
        for t in manifest.tasks
    ]
    setting = manifest.tasks[0].settings
    models = "\n".join(
        f"  - model: {t.model if t.model in experts else '/path/to/' + t.name}" for t in manifest.tasks
    )
    return "\n".join(
        [
            "---",
            yaml.safe_dump(front, sort_keys=False).strip(),
            "---",
            "",
            f"# {repo_id}",
            "",
            "Activation statistics (per-task mean Grams `G_t = mean x xᵀ` of every body linear module's "
            "input) for data-assisted [Bayesian Model Merging](https://arxiv.org/abs/2605.12843) and "
            "RegMean with mergekit-bmm: merge these experts without their data.",
            "",
            "| task | expert | calibration data | samples | tokens | passes |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            f"Architecture `{manifest.model_type}`, {len(manifest.modules)} modules, "
            f"{len(set(manifest.modules.values()))} stored Grams per task; at most "
            f"{setting.get('max_length')} tokens per sample, forward in {setting.get('forward_dtype')}, "
            f"accumulated in {setting.get('accumulate_dtype')}. Format `{manifest.format}` version "
            f"{manifest.format_version} (safetensors and JSON only).",
            "",
            "## Use",
            "",
            "```yaml",
            "merge_method: bmm        # or regmean",
            "base_model: /path/to/base",
            "models:",
            models,
            "parameters:",
            "  gram: activations",
            f"  stats: hf://{repo_id}",
            "```",
            "",
            "`mergekit-yaml recipe.yml out/` fetches the statistics once into the Hugging Face cache and "
            "checks that they were made from the recipe's experts (Hub id and commit, or the weights' "
            "fingerprint for a local copy).",
            "",
        ]
    )


def publish_statistics(
    folder: Path,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    dry_run: bool = False,
    commit_message: str | None = None,
) -> PublishPlan:
    """Check a statistics folder, write its card and upload it (``dry_run``: say what would be sent)."""
    folder = Path(folder)
    _check_repo_id(repo_id)
    manifest = check_statistics(folder)
    card = statistics_card(manifest, repo_id)
    paths = sorted({*files_to_upload(folder, UPLOADED), CARD_FILE})
    plan = PublishPlan(repo_id, folder, paths, card)
    if dry_run:
        plan.problem = hub_access_problem()
        return plan
    _check_hub_access(" (or check the folder with --dry-run)")
    (folder / CARD_FILE).write_text(card, encoding="utf-8")
    message = (
        commit_message or f"Upload activation statistics ({len(manifest.tasks)} tasks) with mergekit-bmm"
    )
    upload(folder, repo_id, private, revision, message, allow_patterns=UPLOADED)
    return plan
