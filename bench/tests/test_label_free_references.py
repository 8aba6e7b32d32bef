"""bench/label_free_references.py on tiny models: the top-k KL is a lower bound that tightens with k."""

from __future__ import annotations

import json


def test_top_k_kl_is_a_lower_bound_that_tightens(tmp_path):
    from click.testing import CliRunner

    from bench.label_free_references import main
    from mergekit_bmm.examples.tiny_models import make_tiny_family

    family = make_tiny_family(tmp_path / "tiny", "llama", n_experts=2)
    data = tmp_path / "texts.jsonl"
    data.write_text(
        "".join(json.dumps({"text": f"the expert reads text number {i}"}) + "\n" for i in range(4))
    )
    out = tmp_path / "table.json"
    args = ["--base", str(family.base), "--expert", str(family.experts[0]), "--candidate", str(family.base)]
    args += [
        "--candidate",
        str(family.experts[1]),
        "--data",
        str(data),
        "--k",
        "16,64,320",
        "--out",
        str(out),
    ]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    for row in json.loads(out.read_text())["rows"]:
        assert row["k16"] <= row["k64"] + 1e-12 <= row["full_kl"] + 2e-12
        assert abs(row["k320"] - row["full_kl"]) <= 1e-6 * row["full_kl"] + 1e-9  # k = the vocabulary: exact
