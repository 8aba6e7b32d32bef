"""When ``bmm`` solves a weight from its LoRA experts' factors (:mod:`mergekit_bmm.core.low_rank`).

Every expert must be a plain LoRA adapter on the recipe's base (``model: BASE+ADAPTER``), the Grams
data-free (each weight's own, or pooled over the weights that read its input) and untouched by
``task_balance``, the weight an ``nn.Linear`` one (not GPT-2's Conv1D, not
a slice of an expert stack), and ``low_rank`` not switched off. Anything else takes the full route.
An anchor that is a sum of the adapters' updates (Task Arithmetic, the base) is formed from their
factors too: nothing on the route is computed from the dense copies mergekit made of the adapters.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from mergekit.merge_methods.base import TensorEntry, TensorGroup

from mergekit_bmm.core.finite import all_finite
from mergekit_bmm.core.low_rank import LowRankUpdate, SpanAnchor
from mergekit_bmm.errors import TensorInputError
from mergekit_bmm.io.lora_adapters import Adapter, adapter_for
from mergekit_bmm.io.model_folder import local_model_dir, weight_names_of
from mergekit_bmm.merge_methods.bmm_anchor import AnchorSource, PieceAnchor
from mergekit_bmm.merge_methods.bmm_parameters import BMMSettings
from mergekit_bmm.merge_methods.pieces import Piece


def lora_updates(
    settings: BMMSettings,
    group: TensorGroup,
    tasks: Sequence[TensorEntry],
    name: str,
    transpose: bool,
    piece: Piece | None = None,
    data_assisted: bool = False,
) -> list[LowRankUpdate] | None:
    """The experts' ``(s·B, A)`` for weight ``name`` ([] when no adapter touches it), or None when the
    route does not apply: the data-free low-rank route, or with ``data_assisted`` the route of
    ``gram: activations | mix`` (:mod:`mergekit_bmm.core.low_rank_data`). The factors are checked for
    NaN/Inf here, since the route reads them and not the dense copies mergekit made from them."""
    if not _applies(settings, data_assisted) or transpose:  # Conv1D layouts: full route
        return None
    whole = name
    if piece is not None:  # a fused weight's part: its rows of B (expert stacks: full route)
        if piece.index is not None or not isinstance(piece.rows, slice):
            return None
        whole = name.rsplit("[", 1)[0]
    elif "[" in name:
        return None
    return adapter_factors(group, tasks, name, whole, piece)


def _applies(settings: BMMSettings, data_assisted: bool) -> bool:
    """Data-free and mix: either Gram rule (pooled Grams read the siblings' factors,
    :func:`sibling_updates`); data-assisted: not ``lambda: auto`` (its evidence reads dense equations);
    both: plain task weights."""
    if not settings.low_rank or settings.task_balance != "none":
        return False
    if not data_assisted:
        return settings.gram == "data_free"
    return settings.gram in ("activations", "mix") and not settings.lambda_auto


def adapter_factors(
    group: TensorGroup,
    tasks: Sequence[TensorEntry],
    name: str,
    whole: str | None = None,
    piece: Piece | None = None,
) -> list[LowRankUpdate] | None:
    """Every expert's ``(s·B, A)`` for the weight ``whole`` (default ``name``), when the experts are
    plain adapters on the recipe's base ([] when none touches it; None otherwise)."""
    whole = whole or name
    adapters = plain_adapters(group, tasks)
    if adapters is None:
        return None
    updates = []
    for index, (entry, adapter) in enumerate(zip(tasks, adapters)):
        factors = adapter.update(whole)
        if factors is not None and piece is not None:
            factors = (factors[0][piece.rows], factors[1])
        if factors is not None:
            if not all(all_finite(f) for f in factors):
                raise TensorInputError(
                    f"the LoRA factors of {name} in adapter {entry.id.lora} contain NaN or Inf; repair "
                    "or re-train that adapter before merging"
                )
            updates.append(LowRankUpdate(*factors, expert=index))
    return updates


def sibling_updates(
    group: TensorGroup, tasks: Sequence[TensorEntry], siblings: Sequence[str]
) -> list[LowRankUpdate]:
    """Every expert's ``(s·B, A)`` for the other weights that read this weight's input (``gram_sharing:
    input``), each tagged with its expert; weights no adapter touches add nothing."""
    updates = []
    for sibling in siblings:
        updates += adapter_factors(group, tasks, sibling) or []
    return updates


def touched(group: TensorGroup, tasks: Sequence[TensorEntry], names: Sequence[str]) -> bool:
    """Whether any expert's adapter changes one of the weights ``names`` (read from the adapters'
    configs, no factor loaded)."""
    adapters = plain_adapters(group, tasks) or []
    return any(adapter.touches(name) for adapter in adapters for name in names)


def plain_adapters(group: TensorGroup, tasks: Sequence[TensorEntry]) -> list[Adapter] | None:
    """Each expert's adapter, when every expert is a plain LoRA adapter on the recipe's base whose
    modules are all weights of that base; else None (a dense expert, an adapter on another base, DoRA
    and the rest, or module names that do not line up with the checkpoint's: a weight the adapter
    changes must never be taken for one it leaves alone)."""
    base_model = getattr(group.base.id, "model", None)
    if base_model is None:
        return None
    adapters = []
    for entry in tasks:
        lora, model = getattr(entry.id, "lora", None), getattr(entry.id, "model", None)
        if lora is None or model is None or str(model) != str(base_model):
            return None
        adapter = adapter_for(local_model_dir(str(lora)))
        if adapter is None or not _names_line_up(adapter, str(base_model)):
            return None
        adapters.append(adapter)
    return adapters


def _names_line_up(adapter: Adapter, base_model: str) -> bool:
    return _modules_are_weights(str(adapter.folder), tuple(sorted(adapter.factors)), base_model)


@lru_cache(maxsize=64)
def _modules_are_weights(folder: str, modules: tuple[str, ...], base_model: str) -> bool:
    """Whether every module the adapter trains is a ``.weight`` of the base checkpoint (read once)."""
    names = set(weight_names_of(base_model))
    return all(f"{module}.weight" in names for module in modules)


def keeps_base(source: AnchorSource) -> bool:
    """Whether the anchor's value is the base itself because no expert's adapter touches the tensor
    and the anchor sums the adapters' updates (all zero here): norms, embeddings and modules outside
    the adapters' targets then keep the base without a pass over the dense copies."""
    name = source.group.metadata.name or ""
    adapters = plain_adapters(source.group, source.tasks) if source.tasks else None
    if adapters is None or any(adapter.touches(name) for adapter in adapters):
        return False
    return source.span_coefficients() is not None


def span_anchor(source: AnchorSource | PieceAnchor, shape: tuple[int, int]) -> SpanAnchor | None:
    """The anchor as a sum of the adapters' updates (Task Arithmetic of them, the base), formed
    from their factors; None when it is anything else (computed from the dense copies as before)."""
    coefficients = source.span_coefficients() if isinstance(source, AnchorSource) else None
    return None if coefficients is None else SpanAnchor(coefficients, shape)
