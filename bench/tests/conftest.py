"""The benchmark's tests: offline, with the plugin's methods registered and tiny models made locally."""

from __future__ import annotations

import os

import pytest

from mergekit_bmm.plugin import activate

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# The benchmark calls mergekit's Python API, which needs the plugin's methods registered
# also where the start-up hook is switched off.
activate()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from mergekit_bmm.examples.tiny_models import make_tiny_family

    return make_tiny_family(tmp_path_factory.mktemp("llama"), "llama", n_experts=3)
