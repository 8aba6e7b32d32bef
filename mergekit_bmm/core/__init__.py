"""The mathematics of every merge, in pure torch (no mergekit import).

BMM's normal equations (:mod:`~mergekit_bmm.core.normal_equations`, with task balance) and
their solve (:mod:`~mergekit_bmm.core.closed_form`), the tensor naming of
:mod:`~mergekit_bmm.core.module_map`, and the other merges, each a function of one
weight's task vectors ``τ_t = W_t − W_pre`` as ``(out, in)`` matrices returning the merged
task vector (without the output scale ``α``, which the mergekit methods in
:mod:`mergekit_bmm.merge_methods` apply); computed in the inputs' dtype promoted to at least
float32, on the inputs' device:

* :func:`tsv_merge` — Task Singular Vectors (TSV-M, Gargiulo et al. 2025);
* :func:`iso_c_merge`, :func:`iso_cts_merge` — isotropic merging (Marczak et al. 2025);
* :func:`wudi_merge` — WUDI-Merging (Cheng et al. 2025), Adam or exact closed form;
* :func:`regmean_merge` — RegMean (Jin et al. 2023) from per-task activation Grams;
* :func:`ace_merge` — ACE-Merging (Xu et al. 2026), covariances estimated from the task vectors.
"""

from mergekit_bmm.core.ace import ace_merge
from mergekit_bmm.core.iso import iso_c_merge, iso_cts_merge, iso_cts_split
from mergekit_bmm.core.merge_tools import mean_task_vector
from mergekit_bmm.core.regmean import regmean_merge, shrink_off_diagonal
from mergekit_bmm.core.tsv import tsv_factors, tsv_merge
from mergekit_bmm.core.wudi import wudi_closed_form, wudi_equations, wudi_loss, wudi_merge

__all__ = [
    "ace_merge",
    "iso_c_merge",
    "iso_cts_merge",
    "iso_cts_split",
    "mean_task_vector",
    "regmean_merge",
    "shrink_off_diagonal",
    "tsv_factors",
    "tsv_merge",
    "wudi_closed_form",
    "wudi_equations",
    "wudi_loss",
    "wudi_merge",
]
