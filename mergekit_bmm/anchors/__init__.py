"""Anchor merges on one weight matrix, in pure torch (no mergekit import).

Each function takes the task vectors ``τ_t = W_t − W_pre`` of one tensor, as ``(out, in)``
matrices, and returns the merged task vector (without the output scale ``α``, which the
mergekit adapters in :mod:`mergekit_bmm.methods` apply). Computation happens in the
inputs' dtype promoted to at least float32, on the inputs' device.

* :func:`tsv_merge` — Task Singular Vectors (TSV-M, Gargiulo et al. 2025);
* :func:`iso_c_merge`, :func:`iso_cts_merge` — isotropic merging (Marczak et al. 2025);
* :func:`wudi_merge` — WUDI-Merging (Cheng et al. 2025), Adam or exact closed form;
* :func:`regmean_merge` — RegMean (Jin et al. 2023) from per-task activation Grams;
* :func:`ace_merge` — ACE-Merging (Xu et al. 2026), covariances estimated from the task vectors.
"""

from mergekit_bmm.anchors.ace import ace_merge
from mergekit_bmm.anchors.common import mean_task_vector
from mergekit_bmm.anchors.iso import iso_c_merge, iso_cts_merge, iso_cts_split
from mergekit_bmm.anchors.regmean import regmean_merge, shrink_off_diagonal
from mergekit_bmm.anchors.tsv import tsv_factors, tsv_merge
from mergekit_bmm.anchors.wudi import wudi_closed_form, wudi_equations, wudi_loss, wudi_merge

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
