"""Models as people hold them: Hub ids missing from an offline cache (the walkthrough,
test_walkthrough.py, runs the cached ones), LoRA adapters as experts, and recipes whose output does
not depend on the hash seed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import load_weights, relative_error
from hf_cache import lay_out
from search_objectives import EVALUATOR

from mergekit_bmm.cards.merge_record import read_record
from mergekit_bmm.errors import ConfigError
from mergekit_bmm.io import hub_models
from mergekit_bmm.plugin.run import merge_recipe_text

BIN = Path(sys.executable).parent
TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    from mergekit_bmm.examples.tiny_models import make_tiny_family

    return make_tiny_family(tmp_path_factory.mktemp("hub"), "llama", n_experts=2, hidden=32, layers=2)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty Hugging Face cache, offline, for this process and the commands it starts."""
    import huggingface_hub

    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    hub_models._cached.cache_clear()
    yield cache
    hub_models._cached.cache_clear()


def _recipe(base: str, experts: list[str], **parameters) -> dict:
    return {
        "merge_method": "bmm",
        "base_model": base,
        "models": [{"model": e, "parameters": {"weight": 0.5}} for e in experts],
        "parameters": {"anchor_method": "task_arithmetic", "lambda": 0.1, **parameters},
        "dtype": "float32",
    }


def _publish(cache: Path, family) -> dict[str, str]:
    """The family in the cache as org/base, org/expert-a, ...; their commits."""
    return {
        f"org/{folder.name}": lay_out(cache, f"org/{folder.name}", folder)
        for folder in (family.base, *family.experts)
    }


def test_a_model_missing_from_the_cache_is_one_line_naming_it(family, hub, tmp_path):
    _publish(hub, family)
    recipe = tmp_path / "merge.yml"
    recipe.write_text(yaml.safe_dump(_recipe("org/base", ["org/expert-a", "org/expert-zzz"])))
    done = subprocess.run(
        [str(BIN / "mergekit-yaml"), str(recipe), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=os.environ,
    )
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert "org/expert-zzz is not in the Hugging Face cache" in lines[-1]
    assert "hf download org/expert-zzz" in lines[-1] and "Traceback" not in done.stderr


def test_a_search_on_a_missing_hub_id_is_one_line(family, hub, tmp_path):
    from mergekit_bmm.search import SearchOptions, parse_search_config, run_search

    raw = {
        "recipe": _recipe("org/base", ["org/expert-a"]),
        "budget": 2,
        "n_initial": 2,
        "evaluator": {"type": "python", "callable": "search_objectives:per_task_scores"},
    }
    with pytest.raises(ConfigError, match="org/base is not in the Hugging Face cache"):
        run_search(parse_search_config(raw, TESTS), tmp_path / "s", SearchOptions(progress=False))


def _adapter(base: Path, folder: Path, seed: int) -> Path:
    from mergekit_bmm.examples.tiny_models import make_lora_adapter

    return make_lora_adapter(base, folder, seed)


def test_lora_experts_merge_with_no_flag_and_are_told_apart(family, tmp_path, monkeypatch):
    monkeypatch.setenv("MERGEKIT_BMM_CACHE", str(tmp_path / "cache"))
    base = str(family.base)
    adapters = [_adapter(family.base, tmp_path / f"adapter-{i}", seed=i) for i in range(2)]
    experts = [f"{base}+{adapter}" for adapter in adapters]
    out = tmp_path / "merged"
    # the full route: the same arithmetic as on dense experts (the LoRA route: test_lora_route.py)
    merge_recipe_text(yaml.safe_dump(_recipe(base, experts, low_rank=False)), out)
    record = read_record(out)
    prints = [item.fingerprint for item in record.inputs]
    assert len(set(prints)) == 3 and all(prints)  # base, and each adapter on it, told apart
    assert "with the LoRA adapter" in (out / "README.md").read_text()
    merged_copies = list((tmp_path / "cache" / "lora-merges").glob("*/*"))
    assert len(merged_copies) == 2  # each adapter merged into the base once, under the default cache
    # The same as merging the adapters into full models first and merging those.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    dense = []
    for index, adapter in enumerate(adapters):
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(adapter))
        folder = tmp_path / f"dense-{index}"
        model.merge_and_unload().save_pretrained(folder)
        dense.append(str(folder))
    reference = tmp_path / "dense-merge"
    merge_recipe_text(yaml.safe_dump(_recipe(base, dense)), reference)
    merged, expected = load_weights(out), load_weights(reference)
    assert max(relative_error(merged[n], expected[n]) for n in expected) < 1e-6
    # A changed adapter is a new expert: a new fingerprint, merged again.
    _adapter(family.base, adapters[0], seed=7)
    again = tmp_path / "again"
    merge_recipe_text(yaml.safe_dump(_recipe(base, experts)), again)
    assert read_record(again).inputs[1].fingerprint != prints[1]
    assert len(list((tmp_path / "cache" / "lora-merges").glob("*/*"))) == 4


def _with_added_token(source: Path, folder: Path, token: str) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(source), AutoTokenizer.from_pretrained(source)
    tokenizer.add_tokens([token])
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_union_tokenizer_recipe_is_byte_identical_under_any_hash_seed(family, tmp_path):
    experts = [
        _with_added_token(path, tmp_path / f"tok-{i}", f"<new-{i}>") for i, path in enumerate(family.experts)
    ]
    recipe = _recipe(str(family.base), [str(e) for e in experts])
    recipe["tokenizer_source"] = "union"
    path = tmp_path / "union.yml"
    path.write_text(yaml.safe_dump(recipe))
    outputs, runs = [], {}
    for seed in ("1", "2", "3"):  # the three merges side by side (each is mostly its start-up)
        out = tmp_path / f"seed-{seed}"
        env = {**os.environ, "PYTHONHASHSEED": seed}
        runs[out] = subprocess.Popen(
            [str(BIN / "mergekit-yaml"), str(path), str(out)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
    for out, run in runs.items():
        _, stderr = run.communicate()
        assert run.returncode == 0, stderr[-2000:]
        weights = b"".join(p.read_bytes() for p in sorted(out.glob("*.safetensors")))
        vocabulary = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
        outputs.append((weights, json.dumps(vocabulary)))
    assert outputs[0] == outputs[1] == outputs[2]


def test_lora_experts_in_statistics_alignment_and_a_search(family, tmp_path, monkeypatch):
    from mergekit.common import ModelReference
    from stats_helpers import write_calibration

    from mergekit_bmm.search import SearchOptions, parse_search_config, run_search
    from mergekit_bmm.stats.alignment import alignment_rows
    from mergekit_bmm.stats.collect import collect_statistics
    from mergekit_bmm.stats.config import parse_stats_config
    from mergekit_bmm.stats.store import activation_grams_for, load_manifest

    monkeypatch.setenv("MERGEKIT_BMM_CACHE", str(tmp_path / "cache"))
    base = str(family.base)
    experts = [f"{base}+{_adapter(family.base, tmp_path / f'adapter-{i}', seed=i)}" for i in range(2)]
    data = write_calibration(tmp_path / "calibration.jsonl", lines=12)
    tasks = [{"name": f"task{i}", "model": expert, "data": str(data)} for i, expert in enumerate(experts)]
    stats = tmp_path / "stats"
    config = parse_stats_config({"tasks": tasks, "max_length": 32, "max_samples": 8})
    collect_statistics(config, stats, progress=False)
    manifest = load_manifest(stats)
    assert len({task.fingerprint for task in manifest.tasks}) == 2  # each adapter its own expert
    references = [ModelReference.parse(e) for e in experts]
    assert [manifest.task_for_model(r, stats).name for r in references] == ["task0", "task1"]
    name = "model.layers.1.self_attn.q_proj.weight"  # its input went through each adapter
    grams = activation_grams_for(stats, name, references)
    assert not torch.equal(grams[0], grams[1])
    rows = alignment_rows(stats, base, experts, progress=False)  # modules an adapter leaves: undefined
    touched = [row for row in rows if any(part in row.module for part in ("q_proj", "v_proj", "down_proj"))]
    assert touched and all(0 <= row.cosine <= 1 for row in touched)
    out = tmp_path / "assisted"
    merge_recipe_text(yaml.safe_dump(_recipe(base, experts, gram="activations", stats=str(stats))), out)
    assert read_record(out).weights_fingerprint
    raw = {
        "recipe": _recipe(base, experts),
        "blocks": 1,
        "budget": 2,
        "n_initial": 2,
        "evaluator": EVALUATOR,
    }
    result = run_search(parse_search_config(raw, TESTS), tmp_path / "search", SearchOptions(progress=False))
    assert result.summary.status == "finished" and result.summary.completed_trials == 2
    assert result.summary.trials == "memory"  # resident trials on the adapters' subspace factors
    assert len(read_record(tmp_path / "search" / "best").low_rank) == 2 * 3
    from mergekit_bmm.cli.search import _write_best_adapter
    from mergekit_bmm.plugin.run import merge_options

    _write_best_adapter(tmp_path / "search", merge_options(quiet=True))  # --best-adapter
    assert (tmp_path / "search" / "best-adapter" / "adapter_model.safetensors").is_file()
