"""diffusers UNets: their ``ResnetBlock2D``s' and output's GroupNorm-then-SiLU pairs through
``flaggems::group_norm_silu``, their ``GEGLU``s through ``flaggems::gelu_mul``, their plain ``Attention``s inline."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling
from torch import nn

from .. import ops
from ._base import PatchedForward
from .forms import _folded_source

#: diffusers' ResNet blocks of the pre-norm form: GroupNorm, SiLU, conv, twice (checked against their source).
RESNETS = frozenset({"ResnetBlock2D"})
#: What a ResnetBlock2D's ``forward`` must say (whitespace folded) for the patched forward to be equivalent.
_RESNET_SOURCE_HAS = (
    "hidden_states = self.norm1(hidden_states) hidden_states = self.nonlinearity(hidden_states)",
    "input_tensor = self.upsample(input_tensor) hidden_states = self.upsample(hidden_states)",
    "input_tensor = self.downsample(input_tensor) hidden_states = self.downsample(hidden_states)",
    "hidden_states = self.conv1(hidden_states)", "temb = self.nonlinearity(temb)",
    "temb = self.time_emb_proj(temb)[:, :, None, None]", "hidden_states = hidden_states + temb",
    "hidden_states = self.norm2(hidden_states)", "time_scale, time_shift = torch.chunk(temb, 2, dim=1)",
    "hidden_states = hidden_states * (1 + time_scale) + time_shift",
    "hidden_states = self.nonlinearity(hidden_states) hidden_states = self.dropout(hidden_states) "
    "hidden_states = self.conv2(hidden_states)",
    "input_tensor = self.conv_shortcut(input_tensor)",
    "output_tensor = (input_tensor + hidden_states) / self.output_scale_factor",
)
#: ``time_embedding_norm`` of the blocks: both norms fused, or (scale and shift between) the first only.
_RESNET_FUSED = {"default": "group_norm_silu (resnet block)",
                 "scale_shift": "group_norm_silu (resnet block, norm1 only: scale_shift)"}
#: diffusers' GEGLU, the feed-forward of its transformer blocks: one projection, ``hidden * gelu(gate)`` of its halves.
GEGLUS = frozenset({"GEGLU"})
_GEGLU_SOURCE_HAS = ("hidden_states = self.proj(hidden_states)",
                     "hidden_states, gate = hidden_states.chunk(2, dim=-1)", "return hidden_states * self.gelu(gate)")
#: diffusers' attention modules, served by their processor: the plain form (``AttnProcessor2_0``, no norms, no
#: residual inside) is called inline, without the division by ``rescale_output_factor == 1.0``.
DIFFUSERS_ATTENTIONS = frozenset({"Attention"})
_SDPA_PROCESSOR = "AttnProcessor2_0"
#: What the processor's ``__call__`` must say (whitespace folded) for the inline forward to be equivalent.
_SDPA_PROCESSOR_SOURCE_HAS = (
    "query = attn.to_q(hidden_states)", "if encoder_hidden_states is None: encoder_hidden_states = hidden_states",
    "key = attn.to_k(encoder_hidden_states) value = attn.to_v(encoder_hidden_states)",
    "inner_dim = key.shape[-1] head_dim = inner_dim // attn.heads",
    "query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)",
    "hidden_states = F.scaled_dot_product_attention( query, key, value, attn_mask=attention_mask, dropout_p=0.0, "
    "is_causal=False )",
    "hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim) "
    "hidden_states = hidden_states.to(query.dtype)",
    "hidden_states = attn.to_out[0](hidden_states)", "hidden_states = attn.to_out[1](hidden_states)",
    "hidden_states = hidden_states / attn.rescale_output_factor",
)
#: What ``Attention.forward`` must say: the keyword arguments filtered, then the processor called.
_ATTENTION_SOURCE_HAS = "return self.processor( self, hidden_states, encoder_hidden_states=encoder_hidden_states, " \
                        "attention_mask=attention_mask, **cross_attention_kwargs, )"
#: Attributes whose steps the inline form leaves out: each must be ``None`` (or false).
_ATTENTION_ABSENT = ("spatial_norm", "group_norm", "norm_q", "norm_k", "norm_cross", "residual_connection")
#: diffusers UNets whose ``forward`` ends in ``conv_norm_out`` then ``conv_act`` (then ``conv_out``).
UNETS = frozenset({"UNet2DConditionModel", "UNet2DModel"})
_UNET_SOURCE_HAS = "sample = self.conv_norm_out(sample) sample = self.conv_act(sample)"


def _silu_after_group_norm(norm: Any, act: Any) -> str | None:
    """Why ``norm`` then ``act`` is not a GroupNorm followed by SiLU (``None`` when it is)."""
    if not isinstance(norm, nn.GroupNorm):
        return f"{type(norm).__name__} is not an nn.GroupNorm"
    if not isinstance(act, nn.SiLU):
        return f"activation {type(act).__name__} is not SiLU"
    return None


def _resnet_reason(block: nn.Module) -> str | None:
    for name in ("norm1", "norm2"):
        reason = _silu_after_group_norm(getattr(block, name, None), getattr(block, "nonlinearity", None))
        if reason is not None:
            return f"{name}: {reason}"
    if getattr(block, "time_embedding_norm", None) not in _RESNET_FUSED:
        return f"time_embedding_norm {getattr(block, 'time_embedding_norm', None)!r} is not one flaggems knows"
    source = _folded_source(type(block))
    if source is None:
        return "its forward's source is not available to check"
    missing = [text for text in _RESNET_SOURCE_HAS if text not in source]
    return f"its forward is not the form flaggems knows (lacks {missing[0]!r})" if missing else None


def _group_norm_silu(norm: nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
    """``silu(norm(x))`` in one ``flaggems::group_norm_silu`` call."""
    return _GROUP_NORM_SILU(x, norm.num_groups, norm.weight, norm.bias, norm.eps)


class _GroupNormSiluForward(PatchedForward):
    """A GroupNorm whose following SiLU it computes too (the UNet's ``conv_norm_out``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _group_norm_silu(self.module, x)


def _resnet_forward(block: nn.Module) -> Callable[..., torch.Tensor]:
    """``ResnetBlock2D.forward`` with its GroupNorm-then-SiLU pairs fused (the same steps otherwise)."""
    return _ResnetForward(block).forward


class _ResnetForward(PatchedForward):
    """A diffusers ``ResnetBlock2D`` with ``flaggems::group_norm_silu`` for its norm-then-SiLU pairs."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__(block)
        self.both = block.time_embedding_norm == "default"

    def forward(self, input_tensor: torch.Tensor, temb: torch.Tensor | None, *args: Any,
                **kwargs: Any) -> torch.Tensor:
        block = self.module
        if args or kwargs.get("scale") is not None:  # the deprecated ``scale``: the class's forward warns about it
            return type(block).forward(block, input_tensor, temb, *args, **kwargs)
        hidden = _group_norm_silu(block.norm1, input_tensor)
        if block.upsample is not None:
            if hidden.shape[0] >= 64:  # as diffusers: its nearest upsampling fails on large channels_last batches
                input_tensor, hidden = input_tensor.contiguous(), hidden.contiguous()
            input_tensor, hidden = block.upsample(input_tensor), block.upsample(hidden)
        elif block.downsample is not None:
            input_tensor, hidden = block.downsample(input_tensor), block.downsample(hidden)
        hidden = block.conv1(hidden)
        if block.time_emb_proj is not None:
            temb = block.time_emb_proj(temb if block.skip_time_act else block.nonlinearity(temb))[:, :, None, None]
        if self.both:
            hidden = _group_norm_silu(block.norm2, hidden if temb is None else hidden + temb)
        else:
            if temb is None:
                raise ValueError(" `temb` should not be None when `time_embedding_norm` is scale_shift")
            scale, shift = torch.chunk(temb, 2, dim=1)
            hidden = block.nonlinearity(block.norm2(hidden) * (1 + scale) + shift)
        hidden = block.conv2(block.dropout(hidden))
        if block.conv_shortcut is not None:
            input_tensor = block.conv_shortcut(input_tensor.contiguous() if block.training else input_tensor)
        output = input_tensor + hidden
        # x / 1.0 is x bit for bit (and its gradient the identity): SD's blocks skip a kernel and a backward node
        return output if block.output_scale_factor == 1.0 else output / block.output_scale_factor


def _geglu_reason(module: nn.Module) -> str | None:
    proj = getattr(module, "proj", None)
    if not isinstance(proj, nn.Linear) or proj.out_features % 2:
        return "proj is not an nn.Linear of an even output size"
    source, gelu = _folded_source(type(module)), _folded_source(type(module), "gelu")
    if source is None or gelu is None:
        return "its source is not available to check"
    missing = [text for text in _GEGLU_SOURCE_HAS if text not in source]
    if missing or not gelu.endswith("return F.gelu(gate)"):
        return f"its forward is not the form flaggems knows (lacks {(missing or ['return F.gelu(gate)'])[0]!r})"
    return None  # a vendor's path for it (Ascend's NPU GEGLU) is the vendor's PatchRule


def _geglu_forward(module: nn.Module) -> Callable[..., torch.Tensor]:
    """``GEGLU.forward``: the projection, then ``gelu(gate) * hidden`` of its halves in one ``gelu_mul`` call."""
    return _GegluForward(module).forward


class _GegluForward(PatchedForward):
    """diffusers' ``GEGLU`` with ``flaggems::gelu_mul`` reading its projection's halves in place."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self.op = ops.overload("gelu_mul")

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        module = self.module
        if args or kwargs.get("scale") is not None:  # the deprecated ``scale``: the class's forward warns about it
            return type(module).forward(module, hidden_states, *args, **kwargs)
        hidden, gate = module.proj(hidden_states).chunk(2, dim=-1)
        return self.op(gate, hidden)


def _attention_reason(attention: nn.Module) -> str | None:
    processor = getattr(attention, "processor", None)
    if type(processor).__name__ != _SDPA_PROCESSOR:
        return f"processor {type(processor).__name__} is not {_SDPA_PROCESSOR}"
    present = [name for name in _ATTENTION_ABSENT if getattr(attention, name, None)]
    if present:
        return f"its {present[0]} is set (the inline form has no such step)"
    to_out = getattr(attention, "to_out", None)
    if not isinstance(to_out, nn.ModuleList) or len(to_out) != 2:
        return "to_out is not a projection and a dropout"
    source, call = _folded_source(type(attention)), _folded_source(type(processor), "__call__")
    if source is None or call is None:
        return "its source is not available to check"
    missing = [text for text in _SDPA_PROCESSOR_SOURCE_HAS if text not in call]
    if missing or _ATTENTION_SOURCE_HAS not in source:
        return f"its forward is not the form flaggems knows (lacks {(missing or [_ATTENTION_SOURCE_HAS])[0]!r})"
    return None


def _attention_forward(attention: nn.Module) -> Callable[..., torch.Tensor]:
    """``Attention.forward`` with an ``AttnProcessor2_0``, inline: the same calls, less the division by a
    ``rescale_output_factor`` of 1.0 and the per-call ``inspect.signature`` of the processor (19 µs on CPU)."""
    return _AttentionForward(attention).forward


class _AttentionForward(PatchedForward):
    """diffusers' plain ``Attention`` (``AttnProcessor2_0``), its processor's steps inline."""

    def __init__(self, attention: nn.Module) -> None:
        super().__init__(attention)
        self.processor_type = type(attention.processor)

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        attention = self.module
        if (kwargs or attention_mask is not None or hidden_states.ndim != 3
                or type(attention.processor) is not self.processor_type):  # another processor set since: its own
            return type(attention).forward(attention, hidden_states, encoder_hidden_states, attention_mask,
                                           **kwargs)
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        batch, heads = context.shape[0], attention.heads
        query, key, value = attention.to_q(hidden_states), attention.to_k(context), attention.to_v(context)
        head_dim = key.shape[-1] // heads
        query, key, value = (t.view(batch, -1, heads, head_dim).transpose(1, 2) for t in (query, key, value))
        hidden = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)
        hidden = hidden.transpose(1, 2).reshape(batch, -1, heads * head_dim).to(query.dtype)
        hidden = attention.to_out[1](attention.to_out[0](hidden))
        factor = attention.rescale_output_factor
        return hidden if factor == 1.0 else hidden / factor  # x / 1.0 is x bit for bit


def _unet_reason(unet: nn.Module) -> str | None:
    reason = _silu_after_group_norm(getattr(unet, "conv_norm_out", None), getattr(unet, "conv_act", None))
    if reason is not None:
        return f"conv_norm_out/conv_act: {reason}"
    source = _folded_source(type(unet))
    if source is None:
        return "its forward's source is not available to check"
    if _UNET_SOURCE_HAS not in source or source.count("self.conv_act(") != 1:
        return "its forward does not end in conv_norm_out then conv_act alone"
    return None


def _identity(x: torch.Tensor) -> torch.Tensor:
    """The forward of an activation whose work the norm before it does (``flaggems::group_norm_silu``)."""
    return x


_GROUP_NORM_SILU = ops.overload("group_norm_silu")


#: diffusers modules patched one instance at a time: class names -> (why not, the forward, its mark, report label).
_DIFFUSERS_KINDS: tuple[tuple[frozenset[str], Callable[[nn.Module], str | None],
                              Callable[[nn.Module], Callable[..., torch.Tensor]], str,
                              Callable[[nn.Module], str]], ...] = (
    (RESNETS, _resnet_reason, _resnet_forward, "resnet_block", lambda m: _RESNET_FUSED[m.time_embedding_norm]),
    (GEGLUS, _geglu_reason, _geglu_forward, "geglu", lambda m: "gelu_mul (geglu)"),
    (DIFFUSERS_ATTENTIONS, _attention_reason, _attention_forward, "attention", lambda m: "attention (inline sdpa)"),
)


def _diffusers_kind(module: nn.Module) -> tuple | None:
    """The row of :data:`_DIFFUSERS_KINDS` for a module of one of its classes (an ``Attention`` only from
    diffusers: other libraries name theirs so too), else ``None``."""
    cls = type(module)
    for names, *row in _DIFFUSERS_KINDS:
        if cls.__name__ in names and (names is not DIFFUSERS_ATTENTIONS or "diffusers" in cls.__module__):
            return tuple(row)
    return None
