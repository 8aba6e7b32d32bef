"""Writing the report: pictures drawn only when what they show changed, stages left out by ``--skip``."""

from __future__ import annotations

from pathlib import Path

from bench.merging.config import load_config, skip_stages
from bench.merging.report import plots
from bench.merging.report.timings import stage_line

CONFIGS = Path(__file__).resolve().parents[1] / "merging" / "configs"
LORA = {"rank": 16, "intervals": {"bmm over ties - peft linear": {"delta": 0.01, "low": -0.01, "high": 0.03}}}


def test_a_picture_is_drawn_again_only_when_what_it_shows_changed(tmp_path, monkeypatch):
    drawn: list[Path] = []
    save = plots._save

    def counting(fig, path, dpi):
        drawn.append(path)
        return save(fig, path, dpi)

    monkeypatch.setattr(plots, "_save", counting)
    monkeypatch.setattr(plots, "KEPT_IN", tmp_path / "kept")
    path = tmp_path / "lora.png"
    assert plots.plot_lora_intervals(LORA, path) == path and len(drawn) == 1
    assert plots.plot_lora_intervals({**LORA}, path) == path and len(drawn) == 1  # the same: kept
    assert plots.plot_lora_intervals({**LORA, "timings": {"x": 1}}, path) and len(drawn) == 1  # clocks only
    changed = {**LORA, "rank": 8}
    assert plots.plot_lora_intervals(changed, path) == path and len(drawn) == 2
    path.write_bytes(b"not a png")  # a damaged picture is not trusted: the kept copy replaces it
    assert plots.plot_lora_intervals(changed, path) == path and len(drawn) == 2
    assert path.read_bytes().startswith(b"\x89PNG") and plots._stamp(path) is not None
    assert plots.plot_lora_intervals(LORA, path) == path and len(drawn) == 2  # back to a state drawn before
    for kept in (tmp_path / "kept").glob("*.png"):
        kept.unlink()
    path.write_bytes(b"not a png")  # and with no kept copy it is drawn again
    assert plots.plot_lora_intervals(changed, path) == path and len(drawn) == 3
    assert path.read_bytes().startswith(b"\x89PNG")


def test_a_picture_is_drawn_again_when_its_drawing_changed(tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "KEPT_IN", tmp_path / "kept")
    path, drawn = tmp_path / "p.png", []

    def draw(data, path):  # the drawing as it was
        drawn.append("old")
        plt = plots._pyplot()
        return plots._save(plt.figure(), path, 50)

    assert plots.drawn_once(draw)({"x": 1}, path) == path and drawn == ["old"]
    assert plots.drawn_once(draw)({"x": 1}, path) == path and drawn == ["old"]  # the same drawing: kept

    def draw(data, path):  # noqa: F811 (the same name and inputs, other code: not the old picture)
        drawn.append("new")
        plt = plots._pyplot()
        return plots._save(plt.figure(figsize=(2, 2)), path, 50)

    assert plots.drawn_once(draw)({"x": 1}, path) == path and drawn == ["old", "new"]
    monkeypatch.setattr(plots, "helpers_digest", lambda: "the helpers changed")  # `_save`, `_pyplot` edited
    assert plots.drawn_once(draw)({"x": 1}, path) == path and drawn == ["old", "new", "new"]


def test_a_picture_that_reads_some_keys_is_kept_when_a_stage_adds_others(tmp_path, monkeypatch):
    drawn: list[Path] = []
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path, dpi: drawn.append(path) or save(fig, path, dpi))
    monkeypatch.setattr(plots, "KEPT_IN", tmp_path / "kept")
    row = {"anchor": "task_arithmetic", "setting": "anchor", "per_task": {"a": 0.5}, "avg": 0.5}
    results = {"name": "r", "encoder": "e", "tasks": ["a"], "indiv": {"a": 0.9}, "rows": [row]}
    path = tmp_path / "per_anchor.png"
    assert plots.plot_anchors(results, path) == path and len(drawn) == 1
    assert plots.plot_anchors({**results, "sweeps": {"settings": {}}}, path) and len(drawn) == 1
    moved = {**row, "per_task": {"a": 0.6}}
    assert plots.plot_anchors({**results, "rows": [moved]}, path) and len(drawn) == 2


def test_skipped_stages_are_switched_off_and_named_in_the_report():
    config = load_config(CONFIGS / "zeroshot8.yml")  # every optional stage on
    skipped = skip_stages(config, ("sweeps", "variants"))
    assert skipped.sweeps.anchor is None and skipped.variants == []
    assert skipped.ablation.anchor == "task_arithmetic" and skipped.language.enabled
    line = stage_line({"stage_reached": "bmm", "stages_skipped": ["sweeps"]})
    assert line.startswith("Stages run: data, heads, experts, scores, task_arithmetic, anchors, bmm;")
    assert "not yet run: ablation, variants, language; skipped: sweeps." in line


def test_the_curve_takes_a_run_s_task_cosine_from_the_nested_run_that_recorded_it():
    from bench.merging.report.curve import curve_markdown, curve_points

    pairs = {"a / b": 0.1, "a / c": -0.2, "b / c": 0.4, "a / d": 0.0, "b / d": 0.0, "c / d": 0.0}
    small = {"name": "three", "tasks": ["a", "b", "c"], "rows": []}  # recorded no cosines (an older run)
    large = {
        "name": "many",
        "tasks": ["a", "b", "c", "d"],
        "rows": [],
        "task_cosines": {"mean": 0.05, "pairs": pairs},
    }
    points = curve_points([large, small])
    assert [p["task_cosine"] for p in points] == [0.1, 0.05]  # (0.1 − 0.2 + 0.4) / 3: its own three pairs
    assert points[0]["task_cosine_from"] == "many" and points[1]["task_cosine_from"] is None
    assert "+0.100 (many's pairs)" in curve_markdown(points)


def test_the_curve_sets_bmm_against_iso_cts_and_tsv_m_each_with_its_oracle():
    from bench.merging.report.curve import curve_markdown, curve_points

    def cell(anchor, mode, delta, oracle=None):
        found = {
            "anchor": anchor,
            "mode": mode,
            "delta": delta,
            "delta_low": delta - 0.01,
            "delta_high": delta + 0.01,
        }
        if oracle is not None:
            found.update(oracle_delta=oracle, oracle_delta_low=oracle - 0.01, oracle_delta_high=oracle + 0.01)
        return found

    run = {
        "name": "sixteen",
        "tasks": [f"t{i}" for i in range(16)],
        "rows": [],
        "summary": [cell("iso_cts", "data_free", 0.004, oracle=0.012), cell("tsv", "data_assisted", 0.008)],
    }
    (point,) = curve_points([run])
    assert set(point["versus"]) == {
        "over ISO-CTS, data_free",
        "over ISO-CTS, data_free, oracle",
        "over TSV-M, data_assisted",
    }
    text = curve_markdown([point])
    assert "| over TSV-M, data_assisted | +0.8 [" in text and "oracle (test as objective: a ceiling)" in text


def test_the_curve_reads_a_run_reported_in_parts_as_one_point():
    from bench.merging.report.curve import curve_points

    tasks = [f"t{i}" for i in range(8)]
    rows = [
        {"anchor": "pretrained", "setting": "anchor", "avg": 0.5},
        {"anchor": "iso_cts", "setting": "anchor", "avg": 0.8},
    ]
    first = {  # both modes, no oracle
        "name": "eight",
        "tasks": tasks,
        "indiv": {t: 0.9 for t in tasks},
        "rows": rows + [{"anchor": "iso_cts", "setting": "data_free", "avg": 0.81}],
        "summary": [
            {"anchor": "iso_cts", "mode": "data_free", "delta": 0.01, "delta_low": 0.0, "delta_high": 0.02}
        ],
    }
    oracle_pass = {  # a later pass over the same cache: the same search, and the oracle beside it
        "name": "eight",
        "tasks": tasks,
        "indiv": {t: 0.9 for t in tasks},
        "rows": [{"anchor": "iso_cts", "setting": "data_free", "avg": 0.81}],
        "summary": [
            {"anchor": "iso_cts", "mode": "data_free", "delta": 0.01, "delta_low": 0.0, "delta_high": 0.02}
            | {"oracle_delta": 0.03, "oracle_delta_low": 0.01, "oracle_delta_high": 0.05}
        ],
    }
    (point,) = curve_points([first, oracle_pass])
    assert point["tasks"] == 8 and round(point["shares"]["bmm over iso_cts (data_free)"], 3) == 0.775
    assert point["versus"]["over ISO-CTS, data_free"]["estimate"] == 0.01
    assert point["versus"]["over ISO-CTS, data_free, oracle"] == {"estimate": 0.03, "low": 0.01, "high": 0.05}
