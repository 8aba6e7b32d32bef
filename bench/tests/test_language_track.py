"""Language-track building blocks: multiple-choice data, lm-eval task YAMLs, answer-only loss."""

from __future__ import annotations

import json

import pytest
import yaml


@pytest.fixture()
def mc_task(tmp_path):
    from bench.merging.config import LanguageTaskSpec
    from bench.merging.language.mc_tasks import build_mc_task

    data = tmp_path / "mood.jsonl"
    with open(data, "w", encoding="utf-8") as handle:
        for i in range(60):
            handle.write(
                json.dumps({"text": f"example {i} is {'good' if i % 2 else 'bad'}", "label": i % 2}) + "\n"
            )
    spec = LanguageTaskSpec(
        name="mood_mc",
        jsonl=data,
        choices={"0": "negative", "1": "positive"},
        prompt="Text: {text}\nQuestion: positive or negative?\nAnswer:",
        train=20,
        validation=5,
        test=10,
    )
    task, cached = build_mc_task(spec, tmp_path / "cache", seed=0)
    assert not cached
    return task


def test_mc_task_records_and_lm_eval_yaml(mc_task, tmp_path, monkeypatch):
    from bench.merging.language.mc_tasks import write_lm_eval_yamls

    assert mc_task.counts == {"train": 20, "validation": 5, "test": 10}
    record = mc_task.records("test")[0]
    assert record["choices"] == ["negative", "positive"]
    assert record["query"].startswith("Text: example ") and record["query"].endswith("Answer:")
    assert record["choices"][record["label"]] == ("positive" if "good" in record["query"] else "negative")

    folder = write_lm_eval_yamls([mc_task], tmp_path / "yamls")
    document = yaml.safe_load((folder / "bmm_mood_mc_test.yaml").read_text())
    path = document["dataset_kwargs"]["data_files"]["test"]
    assert path.startswith("/") and json.loads(open(path).readline())["split"] == "test"
    assert document["test_split"] == "test" and document["output_type"] == "multiple_choice"

    # lm-eval itself reads the generated task offline, from another working directory.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval.tasks import TaskManager, get_task_dict

    tasks = get_task_dict(["bmm_mood_mc_test"], TaskManager(include_path=str(folder), include_defaults=False))
    task = tasks["bmm_mood_mc_test"]
    docs = list(task.test_docs())
    assert len(docs) == 10
    assert task.doc_to_choice(docs[0]) == ["negative", "positive"]
    assert task.doc_to_target(docs[0]) == docs[0]["label"]


def test_answer_only_loss_masks_the_prompt():
    from bench.merging.language.lm_finetune import collate, encode_example
    from mergekit_bmm.examples.tiny_models import build_tokenizer

    tokenizer = build_tokenizer()
    ids, n_answer = encode_example(tokenizer, "Text: good\nAnswer:", "positive", max_length=64)
    context = tokenizer("Text: good\nAnswer:", add_special_tokens=False)["input_ids"]
    assert ids[: len(context)] == context and n_answer == len(ids) - len(context) >= 1
    short = encode_example(tokenizer, "Q:", "no", max_length=64)
    batch = collate([(ids, n_answer), short], pad_id=0)
    labels = batch["labels"]
    assert labels[0, : len(context)].eq(-100).all()
    assert labels[0, len(context) : len(ids)].tolist() == ids[len(context) :]
    assert labels[1, len(short[0]) :].eq(-100).all() and batch["attention_mask"][1].sum() == len(short[0])


def test_language_table():
    from bench.merging.report import language_markdown

    scores = {"a": {"validation": 0.5, "test": 0.25}, "b": {"validation": 1.0, "test": 0.75}}
    text = language_markdown(
        {
            "model": "lm",
            "tasks": ["a", "b"],
            "pretrained": scores,
            "indiv": scores,
            "task_arithmetic": {"weight": 0.5, "validation_sweep": {"0.5": 0.75}, "scores": scores},
            "intervals": {
                "bmm over task_arithmetic - task_arithmetic": {"delta": 0.021, "low": -0.004, "high": 0.05}
            },
        }
    )
    assert "| pretrained (lm) | 50.0 / 25.0 | 100.0 / 75.0 | 50.0 |" in text
    assert "| bmm over task_arithmetic - task_arithmetic | +2.1 | [-0.4, +5.0] |" in text
    assert "task_arithmetic (weight 0.5)" in text and "0.5: 75.0" in text


def test_language_table_lists_every_anchor_and_its_bmm_row():
    from bench.merging.report import language_markdown

    scores = {"a": {"validation": 0.5, "test": 0.25}}
    better = {"a": {"validation": 0.6, "test": 0.5}}
    bmm = {"budget": 4, "best_values": {"block0.scale": 1.2}, "scores": better}
    text = language_markdown(
        {
            "model": "lm",
            "tasks": ["a"],
            "pretrained": scores,
            "indiv": scores,
            "anchors": {"ties": {"parameter": "lambda", "value": 0.6, "scores": scores, "bmm": bmm}},
        }
    )
    assert "| ties (lambda 0.6) | 50.0 / 25.0 | 25.0 |" in text
    assert "| ties + BMM (data-free, K=4; block0.scale=1.2) | 60.0 / 50.0 | 50.0 |" in text


def test_searches_without_labels_are_paired_with_the_labelled_search_the_defaults_and_entropy():
    """Each label-free search's test gain as a share of the labelled search's, and its paired
    difference from the labelled search, the defaults and the other objective (issue 59's columns)."""
    from bench.merging.language.label_free import label_free_pairs
    from bench.merging.report.language import label_free_summary

    free = {"agreement": {"model_id": "d"}, "entropy": {"model_id": "e"}}
    pairs = label_free_pairs("ties", {"bmm": {"label_free": free}})
    assert ("bmm agreement over ties", "bmm over ties") in pairs
    assert ("bmm entropy over ties", "bmm defaults over ties") in pairs
    assert ("bmm agreement over ties", "bmm entropy over ties") in pairs
    assert ("bmm agreement over ties", "ties") in pairs
    found = {
        "bmm over ties - ties": {"delta": 0.02, "low": 0.01, "high": 0.03},
        "bmm data_assisted over ties - ties": {"delta": 0.01, "low": 0.0, "high": 0.02},
        "bmm auto over ties - ties": {"delta": 0.01, "low": 0.0, "high": 0.02},
        "bmm auto over ties - bmm over ties": {"delta": -0.01, "low": -0.02, "high": 0.0},
        "bmm agreement over ties - ties": {"delta": 0.016, "low": 0.005, "high": 0.03},
        "bmm agreement over ties - bmm over ties": {"delta": -0.004, "low": -0.01, "high": 0.002},
        "bmm agreement over ties - bmm defaults over ties": {"delta": -0.001, "low": -0.01, "high": 0.008},
        "bmm agreement over ties - bmm entropy over ties": {"delta": 0.01, "low": 0.004, "high": 0.016},
    }
    text = label_free_summary(found)
    assert "(agreement): +1.6 over ties (80% of the labelled search's +2.0)" in text
    assert "-0.4 [-1.0, +0.2] against the labelled search" in text
    assert "+1.0 [+0.4, +1.6] against entropy" in text
    assert "data_assisted" not in text and "(auto)" not in text  # searched with labels, or no search


@pytest.fixture()
def tiny_llama(tmp_path):
    from mergekit_bmm.examples.tiny_models import make_tiny_family

    return make_tiny_family(tmp_path / "llama", "llama", n_experts=1)


def test_test_scores_keep_each_document_for_paired_intervals(mc_task, tiny_llama, tmp_path, monkeypatch):
    from bench.merging.cache import ScoreCache
    from bench.merging.intervals import paired_difference
    from bench.merging.language.lm_eval_runner import lm_score_key, score_lm, test_documents
    from bench.merging.language.mc_tasks import write_lm_eval_yamls

    monkeypatch.chdir(tmp_path)
    folder = write_lm_eval_yamls([mc_task], tmp_path / "yamls")
    cache = ScoreCache(tmp_path / "cache")
    jobs = [(mc_task, "validation"), (mc_task, "test")]
    models = {"base": tiny_llama.base, "expert": tiny_llama.experts[0]}
    for name, path in models.items():
        scores, seconds = score_lm(name, path, jobs, folder, cache, batch_size=4, limit=None)
        documents = test_documents(name, [mc_task], cache, None)["mood_mc"]
        assert len(documents) == 10 and set(documents) <= {0.0, 1.0}
        assert scores[("mood_mc", "test")] == pytest.approx(sum(documents) / 10)
    delta, low, high = paired_difference(*(test_documents(n, [mc_task], cache, None) for n in models))
    assert low <= delta <= high

    # a test score cached before documents were kept is scored again; validation is not
    key = lm_score_key("base", mc_task, "test", None)
    cache.put(key, {"accuracy": 0.5, "n": 10, "seconds": 1.0})
    _, seconds = score_lm("base", models["base"], jobs, folder, cache, batch_size=4, limit=None)
    assert seconds > 0 and len(cache.get(key)["documents"]) == 10
    _, seconds = score_lm("base", models["base"], jobs, folder, cache, batch_size=4, limit=None)
    assert seconds == 0.0


def test_lora_experts_peft_merges_and_their_intervals(mc_task, tiny_llama, tmp_path, monkeypatch):
    """The LoRA track's pieces on a tiny model: an adapter trained on the task, PEFT's adapter merges
    tuned on validation, and paired intervals between two of them."""
    from bench.merging.cache import ScoreCache
    from bench.merging.config import FinetuneSpec, LoraTrackSpec
    from bench.merging.language.lm_eval_runner import test_documents
    from bench.merging.language.lora_track import Scoring, intervals, train_lora, tuned_knots, tuned_peft
    from bench.merging.language.mc_tasks import write_lm_eval_yamls
    from bench.merging.report.language import lora_markdown

    monkeypatch.chdir(tmp_path)
    spec = LoraTrackSpec(
        enabled=True,
        rank=2,
        alpha=4,
        targets=["q_proj", "v_proj"],
        finetune=FinetuneSpec(steps=1, batch_size=4, lr=1e-3, warmup_fraction=0.0, threads=1),
        peft_methods=["ties"],
        peft_weights=[0.5],
        peft_densities=[0.5],
        knots=["ties"],
        knots_top_k=[1.0],
    )
    adapters = []
    for seed in (0, 1):
        folder = tmp_path / f"lora-{seed}"
        info = train_lora(tiny_llama.base, mc_task, spec, 48, seed, folder)
        assert info["steps"] == 1 and (folder / "adapter_model.safetensors").is_file()
        adapters.append(folder)
    scoring = Scoring(
        [mc_task], write_lm_eval_yamls([mc_task], tmp_path / "yamls"), ScoreCache(tmp_path / "c"), 4, None
    )
    ties = tuned_peft("ties", spec, tiny_llama.base, adapters, scoring, tmp_path)
    assert ties["density"] == 0.5 and ties["weight"] == 0.5 and 0 <= ties["scores"]["mood_mc"]["test"] <= 1
    assert len(test_documents(ties["model_id"], [mc_task], scoring.cache, None)["mood_mc"]) == 10
    pairs = intervals({"bmm x": ties["model_id"], "peft ties": ties["model_id"]}, scoring)
    assert pairs == {"bmm x - peft ties": {"delta": 0.0, "low": 0.0, "high": 0.0}}
    knots = tuned_knots("ties", spec, tiny_llama.base, adapters, scoring, tmp_path)
    assert knots["top_k"] == 1.0 and knots["model_id"] != ties["model_id"]
    assert 0 <= knots["scores"]["mood_mc"]["test"] <= 1
    found = {"rank": 2, "alpha": 4, "targets": ["q_proj"], "indiv": {}, "peft": {"ties": ties}}
    table = lora_markdown({**found, "knots": {"ties": knots}}, ["mood_mc"], lambda label, scores: label)
    assert "PEFT ties (weight 0.5, density 0.5)" in table and "KnOTS-TIES (weight 0.5, top-K 1.0)" in table

    # the data-assisted columns: the adapter's statistics on its training prompts, then mix BMM over them
    import yaml

    from bench.merging.language.statistics import expert_statistics
    from bench.merging.searches import bmm_template
    from mergekit_bmm.cards.merge_record import read_record
    from mergekit_bmm.plugin.run import merge_recipe_text

    expert = f"{tiny_llama.base}+{adapters[0]}"
    stats = expert_statistics(tmp_path, [expert], [mc_task], 48)
    assert expert_statistics(tmp_path, [expert], [mc_task], 48) == stats  # collected once
    recipe = bmm_template(tiny_llama.base, [expert], None, "mix", stats)
    merge_recipe_text(yaml.safe_dump(recipe), tmp_path / "mix")
    assert read_record(tmp_path / "mix").low_rank  # solved from the adapter's factors
    from bench.merging.anchor_tuning import anchor_recipe
    from bench.merging.config import AnchorSpec

    regmean = AnchorSpec(name="regmean", method="regmean", grid={"off_diagonal_scale": [0.5]})
    merge_recipe_text(
        yaml.safe_dump(anchor_recipe(regmean, tiny_llama.base, [expert], 0.5, stats)), tmp_path / "rm"
    )
    assert (tmp_path / "rm" / "model.safetensors").is_file()  # RegMean over the adapter, from its statistics
    scores = ties["scores"]
    searched = {"setting": "mix", "budget": 2, "best_values": {}, "scores": scores, "model_id": "m"}
    proposed = {"model_id": "c", "parameters": {"low_rank_rows": "adapters"}, "scores": scores}
    anchor = {"scores": scores, "model_id": "a", "bmm_settings": {"mix": {**searched, "candidate": proposed}}}
    table = lora_markdown({**found, "anchors": {"ties": anchor}}, ["mood_mc"], lambda label, scores: label)
    assert "ties + BMM (mix, K=2; )" in table
    assert "BMM (mix) over ties at its defaults with low_rank_rows: adapters" in table


def test_the_lora_picture_draws_each_bmm_against_every_other_merge(tmp_path):
    from bench.merging.report.plots import plot_lora_intervals

    def interval(delta):
        return {"delta": delta, "low": delta - 0.02, "high": delta + 0.02}

    peers = ["task_arithmetic", "peft linear", "peft ties", "knots ties"]
    found = {}
    for anchor in ("task_arithmetic", "ties"):
        for kind in ("over", "defaults over", "auto over"):
            for index, peer in enumerate(peers):
                found[f"bmm {kind} {anchor} - {peer}"] = interval(0.01 * index)
    path = plot_lora_intervals({"rank": 16, "intervals": found}, tmp_path / "lora.png")
    assert path is not None and path.stat().st_size > 10_000
    assert plot_lora_intervals({"rank": 16, "intervals": {}}, tmp_path / "none.png") is None


def test_label_free_evaluator_reads_the_training_prompts_and_no_label(mc_task, tiny_llama, tmp_path):
    """The language track's label-free block: each expert against the merge on its task's training
    prompts (the `query` field); the base scores 0 on the share of its gap closed, the expert 1."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.merging.config import LabelFreeSpec
    from bench.merging.language.label_free import bmm_models, label_free_evaluator
    from mergekit_bmm.evaluation import make_evaluator
    from mergekit_bmm.evaluation.config import AgreementEvaluatorConfig

    block = label_free_evaluator(LabelFreeSpec(), [mc_task], [tiny_llama.experts[0]], 32, 4)
    assert block["tasks"][0]["text_field"] == "query"
    assert set(block["tasks"][0]) == {"name", "model", "data", "text_field", "split"}  # no label field
    config = AgreementEvaluatorConfig.model_validate({**block, "base_model": str(tiny_llama.base)})
    evaluator = make_evaluator(config, "cpu")
    assert len(evaluator.tasks[0].samples) == 20  # the train split's prompts
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama.base)
    for path, expected in ((tiny_llama.base, 0.0), (tiny_llama.experts[0], 1.0)):
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        assert evaluator.evaluate_model(model, tokenizer)["mood_mc"] == pytest.approx(expected, abs=1e-4)
    last = LabelFreeSpec(positions="last")  # the answer's position only: its own name and evaluator setting
    block = label_free_evaluator(last, [mc_task], [tiny_llama.experts[0]], 32, 4)
    assert block["positions"] == "last" and last.name == "agreement-last"
    evaluator = make_evaluator(
        AgreementEvaluatorConfig.model_validate({**block, "base_model": str(tiny_llama.base)}), "cpu"
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_llama.experts[0]).eval()
    assert evaluator.evaluate_model(model, tokenizer)["mood_mc"] == pytest.approx(1.0, abs=1e-4)
    bmm = {"model_id": "a", "defaults": {"model_id": "b"}, "auto": {"model_id": "c"}}
    bmm["label_free"] = {"agreement": {"model_id": "d"}, "agreement-last": {"model_id": "e"}}
    assert bmm_models("ties", bmm)["bmm agreement over ties"] == "d"
    assert bmm_models("ties", bmm)["bmm agreement-last over ties"] == "e"
    del bmm["auto"]  # `search.evidence_lambda: false`: no merge at lambda: auto, nothing to pair
    assert "bmm auto over ties" not in bmm_models("ties", bmm)


def test_a_traced_language_search_reads_every_trial_at_both_positions_against_test(
    mc_task, tiny_llama, tmp_path, monkeypatch
):
    """Each trial of a label-free search re-merged (under the rule its template states), scored on test
    by lm-eval and read under every objective at every position and at the answer's; rank correlations
    per reading; a second trace reads everything from the cache; the report shows it."""
    from types import SimpleNamespace

    import bench.merging.language.label_free_trace as trace_module
    from bench.merging.config import LabelFreeSpec, LanguageSpec
    from bench.merging.language.mc_tasks import write_lm_eval_yamls
    from bench.merging.report.label_free import language_traces, trace_table

    monkeypatch.chdir(tmp_path)
    base, expert = str(tiny_llama.base), str(tiny_llama.experts[0])
    template = {
        "merge_method": "bmm",
        "base_model": base,
        "models": [{"model": expert, "parameters": {"weight": 1.0}}],
        "parameters": {"anchor_method": "task_arithmetic", "lambda": 0.1, "gram_sharing": "weight"},
        "dtype": "float32",
    }
    folder = tmp_path / "search"
    (folder / "trials").mkdir(parents=True)
    with open(folder / "trials.jsonl", "w", encoding="utf-8") as log:
        for trial, lam in enumerate((0.01, 0.1, 1.0)):  # written before the rule was stated
            recipe = {**template, "parameters": {"anchor_method": "task_arithmetic", "lambda": lam}}
            (folder / "trials" / f"trial-{trial}.yml").write_text(yaml.safe_dump(recipe))
            record = {"trial": trial, "status": "ok", "score": lam, "yaml": f"trials/trial-{trial}.yml"}
            log.write(json.dumps(record) + "\n")
    config = SimpleNamespace(language=LanguageSpec(max_length=32, eval_batch_size=4))
    include = write_lm_eval_yamls([mc_task], tmp_path / "yamls")
    spec = LabelFreeSpec(trace=["task_arithmetic"])
    args = (config, tmp_path / "cache", spec, folder, template, [mc_task], [tiny_llama.experts[0]], include)
    found = trace_module.trace_lm_search(*args)
    assert [t["trial"] for t in found["trials"]] == [0, 1, 2]
    assert set(found["trials"][0]["positions"]) == {"all", "last"}
    assert all(0 <= t["test_avg"] <= 1 for t in found["trials"])
    assert found["trials"][2]["positions"]["all"]["kl"]["mood_mc"] == pytest.approx(
        0.0, abs=1e-5
    )  # the expert
    assert set(found["correlations"]) == {"all", "last"}
    from bench.merging.label_free_trace import traced_trials  # each merged under the template's rule

    merged = traced_trials(folder, tmp_path / "cache", None, template)
    assert [recipe["parameters"]["gram_sharing"] for _, recipe, _, _ in merged] == ["weight"] * 3
    monkeypatch.setattr(trace_module, "run_mergekit", lambda *a: pytest.fail("not from the cache"))
    assert trace_module.trace_lm_search(*args)["trials"] == found["trials"]
    language = {"bmm": {"label_free": {"agreement": {"trace": found}}}}  # the dense track's own search
    text = trace_table(language_traces(language))
    assert "searched on agreement, read at the answer's position (3)" in text


def test_a_run_with_no_dense_experts_finishes_and_writes_its_record(mc_task, tiny_llama, tmp_path):
    """`language.dense: false` (a run for the LoRA track): the pretrained model is scored and the
    run's record written with no expert in it (it once failed after every cell was scored)."""
    import json

    from bench.merging.config import RunConfig
    from bench.merging.language.track import run_language_track

    task = {
        "name": "mood_mc",
        "jsonl": str(tmp_path / "mood.jsonl"),
        "choices": {"0": "negative", "1": "positive"},
    }
    task.update(
        prompt="Text: {text}\nQuestion: positive or negative?\nAnswer:", train=20, validation=5, test=10
    )
    config = RunConfig.model_validate(
        {
            "name": "no_dense",
            "tasks": [{"name": "rt_sentiment", "descriptions": {"fresh": "good", "rotten": "bad"}}],
            "language": {
                "enabled": True,
                "name": "tiny",
                "wheel": None,
                "path": str(tiny_llama.base),
                "dense": False,
                "eval_batch_size": 4,
                "tasks": [task],
            },
        }
    )
    out = run_language_track(config, tmp_path / "cache")
    assert set(out["pretrained"]) == {"mood_mc"} and "indiv" not in out
    record = json.loads((tmp_path / "cache" / "runs" / "no_dense" / "language.json").read_text())
    assert record["experts"] == {}


def test_a_lora_run_checkpoints_each_search_over_an_anchor(mc_task, tiny_llama, tmp_path):
    """A LoRA cell's searches take hours each on a CPU: the run's checkpoint sees the anchor once tuned,
    then after each search (labelled, then each with no labels), so a stopped run keeps what it found."""
    import copy

    from bench.merging.config import RunConfig
    from bench.merging.language.track import run_language_track
    from bench.merging.report import language_markdown

    task = {
        "name": "mood_mc",
        "jsonl": str(tmp_path / "mood.jsonl"),
        "choices": {"0": "negative", "1": "positive"},
        "prompt": "Text: {text}\nQuestion: positive or negative?\nAnswer:",
        "train": 20,
        "validation": 5,
        "test": 10,
    }
    search = {"settings": ["data_free"], "budget": 1, "n_initial": 1, "blocks": 1, "evidence_lambda": True}
    search["groups"] = ["attn_in+attn_out+mlp_in+mlp_out"]
    search["label_free"] = [{"objective": "agreement", "anchors": ["ta"], "max_samples": 4}]
    lora = {
        "enabled": True,
        "rank": 2,
        "alpha": 4,
        "targets": ["q_proj", "v_proj"],
        "finetune": {"steps": 1, "batch_size": 4, "lr": 1e-3, "warmup_fraction": 0.0, "threads": 1},
        "anchors": [{"name": "ta", "method": "task_arithmetic", "model_parameters": {"weight": 0.5}}],
        "peft_methods": [],
        "knots": [],
        "search": search,
    }
    language = {"enabled": True, "name": "tiny", "wheel": None, "path": str(tiny_llama.base), "dense": False}
    language.update(eval_batch_size=4, max_length=48, tasks=[task], lora=lora)
    config = RunConfig.model_validate(
        {
            "name": "lora_checkpoints",
            "tasks": [{"name": "rt_sentiment", "descriptions": {"fresh": "good", "rotten": "bad"}}],
            "language": language,
        }
    )
    notes: list[str] = []
    seen: list[dict] = []
    tables: list[str] = []

    def checkpoint(results: dict) -> None:
        notes.append(results["reached"])
        seen.append(copy.deepcopy(results["lora"]))  # as the report writes it, at that moment
        tables.append(language_markdown(results))

    out = run_language_track(config, tmp_path / "cache", checkpoint)
    assert notes == [
        "LoRA: ta, tuned",
        "LoRA: ta, searched data_free",
        "LoRA: ta, searched data_free, agreement (no labels)",
        "LoRA: anchors up to ta",
    ]
    assert "bmm" not in seen[0]["anchors"]["ta"] and "label_free" not in seen[1]["anchors"]["ta"]["bmm"]
    assert "bmm agreement over ta - bmm over ta" in seen[2]["intervals"]  # paired at the checkpoint
    row = "BMM over ta searched with no labels (agreement)"
    assert row not in tables[1] and row in tables[2] and "ta + BMM (data-free, K=1" in tables[1]
    assert (
        out["lora"]["anchors"]["ta"]["bmm"]["label_free"]["agreement"]
        == seen[2]["anchors"]["ta"]["bmm"]["label_free"]["agreement"]
    )
    # each row shows its own model's accuracy as scored (the searched row once showed the lambda: auto
    # merge's; on this tiny run the merges score alike, so this states the contract)
    scored = {}
    for path in (tmp_path / "cache" / "scores").glob("*.json"):
        record = json.loads(path.read_text())
        if record["key"].get("split") == "test" and "lm_eval_task" in record["key"]:
            scored[record["key"]["model"]] = record["accuracy"]
    bmm = out["lora"]["anchors"]["ta"]["bmm"]
    for cell in (bmm, bmm["auto"], bmm["defaults"]):
        assert cell["scores"]["mood_mc"]["test"] == round(scored[cell["model_id"]], 4)
