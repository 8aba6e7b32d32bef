"""The fixed cost of one lm-eval call, with and without lm-eval's environment report.

A staged search (cheap-then-full) scores a trial's documents in chunks, one ``simple_evaluate`` call
each. At its end ``simple_evaluate`` collects an environment report (torch's ``collect_env`` runs
``pip list`` and more in subprocesses); the lm-eval evaluator skips it. A one-document call on a tiny
Llama and the test suite's toy task, both ways alternating round by round (:mod:`bench.perf.harness`),
wall and CPU time (this process plus its subprocesses). The report's cost does not depend on the model,
so the difference is what every call saves on any model.

    python -m bench.perf lm_eval_call --rounds 5
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from pathlib import Path
from typing import Any
from unittest import mock

from bench.perf.harness import Group, Job, Workload

REPO = Path(__file__).resolve().parents[3]
SKIPPED = "report skipped (the evaluator as shipped)"


def build(parameters: dict[str, Any], root: Path) -> list[Group]:
    import torch

    from mergekit_bmm.evaluation import lm_harness
    from mergekit_bmm.evaluation.base import load_model, load_tokenizer
    from mergekit_bmm.evaluation.config import LMEvalEvaluatorConfig
    from mergekit_bmm.examples.tiny_models import make_tiny_family

    torch.set_num_threads(1)
    os.chdir(REPO)  # the toy task's data_files is relative to the repository
    family = make_tiny_family(root / "family", "llama", n_experts=1, hidden=16, layers=2)
    config = LMEvalEvaluatorConfig(
        type="lm_eval", tasks=["toy_choice"], include_path=str(REPO / "tests" / "fixtures" / "lm_eval")
    )
    evaluator = lm_harness.LMEvalEvaluator(config, "cpu")
    score = evaluator.example_scorer(
        load_model(family.base, "AutoModelForCausalLM", "cpu"), load_tokenizer(family.base)
    )
    score("toy_choice", [0])  # warm: the task, the wrapper

    def call(report: bool):
        def run(out: Path) -> None:
            with (
                mock.patch.object(lm_harness, "_no_environment_report", nullcontext)
                if report
                else nullcontext()
            ):
                score("toy_choice", [0])

        return run

    return [Group([Job(SKIPPED, call(False)), Job("with the report", call(True), SKIPPED)])]


WORKLOAD = Workload(
    name="lm_eval_call",
    summary="one lm-eval call with and without lm-eval's environment report (wall and CPU time)",
    sizes={"full": {"rounds": 5}, "quick": {"rounds": 1}},
    build=build,
    notes=lambda p: "a one-document lm-eval call, tiny Llama, the test suite's toy task",
)
