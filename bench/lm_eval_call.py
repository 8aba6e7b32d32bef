"""The fixed cost of one lm-eval call, with and without lm-eval's environment report.

A staged search (cheap-then-full) scores a trial's documents in chunks, one ``simple_evaluate``
call each. At its end ``simple_evaluate`` collects an environment report (torch's
``collect_env`` runs ``pip list`` and more in subprocesses); the lm-eval evaluator skips it.
This prints, for a one-document call on a tiny Llama and the test suite's toy task, the wall
time and the CPU time (this process plus its subprocesses) per call, both ways, measured in
the same run. The report's cost does not depend on the model, so the difference is what every
call saves on any model.

    python bench/lm_eval_call.py --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]


def cpu_seconds() -> float:
    """CPU time of this process and of the subprocesses it waited for."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    import torch

    from mergekit_bmm.evaluation import lm_harness
    from mergekit_bmm.evaluation.base import load_model, load_tokenizer
    from mergekit_bmm.evaluation.config import LMEvalEvaluatorConfig
    from mergekit_bmm.examples.tiny_models import make_tiny_family

    torch.set_num_threads(1)
    os.chdir(REPO)  # the toy task's data_files is relative to the repository
    with tempfile.TemporaryDirectory() as tmp:
        family = make_tiny_family(Path(tmp) / "family", "llama", n_experts=1, hidden=16, layers=2)
        config = LMEvalEvaluatorConfig(
            type="lm_eval", tasks=["toy_choice"], include_path=str(REPO / "tests" / "fixtures" / "lm_eval")
        )
        evaluator = lm_harness.LMEvalEvaluator(config, "cpu")
        model = load_model(family.base, "AutoModelForCausalLM", "cpu")
        score = evaluator.example_scorer(model, load_tokenizer(family.base))
        score("toy_choice", [0])  # warm: the task, the wrapper
        rows = {}
        for name, skip in (
            ("with the report", mock.patch.object(lm_harness, "_no_environment_report", nullcontext)),
            ("report skipped", nullcontext()),  # the evaluator as shipped
        ):
            walls, cpus = [], []
            with skip:
                for _ in range(args.repeats):
                    wall, cpu = time.perf_counter(), cpu_seconds()
                    score("toy_choice", [0])
                    walls.append(time.perf_counter() - wall)
                    cpus.append(cpu_seconds() - cpu)
            rows[name] = (statistics.median(walls), statistics.median(cpus))
    print(f"{'one-document lm-eval call':<28}{'wall s':>10}{'CPU s':>10}")
    print("-" * 48)
    for name, (wall, cpu) in rows.items():
        print(f"{name:<28}{wall:>10.3f}{cpu:>10.3f}")
    (wall_with, cpu_with), (wall_without, cpu_without) = rows.values()
    print(
        f"\nsaved per call: {wall_with - wall_without:.2f} s wall, {cpu_with - cpu_without:.2f} CPU-s "
        f"({wall_with / wall_without:.1f}x faster call); median of {args.repeats}"
    )


if __name__ == "__main__":
    main()
