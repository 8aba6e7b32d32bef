"""How much each expert moved, per module group: the size that weighs a task in the data-free Gram.

The data-free Gram ``Σ U_tᵀU_t`` weighs task t by the size of its update; activation Grams
are means per task. Before balancing tasks (``task_balance:``), see whether their updates
differ at all. For every expert folder it prints, per module group (``attn_in``, ``attn_out``,
``mlp_in``, ``mlp_out``) and over all solved weights, ``‖U_t‖_F`` (the root of the summed
squares over the group's weights) and ``tr(U_tᵀU_t)`` as a share of the tasks' total, then
the largest-to-smallest ratio across tasks. Nothing is loaded but the checkpoints.

    python bench/task_vector_norms.py BASE_DIR EXPERT_DIR [EXPERT_DIR ...] [--json OUT.json]
    python bench/task_vector_norms.py --cache /work/bench-cache    # the merging benchmark's experts
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from mergekit_bmm.core.module_map import GROUP_NAMES, classify
from mergekit_bmm.io.checkpoint import iter_tensors, load_state_dict
from mergekit_bmm.io.model_folder import model_type_of


def squared_norms(base: dict, expert: Path, model_type: str | None) -> dict[str, float]:
    """Per group (and ``all``): the summed squared Frobenius norms of ``W_t − W_pre``."""
    sums = dict.fromkeys((*GROUP_NAMES, "all"), 0.0)
    for name, tensor in iter_tensors(expert):
        info = classify(name, model_type) if tensor.ndim == 2 and name in base else None
        if info is None:
            continue
        value = float((tensor.double() - base[name].double()).pow(2).sum())
        sums[info.group.value] += value
        sums["all"] += value
    return sums


def benchmark_experts(cache: Path) -> tuple[Path, list[Path]]:
    """The merging benchmark's pretrained encoder and its finished experts (``done.json``)."""
    encoders = sorted(p for p in (cache / "encoders").iterdir() if p.is_dir())
    experts = sorted(p for p in (cache / "experts").iterdir() if (p / "done.json").is_file())
    if not encoders or not experts:
        raise SystemExit(f"{cache}: no encoder or no finished expert yet")
    return encoders[0], experts


def table(rows: dict[str, dict[str, float]]) -> str:
    columns = (*GROUP_NAMES, "all")
    lines = [f"{'expert':<28}" + "".join(f"{c:>16}" for c in columns), "-" * (28 + 16 * len(columns))]
    totals = {c: sum(r[c] for r in rows.values()) or 1.0 for c in columns}
    for expert, row in rows.items():
        cells = "".join(f"{math.sqrt(row[c]):>9.3f} ({100 * row[c] / totals[c]:>3.0f}%)" for c in columns)
        lines.append(f"{expert:<28}{cells}")
    ratios = []
    for c in columns:
        norms = [math.sqrt(r[c]) for r in rows.values() if r[c] > 0]
        ratios.append(f"{max(norms) / min(norms):>16.2f}" if norms else f"{'-':>16}")
    lines.append(f"{'largest / smallest ‖U_t‖':<28}" + "".join(ratios))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="*", type=Path, help="BASE_DIR then the expert folders")
    parser.add_argument("--cache", type=Path, help="the merging benchmark's cache: its encoder and experts")
    parser.add_argument("--json", type=Path, default=None, help="write the squared norms here")
    args = parser.parse_args()
    if args.cache:
        base_dir, experts = benchmark_experts(args.cache)
    elif len(args.folders) >= 2:
        base_dir, experts = args.folders[0], args.folders[1:]
    else:
        parser.error("give BASE_DIR and at least one EXPERT_DIR, or --cache")
    base = load_state_dict(base_dir)
    model_type = model_type_of(base_dir)
    rows = {expert.name: squared_norms(base, expert, model_type) for expert in experts}
    print(f"‖U_t‖_F per module group (share of Σ_t tr(U_tᵀU_t)); base {base_dir}")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"base": str(base_dir), "squared_norms": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
