"""transformers decoders: their RMSNorms, gated MLPs and decoder layers through fused operators, and their
modeling modules' ``apply_rotary_pos_emb`` through ``flaggems::rotary_embedding``."""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling
from torch import nn

from .. import fused_linear, ops
from ._base import _FUNCTIONS, PatchedForward
from .forms import NormKind, _folded_source, _function_form, _recognised

#: Attention classes whose modeling module's ``apply_rotary_pos_emb`` is the rotate-half form.
ATTENTIONS = frozenset({"LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention",
                        "GemmaAttention"})
#: What a layer's ``forward`` must say (and not say) for the fused residual form to be equivalent.
_LAYER_SOURCE_HAS = ("residual = hidden_states", "self.input_layernorm(hidden_states)", "self.self_attn(",
                     "hidden_states = residual + hidden_states", "self.post_attention_layernorm(hidden_states)",
                     "self.mlp(hidden_states)", "return hidden_states")
_LAYER_SOURCE_LACKS = ("outputs", "feedforward_layernorm", "dropout")
#: MLP forms: their ``nn.Linear`` attributes and their activation's attribute.
_MLP_LAYOUTS = {"mlp": (("gate_proj", "up_proj", "down_proj"), "act_fn"),
                "gate_up_mlp": (("gate_up_proj", "down_proj"), "activation_fn")}
#: The norms of a layer of Gemma 2's sandwich form (a norm before and after the attention and the MLP each).
_SANDWICH_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                   "post_feedforward_layernorm")


class _NormForward(PatchedForward):
    """An RMSNorm through ``flaggems::rms_norm`` with its family's rounding."""

    def __init__(self, module: nn.Module, kind: NormKind) -> None:
        super().__init__(module)
        self.op = ops.overload("rms_norm")
        self.kind, self.eps = kind, kind.eps(module)
        self.offset, self.cast_first = kind.weight_offset, kind.cast_first

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self.kind.serves(hidden_states):
            return type(self.module).forward(self.module, hidden_states)
        return self.op(hidden_states, self.module.weight, self.eps, self.offset, self.cast_first)


def _norm_forward(module: nn.Module, kind: NormKind) -> Callable[[torch.Tensor], torch.Tensor]:
    return _NormForward(module, kind).forward


def _norm_kind(module: nn.Module) -> NormKind | None:
    recognised = _recognised(module) if isinstance(module, nn.Module) else None
    kind = recognised[1] if recognised is not None and recognised[0] == "norm" else None
    if kind is None or not hasattr(module, kind.eps_attr):
        return None
    weight = getattr(module, "weight", None)
    if isinstance(module, nn.RMSNorm):  # over the last dimension only (the fused op's); affine or not
        return kind if len(module.normalized_shape) == 1 and (weight is None or weight.dim() == 1) else None
    return kind if isinstance(weight, torch.Tensor) and weight.dim() == 1 else None


#: The fused op of each activation :func:`_activation` names.
_GLU_OPS = {"silu": "silu_mul", "gelu_tanh": "gelu_tanh_mul", "gelu": "gelu_mul"}


def _activation(module: nn.Module, attr: str = "act_fn") -> str | None:
    """``"silu"``, ``"gelu_tanh"`` or ``"gelu"`` (exact) for the activation modules transformers builds, else
    ``None``."""
    act = getattr(module, attr, None)
    name = type(act).__name__
    if isinstance(act, nn.SiLU) or name in ("SiLUActivation", "SiLU"):
        return "silu"
    if name in ("PytorchGELUTanh", "GELUTanh") or (isinstance(act, nn.GELU) and act.approximate == "tanh"):
        return "gelu_tanh"
    if (isinstance(act, nn.GELU) and act.approximate == "none") or (
            name == "GELUActivation" and getattr(act, "act", None) is F.gelu):  # not its python-formula variant
        return "gelu"
    return None


def _mlp_reason(module: nn.Module, form: str = "mlp") -> str | None:
    linears, act = _MLP_LAYOUTS[form]
    for name in linears:
        if not isinstance(getattr(module, name, None), nn.Linear):
            return f"no nn.Linear {name}"
    if _activation(module, act) is None:
        return f"activation {type(getattr(module, act, None)).__name__} is not SiLU or GELU (exact or tanh)"
    return None


class _MlpForward(PatchedForward):
    """A gated MLP, ``down(act(gate(x)) * up(x))``, with the activation and the product in one fused call."""

    def __init__(self, module: nn.Module, form: str) -> None:
        super().__init__(module)
        self.op = ops.overload(_GLU_OPS[_activation(module, _MLP_LAYOUTS[form][1])])
        self.gate_up: fused_linear.FusedLinear | None = None  # gate and up as one GEMM (patch sets it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        module = self.module
        if self.gate_up is not None and self.gate_up.serves():
            gate, up = self.gate_up(x)
            return module.down_proj(self.op(gate, up))
        return module.down_proj(self.op(module.gate_proj(x), module.up_proj(x)))


class _GateUpMlpForward(_MlpForward):
    """Phi-3's MLP: ``up * act(gate)`` of one projection's halves."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.module.gate_up_proj(x).chunk(2, dim=-1)
        return self.module.down_proj(self.op(gate, up))


def _mlp_forward(module: nn.Module, form: str = "mlp") -> Callable[[torch.Tensor], torch.Tensor]:
    return (_GateUpMlpForward if form == "gate_up_mlp" else _MlpForward)(module, form).forward


def _forwarded(layer: nn.Module) -> list[str]:
    """``p=p`` for each parameter of the layer's ``forward`` but ``hidden_states`` and ``**kwargs``: what its
    source must pass on to the attention for a patched forward passing ``**kwargs`` to be the same."""
    return [f"{p}={p}" for p in inspect.signature(type(layer).forward).parameters
            if p not in ("self", "hidden_states", "kwargs")]


def _layer_reason(layer: nn.Module) -> str | None:
    for name in ("input_layernorm", "post_attention_layernorm"):
        if _norm_kind(getattr(layer, name, None)) is None:
            return f"{name} is not an RMSNorm flaggems knows"
    try:
        source = inspect.getsource(type(layer).forward)
    except (OSError, TypeError):
        return "its forward's source is not available to check"
    missing = [text for text in (*_LAYER_SOURCE_HAS, *_forwarded(layer)) if text not in source]
    extra = [text for text in _LAYER_SOURCE_LACKS if text in source]
    if missing or extra:
        return f"its forward is not the pre-norm residual form ({'lacks ' + repr(missing[0]) if missing else ''}" \
               f"{'has ' + repr(extra[0]) if extra and not missing else ''})"
    return None


def _sandwich_reason(layer: nn.Module) -> str | None:
    """Why a layer of Gemma 2's form (recognised by its code) is not patched, or ``None``."""
    for name in _SANDWICH_NORMS:
        if _norm_kind(getattr(layer, name, None)) is None:
            return f"{name} is not an RMSNorm flaggems knows"
    source = _folded_source(type(layer))
    if source is None:
        return "its forward's source is not available to check"
    missing = [text for text in _forwarded(layer) if text not in source]
    return f"its forward does not pass {missing[0]!r} on to the attention" if missing else None


def _layer_forward(layer: nn.Module, sandwich: bool = False) -> Callable[..., torch.Tensor]:
    """The layer with its residual add and the norm after it in one ``flaggems::add_rms_norm``: Llama's form
    (the post-attention norm), or Gemma 2's ``sandwich`` (the attention's and the MLP's outputs normed before
    each residual add; the pre-feedforward norm fused)."""
    return _LayerForward(layer, sandwich).forward


class _LayerForward(PatchedForward):
    """A pre-norm decoder layer whose residual add and the norm after it are one ``flaggems::add_rms_norm``."""

    def __init__(self, layer: nn.Module, sandwich: bool) -> None:
        super().__init__(layer)
        self.op, self.sandwich = ops.overload("add_rms_norm"), sandwich
        self.norm_name = "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm"
        self.kind = kind = _norm_kind(getattr(layer, self.norm_name))
        self.eps, self.offset, self.cast_first = kind.eps(getattr(layer, self.norm_name)), kind.weight_offset, \
            kind.cast_first

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        layer = self.module
        if args or not self.kind.serves(hidden_states):  # by position: the class's forward knows where they go
            return type(layer).forward(layer, hidden_states, *args, **kwargs)
        residual = hidden_states
        hidden_states, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden_states), **kwargs)
        if self.sandwich:
            hidden_states = layer.post_attention_layernorm(hidden_states)
        weight = getattr(layer, self.norm_name).weight
        hidden_states, residual = self.op(hidden_states, residual, weight, self.eps, self.offset, self.cast_first)
        hidden_states = layer.mlp(hidden_states)
        return residual + (layer.post_feedforward_layernorm(hidden_states) if self.sandwich else hidden_states)


_ROTARY_OP = ops.overload("rotary_embedding")


def _rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary_pos_emb`` of the patched modeling modules, through ``flaggems::rotary_embedding``."""
    return _ROTARY_OP(q, k, cos, sin, unsqueeze_dim, False)


def _rotary_form(module: Any) -> bool:
    """Whether a modeling module's ``apply_rotary_pos_emb`` and ``rotate_half`` read as Llama's."""
    try:
        llama = importlib.import_module("transformers.models.llama.modeling_llama")
    except ImportError:
        return False
    if module is llama:
        return True
    return all(_function_form(getattr(module, name, None)) is not None
               and _function_form(getattr(module, name, None)) == _function_form(getattr(llama, name, None))
               for name in ("apply_rotary_pos_emb", "rotate_half"))


def _rotary_reason(attention: nn.Module) -> str | None:
    module = sys.modules.get(type(attention).__module__)
    original = getattr(module, "apply_rotary_pos_emb", None)
    if original is None:
        return "its modeling module has no apply_rotary_pos_emb"
    if _FUNCTIONS.get((module.__name__, "apply_rotary_pos_emb")):
        return None
    function = original.forward if isinstance(original, nn.Module) else inspect.unwrap(original)
    signature = inspect.signature(function)
    if list(signature.parameters) != ["q", "k", "cos", "sin", "unsqueeze_dim"]:
        return f"apply_rotary_pos_emb{signature} is not (q, k, cos, sin, unsqueeze_dim)"
    if type(attention).__name__ not in ATTENTIONS and not _rotary_form(module):
        return "its modeling module's apply_rotary_pos_emb is not Llama's rotate-half form"
    return None


def _rotary_candidate(attention: nn.Module) -> bool:
    """An attention module whose rotary embedding :func:`patch` considers: named, or an ``...Attention``
    of a modeling module with an ``apply_rotary_pos_emb``."""
    name = type(attention).__name__
    module = sys.modules.get(type(attention).__module__)
    return name in ATTENTIONS or (name.endswith("Attention") and hasattr(module, "apply_rotary_pos_emb"))


#: Decoder layer forms: why one is not patched, its patched forward, the norm ``add_rms_norm`` takes over.
_LAYER_KINDS = {"layer": (_layer_reason, _layer_forward, "post_attention_layernorm"),
                "sandwich_layer": (_sandwich_reason, functools.partial(_layer_forward, sandwich=True),
                                   "pre_feedforward_layernorm")}
