"""How one mean Gram is stored in a statistics part file (format version 2), and read back.

A Gram ``G = Σ x xᵀ / n`` is symmetric and, when the calibration data has fewer tokens
than the module has inputs, of rank at most ``n``. Each is stored in the smaller of two
forms, both exact to float32:

* ``packed``: the upper triangle, row by row, float32 (``d(d+1)/2`` numbers, half the full
  matrix). The values are those of the full float32 matrix, bit for bit.
* ``tokens``: the ``n × d`` float32 activation rows themselves (chosen when ``n < (d+1)/2``);
  the reader forms ``XᵀX / n`` in float64 and rounds once to float32, which is what the
  collector's float64 accumulation gives (within float32's rounding).

The form, ``d`` and ``n`` of every Gram are in the file's safetensors metadata; the reader
checks shape and dtype against them from the header before any tensor is loaded, so a
file made elsewhere (a Hub download) cannot make it allocate more than it declares.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mergekit_bmm.errors import StatisticsError
from mergekit_bmm.io.atomic import replacing

PACKED = "packed"
TOKENS = "tokens"
FORMS = (PACKED, TOKENS)
METADATA_KEY = "mergekit_bmm_grams"
STORED_DTYPE = "F32"


def tokens_are_smaller(tokens: int, d_in: int) -> bool:
    """Whether ``tokens × d_in`` activation rows take less room than the packed triangle."""
    return 2 * tokens < d_in + 1


def packed_size(d_in: int) -> int:
    return d_in * (d_in + 1) // 2


def pack(gram: torch.Tensor) -> torch.Tensor:
    """The upper triangle of a square matrix, row by row, as one contiguous vector."""
    return torch.cat([gram[row, row:] for row in range(gram.shape[0])]).contiguous()


_MIRROR_BLOCK = 512


def unpack(packed: torch.Tensor, d_in: int) -> torch.Tensor:
    """The symmetric matrix a packed upper triangle stands for (bit for bit)."""
    gram = packed.new_empty((d_in, d_in))
    for row, values in enumerate(torch.split(packed, list(range(d_in, 0, -1)))):
        gram[row, row:] = values
    # the lower triangle mirrored block by block: a whole-matrix transpose walks memory with a
    # stride of d_in and took most of a large Gram's reading time
    for top in range(0, d_in, _MIRROR_BLOCK):
        rows = slice(top, top + _MIRROR_BLOCK)
        upper = gram[rows, rows].triu()
        gram[rows, rows] = upper + upper.T.tril(-1)
        for left in range(top + _MIRROR_BLOCK, d_in, _MIRROR_BLOCK):
            gram[left : left + _MIRROR_BLOCK, rows] = gram[rows, left : left + _MIRROR_BLOCK].T
    return gram


@dataclass(frozen=True)
class StoredGram:
    """One Gram as written: its form, input size and token count, and the tensor."""

    form: str
    d_in: int
    tokens: int
    tensor: torch.Tensor

    def describe(self) -> list:
        return [self.form, self.d_in, self.tokens]


def from_mean(mean: torch.Tensor, tokens: int) -> StoredGram:
    """A mean Gram, stored packed (float32)."""
    mean = mean.to(torch.float32).cpu()
    return StoredGram(PACKED, mean.shape[0], tokens, pack(mean))


def from_sum(total: torch.Tensor, tokens: int) -> StoredGram:
    """A float64 accumulator ``Σ x xᵀ`` over ``tokens`` tokens, stored packed (float32)."""
    return from_mean(total / tokens, tokens)


def from_rows(rows: torch.Tensor) -> StoredGram:
    """The activation rows themselves (float32): the Gram is ``rowsᵀ rows / n``."""
    rows = rows.to(torch.float32).cpu().contiguous()
    return StoredGram(TOKENS, rows.shape[1], rows.shape[0], rows)


def full_matrix(stored: StoredGram) -> torch.Tensor:
    """The float32 ``d × d`` mean Gram a stored one stands for."""
    if stored.form == PACKED:
        return unpack(stored.tensor, stored.d_in)
    rows = stored.tensor.to(torch.float64)
    return (rows.T @ rows / stored.tokens).to(torch.float32)


def write_part(path: Path, grams: Mapping[str, StoredGram]) -> None:
    """Atomically write one part file with each Gram's form in its metadata."""
    from safetensors.torch import save_file

    metadata = {METADATA_KEY: json.dumps({key: gram.describe() for key, gram in grams.items()})}
    with replacing(path) as temporary:
        save_file({key: gram.tensor for key, gram in grams.items()}, str(temporary), metadata=metadata)


def _expected_shape(form: str, d_in: int, tokens: int) -> tuple[int, ...]:
    return (packed_size(d_in),) if form == PACKED else (tokens, d_in)


def check_part_gram(path: Path, key: str, where: str) -> None:
    """Refuse, in one line, a part file whose header does not declare Gram ``key`` as readable."""
    _read(path, key, where, load=False)


def read_part_gram(path: Path, key: str, where: str) -> torch.Tensor:
    """Gram ``key`` of a part file as a full float32 matrix; refuses what the header does not vouch for.

    ``where`` names the statistics and task in the one-line refusal.
    """
    return _read(path, key, where, load=True)


@contextmanager
def statistics_file(path: Path, where: str = "") -> Iterator[Any]:
    """``safe_open`` on a statistics file; a missing or damaged file becomes one StatisticsError line."""
    from safetensors import safe_open

    prefix = f"{where}: " if where else ""
    try:
        with safe_open(str(path), framework="pt") as handle:
            yield handle
    except FileNotFoundError:
        raise StatisticsError(
            f"{prefix}statistics file {path} is missing; re-run mergekit-bmm-stats"
        ) from None
    except StatisticsError:
        raise
    except Exception as error:  # safetensors reports a damaged file with its own error type
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise StatisticsError(
            f"{prefix}statistics file {path} is unreadable ({first}); re-run mergekit-bmm-stats"
        ) from None


def _read(path: Path, key: str, where: str, load: bool) -> torch.Tensor | None:
    with statistics_file(path, where) as handle:
        declared = json.loads((handle.metadata() or {}).get(METADATA_KEY, "{}"))
        entry = declared.get(key)
        if key not in handle.keys() or not isinstance(entry, list) or len(entry) != 3:
            raise StatisticsError(f"{where}: {path.name} lacks the Gram {key}; re-run mergekit-bmm-stats")
        form, d_in, tokens = entry
        if form not in FORMS or not all(isinstance(v, int) and v > 0 for v in (d_in, tokens)):
            raise StatisticsError(
                f"{where}: {path.name} declares Gram {key} as {entry!r}, which this mergekit-bmm cannot "
                "read (forms: packed, tokens); re-run mergekit-bmm-stats"
            )
        piece = handle.get_slice(key)
        shape, dtype = tuple(piece.get_shape()), piece.get_dtype()
        if shape != _expected_shape(form, d_in, tokens) or dtype != STORED_DTYPE:
            raise StatisticsError(
                f"{where}: {path.name} holds Gram {key} as {dtype} {shape}, not the {form} float32 "
                f"form its header declares for {d_in} inputs; the file is damaged or not ours"
            )
        tensor = handle.get_tensor(key) if load else None
    return None if tensor is None else full_matrix(StoredGram(form, d_in, tokens, tensor))
