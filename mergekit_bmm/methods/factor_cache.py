"""On-disk store of BMM's λ-independent factors: one safetensors file per tensor and key.

A search re-merges the same inputs with new λ and s. Everything except the last product
is the same in every trial, so the first merge of a tensor stores ``G = QΛQᵀ``, ``C Q``
and ``U0 Q`` (:class:`~mergekit_bmm.core.closed_form.EigenFactors`) and every later merge
reads them back and does one ``(out × in × in)`` product.

File layout: ``<cache>/<tensor name>.<digest>.safetensors`` where ``digest`` hashes a
*key*, a canonical JSON text describing everything the factors depend on (built by
:mod:`mergekit_bmm.methods.cache_key`). The full key is also stored in the file's
metadata and must match on reading, with a CRC-32 of every stored tensor: a stale,
truncated or corrupt file is ignored (with a log line) and rewritten, never used. (A process
checks an entry's CRCs the first time it reads it, and again only if the file changed.)

Writes go to a unique temporary file in the same directory and are renamed into place
(atomic on POSIX), so concurrent processes filling one cache at most do the same work
twice and a reader never sees half a file. Nothing is ever deleted: ``rm -r`` the
directory to reclaim space.

Precision: factors are stored in the compute dtype unless ``float16`` is asked for; then
each column of ``Q``, ``C Q`` and ``U0 Q`` is divided by its largest magnitude (kept in
float32) before rounding, so neither float16's range nor its subnormals bite. The
eigenvalues always stay in the compute dtype. Whoever stores factors solves from the
rounded copy that was stored, so a first (filling) merge and a later (reading) merge
give bit-identical results.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import zlib
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mergekit_bmm.core.closed_form import EigenFactors
from mergekit_bmm.io.atomic import replacing

LOG = logging.getLogger("mergekit_bmm")

CACHE_FORMAT = "mergekit-bmm-factors/1"
MATRICES = ("basis", "cross_basis", "anchor_basis")
SCALARS = ("mean_eigenvalue", "diagonal_max")
SCALE_SUFFIX = ".scale"
ANCHOR = "anchor"
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


# Entries whose checksums this process has verified, with the file's identity then. Cache
# files are only ever replaced (new inode), never rewritten in place, so a search that
# reads an entry once per trial checks its CRCs on the first read only.
_VERIFIED: dict[str, tuple[int, int, int, int]] = {}


class CorruptEntry(Exception):
    """A cache file that cannot be trusted; the message says why."""


def entry_path(directory: str | Path, tensor_name: str, key: str) -> Path:
    """Where the entry for ``tensor_name`` under ``key`` lives."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    readable = _SAFE_NAME.sub("_", tensor_name)[:160] or "tensor"
    return Path(directory) / f"{readable}.{digest}.safetensors"


def checksum(tensor: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes (runs at several GB/s; catches truncation and bit rot)."""
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return zlib.crc32(data.numpy())


def _encode(name: str, matrix: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    if dtype != torch.float16:
        return {name: matrix.to(dtype)}
    scale = matrix.abs().amax(dim=0)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(torch.float32)
    return {name: (matrix / scale.to(matrix.dtype)).to(torch.float16), name + SCALE_SUFFIX: scale}


def _factor_tensors(
    factors: EigenFactors, dtype: torch.dtype, compute: torch.dtype
) -> dict[str, torch.Tensor]:
    tensors = {"eigenvalues": factors.eigenvalues.to(compute)}
    for name in MATRICES:
        tensors.update(_encode(name, getattr(factors, name), dtype))
    return tensors


def _factors_from(
    tensors: dict[str, torch.Tensor], scalars: dict[str, float], compute: torch.dtype
) -> EigenFactors:
    matrices = {name: tensors[name] for name in MATRICES}
    if next(iter(matrices.values())).dtype != torch.float16:
        matrices = {name: matrix.to(compute) for name, matrix in matrices.items()}
    scales = {name.removesuffix("_basis") + "_scale": tensors.get(name + SCALE_SUFFIX) for name in MATRICES}
    return EigenFactors(eigenvalues=tensors["eigenvalues"].to(compute), **matrices, **scales, **scalars)


class FactorCache:
    """One cache directory; every method is safe to call from several processes at once."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)

    # -- factors of solved tensors ---------------------------------------------------
    def load_factors(
        self, tensor_name: str, key: str, shape: tuple[int, int], compute: torch.dtype
    ) -> EigenFactors | None:
        """The stored factors for ``key`` (None when absent, stale or corrupt)."""
        out_features, in_features = shape
        expected = {
            "basis": (in_features, in_features),
            "eigenvalues": (in_features,),
            "cross_basis": (out_features, in_features),
            "anchor_basis": (out_features, in_features),
        }
        read = self._read(entry_path(self.directory, tensor_name, key), key, expected)
        if read is None:
            return None
        tensors, metadata = read
        try:
            scalars = {name: float(metadata[name]) for name in SCALARS}
        except (KeyError, ValueError):
            return self._reject(entry_path(self.directory, tensor_name, key), "scalars are missing")
        return _factors_from(tensors, scalars, compute)

    def store_factors(
        self, tensor_name: str, key: str, factors: EigenFactors, dtype: torch.dtype, compute: torch.dtype
    ) -> EigenFactors:
        """Write ``factors`` rounded to ``dtype``; return exactly what a later read gives
        (in the ``compute`` dtype)."""
        tensors = _factor_tensors(factors, dtype, compute)
        scalars = {name: float(getattr(factors, name)) for name in SCALARS}
        stored = _factors_from(tensors, scalars, compute)
        metadata = {name: repr(value) for name, value in scalars.items()}
        metadata["precision"] = str(dtype)
        self._write(entry_path(self.directory, tensor_name, key), key, tensors, metadata)
        return stored

    # -- anchor results of tensors BMM does not solve --------------------------------
    def load_tensor(self, tensor_name: str, key: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        read = self._read(entry_path(self.directory, tensor_name, key), key, {ANCHOR: tuple(shape)})
        return None if read is None else read[0][ANCHOR]

    def store_tensor(self, tensor_name: str, key: str, tensor: torch.Tensor) -> None:
        self._write(entry_path(self.directory, tensor_name, key), key, {ANCHOR: tensor}, {})

    # -- files -----------------------------------------------------------------------
    def _read(
        self, path: Path, key: str, expected: dict[str, tuple[int, ...]]
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
        try:
            status = path.stat()
        except OSError:
            return None
        stamp = (status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns)
        verified = _VERIFIED.get(str(path)) == stamp
        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
                if metadata.get("format") != CACHE_FORMAT:
                    raise CorruptEntry(f"format {metadata.get('format')!r}, expected {CACHE_FORMAT!r}")
                if metadata.get("key") != key:
                    raise CorruptEntry("its key differs from this merge's")
                sums = json.loads(metadata.get("checksums", "{}"))
                names = set(handle.keys())
                if set(sums) != names or not set(expected) <= names:
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
            with replacing(path, fsync=False) as temporary:
                save_file(tensors, str(temporary), metadata=metadata)
        except (OSError, SafetensorError) as error:
            LOG.warning("bmm cache: could not write %s (%s); merging without caching it", path, error)
