"""Parts of one stored tensor that are solved as weights of their own.

Two kinds, one convention: the piece is named ``<tensor>[<label>]`` and :meth:`Piece.take` cuts it
out of the stored tensor (or of anything shaped like it: the anchor, a resident model's parameter).

* **An expert of a mixture-of-experts stack** (E, out, in): label ``e``, the slice along dim 0. Its
  per-expert statistics are stored under the same name (:mod:`mergekit_bmm.stats.expert_hooks`).
* **One logical weight of a fused one** (Phi-3's ``qkv_proj`` → q, k, v; ``gate_up_proj`` → gate, up;
  GPT-2's ``c_attn``; Falcon's and GPT-NeoX's interleaved ``query_key_value``): rows of the ``(out, in)``
  orientation. Under ``gram_sharing: weight`` each logical weight has its own data-free Gram whatever
  the layout stores it in, so a fused checkpoint merges exactly as its split twin (Llama's q_proj,
  k_proj, v_proj). The parts read one input, so their activation statistics are the whole weight's.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from mergekit.merge_methods.base import TensorEntry, TensorGroup

from mergekit_bmm.merge_methods.bmm_parameters import BMMSettings

_EXPERT = re.compile(r"\[(\d+)(?::\w+)?\]$")
Rows = slice | torch.Tensor  # rows of the (out, in) orientation: a range, or indices where parts interleave


@dataclass(frozen=True)
class Piece:
    """Where a piece sits in its stored tensor of ``shape``: an expert ``index`` of a stack and/or
    ``rows`` of one logical weight (``part``) in the (out, in) orientation."""

    count: int  # pieces of the whole tensor
    shape: tuple[int, ...]
    index: int | None = None
    part: str | None = None
    rows: Rows | None = None
    transposed: bool = False  # stored (in, out): rows of the solve are columns of the storage

    @property
    def label(self) -> str:
        """``3`` (an expert), ``q`` (a part of a fused weight), ``3:gate`` (a part of an expert)."""
        return ":".join(str(v) for v in (self.index, self.part) if v is not None)

    @property
    def is_view(self) -> bool:
        """Whether :meth:`take` returns a view that writes through to the tensor."""
        return self.rows is None or isinstance(self.rows, slice)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.index is not None:
            tensor = tensor[self.index]
        if self.rows is None:
            return tensor
        rows = self.rows if isinstance(self.rows, slice) else self.rows.to(tensor.device)
        return tensor[:, rows] if self.transposed else tensor[rows]

    def put(self, tensor: torch.Tensor, value: torch.Tensor) -> None:
        """Write ``value`` where :meth:`take` reads."""
        if self.is_view:
            self.take(tensor).copy_(value)
            return
        target = tensor if self.index is None else tensor[self.index]
        rows = self.rows.to(tensor.device)
        if self.transposed:
            target[:, rows] = value
        else:
            target[rows] = value

    def name(self, tensor_name: str) -> str:
        return f"{tensor_name}[{self.label}]"


def assemble(pieces: Sequence[tuple[Piece, torch.Tensor]]) -> torch.Tensor:
    """The stored tensor from all of its pieces."""
    first, value = pieces[0]
    whole = value.new_empty(first.shape)
    for piece, value in pieces:
        piece.put(whole, value)
    return whole


def piece_group(group: TensorGroup, piece: Piece) -> TensorGroup:
    """``group`` cut down to ``piece``, named ``tensor[label]``."""
    entries = tuple(TensorEntry(e.id, piece.take(e.tensor), e.is_base) for e in group.entries)
    return TensorGroup(entries, replace(group.metadata, name=piece.name(group.metadata.name or "")))


def pieces_of(
    shape: tuple[int, ...], parts: Sequence[tuple[str, Rows]] | None, experts: bool, transposed: bool
) -> list[Piece]:
    """Every piece of a stored tensor: each expert of a stack, each logical weight of a fused one
    (``parts``), or both: each logical weight of each expert."""
    indices = range(shape[0]) if experts else [None]
    named = parts or [(None, None)]
    count = len(indices) * len(named)
    return [
        Piece(count, tuple(shape), index, part, rows, transposed) for index in indices for part, rows in named
    ]


def expert_slice(group: TensorGroup, index: int) -> TensorGroup:
    """Expert ``index`` of a mixture-of-experts stack, as its own group (named ``stack[index]``)."""
    shape = tuple(group.base.tensor.shape)
    return piece_group(group, Piece(shape[0], shape, index=index))


def statistics_name(name: str) -> str:
    """The weight whose activation Grams a piece reads: an expert its own, a fused part its whole
    weight's or its expert's (the parts read one input)."""
    if not name.endswith("]"):
        return name
    expert = _EXPERT.search(name)
    whole = name.rsplit("[", 1)[0]
    return f"{whole}[{expert.group(1)}]" if expert else whole


def fused_parts(name: str, config: Any, rows: int) -> list[tuple[str, Rows]] | None:
    """The logical weights of the fused weight ``name`` (``rows`` outputs), or None when it is not
    fused or ``config`` does not account for its rows."""
    leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
    leaf = leaf.split("[", 1)[0]
    if leaf == "gate_up_proj" and rows % 2 == 0:
        return _contiguous((("gate", rows // 2), ("up", rows // 2)), rows)
    if config is None:
        return None
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if not heads or not hidden:
        return None
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    if leaf == "qkv_proj":
        kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
        return _contiguous((("q", heads * head_dim), ("k", kv), ("v", kv)), rows)
    per_head = getattr(config, "model_type", "") == "gpt_bigcode" and not getattr(config, "multi_query", True)
    if leaf == "c_attn" and per_head:  # GPT-BigCode without multi-query: per head, q, k, v
        return _interleaved(config, heads, head_dim, rows)
    if leaf == "c_attn" and (rows - hidden) % 2 == 0:  # GPT-2 (3 equal parts), GPT-BigCode multi-query
        kv = (rows - hidden) // 2
        return _contiguous((("q", hidden), ("k", kv), ("v", kv)), rows)
    if leaf == "query_key_value":
        return _interleaved(config, heads, head_dim, rows)
    return None


def _contiguous(sizes: Sequence[tuple[str, int]], rows: int) -> list[tuple[str, Rows]] | None:
    if sum(size for _, size in sizes) != rows:
        return None
    parts, start = [], 0
    for label, size in sizes:
        parts.append((label, slice(start, start + size)))
        start += size
    return parts


def _interleaved(config: Any, heads: int, head_dim: int, rows: int) -> list[tuple[str, Rows]] | None:
    """Falcon's ``query_key_value``: per key/value group, its query heads then one key and one value
    head (new decoder architecture), or q heads then one k and v (multi-query); GPT-NeoX and the rest:
    per head, q, k, v."""
    if getattr(config, "new_decoder_architecture", False):
        groups = getattr(config, "num_kv_heads", None) or heads
        per_group = heads // groups + 2
        if groups * per_group * head_dim != rows:
            return None
        layout = torch.arange(rows).view(groups, per_group, head_dim)
        parts = (("q", layout[:, :-2]), ("k", layout[:, -2]), ("v", layout[:, -1]))
    elif getattr(config, "multi_query", False):
        return _contiguous((("q", heads * head_dim), ("k", head_dim), ("v", head_dim)), rows)
    else:
        if 3 * heads * head_dim != rows:
            return None
        layout = torch.arange(rows).view(heads, 3, head_dim)
        parts = (("q", layout[:, 0]), ("k", layout[:, 1]), ("v", layout[:, 2]))
    return [(label, index.reshape(-1)) for label, index in parts]


def unreached(stats: str, name: str, models: Sequence[Hashable]) -> bool:
    """Whether ``name`` is a mixture-of-experts expert (a stack's slice, or a checkpoint's per-expert
    weight) that no calibration token of any task was routed to: it has no data to be solved with."""
    from mergekit_bmm.stats.store import activation_tokens_for, load_manifest

    name = statistics_name(name)
    key = load_manifest(stats).stored_key(name)
    if key is None or not key.endswith("]"):
        return False
    return sum(activation_tokens_for(stats, models, name)) == 0


def no_routed_token(settings: BMMSettings, name: str, tasks: Sequence[TensorEntry]) -> bool:
    """A data-assisted solve of a mixture-of-experts expert that no calibration token reached
    (it keeps the anchor: a zero Gram has nothing to solve with)."""
    return settings.gram != "data_free" and unreached(settings.stats, name, [t.id for t in tasks])
