"""The statistics collector: Grams against explicit hooks, data sources, resume, refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import relative_error
from stats_helpers import stored_grams, write_calibration

from mergekit_bmm.errors import ConfigError, StatisticsError
from mergekit_bmm.stats.collect import collect_statistics
from mergekit_bmm.stats.config import parse_stats_config
from mergekit_bmm.stats.store import FORMAT_VERSION

MAX_LENGTH = 48


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    from mergekit_bmm.examples.tiny_models import make_tiny_family

    return make_tiny_family(tmp_path_factory.mktemp("bert"), "bert", n_experts=2)


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory):
    from mergekit_bmm.examples.tiny_models import make_tiny_family

    return make_tiny_family(tmp_path_factory.mktemp("mistral"), "mistral", n_experts=1, hidden=32, layers=2)


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    """A two-layer Gemma expert (not among the tiny families), saved with the tiny tokenizer."""
    from types import SimpleNamespace

    from transformers import GemmaConfig, GemmaForCausalLM

    from mergekit_bmm.examples.tiny_models import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = GemmaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    path = tmp_path_factory.mktemp("gemma") / "expert-a"
    GemmaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return SimpleNamespace(experts=(path,))


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> Path:
    return write_calibration(tmp_path_factory.mktemp("data") / "calibration.jsonl")


def config_for(tasks, **top):
    return parse_stats_config({"tasks": tasks, "max_length": MAX_LENGTH, "batch_size": 4, **top})


def reference_grams(model_dir: Path, architecture: str, texts: list[str]) -> dict[str, torch.Tensor]:
    """Mean ``x xᵀ`` per linear module, one unpadded sequence at a time, via forward hooks."""
    import transformers as tf
    from transformers.pytorch_utils import Conv1D

    model_class = {
        "llama": tf.LlamaForCausalLM,
        "qwen2": tf.Qwen2ForCausalLM,
        "mistral": tf.MistralForCausalLM,
        "gemma": tf.GemmaForCausalLM,
        "gpt2": tf.GPT2LMHeadModel,
        "bert": tf.BertModel,
    }
    model = model_class[architecture].from_pretrained(model_dir).eval()
    tokenizer = tf.AutoTokenizer.from_pretrained(model_dir)
    sums: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(module, inputs, output):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).double()  # batch of one, no padding
            sums[name] = sums.get(name, 0) + x.T @ x

        return record

    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, Conv1D)):
            module.register_forward_hook(hook(f"{name}.weight"))
    tokens = 0
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, truncation=True, max_length=MAX_LENGTH, return_tensors="pt")["input_ids"]
            model(input_ids=ids)
            tokens += ids.shape[1]
    return {name: total / tokens for name, total in sums.items()}, tokens


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "mistral", "gemma", "gpt2", "bert"])
def test_grams_match_explicit_hooks(architecture, request, calibration, tmp_path):
    family = request.getfixturevalue(f"tiny_{architecture}")
    expert = family.experts[0]
    config = config_for(
        [{"name": "task-a", "model": str(expert), "data": str(calibration), "max_samples": 10}]
    )
    manifest = collect_statistics(config, tmp_path / "stats", progress=False)

    texts = [json.loads(line)["text"] for line in calibration.read_text().splitlines()[:10]]
    expected, tokens = reference_grams(expert, architecture, texts)
    task = manifest.tasks[0]
    assert (task.samples, task.tokens) == (10, tokens)
    assert task.fingerprint.startswith("sha256:") and task.model == str(expert)

    grams = stored_grams(tmp_path / "stats")[str(expert)]
    body = {name for name in expected if ".layer" in name or ".h." in name}
    assert set(grams) == body, "every body linear module has a Gram"
    for name, gram in grams.items():
        assert gram.dtype == torch.float32 and gram.shape == expected[name].shape
        assert relative_error(gram, expected[name]) < 1e-5, name

    stored_keys = set(manifest.modules.values())
    if architecture == "gpt2":
        assert stored_keys == set(manifest.modules), "GPT-2 modules each read their own input"
        assert grams["transformer.h.0.mlp.c_fc.weight"].shape == (64, 64)  # Conv1D: in x in
        assert grams["transformer.h.0.mlp.c_proj.weight"].shape == (256, 256)  # n_inner = 4 x 64
    else:
        if architecture == "bert":
            prefix = "encoder.layer.0."
            groups = [tuple(f"attention.self.{n}" for n in ("query", "key", "value"))]
        else:
            prefix = "model.layers.0."
            groups = [
                ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                ("mlp.gate_proj", "mlp.up_proj"),
            ]
        for group in groups:
            keys = {manifest.modules[f"{prefix}{module}.weight"] for module in group}
            assert keys == {f"{prefix}{group[0]}.weight"}, f"{group} share one stored Gram"
        layers = len({name.split(".")[2] for name in manifest.modules})
        assert len(stored_keys) == 4 * layers, "four distinct inputs per layer"


def test_dataset_saved_to_disk_and_split(tiny_llama, calibration, tmp_path):
    import datasets

    rows = [json.loads(line) for line in calibration.read_text().splitlines()]
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    expert = str(tiny_llama.experts[0])
    from_jsonl = collect_statistics(
        config_for([{"name": "a", "model": expert, "data": str(calibration), "split": "train"}]),
        tmp_path / "jsonl",
        progress=False,
    )
    from_disk = collect_statistics(
        config_for([{"name": "a", "model": expert, "data": str(folder), "split": "train"}]),
        tmp_path / "disk",
        progress=False,
    )
    assert from_jsonl.tasks[0].samples == sum(row["split"] == "train" for row in rows) == 18
    assert from_jsonl.tasks[0].tokens == from_disk.tasks[0].tokens
    left, right = stored_grams(tmp_path / "jsonl")[expert], stored_grams(tmp_path / "disk")[expert]
    assert all(torch.equal(left[name], right[name]) for name in left)


def test_chat_template_renders_each_sample(tiny_llama, calibration, tmp_path):
    from transformers import AutoTokenizer

    plain = str(tiny_llama.experts[1])
    with pytest.raises(ConfigError, match="has no chat template"):
        collect_statistics(
            config_for([{"name": "a", "model": plain, "data": str(calibration), "chat_template": True}]),
            tmp_path / "refused",
            progress=False,
        )
    chat = tmp_path / "chat-expert"
    shutil.copytree(plain, chat)
    tokenizer = AutoTokenizer.from_pretrained(chat)
    tokenizer.chat_template = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    tokenizer.save_pretrained(chat)
    manifest = collect_statistics(
        config_for(
            [
                {
                    "name": "a",
                    "model": str(chat),
                    "data": str(calibration),
                    "chat_template": True,
                    "max_samples": 3,
                }
            ]
        ),
        tmp_path / "chat",
        progress=False,
    )
    texts = [json.loads(line)["text"] for line in calibration.read_text().splitlines()[:3]]
    rendered = [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False) for t in texts
    ]
    expected = sum(len(tokenizer(r, add_special_tokens=False)["input_ids"][:MAX_LENGTH]) for r in rendered)
    assert manifest.tasks[0].tokens == expected
    assert manifest.tasks[0].settings["chat_template"] is True


def _mtimes(stats_dir: Path) -> dict[str, tuple[int, ...]]:
    """{task: modification times of its part files}."""
    return {
        folder.name: tuple(p.stat().st_mtime_ns for p in sorted(folder.glob("*.safetensors")))
        for folder in (stats_dir / "grams").iterdir()
    }


def test_rerun_resumes_and_refuses_to_overwrite(tiny_llama, calibration, tmp_path):
    from mergekit_bmm.cli.stats import main

    out = tmp_path / "stats"
    experts = [str(path) for path in tiny_llama.experts[:2]]
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"body": "no text field here"}\n')
    tasks = [
        {"name": "a", "model": experts[0], "data": str(calibration), "max_samples": 4},
        {"name": "b", "model": experts[1], "data": str(broken), "max_samples": 4},
    ]
    with pytest.raises(ConfigError, match=r"line 1 of .*broken.jsonl has no field 'text'"):
        collect_statistics(config_for(tasks), out, progress=False)
    finished = json.loads((out / "manifest.json").read_text())
    assert [task["name"] for task in finished["tasks"]] == ["a"], "the finished task is kept"

    tasks[1]["data"] = str(calibration)
    before = _mtimes(out)
    manifest = collect_statistics(config_for(tasks), out, progress=False)
    assert [task.name for task in manifest.tasks] == ["a", "b"]
    assert _mtimes(out)["a"] == before["a"], "task a was not collected again"

    again = _mtimes(out)
    collect_statistics(config_for(tasks), out, progress=False)
    assert _mtimes(out) == again, "an up-to-date directory is left alone"

    config_path = tmp_path / "stats.yml"
    tasks[1]["max_samples"] = 6
    import yaml

    config_path.write_text(yaml.safe_dump({"tasks": tasks, "max_length": MAX_LENGTH}))
    runner = CliRunner()
    refused = runner.invoke(main, [str(config_path), str(out), "--quiet"])
    assert refused.exit_code != 0
    assert refused.output.strip().splitlines()[-1] == (
        f"mergekit-bmm: error: task 'b' in {out} was collected differently (max_samples 4 vs 6); "
        "pass --force to recollect it, or choose a new OUT_PATH"
    )
    assert _mtimes(out) == again, "nothing was overwritten"

    forced = runner.invoke(main, [str(config_path), str(out), "--quiet", "--force"])
    assert forced.exit_code == 0, forced.output
    assert _mtimes(out)["a"] == again["a"]
    assert json.loads((out / "manifest.json").read_text())["tasks"][1]["samples"] == 6

    config_path.write_text(yaml.safe_dump({"tasks": tasks[1:], "max_length": MAX_LENGTH}))
    extra = runner.invoke(main, [str(config_path), str(out), "--quiet"])
    assert extra.exit_code != 0 and "also holds tasks a that stats.yml does not list" in extra.output

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    refused = runner.invoke(main, [str(config_path), str(foreign), "--force", "--quiet"])
    assert refused.exit_code != 0 and "is not a statistics directory" in refused.output
    assert (foreign / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize(
    "tasks, message",
    [
        ([{"name": "a b", "model": "/m", "data": "/d"}], "task name 'a b' must start"),
        ([{"name": "a", "model": "/m", "data": "/d", "max_sample": 3}], "max_sample: unknown key"),
        (
            [{"name": "a", "model": "/m", "data": "/d"}, {"name": "b", "model": "/m", "data": "/d"}],
            "same model",
        ),
        ([{"name": "a", "model": "/m", "data": "/d", "max_samples": 0}], "max_samples"),
    ],
)
def test_bad_stats_config_is_one_line(tasks, message):
    with pytest.raises(ConfigError, match=message) as info:
        parse_stats_config({"tasks": tasks})
    assert "\n" not in str(info.value)


def test_missing_data_and_device_are_refused(tiny_llama, tmp_path):
    config = config_for(
        [{"name": "a", "model": str(tiny_llama.experts[0]), "data": str(tmp_path / "none.jsonl")}]
    )
    with pytest.raises(ConfigError, match="calibration data .*none.jsonl does not exist"):
        collect_statistics(config, tmp_path / "out", progress=False)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device on this machine"):
            collect_statistics(config, tmp_path / "out", device="cuda", progress=False)


def test_unusable_stats_dir_needs_force(tiny_llama, calibration, tmp_path):
    out = tmp_path / "stats"
    config = config_for(
        [{"name": "a", "model": str(tiny_llama.experts[0]), "data": str(calibration), "max_samples": 2}]
    )
    collect_statistics(config, out, progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["format_version"] = 99
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StatisticsError, match="version 99.*pass --force"):
        collect_statistics(config, out, progress=False)
    assert collect_statistics(config, out, force=True, progress=False).format_version == FORMAT_VERSION


def test_weight_names_match_across_stack_prefixes():
    from mergekit_bmm.stats.store import StatsManifest

    query = "encoder.layer.0.attention.self.query.weight"
    manifest = StatsManifest(
        package_version="0",
        tasks=[],
        modules={query: query, "encoder.layer.0.attention.self.key.weight": query},
    )
    assert manifest.stored_key("bert.encoder.layer.0.attention.self.key.weight") == query
    assert manifest.stored_key("encoder.layer.1.attention.self.key.weight") is None
    two_stacks = StatsManifest(
        package_version="0",
        tasks=[],
        modules={"encoder.block.0.fc1.weight": "a", "decoder.block.0.fc1.weight": "b"},
    )
    assert two_stacks.stored_key("decoder.block.0.fc1.weight") == "b"
    assert two_stacks.stored_key("model.block.0.fc1.weight") is None, "ambiguous: no guess"
