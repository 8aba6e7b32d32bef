"""On-disk store of BMM's λ-independent factors: one file per solved tensor, one per distinct Gram.

A search re-merges the same inputs with new λ and s. Everything except the last product
is the same in every trial, so the first merge of a tensor stores the eigendecomposition
``G = QΛQᵀ``, the correction ``E Q = (C − U0 G) Q`` and the anchor ``U0``
(:class:`~mergekit_bmm.core.closed_form.EigenFactors`); every later merge reads them back
and does one ``(out × in × r)`` product.

File layout:

* ``<cache>/<tensor name>.<digest>.safetensors``: the tensor's correction and anchor (dense
  ``U0``, its coordinates ``U0·Q`` in a thin basis, or nothing: ``U0 = 0``, or an anchor every
  merge recomputes from the inputs it loads anyway, metadata ``anchor: inputs``), where
  ``digest`` hashes a *key*, a canonical JSON text describing everything the factors depend
  on (built by :mod:`mergekit_bmm.merge_methods.factor_cache.key`);
* ``<cache>/bases/<id>.<precision>.safetensors``: ``Q`` and ``Λ`` of one eigendecomposition;
  an entry names the basis it was formed in. Weights that read the same input with the same
  statistics (q/k/v, gate/up in the ``activations`` mode) have the same ``G`` and share one
  basis and one eigendecomposition (:mod:`~mergekit_bmm.merge_methods.factor_cache.fill`); a data-free or
  ``mix`` Gram contains the weight's own task vectors and is its own.

Every file stores its full key in its metadata, which must match on reading, with a CRC-32 of
every stored tensor: a stale, truncated or corrupt file is ignored (with a log line) and
rewritten, never used. (A process checks a file's CRCs the first time it reads it, and again
only if the file changed.)

Writes go to a unique temporary file in the same directory and are renamed into place
(atomic on POSIX), so concurrent processes filling one cache at most do the same work
twice and a reader never sees half a file. Nothing is ever deleted: ``rm -r`` the
directory to reclaim space.

Precision per factor (:mod:`~mergekit_bmm.merge_methods.factor_cache.precision`): int16 fixed point with a
float32 scale per column, or float32 (float16 or float64 when asked). Whoever stores factors solves from
the rounded copies that were stored, so a first (filling) merge and a later (reading) merge
give bit-identical results.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mergekit_bmm.core import fixed_point
from mergekit_bmm.core.closed_form import EigenFactors
from mergekit_bmm.core.evidence import EvidenceTerms
from mergekit_bmm.io.atomic import replacing
from mergekit_bmm.merge_methods.factor_cache.precision import encode

LOG = logging.getLogger("mergekit_bmm")

CACHE_FORMAT = "mergekit-bmm-factors/3"
# /3 adds entries whose anchor is recomputed from the merge's inputs (``anchor: inputs``); a /2 file
# reads as before, and a /3 file is rejected (and rewritten) by versions that know only /2, which
# would take its missing anchor for U0 = 0
READ_FORMATS = ("mergekit-bmm-factors/2", CACHE_FORMAT)
ANCHOR_FROM_INPUTS = "inputs"
BASIS_DIR = "bases"
SCALARS = ("mean_eigenvalue", "diagonal_max")
EVIDENCE_SCALARS = ("energy", "observations")  # with the tensor COLUMN_ENERGY: what λ auto needs
OPTIONAL_SCALARS = ("zero_floor",)  # EigenFactors.zero_floor, where the producer set one
COLUMN_ENERGY = "column_energy"
SCALE_SUFFIX = ".scale"
ANCHOR = "anchor"
ANCHOR_IN_BASIS = "anchor_in_basis"  # U0 = (this) @ Qᵀ: an anchor in a thin basis' span, out × r
ROWS = "rows"  # U = rows @ (the entry's k-row update): the LoRA data route's stacked B_t, float32
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")
_DTYPES = {str(dtype): dtype for dtype in (torch.int16, torch.float16, torch.float32, torch.float64)}
_SIXTEEN_BITS = (torch.int16, torch.float16)  # kept as stored; their column scales fold into the solve


# Entries whose checksums this process has verified, with the file's identity then. Cache
# files are only ever replaced (new inode), never rewritten in place, so a search that
# reads an entry once per trial checks its CRCs on the first read only.
_VERIFIED: dict[str, tuple[int, int, int, int]] = {}


class CorruptEntry(Exception):
    """A cache file that cannot be trusted; the message says why."""


def key_digest(key: str) -> str:
    """A key's digest, as file names use it."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def entry_path(directory: str | Path, tensor_name: str, key: str) -> Path:
    """Where the entry for ``tensor_name`` under ``key`` lives."""
    readable = _SAFE_NAME.sub("_", tensor_name)[:160] or "tensor"
    return Path(directory) / f"{readable}.{key_digest(key)}.safetensors"


def basis_path(directory: str | Path, basis_id: str, precision: torch.dtype) -> Path:
    """Where the basis ``basis_id`` lives, stored in ``precision``."""
    precision_name = str(precision).removeprefix("torch.")
    return Path(directory) / BASIS_DIR / f"{_SAFE_NAME.sub('_', basis_id)}.{precision_name}.safetensors"


def checksum(tensor: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes (runs at several GB/s; catches truncation and bit rot)."""
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return zlib.crc32(data.numpy())


def _stored(
    name: str, matrix: torch.Tensor, dtype: torch.dtype, blocks: bool = False
) -> dict[str, torch.Tensor]:
    stored, scale = encode(matrix, dtype, blocks)
    return {name: stored} if scale is None else {name: stored, name + SCALE_SUFFIX: scale}


def _in_compute(tensors: dict[str, torch.Tensor], name: str, compute: torch.dtype):
    """A stored matrix as the solve uses it: float16 stays (its scales are folded in later)."""
    matrix = tensors[name]
    scale = tensors.get(name + SCALE_SUFFIX)
    return (matrix if matrix.dtype in _SIXTEEN_BITS else matrix.to(compute)), scale


@dataclass(frozen=True)
class StoredBasis:
    """One eigendecomposition's ``Λ`` and ``Q`` as stored."""

    basis_id: str
    eigenvalues: torch.Tensor
    basis: torch.Tensor
    scale: torch.Tensor | None

    @property
    def precision(self) -> torch.dtype:
        return self.basis.dtype


def _factors(
    basis: StoredBasis, tensors: dict[str, torch.Tensor], scalars: dict[str, float], compute: torch.dtype
) -> EigenFactors:
    correction, correction_scale = _in_compute(tensors, "correction", compute)
    anchor, anchor_scale = _in_compute(tensors, ANCHOR, compute) if ANCHOR in tensors else (None, None)
    in_basis, in_basis_scale = (
        _in_compute(tensors, ANCHOR_IN_BASIS, compute) if ANCHOR_IN_BASIS in tensors else (None, None)
    )
    stored_basis = basis.basis if basis.basis.dtype in _SIXTEEN_BITS else basis.basis.to(compute)
    evidence = None
    if COLUMN_ENERGY in tensors and all(name in scalars for name in EVIDENCE_SCALARS):
        evidence = EvidenceTerms(
            eigenvalues=basis.eigenvalues.to(torch.float64),
            column_energy=tensors[COLUMN_ENERGY].to(torch.float64),
            energy=scalars["energy"],
            observations=scalars["observations"],
            rows=correction.shape[0],
            mean_eigenvalue=scalars["mean_eigenvalue"],
        )
    rows = tensors.get(ROWS)
    return EigenFactors(
        rows=None if rows is None else rows.to(compute),
        basis=stored_basis,
        eigenvalues=basis.eigenvalues.to(compute),
        correction=correction,
        anchor=anchor,
        mean_eigenvalue=scalars["mean_eigenvalue"],
        diagonal_max=scalars["diagonal_max"],
        zero_floor=scalars.get("zero_floor"),
        basis_scale=basis.scale,
        correction_scale=correction_scale,
        anchor_scale=anchor_scale,
        anchor_in_basis=in_basis,
        anchor_in_basis_scale=in_basis_scale,
        evidence=evidence,
    )


def with_recomputed_anchor(factors: EigenFactors, anchor: torch.Tensor, compute: torch.dtype) -> EigenFactors:
    """``factors`` with ``U0`` as the merge recomputed it (``out × in``, in ``compute``)."""
    expected = (factors.correction.shape[0], factors.d_in)
    if tuple(anchor.shape) != expected:
        raise ValueError(f"the recomputed anchor has shape {tuple(anchor.shape)}, expected {expected}")
    return replace(factors, anchor=anchor.to(compute), anchor_recomputed=True)


class FactorCache:
    """One cache directory; every method is safe to call from several processes at once."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)

    # -- bases: one per distinct Gram -------------------------------------------------
    def load_basis(
        self, basis_id: str, d_in: int, compute: torch.dtype, precision: torch.dtype
    ) -> StoredBasis | None:
        """The basis ``basis_id`` stored in ``precision`` (None when absent or unreadable)."""
        path = basis_path(self.directory, basis_id, precision)
        read = self._read(path, basis_id + str(precision), {})
        if read is None:
            return None
        tensors, _ = read
        basis, eigenvalues = tensors.get("basis"), tensors.get("eigenvalues")
        if basis is None or eigenvalues is None or basis.ndim != 2 or basis.shape[0] != d_in:
            return self._reject(path, "the basis has the wrong shape")
        if eigenvalues.shape != (basis.shape[1],) or basis.dtype != precision:
            return self._reject(path, "the eigenvalues do not match the basis")
        scale = tensors.get("basis" + SCALE_SUFFIX)
        blocks = (fixed_point.block_count(d_in), basis.shape[1])
        if scale is not None and scale.shape not in ((basis.shape[1],), blocks):
            return self._reject(path, "its scales do not match the basis")
        return StoredBasis(basis_id, eigenvalues.to(compute), basis, scale)

    def store_basis(
        self,
        basis_id: str,
        eigenvalues: torch.Tensor,
        basis: torch.Tensor,
        precision: torch.dtype,
        compute: torch.dtype,
    ) -> StoredBasis:
        """Write ``Q`` rounded to ``precision`` and ``Λ``; return what a later read gives."""
        path = basis_path(self.directory, basis_id, precision)
        # a basis in int16 gets a scale per block of rows (mergekit_bmm.core.fixed_point)
        tensors = {"eigenvalues": eigenvalues.to(compute), **_stored("basis", basis, precision, blocks=True)}
        self._write(path, basis_id + str(precision), tensors, {})
        return StoredBasis(
            basis_id, tensors["eigenvalues"], tensors["basis"], tensors.get("basis" + SCALE_SUFFIX)
        )

    # -- factors of solved tensors ---------------------------------------------------
    def load_factors(
        self,
        tensor_name: str,
        key: str,
        shape: tuple[int, int],
        compute: torch.dtype,
        anchor: Callable[[], torch.Tensor] | None = None,
    ) -> EigenFactors | None:
        """The stored factors for ``key`` (None when absent, stale or corrupt); ``anchor`` gives ``U0``
        (``out × in``) for an entry that does not store it (None then: the entry cannot be used)."""
        out_features, in_features = shape
        path = entry_path(self.directory, tensor_name, key)
        read = self._read(path, key, {ANCHOR: (out_features, in_features)}, required=("correction",))
        if read is None:
            return None
        tensors, metadata = read
        try:
            scalars = {name: float(metadata[name]) for name in SCALARS}
            optional = EVIDENCE_SCALARS + OPTIONAL_SCALARS
            scalars.update({name: float(metadata[name]) for name in optional if name in metadata})
            basis_id, precision = metadata["basis"], _DTYPES[metadata["basis_precision"]]
        except (KeyError, ValueError):
            return self._reject(path, "its metadata is incomplete")
        basis = self.load_basis(basis_id, in_features, compute, precision)
        correction = tensors.get("correction")
        if basis is None:
            return self._reject(path, "its basis file is missing or unreadable")
        if correction is None or tuple(correction.shape) != (out_features, basis.basis.shape[1]):
            return self._reject(path, "its correction does not match its basis")
        in_basis = tensors.get(ANCHOR_IN_BASIS)
        if in_basis is not None and (ANCHOR in tensors or in_basis.shape != correction.shape):
            return self._reject(path, "its anchor does not match its basis")
        column_energy = tensors.get(COLUMN_ENERGY)
        if column_energy is not None and tuple(column_energy.shape) != (basis.basis.shape[1],):
            return self._reject(path, "its evidence terms do not match its basis")
        factors = _factors(basis, tensors, scalars, compute)
        if metadata.get(ANCHOR) != ANCHOR_FROM_INPUTS:
            return factors
        if ANCHOR in tensors or in_basis is not None:
            return self._reject(path, "it stores an anchor it says the inputs give")
        if anchor is None:  # a caller that cannot recompute the anchor: filled again, in its layout
            return None
        return with_recomputed_anchor(factors, anchor(), compute)

    def store_factors(
        self,
        tensor_name: str,
        key: str,
        basis: StoredBasis,
        correction: torch.Tensor,
        anchor: torch.Tensor | None,
        precisions: dict[str, torch.dtype],
        scalars: dict[str, float],
        compute: torch.dtype,
        evidence: EvidenceTerms | None = None,
        rows: torch.Tensor | None = None,
        anchor_in_basis: torch.Tensor | None = None,
        anchor_from_inputs: torch.Tensor | None = None,
    ) -> EigenFactors:
        """Write the correction and the anchor (dense, or as ``anchor_in_basis`` coordinates, or
        neither for ``U0 = 0``) rounded to their ``precisions`` (and the evidence's terms, exact:
        O(r) numbers; ``rows`` in float32); return exactly what a later read gives (in ``compute``).
        ``anchor_from_inputs``: ``U0`` as every merge recomputes it, not stored (the entry says so)."""
        tensors = _stored("correction", correction, precisions["correction"])
        if anchor is not None:
            tensors.update(_stored(ANCHOR, anchor, precisions["anchor"]))
        elif anchor_in_basis is not None:
            tensors.update(_stored(ANCHOR_IN_BASIS, anchor_in_basis, precisions["anchor"]))
        if rows is not None:
            tensors[ROWS] = rows.to(torch.float32)
        scalars = dict(scalars)
        if evidence is not None:
            tensors[COLUMN_ENERGY] = evidence.column_energy.to(torch.float64)
            scalars.update(energy=evidence.energy, observations=evidence.observations)
        metadata = {name: repr(float(value)) for name, value in scalars.items()}
        metadata.update(basis=basis.basis_id, basis_precision=str(basis.precision))
        metadata["precision"] = json.dumps({name: str(dtype) for name, dtype in precisions.items()})
        if anchor_from_inputs is not None:
            metadata[ANCHOR] = ANCHOR_FROM_INPUTS
        self._write(entry_path(self.directory, tensor_name, key), key, tensors, metadata)
        factors = _factors(basis, tensors, scalars, compute)
        if anchor_from_inputs is None:
            return factors
        return with_recomputed_anchor(factors, anchor_from_inputs, compute)

    # -- anchor results of tensors BMM does not solve --------------------------------
    def load_tensor(self, tensor_name: str, key: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        read = self._read(entry_path(self.directory, tensor_name, key), key, {ANCHOR: tuple(shape)})
        return None if read is None else read[0][ANCHOR]

    def store_tensor(self, tensor_name: str, key: str, tensor: torch.Tensor) -> None:
        self._write(entry_path(self.directory, tensor_name, key), key, {ANCHOR: tensor}, {})

    # -- files -----------------------------------------------------------------------
    def _read(
        self,
        path: Path,
        key: str,
        expected: dict[str, tuple[int, ...]],
        required: tuple[str, ...] | None = None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
        """The file's tensors and metadata, checked: tensors in ``expected`` have those shapes when
        present, and those ``required`` (default: all of ``expected``) are there."""
        required = tuple(expected) if required is None else required
        try:
            status = path.stat()
        except OSError:
            return None
        stamp = (status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns)
        verified = _VERIFIED.get(str(path)) == stamp
        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
                if metadata.get("format") not in READ_FORMATS:
                    raise CorruptEntry(f"format {metadata.get('format')!r}, expected {CACHE_FORMAT!r}")
                if metadata.get("key") != key:
                    raise CorruptEntry("its key differs from this merge's")
                sums = json.loads(metadata.get("checksums", "{}"))
                names = set(handle.keys())
                if set(sums) != names or not set(required) <= names:
                    raise CorruptEntry("tensors are missing")
                tensors = {}
                for name in sorted(names):
                    tensor = handle.get_tensor(name)
                    want = expected.get(name)
                    if want is not None and tuple(tensor.shape) != tuple(want):
                        raise CorruptEntry(f"{name} has shape {tuple(tensor.shape)}, expected {want}")
                    if not verified and checksum(tensor) != sums[name]:
                        raise CorruptEntry(f"checksum of {name} does not match")
                    tensors[name] = tensor
        except CorruptEntry as error:
            return self._reject(path, str(error))
        except (SafetensorError, OSError, ValueError, RuntimeError) as error:
            reason = " ".join(str(error).split())[:200] or type(error).__name__
            return self._reject(path, f"unreadable: {reason}")
        _VERIFIED[str(path)] = stamp
        return tensors, metadata

    @staticmethod
    def _reject(path: Path, reason: str) -> None:
        LOG.warning("bmm cache: ignoring %s (%s); recomputing and rewriting it", path, reason)
        return None

    def _write(self, path: Path, key: str, tensors: dict[str, torch.Tensor], extra: dict[str, str]) -> None:
        tensors = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
        metadata = {
            "format": CACHE_FORMAT,
            "key": key,
            "checksums": json.dumps({name: checksum(t) for name, t in tensors.items()}, sort_keys=True),
            **extra,
        }
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with replacing(path, fsync=False) as temporary:
                save_file(tensors, str(temporary), metadata=metadata)
        except (OSError, SafetensorError) as error:
            LOG.warning("bmm cache: could not write %s (%s); merging without caching it", path, error)
