"""transformers decoders' attention blocks: the rotary embedding and the ``DynamicCache`` append as one
``flaggems::rotary_cache_append`` call.

A Llama-form attention's forward rotates ``q`` and ``k`` (one call, patched
already), then its cache's ``update`` runs Python (the cache, then its
layer) and two ``torch.cat``. :class:`_AttentionBlockForward` does those in
one fused call where the cache is exactly transformers' ``DynamicCache`` with
plain ``DynamicLayer`` layers that already hold keys, stores the grown
tensors in the layer as ``update`` does, and calls the projections, the norms
(Qwen3's ``q_norm``/``k_norm``), the attention function and ``o_proj`` as the
module does. Every other call (no cache, a static, sliding-window, quantized or
offloaded cache, a layer's first call, ``torch.compile`` tracing, positional
extras) runs the class's own ``forward``.

Forms are recognised by code: the class's ``forward`` reads as one of the
reference attentions of the installed transformers (:data:`_REFERENCES`),
annotations and comments aside.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import ops
from ._base import PatchedForward
from .forms import _code_form


@dataclass(frozen=True)
class AttentionForm:
    """What distinguishes a reference attention's forward from Llama's.

    Attributes:
        qk_norm: ``q``/``k`` pass ``q_norm``/``k_norm`` over ``[B, S, H, D]`` before the transpose (Qwen3).
        sliding_window: how the attention function gets ``sliding_window``: ``""`` not at all,
            ``"module"`` ``self.sliding_window`` (Qwen2, Qwen3), ``"config"`` the config's (Mistral).
        cache_arg: the forward's cache parameter (``cache`` in transformers 5.2x, ``past_key_values`` before).
    """

    qk_norm: bool = False
    sliding_window: str = ""
    cache_arg: str = "cache"


#: Reference attentions, by modeling module: (module, class, qk_norm, sliding_window).
_REFERENCES = (
    ("transformers.models.llama.modeling_llama", "LlamaAttention", False, ""),
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2Attention", False, "module"),
    ("transformers.models.qwen3.modeling_qwen3", "Qwen3Attention", True, "module"),
    ("transformers.models.mistral.modeling_mistral", "MistralAttention", False, "config"),
)


def _forward_form(cls: type) -> str | None:
    try:
        return _code_form(inspect.getsource(cls.forward), cls.__name__)
    except Exception:  # noqa: BLE001 - a forward whose source cannot be read has no form (never patched)
        return None


def _cache_arg(cls: type) -> str | None:
    names = list(inspect.signature(cls.forward).parameters)
    return next((name for name in ("cache", "past_key_values") if name in names), None)


@functools.cache
def _reference_forms() -> dict[str, AttentionForm]:
    """Forward form -> :class:`AttentionForm` of the installed transformers' reference attentions."""
    found: dict[str, AttentionForm] = {}
    for module_name, class_name, qk_norm, sliding in _REFERENCES:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        form, cache_arg = _forward_form(cls), _cache_arg(cls)
        if form is not None and cache_arg is not None:
            found.setdefault(form, AttentionForm(qk_norm, sliding, cache_arg))
    return found


def attention_form(attention: nn.Module) -> AttentionForm | None:
    """The form of an attention module whose forward reads as a reference attention's, else ``None``."""
    if "transformers" not in sys.modules:
        return None
    form = _forward_form(type(attention))
    return None if form is None else _reference_forms().get(form)


def attention_reason(attention: nn.Module) -> str | None:
    """Why an attention's block is not fused (``None`` when it is): its form, its modeling module's names."""
    form = attention_form(attention)
    if form is None:
        return "rotary embedding patched alone: its forward reads as no attention form flaggems knows"
    module = sys.modules.get(type(attention).__module__)
    if not all(hasattr(module, name) for name in ("ALL_ATTENTION_FUNCTIONS", "eager_attention_forward")):
        return "its modeling module has no ALL_ATTENTION_FUNCTIONS / eager_attention_forward"
    needed = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "layer_idx", "config", "scaling",
              "attention_dropout")
    if form.qk_norm:
        needed += ("q_norm", "k_norm")
    missing = [name for name in needed if not hasattr(attention, name)]
    return f"no attribute {', '.join(missing)}" if missing else None


@functools.cache
def _dynamic_classes() -> tuple[type, type, Any] | None:
    try:
        from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
    except ImportError:
        return None
    return DynamicCache, DynamicLayer, Cache.update


def _dynamic_layer(cache: Any, index: int) -> Any:
    """The cache's layer ``index`` where the fused append is what ``cache.update`` would do, else ``None``."""
    classes = _dynamic_classes()
    if classes is None or type(cache) is not classes[0] or type(cache).update is not classes[2]:
        return None
    if getattr(cache, "offloading", False) or index >= len(cache.layers):
        return None
    layer = cache.layers[index]
    if type(layer) is not classes[1] or not getattr(layer, "is_initialized", False) or layer.keys.dim() != 4:
        return None
    return layer


class _AttentionBlockForward(PatchedForward):
    """A reference-form attention with its rotary embedding and ``DynamicCache`` append in one call."""

    def __init__(self, module: nn.Module, form: AttentionForm) -> None:
        super().__init__(module)
        self.op = ops.overload("rotary_cache_append")
        self.form = form
        self.modeling = type(module).__module__  # a name, not the registry: a deep copy sees later registrations

    def _interface(self) -> Any:
        modeling = sys.modules[self.modeling]
        functions, eager = modeling.ALL_ATTENTION_FUNCTIONS, modeling.eager_attention_forward
        implementation = self.module.config._attn_implementation
        if hasattr(functions, "get_interface"):
            return functions.get_interface(implementation, eager)
        return eager if implementation == "eager" else functions[implementation]

    def _window(self) -> dict[str, Any]:
        if self.form.sliding_window == "module":
            return {"sliding_window": self.module.sliding_window}
        if self.form.sliding_window == "config":
            return {"sliding_window": getattr(self.module.config, "sliding_window", None)}
        return {}

    def forward(self, hidden_states: torch.Tensor, position_embeddings: Any = None, attention_mask: Any = None,
                *args: Any, **kwargs: Any) -> Any:
        m = self.module
        cache = kwargs.get(self.form.cache_arg)
        layer = None if args or position_embeddings is None or torch.compiler.is_compiling() else (
            _dynamic_layer(cache, m.layer_idx))
        if layer is None:
            return type(m).forward(m, hidden_states, position_embeddings, attention_mask, *args, **kwargs)
        del kwargs[self.form.cache_arg]
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, m.head_dim)
        q = m.q_proj(hidden_states).view(hidden_shape)
        if self.form.qk_norm:
            q = m.q_norm(q)
        k = m.k_proj(hidden_states).view(hidden_shape)
        if self.form.qk_norm:
            k = m.k_norm(k)
        v = m.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, layer.keys, layer.values = self.op(q.transpose(1, 2), k.transpose(1, 2), v, cos, sin, layer.keys,
                                              layer.values, 1)
        output, weights = self._interface()(m, q, layer.keys, layer.values, attention_mask,
                                            dropout=0.0 if not m.training else m.attention_dropout,
                                            scaling=m.scaling, **self._window(), **kwargs)
        return m.o_proj(output.reshape(*input_shape, -1).contiguous()), weights


def attention_forward(module: nn.Module) -> Any:
    """The fused forward of a recognised attention (:func:`attention_reason` found nothing against it)."""
    return _AttentionBlockForward(module, attention_form(module)).forward
