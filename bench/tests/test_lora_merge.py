"""bench/lora_merge.py at a tiny shape: every row runs and the table is printed."""

from __future__ import annotations

import json
import sys

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("targets", [[], ["--targets", "q_proj,v_proj"]])
def test_every_row_runs_and_the_routes_match_the_float64_solve(tmp_path, monkeypatch, capsys, targets):
    from bench import lora_merge

    argv = ["lora_merge.py", "--hidden", "64", "--layers", "1", "--rank", "4", "--repeats", "1", *targets]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(tmp_path)])
    lora_merge.main()
    table = capsys.readouterr().out
    for row in ("Task Arithmetic", "bmm, low-rank route", lora_merge.ADAPTER_ROW, lora_merge.TRIAL_ROW):
        assert f"| {row} |" in table
    result = json.loads((tmp_path / "rows.json").read_text())
    assert result["errors"]["bmm, low-rank route"] < 1e-5
    assert (tmp_path / "merged" / "adapter" / "adapter_model.safetensors").is_file()
