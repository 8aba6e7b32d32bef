"""Model cards of BMM merges: from the stock ``mergekit-yaml``, from ``run_merge``, and for a search.

Every card is parsed with ``huggingface_hub.ModelCard`` and checked field by field.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import load_weights
from huggingface_hub import ModelCard

from mergekit_bmm.cards.card import PAPER_URL, write_search_card
from mergekit_bmm.cards.merge_record import RECORD_FILE, read_record, recipe_digest
from mergekit_bmm.core.module_map import classify
from mergekit_bmm.errors import ConfigError
from mergekit_bmm.io.fingerprint import model_fingerprint
from mergekit_bmm.io.model_folder import weight_names_of
from mergekit_bmm.recipes.blockwise import BlockSetting, blockwise_recipe
from mergekit_bmm.search.summary import SearchSummary, read_summary, write_summary

BIN = Path(sys.executable).parent
LAMBDAS = [
    {"attn_in": 0.01, "attn_out": 0.02, "mlp_in": 0.03, "mlp_out": 0.04},
    {"attn_in": 0.5, "attn_out": 0.6, "mlp_in": 0.7, "mlp_out": 0.8},
]
SCALES = [1.2, 0.9]
EXPECTED_ROWS = [
    ["0–1", "0.01", "0.02", "0.03", "0.04", "1.2"],
    ["2–3", "0.5", "0.6", "0.7", "0.8", "0.9"],
]


def models_recipe(base: str, experts: list[str], **parameters) -> dict:
    return {
        "merge_method": "bmm",
        "base_model": base,
        "models": [{"model": path, "parameters": {"weight": 0.3}} for path in experts],
        "parameters": {"anchor_method": "task_arithmetic", "gram": "data_free", **parameters},
        "dtype": "float32",
    }


def blockwise(family, base: str, experts: list[str]) -> dict:
    settings = [BlockSetting(0, 2, LAMBDAS[0], SCALES[0]), BlockSetting(2, 4, LAMBDAS[1], SCALES[1])]
    return blockwise_recipe(models_recipe(base, experts), settings, weight_names_of(str(family.base)))


def merge(config: dict, out: Path, text: str | None = None, write_card: bool = True) -> None:
    """In-process ``run_merge``, given the recipe text as the CLI gives it (None: as the API)."""
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    run_merge(
        MergeConfiguration.model_validate(copy.deepcopy(config)),
        str(out),
        options=MergeOptions(copy_tokenizer=False, quiet=True, write_model_card=write_card),
        config_source=text,
    )


def fenced(text: str, language: str) -> list[str]:
    return re.findall(rf"^(`{{3,}}){language}\n(.*?)\n\1$", text, flags=re.S | re.M)


def table_after(text: str, header_start: str) -> list[list[str]]:
    """Body rows of the markdown table whose header line starts with ``header_start``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def check_front_matter(card: ModelCard, expected_models: list[str]) -> None:
    data = card.data.to_dict()
    assert data["base_model"] == expected_models
    assert {"mergekit", "merge", "bmm"} <= set(data["tags"])
    assert data["library_name"] == "transformers"
    assert data["base_model_relation"] == "merge"


@pytest.mark.slow
def test_stock_mergekit_yaml_writes_bmm_card_offline_with_relative_paths(tiny_llama, tmp_path):
    # Relative repo-id-like paths are what made mergekit's own card ask the Hub and crash
    # offline after the weights were written.
    models = tmp_path / "models"
    models.mkdir()
    for path in (tiny_llama.base, *tiny_llama.experts):
        (models / path.name).symlink_to(path, target_is_directory=True)
    names = [f"models/{path.name}" for path in tiny_llama.experts]
    config = blockwise(tiny_llama, "models/base", names)
    recipe_text = yaml.safe_dump(config, sort_keys=False)
    (tmp_path / "recipe.yml").write_text(recipe_text)

    result = subprocess.run(
        [str(BIN / "mergekit-yaml"), "recipe.yml", "out", "--no-copy-tokenizer", "--quiet"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    card = ModelCard.load(out / "README.md")
    check_front_matter(card, [str(models / "base"), *(str(models / p.name) for p in tiny_llama.experts)])

    text = card.text
    assert f"[arXiv 2605.12843]({PAPER_URL})" in text
    assert "Task Arithmetic" in text and "(the default)" not in text
    assert "data-free" in text and "relative: `λ' = λ·tr(G)/d_in`" in text
    assert table_after(text, "| layers") == EXPECTED_ROWS
    experts = table_after(text, "| model | `weight` |")
    assert [row[1] for row in experts] == ["0.3"] * 3

    # The exact recipe is embedded, is the one mergekit saved, and reproduces the weights.
    (embedded,) = [body for _, body in fenced(text, "yaml")]
    assert embedded == recipe_text.rstrip()
    assert (out / "mergekit_config.yml").read_text() == recipe_text

    record = read_record(out)
    assert record.weights_fingerprint == model_fingerprint(out)
    assert record.recipe_sha256 == recipe_digest(recipe_text)
    assert [item.role for item in record.inputs] == ["base", "expert", "expert", "expert"]
    assert record.inputs[0].fingerprint == model_fingerprint(tiny_llama.base)
    assert f"`{record.weights_fingerprint}`" in text

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        merge(yaml.safe_load(embedded), tmp_path / "again", text=embedded)
    finally:
        os.chdir(cwd)
    first, second = load_weights(out), load_weights(tmp_path / "again")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_card_shows_anchor_method_and_its_parameters(tiny_llama, tmp_path):
    experts = [str(p) for p in tiny_llama.experts]
    config = models_recipe(str(tiny_llama.base), experts, anchor_method="ties", density=0.5, scale=1.1)
    config["parameters"]["lambda"] = 0.05
    for item, weight in zip(config["models"], (0.3, 0.4, 0.5)):
        item["parameters"]["weight"] = weight
    text = yaml.safe_dump(config, sort_keys=False)
    merge(config, tmp_path / "out", text=text)

    card = ModelCard.load(tmp_path / "out" / "README.md")
    check_front_matter(card, [str(tiny_llama.base), *experts])
    assert "[TIES](https://arxiv.org/abs/2306.01708) (`ties`)" in card.text
    rows = table_after(card.text, "| model | `weight` | `density` |")
    assert rows == [[f"`{path}`", weight, "0.5"] for path, weight in zip(experts, ("0.3", "0.4", "0.5"))]
    shared = dict(table_after(card.text, "| anchor parameter |"))
    assert shared["`anchor_lambda`"] == "1 (default)"
    assert table_after(card.text, "| layers") == [["0–3", "0.05", "0.05", "0.05", "0.05", "1.1"]]


def make_stats(family, out: Path) -> Path:
    """A statistics directory for every body weight (the format of mergekit_bmm.stats.store)."""
    from mergekit_bmm.stats.store import StatsManifest, TaskStats, write_grams, write_manifest

    base = load_weights(family.base)
    body = [name for name, w in base.items() if w.ndim == 2 and classify(name) is not None]
    tasks = []
    for index, expert in enumerate(family.experts):
        generator = torch.Generator().manual_seed(index)
        grams = {}
        for name in body:
            x = torch.randn(48, base[name].shape[1], generator=generator)
            grams[name] = x.T @ x / 48
        write_grams(out / "grams" / f"task{index}.safetensors", grams)
        tasks.append(
            TaskStats(
                name=f"task-{index}",
                model=str(expert),
                fingerprint=model_fingerprint(expert),
                file=f"task{index}.safetensors",
                samples=10 + index,
                tokens=300 + index,
                data="/data/synthetic.jsonl",
            )
        )
    write_manifest(
        out,
        StatsManifest(format_version=1, package_version="0.1.0", tasks=tasks, modules={n: n for n in body}),
    )
    return out


def test_activation_card_reports_statistics_through_the_python_api(tiny_llama, tmp_path):
    stats = make_stats(tiny_llama, tmp_path / "stats")
    experts = [str(p) for p in tiny_llama.experts]
    config = models_recipe(str(tiny_llama.base), experts, gram="activations", stats=str(stats))
    merge(config, tmp_path / "out")  # no recipe text: mergekit saves its normalised form

    card = ModelCard.load(tmp_path / "out" / "README.md")
    check_front_matter(card, [str(tiny_llama.base), *experts])
    assert "activations: `G_t` is the mean of `x xᵀ`" in card.text
    assert "3 tasks, 33 samples, 903 tokens in all" in card.text
    rows = table_after(card.text, "| task | expert | samples | tokens |")
    assert [(r[0], r[2], r[3]) for r in rows] == [
        ("task-0", "10", "300"),
        ("task-1", "11", "301"),
        ("task-2", "12", "302"),
    ]
    assert table_after(card.text, "| layers") == [["0–3", "0.1", "0.1", "0.1", "0.1", "1"]]
    (embedded,) = [body for _, body in fenced(card.text, "yaml")]
    assert "modules:" in embedded and read_record(tmp_path / "out").recipe_sha256 == recipe_digest(
        (tmp_path / "out" / "mergekit_config.yml").read_text()
    )


def test_other_methods_keep_mergekits_card(tiny_llama, tmp_path):
    config = models_recipe(str(tiny_llama.base), [str(p) for p in tiny_llama.experts])
    config["merge_method"] = "task_arithmetic"
    del config["parameters"]
    merge(config, tmp_path / "out", text=yaml.safe_dump(config))
    card = ModelCard.load(tmp_path / "out" / "README.md")
    assert card.data.tags == ["mergekit", "merge"]
    assert not (tmp_path / "out" / RECORD_FILE).exists()


def test_failure_to_build_the_card_falls_back_to_a_minimal_valid_card(
    tiny_llama, tmp_path, monkeypatch, caplog
):
    from mergekit_bmm.cards import card as card_module

    def broken(*args, **kwargs):
        raise RuntimeError("simulated failure")

    # Fault injection: the one way to reach the fallback on purpose.
    monkeypatch.setattr(card_module, "merge_card", broken)
    experts = [str(p) for p in tiny_llama.experts]
    config = models_recipe(str(tiny_llama.base), experts)
    with caplog.at_level(logging.WARNING, logger="mergekit_bmm"):
        merge(config, tmp_path / "out", text=yaml.safe_dump(config))
    assert "could not build the full model card (simulated failure)" in caplog.text
    card = ModelCard.load(tmp_path / "out" / "README.md")
    check_front_matter(card, [str(tiny_llama.base), *experts])
    assert (tmp_path / "out" / "model.safetensors").exists() and read_record(tmp_path / "out") is not None


def make_search_out(family, root: Path, anchor: bool = True) -> Path:
    """A search output folder as mergekit-bmm-search writes it (summary.json, best.yml, plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    search_out = root / "search"
    search_out.mkdir()
    config = blockwise(family, str(family.base), [str(p) for p in family.experts])
    (search_out / "best.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    figure, axis = plt.subplots(figsize=(3, 2))
    axis.plot([0.70, 0.78, 0.83], marker="o")
    figure.savefig(search_out / "convergence.png")
    plt.close(figure)
    summary = {
        "recipe": "/abs/template.yml",
        "strategy": "bo",
        "budget": 60,
        "n_initial": 10,
        "seed": 0,
        "blocks": [[0, 2], [2, 4]],
        "groups": ["attn_in", "attn_out", "mlp_in", "mlp_out"],
        "completed_trials": 60,
        "failed_trials": 0,
        "best_trial": 17,
        "best_score": 0.83,
        "best_per_task": {"taskA": 0.81, "taskB": 0.85},
        "best_values": {"block0.attn_in": 0.01, "block0.scale": 1.2},
        "anchor_score": 0.80 if anchor else None,
        "anchor_per_task": {"taskA": 0.78, "taskB": 0.82} if anchor else None,
        "evaluator": {"type": "python"},
        "convergence_plot": "convergence.png",
        "lambda_plot": "lambdas.png",  # not written: the card must cope
        "best_recipe": "best.yml",
        "best_model": "best",
        "status": "finished",
        "dimensions": ["block0.attn_in", "block0.scale"],
        "lambda_range": [1e-4, 1.0],
    }
    write_summary(search_out / "summary.json", SearchSummary.model_validate(summary))
    return search_out


def test_search_card_adds_strategy_scores_and_plot(tiny_llama, tmp_path):
    search_out = make_search_out(tiny_llama, tmp_path)
    best_text = (search_out / "best.yml").read_text()
    best = search_out / "best"
    merge(yaml.safe_load(best_text), best, text=best_text)

    path = write_search_card(best, read_summary(search_out), search_out)
    assert path == best / "README.md"
    card = ModelCard.load(path)
    check_front_matter(card, [str(tiny_llama.base), *(str(p) for p in tiny_llama.experts)])
    facts = dict(table_after(card.text, "| search | value |"))
    assert facts["strategy"] == "bo" and facts["budget"] == "60" and facts["best score"] == "0.83"
    assert facts["trials completed / failed"] == "60 / 0" and facts["anchor score"] == "0.8"
    assert table_after(card.text, "| task | BMM (this model) | anchor | Δ |") == [
        ["taskA", "0.8100", "0.7800", "+0.0300"],  # one precision for scores and differences
        ["taskB", "0.8500", "0.8200", "+0.0300"],
        ["**overall**", "0.8300", "0.8000", "+0.0300"],
    ]
    assert "No trial beat the anchor" not in card.text
    title = [line for line in card.text.splitlines() if line.startswith("# ")][0]
    assert title == "# BMM merge of expert-a + expert-b + expert-c (task_arithmetic anchor)"
    assert "![Convergence of the search](convergence.png)" in card.text
    assert (best / "convergence.png").read_bytes() == (search_out / "convergence.png").read_bytes()
    assert "lambdas.png" not in card.text
    assert table_after(card.text, "| layers") == EXPECTED_ROWS
    (embedded,) = [body for _, body in fenced(card.text, "yaml")]
    assert embedded == best_text.rstrip()


def test_search_card_for_a_folder_merged_without_card(tiny_llama, tmp_path):
    from mergekit_bmm.cards.publish import check_folder

    search_out = make_search_out(tiny_llama, tmp_path, anchor=False)
    best = search_out / "best"
    merge(yaml.safe_load((search_out / "best.yml").read_text()), best, write_card=False)
    assert not (best / "mergekit_config.yml").exists()

    card = ModelCard.load(write_search_card(best, read_summary(search_out), search_out))
    assert (best / "mergekit_config.yml").read_text() == (search_out / "best.yml").read_text()
    assert table_after(card.text, "| task | BMM (this model) | anchor | Δ |")[0] == [
        "taskA",
        "0.8100",
        "—",
        "—",
    ]
    assert "The anchor was not evaluated" in card.text
    assert check_folder(best).weights_fingerprint == model_fingerprint(best)


def test_search_card_says_when_the_anchor_was_not_beaten(tiny_llama, tmp_path):
    search_out = make_search_out(tiny_llama, tmp_path)
    summary = read_summary(search_out).model_copy(update={"anchor_score": 0.9})
    assert summary.beats_anchor is False
    best = search_out / "best"
    best_text = (search_out / "best.yml").read_text()
    merge(yaml.safe_load(best_text), best, text=best_text)
    card = ModelCard.load(write_search_card(best, summary, search_out))
    assert "**No trial beat the anchor merge: best 0.83 against the anchor's 0.9" in card.text


@pytest.mark.parametrize(
    "direct_url, expected",
    [
        (
            {"url": "https://github.com/org/mergekit-bmm", "vcs_info": {"vcs": "git", "commit_id": "abc123"}},
            'pip install "mergekit-bmm @ git+https://github.com/org/mergekit-bmm@abc123"',
        ),
        (
            {"url": "https://example.org/mergekit_bmm-1.2.0-py3-none-any.whl", "archive_info": {}},
            'pip install "mergekit-bmm @ https://example.org/mergekit_bmm-1.2.0-py3-none-any.whl"',
        ),
        (
            {"url": "file:///nowhere/checkout", "dir_info": {"editable": True}},
            "pip install ./mergekit-bmm  #",
        ),
    ],
)
def test_reproduce_step_installs_from_where_the_plugin_came(direct_url, expected):
    from mergekit_bmm.cards.install import command_for

    line = command_for(direct_url, "1.2.0")
    assert line.startswith(expected)
    if direct_url["url"].startswith("file:"):
        assert "1.2.0" in line and "names no public source" in line


def test_search_card_needs_a_summary(tmp_path):
    with pytest.raises(ConfigError, match="has no summary.json"):
        read_summary(tmp_path)


def test_hub_ids_are_known_without_asking_the_hub(tmp_path):
    from mergekit_bmm.cards.recipe_view import hub_id_of, local_folder

    snapshot = tmp_path / "hub" / "models--meta-llama--Llama-3.2-1B" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    assert hub_id_of(str(snapshot), local_folder(str(snapshot))) == "meta-llama/Llama-3.2-1B"
    assert hub_id_of("org/model", local_folder("org/model")) == "org/model"  # not local: fetched from the Hub
    assert hub_id_of(str(tmp_path), local_folder(str(tmp_path))) is None
    assert hub_id_of("/no/such/folder", None) is None


def test_weight_hashes_are_the_sha256_of_each_file_sharded_or_empty(tmp_path):
    """What `mergekit-bmm-publish` compares with the Hub's LFS object ids: every shard's own SHA-256,
    however the files are hashed (side by side for shards, from a memory map)."""
    import hashlib
    import os

    from mergekit_bmm.cards.merge_record import weight_hashes

    sizes = {"model-00001-of-00003.safetensors": 5 << 20, "model-00002-of-00003.safetensors": 123,
             "model-00003-of-00003.safetensors": 0}  # fmt: skip
    expected = {}
    for name, size in sizes.items():
        data = os.urandom(size)
        (tmp_path / name).write_bytes(data)
        expected[name] = hashlib.sha256(data).hexdigest()
    (tmp_path / "config.json").write_text("{}")
    assert weight_hashes(tmp_path) == expected
    one = tmp_path / "single"
    one.mkdir()
    (one / "model.safetensors").write_bytes(b"abc")
    assert weight_hashes(one) == {"model.safetensors": hashlib.sha256(b"abc").hexdigest()}
