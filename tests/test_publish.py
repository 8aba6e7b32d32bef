"""``mergekit-bmm-publish``: refusals, ``--dry-run``, and a real upload to a local Hub stand-in."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from conftest import load_weights
from hub_standin import HubStandIn
from huggingface_hub import ModelCard
from safetensors.torch import save_file

from mergekit_bmm.cards.publish import files_to_upload, publish_folder
from mergekit_bmm.cli.publish import main as publish_main
from mergekit_bmm.errors import PublishError

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def merged(tiny_llama, tmp_path_factory) -> Path:
    """A bmm merge written by ``run_merge`` (card, recipe and merge record included)."""
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    config = {
        "merge_method": "bmm",
        "base_model": str(tiny_llama.base),
        "models": [{"model": str(p), "parameters": {"weight": 0.3}} for p in tiny_llama.experts],
        "parameters": {"lambda": 0.05},
        "dtype": "float32",
    }
    out = tmp_path_factory.mktemp("publish") / "merged"
    run_merge(
        MergeConfiguration.model_validate(config),
        str(out),
        options=MergeOptions(copy_tokenizer=False, quiet=True),
        config_source=yaml.safe_dump(config),
    )
    return out


@pytest.fixture
def folder(merged, tmp_path) -> Path:
    target = tmp_path / "bmm-merge"
    shutil.copytree(merged, target)
    return target


def ids_of(family) -> dict[str, str]:
    return {str(family.base): "org/base", **{str(path): f"org/{path.name}" for path in family.experts}}


def id_options(family, drop_last: bool = False) -> list[str]:
    """``--base-model-id`` for every input (the tiny models have no Hub ids)."""
    options = ["--base-model-id", f"{family.base}=org/base"]
    for index, path in enumerate(family.experts):
        last = index == len(family.experts) - 1
        options += ["--base-model-id", f"{path}=" if drop_last and last else f"{path}=org/{path.name}"]
    return options


def test_dry_run_lists_what_would_be_uploaded(folder, tiny_llama):
    (folder / ".cache" / "huggingface").mkdir(parents=True)
    (folder / ".cache" / "huggingface" / "download.lock").write_text("")
    readme = (folder / "README.md").read_bytes()
    result = CliRunner().invoke(publish_main, [str(folder), "me/bmm", "--dry-run", *id_options(tiny_llama)])
    assert result.exit_code == 0, result.output
    expected = [
        "README.md",
        "config.json",
        "mergekit_bmm_merge.json",
        "mergekit_config.yml",
        "model.safetensors",
    ]
    assert files_to_upload(folder) == expected
    listing, front_matter = result.output.split("front matter on the Hub would be:")
    listed = [line.split()[0] for line in listing.splitlines()[1:] if line.startswith("  ")]
    assert listed == expected
    card = publish_folder(folder, "me/bmm", dry_run=True, base_model_ids=ids_of(tiny_llama)).card_text
    assert f"README.md  ({len(card.encode())} bytes)" in listing  # the size of the card as uploaded
    assert "\n# me/bmm\n" in card  # titled with the repo id
    assert "checks passed; would upload 5 files" in result.output
    import huggingface_hub

    if huggingface_hub.get_token() is None:  # the dry run says what a real upload will need
        assert "a real upload would stop now" in result.output and "an upload needs one" in result.output
    assert "base_model:\n- org/base" in front_matter and "tags:" in front_matter
    assert (folder / "README.md").read_bytes() == readme  # a dry run changes nothing


def _rewrite_weights(folder: Path, change) -> None:
    weights = load_weights(folder)
    change(weights)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _one_value(weights) -> None:
    name = "model.layers.2.mlp.up_proj.weight"
    weights[name][17, 5] += 1e-3


def _whole_tensor(weights) -> None:
    weights["model.embed_tokens.weight"] *= 1.01


@pytest.mark.parametrize(
    "case, message",
    [
        ("no_card", "holds no model card (README.md)"),
        ("not_a_card", "has no YAML front matter"),
        ("no_record", "has no mergekit_bmm_merge.json"),
        ("no_recipe", "lacks its recipe mergekit_config.yml"),
        ("recipe_edited", "mergekit_config.yml changed since the merge"),
        ("tensor_edited", "do not match the fingerprint recorded at merge time"),
        ("one_value_edited", "model.safetensors changed; re-run the merge"),
        ("weights_added", "added model-extra.safetensors"),
        ("local_base_model", "lists 4 local folders, which are not Hub repo ids"),
        ("bad_repo", "must name the owner too"),
        ("unknown_mapping", "which the card's base_model does not list"),
    ],
)
def test_refuses_with_one_line(folder, tiny_llama, case, message):
    ids = id_options(tiny_llama)
    repo = "me/bmm"
    if case == "no_card":
        (folder / "README.md").unlink()
    elif case == "not_a_card":
        (folder / "README.md").write_text("# just a title\n")
    elif case == "no_record":
        (folder / "mergekit_bmm_merge.json").unlink()
    elif case == "no_recipe":
        (folder / "mergekit_config.yml").unlink()
    elif case == "recipe_edited":
        with open(folder / "mergekit_config.yml", "a") as handle:
            handle.write("# tuned by hand\n")
    elif case == "tensor_edited":
        _rewrite_weights(folder, _whole_tensor)
    elif case == "one_value_edited":
        _rewrite_weights(folder, _one_value)
    elif case == "weights_added":
        shutil.copyfile(folder / "model.safetensors", folder / "model-extra.safetensors")
    elif case == "local_base_model":
        ids = []
    elif case == "bad_repo":
        repo = "no-owner"
    elif case == "unknown_mapping":
        ids = [*ids, "--base-model-id", "/somewhere/else=org/else"]
    result = CliRunner().invoke(publish_main, [str(folder), repo, "--dry-run", *ids])
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mergekit-bmm: error:"), result.output
    assert message in lines[0]


def test_offline_upload_is_refused_before_anything_is_sent(folder, tiny_llama):
    mapping = {str(tiny_llama.base): "org/base", **{str(p): f"org/{p.name}" for p in tiny_llama.experts}}
    with pytest.raises(PublishError, match="offline mode"):
        publish_folder(folder, "me/bmm", base_model_ids=mapping)  # the test session is offline


@pytest.mark.slow
def test_upload_through_a_local_hub_standin(folder, tiny_llama, tmp_path):
    offline = ("HF_", "TRANSFORMERS_OFFLINE")
    env = {key: value for key, value in os.environ.items() if not key.startswith(offline)}
    with HubStandIn() as hub:
        env.update(
            HF_ENDPOINT=hub.endpoint,
            HF_TOKEN="hf_standin_token",
            HF_HOME=str(tmp_path / "hf-home"),
            HF_HUB_DISABLE_TELEMETRY="1",
            HF_HUB_DISABLE_PROGRESS_BARS="1",
        )
        command = [str(BIN / "mergekit-bmm-publish"), str(folder), "me/bmm", "--private"]
        command += ["--revision", "v1", *id_options(tiny_llama, drop_last=True)]
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
        state = hub.state
    assert result.returncode == 0, result.stderr[-3000:]
    assert "uploaded 5 files" in result.stdout and f"{hub.endpoint}/me/bmm" in result.stdout

    routes = [(method, path.split("?")[0]) for method, path, _ in state.requests]
    assert routes == [
        ("POST", "/api/repos/create"),
        ("POST", "/api/models/me/bmm/branch/v1"),
        ("POST", "/api/validate-yaml"),
        ("POST", "/api/models/me/bmm/preupload/v1"),
        ("POST", "/api/models/me/bmm/commit/v1"),
    ]
    assert all(headers.get("authorization") == "Bearer hf_standin_token" for _, _, headers in state.requests)
    repo = state.repos["me/bmm"]
    assert repo.private and len(repo.commits) == 1
    uploaded = repo.branches["v1"]
    assert sorted(uploaded) == files_to_upload(folder)
    assert all(uploaded[name] == (folder / name).read_bytes() for name in uploaded)

    # The card on the Hub names Hub ids; the local card was updated to match.
    card = ModelCard(uploaded["README.md"].decode())
    experts = [f"org/{p.name}" for p in tiny_llama.experts[:-1]]
    assert card.data.base_model == ["org/base", *experts]
    assert {"mergekit", "merge", "bmm"} <= set(card.data.tags)
    assert state.validated_readmes == [uploaded["README.md"].decode()]
    record = json.loads(uploaded["mergekit_bmm_merge.json"])
    assert record["weight_sha256"]["model.safetensors"]
