"""The label-free evaluator (``type: agreement``): its divergences against float64, its references
(computed once, reused, never trusted for other experts), a real resident search, bad input."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from mergekit_bmm.errors import ConfigError
from mergekit_bmm.evaluation import make_evaluator
from mergekit_bmm.evaluation.config import AgreementEvaluatorConfig
from mergekit_bmm.evaluation.divergence import divergence, reference_of
from mergekit_bmm.search import SearchOptions, parse_search_config, run_search

TEXTS = (
    "the model merges experts fine tuned from one base",
    "a search tunes lambda and scale on unlabelled text",
    "each expert predicts the next token of its own task",
    "merging keeps what every expert learned where it can",
    "the quick brown fox jumps over the lazy dog",
    "positive reviews praise the acting and the plot",
)


def _write_texts(path: Path, texts=TEXTS, field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: text}) + "\n" for text in texts))
    return path


def _tasks(family, folder: Path) -> list[dict]:
    return [
        {
            "name": expert.name,
            "model": str(expert),
            "data": str(_write_texts(folder / f"{expert.name}.jsonl")),
        }
        for expert in family.experts
    ]


def _recipe(family) -> dict:
    return {
        "merge_method": "bmm",
        "base_model": str(family.base),
        "models": [{"model": str(e), "parameters": {"weight": 0.3}} for e in family.experts],
        "parameters": {"anchor_method": "task_arithmetic"},
        "dtype": "float32",
    }


def _evaluator(config: dict, folder: Path):
    parsed = AgreementEvaluatorConfig.model_validate(
        {"type": "agreement", **config}, context={"base_dir": folder}
    )
    return make_evaluator(parsed, "cpu")


# ----------------------------------------------------------------------------- divergences
def test_divergences_match_float64_on_full_and_coarsened_distributions():
    generator = torch.Generator().manual_seed(0)
    expert = torch.log_softmax(3 * torch.randn(50, 40, generator=generator, dtype=torch.float64), dim=-1)
    merged = torch.log_softmax(3 * torch.randn(50, 40, generator=generator, dtype=torch.float64), dim=-1)
    p, q = expert.exp(), merged.exp()
    full = reference_of(expert.float(), None)
    exact_kl = (p * (expert - merged)).sum(-1)
    exact_reverse = (q * (merged - expert)).sum(-1)
    assert torch.allclose(divergence(merged.float(), full, "kl"), exact_kl, rtol=1e-5, atol=1e-6)
    assert torch.allclose(divergence(merged.float(), full, "reverse_kl"), exact_reverse, rtol=1e-5, atol=1e-6)
    entropy = -(q * merged).sum(-1)
    assert torch.allclose(divergence(merged.float(), None, "entropy"), entropy, rtol=1e-5)
    assert torch.equal(
        divergence(merged.float(), full, "top1"), (merged.argmax(-1) != expert.argmax(-1)).double()
    )
    # top-k plus the rest: the KL of the coarsened distributions, a lower bound of the full KL
    top = reference_of(expert.float(), 8)
    index = torch.topk(expert, 8, dim=-1).indices
    p_top, q_top = p.gather(-1, index), q.gather(-1, index)
    p_rest, q_rest = 1 - p_top.sum(-1), 1 - q_top.sum(-1)
    coarse = (p_top * (p_top / q_top).log()).sum(-1) + p_rest * (p_rest / q_rest).log()
    measured = divergence(merged.float(), top, "kl")
    assert torch.allclose(measured, coarse, rtol=1e-4, atol=1e-6)
    assert bool((measured <= exact_kl + 1e-6).all())
    assert float(divergence(expert.float(), top, "kl").abs().max()) < 1e-6  # the expert against itself


# ----------------------------------------------------------------------------- the evaluator
def test_score_is_the_share_of_the_base_gap_closed_against_a_float64_kl(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    family = tiny_llama
    config = {"tasks": _tasks(family, tmp_path), "base_model": str(family.base), "top_k": 1000}
    evaluator = _evaluator(config, tmp_path)
    evaluator.prepare()
    candidate = AutoModelForCausalLM.from_pretrained(family.experts[1], dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(family.base)
    scores = evaluator.evaluate_model(candidate, tokenizer)

    def text_kls(model_dir, other) -> list[float]:  # per text: mean over tokens of KL, in float64
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
        other = other.double()
        values = []
        for text in TEXTS:
            ids = tokenizer(text, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                p = torch.log_softmax(reference(ids).logits[0], -1)
                q = torch.log_softmax(other(ids).logits[0], -1)
            values.append(float((p.exp() * (p - q)).sum(-1).mean()))
        other.float()
        return values

    base = AutoModelForCausalLM.from_pretrained(family.base, dtype=torch.float32).eval()
    for expert in family.experts:
        merged_kl = sum(text_kls(expert, candidate)) / len(TEXTS)
        base_kl = sum(text_kls(expert, base)) / len(TEXTS)
        expected = 1.0 - merged_kl / base_kl
        # The evaluator runs the models in float32; these tiny experts are ~1e-4 nats from each other,
        # so float32 rounding of log-probabilities near -5 shows at about 1e-4 of the KL.
        assert scores[expert.name] == pytest.approx(expected, rel=1e-3, abs=1e-5)
    assert scores[family.experts[1].name] == pytest.approx(1.0, abs=1e-6)  # an expert reproduces itself


def test_last_position_only_against_a_float64_kl_and_its_own_references(tiny_llama, tmp_path):
    """``positions: last``: the KL of the next-token distributions after each whole text (where a
    prompt's answer is read), nothing else; references made for every position are not reused."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    family, folder = tiny_llama, tmp_path / "refs"
    config = {"tasks": _tasks(family, tmp_path), "base_model": str(family.base), "references": str(folder)}
    lines: list[str] = []
    _evaluator(config, tmp_path).prepare(echo=lines.append)  # every position (the default)
    last = _evaluator({**config, "positions": "last", "top_k": 1000}, tmp_path)
    last.prepare(echo=lines.append)
    assert any("made for other inputs" in line and "positions" in line for line in lines)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert all(task["positions"] == len(TEXTS) for task in manifest["tasks"].values())  # one a text
    candidate = AutoModelForCausalLM.from_pretrained(family.experts[1], dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(family.base)
    scores = last.evaluate_model(candidate, tokenizer)

    def last_kl(model_dir, other) -> float:  # mean over texts of the KL after the whole text, float64
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
        values = []
        for text in TEXTS:
            ids = tokenizer(text, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                p = torch.log_softmax(reference(ids).logits[0, -1], -1)
                q = torch.log_softmax(other.double()(ids).logits[0, -1], -1)
            values.append(float((p.exp() * (p - q)).sum()))
        other.float()
        return sum(values) / len(values)

    base = AutoModelForCausalLM.from_pretrained(family.base, dtype=torch.float32).eval()
    for expert in family.experts:
        expected = 1.0 - last_kl(expert, candidate) / last_kl(expert, base)
        assert scores[expert.name] == pytest.approx(expected, rel=1e-3, abs=1e-5)
    lines.clear()  # and back: references of the last position alone are not reused for every position
    _evaluator(config, tmp_path).prepare(echo=lines.append)
    assert sum("made for other inputs" in line for line in lines) == 3


def test_references_are_reused_and_recomputed_for_other_experts(tiny_llama, tmp_path):
    family = tiny_llama
    folder = tmp_path / "refs"
    config = {"tasks": _tasks(family, tmp_path), "base_model": str(family.base), "references": str(folder)}
    lines: list[str] = []
    _evaluator(config, tmp_path).prepare(echo=lines.append)
    assert sum("references: task" in line for line in lines) == 3
    manifest = json.loads((folder / "manifest.json").read_text())
    assert set(manifest["tasks"]) == {e.name for e in family.experts}
    lines.clear()
    _evaluator(config, tmp_path).prepare(echo=lines.append)
    assert lines == []  # read, not computed
    # the same task name over another expert: recomputed, with a line that says why
    swapped = [dict(task) for task in config["tasks"]]
    swapped[0]["model"], swapped[1]["model"] = swapped[1]["model"], swapped[0]["model"]
    _evaluator({**config, "tasks": swapped}, tmp_path).prepare(echo=lines.append)
    assert any("made for other inputs" in line for line in lines)
    # a damaged file or a manifest of another format: computed again, with a line
    lines.clear()
    (folder / f"{family.experts[2].name}.safetensors").write_bytes(b"not a tensor file")
    _evaluator(config, tmp_path).prepare(echo=lines.append)
    assert any("unreadable" in line for line in lines)
    (folder / "manifest.json").write_text(
        json.dumps({"format": "mergekit-bmm-references", "format_version": 0})
    )
    lines.clear()
    _evaluator(config, tmp_path).prepare(echo=lines.append)
    assert (
        any("version 0" in line for line in lines) and sum("references: task" in line for line in lines) == 3
    )


def test_entropy_and_top1_objectives_score_within_their_scale(tiny_llama, tmp_path):
    family = tiny_llama
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(family.base, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(family.base)
    for objective in ("entropy", "top1", "reverse_kl"):
        evaluator = _evaluator(
            {"tasks": _tasks(family, tmp_path), "base_model": str(family.base), "objective": objective},
            tmp_path,
        )
        scores = evaluator.evaluate_model(base, tokenizer)
        assert all(value == pytest.approx(0.0, abs=1e-6) for value in scores.values())  # the base scores 0


def test_every_objective_from_one_pass_equals_each_evaluator_alone(tiny_llama, tmp_path):
    """``divergences`` (one forward pass, every objective) gives what an evaluator of each objective
    with ``scale: none`` scores, negated; and the base's divergence under any of them."""
    family = tiny_llama
    from transformers import AutoModelForCausalLM, AutoTokenizer

    expert = AutoModelForCausalLM.from_pretrained(family.experts[0], dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(family.base)
    common = {"tasks": _tasks(family, tmp_path), "base_model": str(family.base), "scale": "none"}
    objectives = ("kl", "reverse_kl", "top1", "entropy")
    one = _evaluator({**common, "objective": "kl"}, tmp_path)
    found = one.divergences(expert, tokenizer, objectives)
    for objective in objectives:
        alone = _evaluator({**common, "objective": objective}, tmp_path)
        scores = alone.evaluate_model(expert, tokenizer)
        assert found[objective] == pytest.approx({name: -value for name, value in scores.items()}, abs=1e-12)
        assert one.base_divergence(objective) == alone.base_divergence()
    assert found["kl"][family.experts[0].name] == pytest.approx(0.0, abs=1e-6)  # the expert on its own text


# ----------------------------------------------------------------------------- bad input
def test_bad_input_is_one_line(tiny_llama, tmp_path):
    family = tiny_llama
    tasks = _tasks(family, tmp_path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": "   "}) + "\n")
    with pytest.raises(ConfigError, match="task 'expert-a'.*no non-empty 'text' samples"):
        _evaluator({"tasks": [{**tasks[0], "data": str(empty)}, *tasks[1:]]}, tmp_path)
    with pytest.raises(ConfigError, match="either as `stats: stats.yml`"):
        parse_search_config(
            {"recipe": _recipe(family), "evaluator": {"type": "agreement", "tasks": tasks, "stats": "s.yml"}},
            tmp_path,
        )
    evaluator = _evaluator({"tasks": tasks[:2]}, tmp_path)
    with pytest.raises(ConfigError, match="no agreement task names it"):
        evaluator.check_recipe(_recipe(family))
    stranger = tmp_path / "stranger"
    shutil.copytree(family.experts[0], stranger)
    torch.manual_seed(3)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(stranger / "model.safetensors"))
    save_file(
        {k: v + 0.01 * torch.randn_like(v) for k, v in weights.items()}, str(stranger / "model.safetensors")
    )
    evaluator = _evaluator({"tasks": [{**tasks[0], "model": str(stranger)}, *tasks[1:]]}, tmp_path)
    with pytest.raises(ConfigError, match="which the recipe does not merge"):
        evaluator.check_recipe(_recipe(family))
    # an expert whose tokenizer reads the text differently from the base's
    from mergekit_bmm.examples.tiny_models import build_tokenizer

    other = tmp_path / "other-tokenizer"
    shutil.copytree(family.experts[0], other)
    build_tokenizer(vocab_size=290).save_pretrained(other)
    evaluator = _evaluator(
        {"tasks": [{**tasks[0], "model": str(other)}, *tasks[1:]], "base_model": str(family.base)}, tmp_path
    )
    with pytest.raises(ConfigError, match="reads text 1 differently from the merge's"):
        evaluator.prepare()
    not_ours = tmp_path / "not-references"
    not_ours.mkdir()
    (not_ours / "notes.txt").write_text("mine")
    evaluator = _evaluator(
        {"tasks": tasks, "base_model": str(family.base), "references": str(not_ours)}, tmp_path
    )
    with pytest.raises(ConfigError, match="is not empty and holds no manifest.json"):
        evaluator.prepare()
    assert (not_ours / "notes.txt").read_text() == "mine"


# ----------------------------------------------------------------------------- a real search
def test_resident_search_from_a_stats_yml_computes_references_once(
    tiny_llama, tmp_path, one_thread_per_module
):
    family = tiny_llama
    stats = {"max_samples": 6, "tasks": _tasks(family, tmp_path)}
    stats_path = tmp_path / "stats.yml"
    import yaml

    stats_path.write_text(yaml.safe_dump(stats))
    raw = {
        "recipe": _recipe(family),
        "blocks": 1,
        "budget": 6,
        "n_initial": 4,
        "evaluator": {"type": "agreement", "stats": "stats.yml"},
    }
    config = parse_search_config(raw, tmp_path)
    lines: list[str] = []
    result = run_search(
        config, tmp_path / "run", SearchOptions(progress=False, plots=False), echo=lines.append
    )
    assert result.summary.best_score is not None and math.isfinite(result.summary.best_score)
    assert all(record.ok for record in result.records)
    assert sum("references: task" in line for line in lines) == 3
    assert any("resident trials" in line for line in lines)
    card = (tmp_path / "run" / "best" / "README.md").read_text()
    assert "This search used no labels" in card and "stats.yml" in card
    # resumed with a larger budget: references read, not computed again
    lines.clear()
    bigger = parse_search_config({**raw, "budget": 8}, tmp_path)
    result = run_search(
        bigger, tmp_path / "run", SearchOptions(progress=False, plots=False), echo=lines.append
    )
    assert len(result.records) == 8
    assert not any("references: task" in line for line in lines)


def test_the_shipped_label_free_search_config_validates():
    from mergekit_bmm.search import load_search_config

    config = load_search_config(Path(__file__).parent.parent / "configs" / "search-label-free.yml")
    assert config.evaluator.type == "agreement" and config.evaluator.stats.endswith("configs/stats.yml")
