"""Tensor name → (layer index, module group, storage layout): one source of truth.

The merge method, the search's YAML writer and the statistics collector all use this
map. Groups follow the paper: ``attn_in`` (q/k/v), ``attn_out``, ``mlp_in`` (gate/up,
fc1) and ``mlp_out`` (down, fc2).

Rules are *substrings*, checked in order, first match wins — exactly how mergekit
matches a ``filter:`` in a recipe. The search writes the same substrings, in the same
order, as ``filter:`` entries, so a tensor's λ in YAML is the λ of its group here.

GPT-2's ``Conv1D`` stores weights as (in, out); rules for it carry ``in_out`` and the
merge transposes before solving. The same names are ordinary ``nn.Linear`` (out, in)
in some other architectures (gpt_bigcode, starcoder2), so the layout is decided by the
checkpoint's ``model_type``; when that is unknown the layout is :data:`UNKNOWN_LAYOUT` and
the merge refuses the tensor instead of guessing.

Mixture-of-experts layers reach a method as 3-D stacks (``mlp.experts.gate_up_proj`` of
shape (E, out, in), as transformers 5 and mergekit 0.1.5 hold them) or, in older layouts,
as one 2-D weight per expert (``experts.3.w1.weight``). Both are classified here; a stack's
:attr:`ModuleInfo.experts` is True and each of its E slices is solved as its own weight.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum


class ModuleGroup(str, Enum):
    ATTN_IN = "attn_in"
    ATTN_OUT = "attn_out"
    MLP_IN = "mlp_in"
    MLP_OUT = "mlp_out"


GROUP_NAMES: tuple[str, ...] = tuple(group.value for group in ModuleGroup)


@dataclass(frozen=True)
class GroupRule:
    """A substring that puts a layer's 2D weight into a group (``None``: never solved)."""

    pattern: str
    group: ModuleGroup | None
    in_out: bool = False


_A_IN, _A_OUT, _M_IN, _M_OUT = (
    ModuleGroup.ATTN_IN,
    ModuleGroup.ATTN_OUT,
    ModuleGroup.MLP_IN,
    ModuleGroup.MLP_OUT,
)

# Order matters: specific patterns before the generic ones they contain.
RULES: tuple[GroupRule, ...] = (
    # Routers of mixture-of-experts layers are not linear maps of the residual stream
    # that the regression view covers; they keep the anchor.
    GroupRule("block_sparse_moe.gate.", None),
    GroupRule("mlp.gate.weight", None),
    GroupRule("shared_expert_gate", None),
    GroupRule("router", None),
    # Norm weights are not linear maps even where they are 2-D (Cohere's per-head q/k norms).
    GroupRule("norm.", None),
    GroupRule("Norm.", None),
    # attention output
    GroupRule("o_proj", _A_OUT),  # Llama, Mistral, Qwen, Gemma, Phi-3, ...
    GroupRule("self_attn.out_proj", _A_OUT),  # OPT, BART-style decoders
    GroupRule("attention.output.dense", _A_OUT),  # BERT, RoBERTa
    GroupRule("attn.c_proj", _A_OUT, in_out=True),  # GPT-2
    GroupRule("self_attention.dense", _A_OUT),  # Falcon
    GroupRule("attention.dense", _A_OUT),  # GPT-NeoX
    GroupRule("attention.wo", _A_OUT),  # InternLM2
    GroupRule("attention.out_proj", _A_OUT),  # EXAONE
    GroupRule("self_attn.dense", _A_OUT),  # Phi-1/2
    # attention input (q/k/v, fused or not)
    GroupRule("self_attn", _A_IN),
    GroupRule("attention.self", _A_IN),  # BERT
    GroupRule("attn.c_attn", _A_IN, in_out=True),  # GPT-2
    GroupRule("query_key_value", _A_IN),  # Falcon, GPT-NeoX
    GroupRule("attention.wqkv", _A_IN),  # InternLM2
    GroupRule("attn.attention", _A_IN),  # EXAONE
    # MLP output
    GroupRule("down_proj", _M_OUT),
    GroupRule("mlp.c_proj", _M_OUT, in_out=True),  # GPT-2
    GroupRule("dense_4h_to_h", _M_OUT),
    GroupRule("fc2", _M_OUT),
    GroupRule(".w2.", _M_OUT),  # Mixtral experts
    GroupRule("feed_forward.w2", _M_OUT),  # InternLM2
    GroupRule("output.dense", _M_OUT),  # BERT (attention.output.dense matched above)
    # MLP input
    GroupRule("mlp.c_fc", _M_IN, in_out=True),  # GPT-2
    GroupRule("mlp", _M_IN),  # gate/up, gate_up_proj, c_fc, ...
    GroupRule("block_sparse_moe", _M_IN),  # Mixtral w1/w3
    GroupRule("feed_forward", _M_IN),
    GroupRule("intermediate.dense", _M_IN),  # BERT
    GroupRule("dense_h_to_4h", _M_IN),
    GroupRule("fc1", _M_IN),
)

# Where Conv1D (in, out) storage is used, by checkpoint ``model_type``.
# (transformers 5's ``Conv1D`` users); every other architecture, gpt_bigcode and starcoder2
# among those that reuse GPT-2's names, stores nn.Linear (out, in).
IN_OUT_MODEL_TYPES = frozenset({"gpt2", "openai-gpt", "imagegpt", "decision_transformer", "clvp"})

_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)\.")


# Mixture-of-experts stacks stored (E, in, out) rather than transformers' default (E, out, in)
# (``use_experts_implementation(is_transposed=True)`` in transformers 5).
IN_OUT_EXPERT_MODEL_TYPES = frozenset({"gpt_oss", "aria", "openai_privacy_filter"})
# The projections of an expert stack: ``<prefix>.experts.<projection>`` with no ``.weight``.
_EXPERT_STACK = re.compile(r"\.experts\.(?:gate_up_proj|gate_proj|up_proj|down_proj|w1|w2|w3)$")


class UnknownLayout(Exception):
    """Raised where a weight's storage layout depends on an architecture nobody named."""


@dataclass(frozen=True)
class ModuleInfo:
    """Where a body weight sits and how it is stored.

    ``stored_in_out`` is None when the layout depends on the architecture and the
    architecture is unknown (GPT-2's names outside a known ``model_type``).
    """

    layer: int
    group: ModuleGroup
    pattern: str
    stored_in_out: bool | None
    experts: bool = False


def layer_index(name: str) -> int | None:
    """The transformer layer a tensor belongs to, or None for embeddings/heads/norms."""
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def layer_local_name(name: str) -> str | None:
    """The name from the layer stack on (``layers.3.mlp.up_proj.weight``); None outside layers.

    Checkpoints of one architecture may prefix the stack differently (``bert.``,
    ``transformer.``, ``model.``); this part is what they share.
    """
    match = _LAYER.search(name)
    if match is None:
        return None
    start = match.start() + (1 if name[match.start()] == "." else 0)
    return name[start:]


def matching_rule(name: str) -> GroupRule | None:
    """The first rule whose pattern occurs in ``name`` (mergekit's filter semantics)."""
    return next((rule for rule in RULES if rule.pattern in name), None)


def is_expert_stack(name: str) -> bool:
    """Whether ``name`` is a mixture-of-experts stack (``mlp.experts.down_proj``: one slice per expert)."""
    return bool(_EXPERT_STACK.search(name)) and layer_index(name) is not None


def classify(name: str, model_type: str | None = None, ndim: int = 2) -> ModuleInfo | None:
    """Map a weight name to its layer and group; None if BMM should not solve it.

    2-D ``*.weight`` tensors inside a numbered layer qualify, and 3-D expert stacks
    (``ndim=3``; their group is the one the same substring rules give). ``model_type``
    (from the checkpoint's config) settles the layout of GPT-2-style names and of expert
    stacks; where it is needed and unknown, ``stored_in_out`` is None.
    """
    if ndim == 3:
        if not is_expert_stack(name):
            return None
        rule = matching_rule(name)
        if rule is None or rule.group is None:
            return None
        layout = None if model_type is None else model_type in IN_OUT_EXPERT_MODEL_TYPES
        return ModuleInfo(layer_index(name), rule.group, rule.pattern, layout, experts=True)
    if ndim != 2 or not name.endswith(".weight"):
        return None
    layer = layer_index(name)
    if layer is None:
        return None
    rule = matching_rule(name)
    if rule is None or rule.group is None:
        return None
    return ModuleInfo(layer, rule.group, rule.pattern, _stored_in_out(rule, model_type))


def _stored_in_out(rule: GroupRule, model_type: str | None) -> bool | None:
    if not rule.in_out:
        return False
    if model_type in IN_OUT_MODEL_TYPES:
        return True
    if model_type is None:
        return None
    # Every other architecture that reuses GPT-2's names (gpt_bigcode, starcoder2, ...) has nn.Linear.
    return False


def filter_rules(names: list[str] | tuple[str, ...]) -> list[GroupRule]:
    """The rules that decide the group of at least one of ``names``, in rule order.

    This is the ordered ``filter:`` list a recipe needs for one value per group; rules
    that match none of the model's weights are left out to keep recipes short.
    """
    used = set()
    for name in names:  # an expert stack (no ``.weight``) has the group its substrings give
        info = classify(name, ndim=3 if is_expert_stack(name) else 2)
        if info is not None:
            used.add(info.pattern)
    return [rule for rule in RULES if rule.pattern in used]


def outside_groups(shapes: Mapping[str, Sequence[int]], model_type: str | None = None) -> list[str]:
    """The 2-D weights no module group covers (embeddings, a BERT pooler, a head): bmm does not
    solve them, they keep the anchor's value."""
    return [name for name, shape in shapes.items() if len(shape) == 2 and classify(name, model_type) is None]
