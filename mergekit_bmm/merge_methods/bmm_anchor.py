"""The anchor (prior mean) of a BMM merge, computed by another registered method.

``U0 = W_anchor - W_pre``. ``W_anchor`` comes from, in order of precedence:

1. an input marked ``anchor: true`` (a merge materialised once elsewhere);
2. ``anchor_method: pretrained`` — the base itself (U0 = 0);
3. any registered mergekit method, run on the same base and experts through its public
   ``__call__`` with its own parameters forwarded from the recipe
   (:func:`~mergekit_bmm.merge_methods.bmm_parameters.anchor_value`: ``anchor_<name>`` first, then
   ``<name>``; of BMM's own names only ``stats`` also reaches the anchor, so one
   statistics directory serves data-assisted BMM and a ``regmean`` anchor).

Random anchors (DARE, DELLA) draw from torch's global generator; the call is wrapped in
a generator seeded from the tensor name (crc32, stable across processes) and
``anchor_seed``, so every merge of a recipe — every search trial — sees the same anchor.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from mergekit.merge_methods.base import (
    BasePolicy,
    ParameterScope,
    TensorEntry,
    TensorGroup,
)

from mergekit_bmm.errors import ConfigError, TensorInputError
from mergekit_bmm.merge_methods.bmm_parameters import DEFAULT_ANCHOR, PRETRAINED_ANCHOR, anchor_value
from mergekit_bmm.merge_methods.pieces import Piece


def _model_label(entry_id: Any) -> str:
    return str(entry_id)


def resolve_anchor_method(anchor_method: str | None, anchor_entry: TensorEntry | None) -> str | None:
    """Name of the method to run, or None when a marked input is the anchor."""
    if anchor_entry is not None:
        if anchor_method not in (None,):
            raise ConfigError(
                f"bmm: both `anchor_method: {anchor_method}` and an input marked `anchor: true` "
                f"({_model_label(anchor_entry.id)}) were given; keep only one of them"
            )
        return None
    return anchor_method or DEFAULT_ANCHOR


def _forwarded(method, parameters: Mapping[str, Any], entries: Sequence[TensorEntry]) -> dict[str, Any]:
    """The anchor method's parameters from the recipe, in the shape its spec expects."""
    forwarded: dict[str, Any] = {}
    for spec in method.spec.parameters:
        value = anchor_value(parameters, spec.name)
        if value is None:
            continue
        if spec.scope == ParameterScope.SHARED:
            if isinstance(value, Mapping):
                values = {v for v in value.values() if v is not None}
                if len(values) != 1:
                    raise ConfigError(
                        f"bmm: anchor `{method.spec.name}` takes `{spec.name}` as one shared value; "
                        "give it under the recipe's `parameters:`, not per model"
                    )
                value = values.pop()
            forwarded[spec.name] = value
            continue
        # BMM declares per-model values for the experts only: a base value never exists.
        targets = [e for e in entries if not e.is_base]
        if not isinstance(value, Mapping):
            forwarded[spec.name] = {e.id: value for e in targets}
            continue
        missing = [e for e in targets if value.get(e.id) is None]
        if missing and len(missing) < len(targets):
            raise ConfigError(
                f"bmm: anchor `{method.spec.name}` needs `{spec.name}` for every expert; missing for "
                + ", ".join(_model_label(e.id) for e in missing)
            )
        if not missing:
            forwarded[spec.name] = {e.id: value[e.id] for e in targets}
    return forwarded


def _anchor_call(
    base: TensorEntry, tasks: Sequence[TensorEntry], method_name: str, parameters: Mapping[str, Any]
):
    """The anchor method, the inputs it takes, and its parameters from the recipe."""
    from mergekit.merge_methods import registry

    method = registry.get(method_name)
    takes_base = method.spec.contract.base in (BasePolicy.REQUIRED, BasePolicy.OPTIONAL)
    entries = (base, *tasks) if takes_base else tuple(tasks)
    if not takes_base:
        entries = tuple(TensorEntry(id=e.id, tensor=e.tensor, is_base=False) for e in entries)
    return method, entries, _forwarded(method, parameters, entries)


def _plain(value: Any) -> Any:
    """A JSON-ready copy of a parameter value (model ids become their names)."""
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


@dataclass(frozen=True)
class AnchorSource:
    """Where one output tensor's anchor ``W_anchor`` comes from.

    ``method_name`` is None when ``anchor_entry`` (an input marked ``anchor: true``) is the
    anchor; ``parameters`` are the recipe's, as mergekit resolved them for this tensor.
    """

    group: TensorGroup
    tasks: tuple[TensorEntry, ...]
    anchor_entry: TensorEntry | None
    method_name: str | None
    parameters: Mapping[str, Any]
    seed: int = 0

    @property
    def computed(self) -> bool:
        """Whether another method computes the anchor (rather than copying an input or the base)."""
        return bool(self.tasks) and self.anchor_entry is None and self.method_name != PRETRAINED_ANCHOR

    @property
    def recomputed_cheaply(self) -> bool:
        """Whether a merge gets ``W_anchor`` for at most a weighted sum of tensors it loads anyway (the
        base, a marked input, Task Arithmetic): the factor cache then stores no such anchor."""
        return not self.computed or self.span_coefficients() is not None

    def dependencies(self) -> dict[str, Any]:
        """Everything :meth:`weight` depends on besides the input tensors (for cache keys)."""
        if self.anchor_entry is not None:
            return {"input": str(self.anchor_entry.id)}
        if not self.computed:
            return {"method": PRETRAINED_ANCHOR}
        _, entries, forwarded = _anchor_call(self.group.base, self.tasks, self.method_name, self.parameters)
        return {
            "method": self.method_name,
            "inputs": [str(e.id) for e in entries],
            "parameters": _plain(forwarded),
            "seed": self.seed,
        }

    def span_coefficients(self) -> tuple[float, ...] | None:
        """``c`` with ``U0 = Σ_t c_t (W_t − W_pre)`` over the experts, when the anchor is such a sum
        (the base: all 0; mergekit's ``task_arithmetic``); None for any other anchor.

        The coefficients are mergekit's own: its method run on unit vectors (the base 0, expert t
        the t-th unit vector) with the recipe's parameters for this tensor, so its ``weight``,
        ``normalize`` and ``lambda`` keep their meaning. The LoRA route then forms the anchor from
        the adapters' factors (:class:`~mergekit_bmm.core.low_rank.SpanAnchor`).
        """
        if self.anchor_entry is not None:
            return None
        if not self.computed:
            return (0.0,) * len(self.tasks)
        method, _, forwarded = _anchor_call(self.group.base, self.tasks, self.method_name, self.parameters)
        if not _sums_task_vectors(method):
            return None
        units = torch.eye(len(self.tasks), dtype=torch.float64)  # Task Arithmetic takes the base first
        zero = torch.zeros(len(self.tasks), dtype=units.dtype)
        probes = (
            TensorEntry(id=self.group.base.id, tensor=zero, is_base=True),
            *(TensorEntry(id=task.id, tensor=unit, is_base=False) for task, unit in zip(self.tasks, units)),
        )
        probe = TensorGroup(entries=probes, metadata=self.group.metadata)
        return tuple(float(value) for value in self._run(method, probe, forwarded, torch.float64))

    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The anchor's full weight ``W_anchor`` for this tensor, in ``dtype``."""
        group = self.group
        if self.anchor_entry is not None:
            return self.anchor_entry.tensor.to(dtype)
        if not self.computed:
            return group.base.tensor.to(dtype)
        method, entries, forwarded = _anchor_call(group.base, self.tasks, self.method_name, self.parameters)
        sub_group = TensorGroup(entries=entries, metadata=group.metadata)
        device = group.base.tensor.device
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            name_seed = zlib.crc32((group.metadata.name or "").encode())
            _seed_generators((name_seed + 1_000_003 * self.seed) % (2**63), device)
            result = self._run(method, sub_group, forwarded, dtype)
        return result.to(dtype)

    def _run(self, method: Any, group: TensorGroup, forwarded: dict[str, Any], dtype: torch.dtype):
        """mergekit's ``method`` on ``group``; a parameter the recipe lacks is one line naming it."""
        try:
            (result,) = method((group,), parameters=forwarded, dtype=dtype)
        except TypeError as error:
            if "Missing required parameter" in str(error):
                missing = str(error).split("Missing required parameter", 1)[1].split(" for ")[0].strip()
                raise ConfigError(
                    f"bmm: anchor `{self.method_name}` needs parameter `{missing}` (tensor "
                    f"{group.metadata.name}); set it in the recipe, e.g. per model "
                    f"`parameters: {{{missing}: ...}}`"
                ) from None
            raise
        return result


def _sums_task_vectors(method: Any) -> bool:
    """Whether mergekit's ``method`` is a weighted sum of task vectors: Task Arithmetic, with no
    sparsification and no sign consensus (TIES, DARE and the rest are not linear in them)."""
    from mergekit.merge_methods.generalized_task_arithmetic import GeneralizedTaskArithmeticMerge

    return (
        isinstance(method, GeneralizedTaskArithmeticMerge)
        and method.consensus_method is None
        and method.sparsification_method is None
    )


def _seed_generators(seed: int, device: torch.device) -> None:
    """Seed the generators a method on ``device`` draws from: the CPU's and that GPU's.

    Same streams as ``torch.manual_seed(seed)``, which also queues a seed for every other backend
    (CUDA, XPU, MTIA), formatting a stack trace each time: 1.3 ms per tensor on a CPU merge.
    """
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)


def split_entries(group: TensorGroup, flags: Any) -> tuple[list[TensorEntry], TensorEntry | None]:
    """Experts, and the input marked ``anchor: true`` (at most one)."""
    tasks, anchors = [], []
    for entry in group.non_base:
        (anchors if flags and flags.get(entry.id) else tasks).append(entry)
    if len(anchors) > 1:
        raise TensorInputError(
            "bmm: more than one input is marked `anchor: true` ("
            + ", ".join(str(e.id) for e in anchors)
            + "); mark exactly one"
        )
    return tasks, (anchors[0] if anchors else None)


class StackAnchor:
    """A value computed on first use and kept: a tensor's anchor, shared by its pieces."""

    def __init__(self, compute: Callable[[], torch.Tensor]) -> None:
        self._compute = compute
        self._value: torch.Tensor | None = None

    def __call__(self) -> torch.Tensor:
        if self._value is None:
            self._value = self._compute()
        return self._value


@dataclass(frozen=True)
class PieceAnchor:
    """The anchor of one piece of a tensor (an expert of a stack, a part of a fused weight): the
    piece of the whole tensor's anchor (:mod:`~mergekit_bmm.merge_methods.pieces`).

    Has :class:`AnchorSource`'s interface over the piece's own inputs (``group``, ``tasks``,
    ``anchor_entry``), so the solve and the factor cache treat it as any weight; its cache key adds
    the expert's index (or the part's label) to the whole tensor's anchor.
    """

    stack: AnchorSource
    group: TensorGroup
    tasks: tuple[TensorEntry, ...]
    piece: Piece
    whole: StackAnchor

    @property
    def anchor_entry(self) -> TensorEntry | None:
        if self.stack.anchor_entry is None:
            return None
        return next(e for e in self.group.entries if e.id == self.stack.anchor_entry.id)

    @property
    def computed(self) -> bool:
        return self.stack.computed

    @property
    def seed(self) -> int:
        return self.stack.seed

    def dependencies(self) -> dict[str, Any]:
        piece = self.piece
        where = {"expert": piece.index, "part": piece.part}
        return {**self.stack.dependencies(), **{k: v for k, v in where.items() if v is not None}}

    def span_coefficients(self) -> tuple[float, ...] | None:
        """The whole tensor's: a piece of a sum of task vectors is that sum of the pieces."""
        return self.stack.span_coefficients()

    @property
    def recomputed_cheaply(self) -> bool:
        return self.stack.recomputed_cheaply

    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        return self.piece.take(self.whole()).to(dtype)
