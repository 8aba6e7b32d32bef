"""``mergekit-bmm-search``: Bayesian optimisation of BMM's per-block λ and s (paper Section 4.2).

config (search.yml) → space (blocks × groups) → strategies (skopt GP-EI, random, grid) →
trial (YAML recipe, merged by mergekit) → evaluation → log (trials.jsonl, resumable) →
report / plots (summary.json, best.yml, convergence.png, lambdas.png).
"""

from mergekit_bmm.search.config import SearchConfig, load_search_config, parse_search_config
from mergekit_bmm.search.loop import SearchOptions, SearchResult, run_search

__all__ = [
    "SearchConfig",
    "SearchOptions",
    "SearchResult",
    "load_search_config",
    "parse_search_config",
    "run_search",
]
