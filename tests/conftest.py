"""Shared fixtures: tiny models generated locally, and a float64 reference of BMM."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mergekit_bmm.plugin import activate

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Tests that call mergekit's Python API directly need the plugin's methods registered,
# also where the start-up hook is switched off.
activate()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from mergekit_bmm.examples.tiny_models import make_tiny_family

    return make_tiny_family(tmp_path_factory.mktemp("llama"), "llama", n_experts=3)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    from mergekit_bmm.examples.tiny_models import make_tiny_family

    return make_tiny_family(tmp_path_factory.mktemp("qwen2"), "qwen2", n_experts=3)


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory):
    from mergekit_bmm.examples.tiny_models import make_tiny_family

    return make_tiny_family(tmp_path_factory.mktemp("gpt2"), "gpt2", n_experts=2)


@pytest.fixture
def one_torch_thread():
    """For modules of tiny tensors: on a shared 2-core machine, thread hand-offs cost more than the math."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def one_thread_per_module():
    """Tiny merges and GP fits are latency-bound: one thread (torch and BLAS) for the whole module
    avoids oversubscribing a shared machine."""
    import skopt  # noqa: F401  (loads numpy's and scipy's BLAS, so the limit reaches them)
    from threadpoolctl import threadpool_limits

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with threadpool_limits(limits=1):
        yield
    torch.set_num_threads(threads)


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    denominator = expected.norm().item() or 1.0
    return (actual.double() - expected).norm().item() / denominator


def reference_solve(
    task_vectors: list[torch.Tensor],
    anchor: torch.Tensor,
    lam: float,
    grams: list[torch.Tensor] | None = None,
    relative: bool = True,
) -> torch.Tensor:
    """The BMM MAP in float64 straight from the paper's formula (λ' > 0)."""
    vectors = [u.double() for u in task_vectors]
    if grams is None:
        grams = [u.T @ u for u in vectors]
    grams = [g.double() for g in grams]
    gram = sum(grams)
    cross = sum(u @ g for u, g in zip(vectors, grams))
    d_in = gram.shape[0]
    ridge = lam * gram.trace().item() / d_in if relative else lam
    system = gram + ridge * torch.eye(d_in, dtype=torch.float64)
    return torch.linalg.solve(system, (cross + ridge * anchor.double()).T).T


@pytest.fixture(autouse=True)
def fresh_eigendecompositions():
    """Each test starts without the eigendecompositions an earlier one left in this process."""
    from mergekit_bmm.merge_methods.factor_cache import fill as factor_fill

    factor_fill._RECENT.clear()
    yield
