"""What one search trial costs with and without bmm's λ-independent cache.

On a Llama-shaped model with realistic module sizes (default: hidden 1024, intermediate
2816, 8 layers, 16 heads / 4 KV heads, T = 8 synthetic experts, bfloat16 checkpoints
generated locally), one run prints:

* the uncached merge (direct route: Grams, cross terms, Cholesky solve per module);
* the first trial with ``cache:`` (the same plus an eigendecomposition, and writing factors);
* a cached trial with new λ/s (reads the factors, one ``out × in × in`` product per module);
* the GEMM floor of one cached trial: the bare products for every solved module, timed in
  this process with the same threads;
* mergekit's I/O floor: the same recipe with a kernel that returns ``W_pre`` untouched
  (plan + load every input + write), which no kernel can go below;
* peak resident memory of each phase, cache size per weight element, and the error of
  cached factors (float32, float16) against the direct route on layer 0's modules.

Timings are the minimum (and median) over repeats; the machine is shared, run it under
``nice``. Every merge runs in this process through ``mergekit.merge.run_merge``, which is
what a search does per trial (no interpreter start-up in the figures).

    nice -n 10 python bench/search_trial.py    # ~15 min on 2 cores once the model exists
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# On a CPU shared with other jobs, OpenMP threads that spin while waiting made LAPACK's
# multithreaded eigendecomposition (the filling trial) 10-60× slower here; sleeping waits
# cost nothing measurable elsewhere. Set OMP_WAIT_POLICY=ACTIVE to see the default.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from mergekit.merge_methods.base import TensorGroup

from bench.common import (
    PeakSampler,
    ensure_llama_family,
    gemm_floor,
    reset_peak_rss,
    solved_shapes,
    status_mib,
)

DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mergekit-bmm" / "bench"


def recipe(family: dict, **parameters) -> dict:
    experts = family["experts"]
    return {
        "merge_method": "bmm",
        "base_model": str(family["base"]),
        "models": [{"model": str(p), "parameters": {"weight": 1.0 / len(experts)}} for p in experts],
        "parameters": {"anchor_method": "task_arithmetic", "gram": "data_free", **parameters},
        "dtype": "bfloat16",
    }


# -- measuring ----------------------------------------------------------------------------
class Phase:
    """Repeated timings of one phase, with its peak memory.

    Two peaks: resident set (``VmHWM``, which also counts the pages of memory-mapped
    checkpoints and cache files the phase touched) and private memory (``RssAnon``,
    sampled every 5 ms: the tensors the merge allocates).
    """

    def __init__(self, name: str):
        self.name, self.times, self.peak_rss, self.peak_private = name, [], 0.0, 0.0

    def run(self, action) -> float:

        reset_peak_rss()
        sampler = PeakSampler("RssAnon", interval=0.005)
        start = time.perf_counter()
        action()
        elapsed = time.perf_counter() - start
        private = sampler.stop()["RssAnon"]
        self.times.append(elapsed)
        self.peak_rss = max(self.peak_rss, status_mib("VmHWM"))
        self.peak_private = max(self.peak_private, private)
        return elapsed

    @property
    def best(self) -> float:
        return min(self.times)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def merge(config: dict, out: Path) -> None:
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    shutil.rmtree(out, ignore_errors=True)
    options = MergeOptions(quiet=True, copy_tokenizer=False, write_model_card=False)
    run_merge(MergeConfiguration.model_validate(copy.deepcopy(config)), str(out), options=options)


def register_io_floor() -> None:
    """A kernel that returns ``W_pre``: what mergekit itself costs per trial."""
    from mergekit.merge_methods import register
    from mergekit.merge_methods.base import BasePolicy, InputContract
    from mergekit.merge_methods.easy_define import merge_method

    from mergekit_bmm.merge_methods.registry import registered_names

    if "bench_io_floor" in registered_names():
        return

    @merge_method(name="bench_io_floor", contract=InputContract(base=BasePolicy.REQUIRED, min_non_base=1))
    def io_floor(group: TensorGroup) -> torch.Tensor:
        return group.base.tensor

    register(io_floor)


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*.safetensors"))


def accuracy(family: dict, shapes, precisions: list[str], scratch: Path) -> dict[str, tuple[float, float]]:
    """Worst relative error over layer 0's modules at the default λ = 0.1, float32 compute.

    For the direct route and for each cache precision: (error vs a float64 direct solve,
    error vs the float32 direct route), as ‖W − W_ref‖ / ‖W_ref − W_pre‖.
    """
    from mergekit.merge_methods.api import merge_tensors
    from safetensors import safe_open

    from mergekit_bmm.io.checkpoint import safetensors_files

    def read(model_dir: Path, name: str) -> torch.Tensor:
        for path in safetensors_files(model_dir):
            with safe_open(str(path), framework="pt") as handle:
                if name in handle.keys():
                    return handle.get_tensor(name).float()
        raise KeyError(name)

    def error(value: torch.Tensor, reference: torch.Tensor, base: torch.Tensor) -> float:
        return float((value.double() - reference).norm() / (reference - base.double()).norm())

    worst = {label: (0.0, 0.0) for label in ["direct", *precisions]}
    for name, _, _ in shapes:
        if ".layers.0." not in name:
            continue
        tensors = [read(family["base"], name)] + [read(p, name) for p in family["experts"]]
        weights = [1.0 / len(family["experts"])] * len(family["experts"])

        def bmm(tensors=tensors, name=name, weights=weights, **parameters) -> torch.Tensor:
            parameters = {"weight": weights, "lambda": 0.1, **parameters}
            return merge_tensors(tensors, "bmm", base_index=0, name=name, parameters=parameters)

        reference = bmm(compute_dtype="float64").double()
        direct = bmm()
        results = {"direct": direct}
        for precision in precisions:
            results[precision] = bmm(cache=str(scratch / precision), cache_dtype=precision)
        for label, value in results.items():
            errors = (error(value, reference, tensors[0]), error(value, direct.double(), tensors[0]))
            worst[label] = tuple(max(a, b) for a, b in zip(worst[label], errors))
    shutil.rmtree(scratch, ignore_errors=True)
    return worst


# -- main ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="models and scratch space")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5, help="cached trials, I/O and GEMM floors")
    parser.add_argument("--uncached-repeats", type=int, default=2)
    parser.add_argument("--precisions", default="float32,float16")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from mergekit_bmm.plugin import activate

    activate()

    register_io_floor()
    family = ensure_llama_family(args.cache_dir, args.hidden, args.intermediate, args.layers, args.experts)
    shapes = solved_shapes(family["base"])
    solved_elements = sum(o * i for _, o, i in shapes)
    scratch = args.cache_dir / "scratch"
    out = scratch / "out"
    print(
        f"model: hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, "
        f"T = {args.experts} experts, {len(shapes)} solved modules ({solved_elements / 1e6:.1f} M weights), "
        f"bfloat16 checkpoints; torch threads {torch.get_num_threads()}",
        flush=True,
    )

    io_config = {**recipe(family), "merge_method": "bench_io_floor"}
    merge(io_config, out)  # warm the page cache and mergekit's loaders
    io = Phase("mergekit I/O floor (kernel returns W_pre)")
    gemm = Phase("GEMM floor of one cached trial (bare products)")

    uncached = Phase("uncached merge (direct route)")
    for index in range(args.uncached_repeats):
        uncached.run(lambda index=index: merge(recipe(family, **{"lambda": 0.1 + 0.05 * index}), out))
        print(f"uncached merge {uncached.times[-1]:.2f} s", flush=True)

    rows = []
    precisions = args.precisions.split(",")
    for precision in precisions:
        cache = scratch / f"cache-{precision}"
        shutil.rmtree(cache, ignore_errors=True)
        build = Phase(f"first trial with cache ({precision}: fills it)")
        cached_config = recipe(family, cache=str(cache), cache_dtype=precision)
        build.run(lambda config=cached_config: merge(config, out))
        print(f"{precision}: first trial {build.best:.2f} s", flush=True)
        cached = Phase(f"cached trial ({precision} factors)")
        ratios = []
        # Interleaved, so that each cached trial has a GEMM floor measured under the same load.
        for index in range(args.repeats):
            trial = copy.deepcopy(cached_config)
            trial["parameters"].update({"lambda": 10 ** (-3 + index % 5), "scale": 0.8 + 0.1 * index})
            io.run(lambda: merge(io_config, out))
            floor = gemm.run(lambda: gemm_floor(shapes, 1))
            ratios.append(cached.run(lambda config=trial: merge(config, out)) / floor)
        rows.append((precision, build, cached, directory_bytes(cache), statistics.median(ratios)))
        print(f"{precision}: cached trial {cached.best:.2f} s, GEMM floor {gemm.best:.2f} s", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    errors = accuracy(family, shapes, precisions, scratch / "accuracy")

    print()
    print(
        f"search trial cost: {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, "
        f"T = {args.experts}, torch threads {torch.get_num_threads()}, OMP_WAIT_POLICY="
        f"{os.environ['OMP_WAIT_POLICY']} (seconds: min and median of runs)"
    )
    header = f"{'phase':<48} {'runs':>4} {'min s':>8} {'median s':>9} {'RSS MiB':>8} {'private MiB':>12}"
    print(header)
    print("-" * len(header))
    for phase in [uncached, *(p for row in rows for p in row[1:3]), gemm, io]:
        times = f"{phase.best:>8.2f} {phase.median:>9.2f}"
        memory = f"{phase.peak_rss:>8.0f} {phase.peak_private:>12.0f}" if phase is not gemm else ""
        print(f"{phase.name:<48} {len(phase.times):>4} {times} {memory}")
    print()
    header = (
        f"{'factors':<8} {'cached/uncached':>15} {'cached/GEMM':>12} {'paired':>7} {'(cached-I/O)/GEMM':>18} "
        f"{'cache GB':>9} {'bytes/weight':>13} {'err vs f64':>11} {'err vs direct':>14}"
    )
    print(header)
    print("-" * len(header))
    print(f"{'direct':<8} {'':>95} {errors['direct'][0]:>11.1e}")
    for precision, _, cached, size, paired in rows:
        ratios = f"{cached.best / uncached.best:>15.3f} {cached.best / gemm.best:>12.2f} {paired:>7.2f}"
        above_io = (cached.best - io.best) / gemm.best
        disk = f"{size / 1e9:>9.2f} {size / solved_elements:>13.2f}"
        error = f"{errors[precision][0]:>11.1e} {errors[precision][1]:>14.1e}"
        print(f"{precision:<8} {ratios} {above_io:>18.2f} {disk} {error}")
    print(
        "\ncached/GEMM: min over min; paired: median of (cached trial / GEMM floor measured just before it)."
        "\nerrors: worst ‖W − W_ref‖ / ‖W_ref − W_pre‖ over layer 0's modules at λ = 0.1 (float32 compute),"
        "\nW_ref = a float64 direct solve (err vs f64) or the float32 direct route (err vs direct)."
    )


if __name__ == "__main__":
    sys.exit(main())
