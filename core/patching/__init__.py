"""``flaggems.patch(model)``: a transformers decoder's layers (or a diffusers UNet's) through fused operators.

A Llama/Qwen/Mistral/Gemma decoder layer spells out in ~40 torch calls what
five fused operators (:mod:`flaggems.ops`) do in a handful, and a decode step
is mostly host time: fewer calls is what makes it faster. ``patch`` rebinds,
per module instance (never a class; parameters keep their identity, keys and values):

* every RMSNorm of a known family, and torch's own ``nn.RMSNorm`` over the
  last dimension: ``flaggems::rms_norm`` (its rounding);
* the decoder layer, where its ``forward`` is the known pre-norm residual
  form: the residual add and the post-attention norm become one
  ``flaggems::add_rms_norm``;
* the MLP with a SiLU, tanh-GELU or exact GELU activation:
  ``flaggems::silu_mul``, ``gelu_tanh_mul`` or ``gelu_mul`` between the
  projections;
* the attention's rotary embedding (the modeling module's
  ``apply_rotary_pos_emb``, shared by every model of that module while one
  is patched): ``flaggems::rotary_embedding`` for q and k in one call;
* q/k/v and gate/up projections: one GEMM each in inference over the modules' own parameters made views of
  one weight (:mod:`flaggems.fused_linear`; ``state_dict()`` unchanged, :func:`unpatch` splits it again).

and in a diffusers UNet (``UNet2DConditionModel`` and every model built of
its blocks):

* each ``ResnetBlock2D`` whose norms are ``nn.GroupNorm`` and whose
  nonlinearity is SiLU, where its ``forward`` is the known form: both
  GroupNorm-then-SiLU pairs become ``flaggems::group_norm_silu`` (with
  ``time_embedding_norm="scale_shift"`` the second norm is followed by the
  time scale and shift, so only the first pair is fused); the nonlinearity
  keeps serving the time embedding;
* the UNet's output ``conv_norm_out`` then ``conv_act`` (SiLU): one
  ``flaggems::group_norm_silu``, ``conv_act`` becoming the identity;
* each ``GEGLU`` (the feed-forward of its transformer blocks) of the known
  form: ``hidden * gelu(gate)`` of its projection's two halves becomes one
  ``flaggems::gelu_mul`` reading the halves in place (three calls forward,
  and their backward, become one each way). Not on an NPU, where diffusers
  itself calls ``torch_npu.npu_geglu``.

* each ``Attention`` served by ``AttnProcessor2_0`` with no norm, spatial
  norm or residual of its own (every attention of SD-1.5): the processor's
  steps inline, less its division by a ``rescale_output_factor`` of 1.0 (one
  kernel and one backward node a call) and ``Attention.forward``'s
  per-call ``inspect.signature``; a call with a mask, extra keyword
  arguments or 4-D states, or once another processor is set, takes the
  module's own ``forward``.

The attention blocks' GroupNorm is followed by a projection, not an
activation: nothing there to fuse with it.

Modules are recognised by class name (the tables below), or by form: a
class whose code reads as one of the reference classes of the installed
transformers (:data:`_REFERENCES`; Llama's ``apply_rotary_pos_emb`` for the
rotary embedding), annotations, docstrings, comments and its own name aside,
is that form (Mixtral, Phi-3's norms, Granite, DeepSeek-V3, Qwen2-MoE, OLMoE,
SmolLM3, Gemma 2/3 and a hundred more in transformers 5.x). In Gemma 2's
layer form (a norm before and after the attention and the MLP each) the
residual add and the pre-feedforward norm become one ``add_rms_norm``. Each is checked
by structure (attributes, the activation, the ``forward``'s source for the
layer); anything else is left alone and the report says why. The operators fall back to their torch
references wherever flaggems is disabled or declines (CPU, float64, an
unsupported layout), so a patched model runs everywhere; ``state_dict()``
keys and values are untouched, and :func:`unpatch` restores every
``forward`` and module function exactly. ``patch`` is idempotent.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .. import fused_linear
from ..patch_rules import Rules
from ..types import PatchRule
from . import attention
from ._base import (  # noqa: F401 - flaggems.patching's own names before the split
    _FUNCTIONS,
    _LOCK,
    MARK,
    UNDO,
    PatchedForward,
    _OpName,
    _replace_function,
    _restore_functions,
    _set_forward,
    _Undo,
    served_function,
)
from .decoders import (  # noqa: F401 - flaggems.patching's own names before the split
    _GLU_OPS,
    _LAYER_KINDS,
    _LAYER_SOURCE_HAS,
    _LAYER_SOURCE_LACKS,
    _MLP_LAYOUTS,
    _ROTARY_OP,
    _SANDWICH_NORMS,
    ATTENTIONS,
    _activation,
    _forwarded,
    _GateUpMlpForward,
    _layer_forward,
    _layer_reason,
    _LayerForward,
    _mlp_forward,
    _mlp_reason,
    _MlpForward,
    _norm_forward,
    _norm_kind,
    _NormForward,
    _rotary,
    _rotary_candidate,
    _rotary_form,
    _rotary_reason,
    _sandwich_reason,
)
from .diffusers import (  # noqa: F401 - flaggems.patching's own names before the split
    _ATTENTION_ABSENT,
    _ATTENTION_SOURCE_HAS,
    _DIFFUSERS_KINDS,
    _GEGLU_SOURCE_HAS,
    _GROUP_NORM_SILU,
    _RESNET_FUSED,
    _RESNET_SOURCE_HAS,
    _SDPA_PROCESSOR,
    _SDPA_PROCESSOR_SOURCE_HAS,
    _UNET_SOURCE_HAS,
    DIFFUSERS_ATTENTIONS,
    GEGLUS,
    RESNETS,
    UNETS,
    _attention_forward,
    _attention_reason,
    _AttentionForward,
    _diffusers_kind,
    _geglu_forward,
    _geglu_reason,
    _GegluForward,
    _group_norm_silu,
    _GroupNormSiluForward,
    _identity,
    _resnet_forward,
    _resnet_reason,
    _ResnetForward,
    _silu_after_group_norm,
    _unet_reason,
)
from .forms import (  # noqa: F401 - flaggems.patching's own names before the split
    _GEMMA_NORM,
    _KIND_SUFFIXES,
    _LLAMA_NORM,
    _REFERENCE_FORMS,
    _REFERENCES,
    _TORCH_NORM,
    LAYERS,
    MLPS,
    NORMS,
    NormKind,
    _code_form,
    _folded_source,
    _form,
    _function_form,
    _Normalised,
    _plain_function,
    _recognised,
    _reference_forms,
)


@dataclass
class PatchReport:
    """What :func:`patch` did: modules patched per kind, modules skipped and why."""

    model: str
    patched: Counter = field(default_factory=Counter)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    already: bool = False
    #: Classes recognised by form, not by name: class -> the reference class its code reads as.
    by_form: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        if self.already:
            return f"flaggems.patch({self.model}): already patched"
        done = ", ".join(f"{kind} x{count}" for kind, count in sorted(self.patched.items())) or "nothing"
        lines = [f"flaggems.patch({self.model}): {done}"]
        lines += [f"  {cls} read as {reference}" for cls, reference in sorted(self.by_form.items())]
        lines += [f"  skipped {name}: {why}" for name, why in self.skipped]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """Plain data (the models benchmark records it)."""
        return {"model": self.model, "patched": dict(self.patched), "skipped": [list(s) for s in self.skipped],
                "already": self.already, "by_form": dict(self.by_form)}


def _fuse(name: str, module: nn.Module, names: tuple[str, ...], shared: dict[int, int], report: PatchReport,
          undo: _Undo) -> fused_linear.FusedLinear | None:
    """``module``'s projections ``names`` over one weight (:mod:`flaggems.fused_linear`), or ``None`` with the
    reason in the report; q/k/v also get their projections' forwards."""
    group, reason = fused_linear.group_of(module, names, shared)
    if group is None:
        report.skipped.append((name, f"{type(module).__name__}: {'/'.join(names)} not fused: {reason}"))
        return None
    undo.fused.append(group)
    report.patched[f"{'_'.join(n.removesuffix('_proj') for n in names)}_proj (one GEMM)"] += 1
    for linear, forward in fused_linear.projection_forwards(group) if names == fused_linear.QKV else ():
        _set_forward(linear, forward, "fused_projection", undo)
    return group


def _patch_new_kind(name: str, module: nn.Module, plugin: str, rule: PatchRule, ruled: Rules, report: PatchReport,
                    undo: _Undo) -> None:
    """Patch ``module`` by the rule of a kind an op family or a plugin added (its forward: the last rule's)."""
    reason = ruled.decline(rule.kind, module)
    if reason is None:
        _set_forward(module, ruled.forward(rule.kind, module, rule.forward), rule.kind, undo)
        report.patched[rule.label or rule.kind] += 1
    else:
        report.skipped.append((name, f"{type(module).__name__}: {reason}"))


def _patch_attention_block(name: str, module: nn.Module, ruled: Rules, report: PatchReport, undo: _Undo) -> None:
    """The attention's rotary embedding and ``DynamicCache`` append as one call (:mod:`.attention`), where its
    forward is a reference form; otherwise the rotary embedding alone serves it, the reason in the report."""
    reason = attention.attention_reason(module) or ruled.decline("decoder_attention", module)
    if reason is None:
        forward = ruled.forward("decoder_attention", module, attention.attention_forward)
        _set_forward(module, forward, "decoder_attention", undo)
        report.patched["rotary_cache_append (attention)"] += 1
    else:
        report.skipped.append((name, f"{type(module).__name__}: {reason}"))


def _require_module(model: Any, name: str) -> None:
    """``TypeError`` (as torch's own module functions raise) for anything but an ``nn.Module``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"flaggems.{name}() takes a torch.nn.Module (a model or one of its modules), "
                        f"not {type(model).__name__}")


def patch(model: nn.Module, rules: Sequence[tuple[str, PatchRule]] = ()) -> PatchReport:
    """Route a transformers decoder's layers, or a diffusers UNet's blocks, through flaggems' fused operators
    (see the module docstring); ``rules``: the plugins' :class:`~flaggems.types.PatchRule` records.

    Returns a :class:`PatchReport`. Patching does not enable flaggems:
    ``flaggems.enable()`` routes the fused operators to the kernels; without
    it (or where they decline) they run their torch references.
    """
    _require_module(model, "patch")
    report = PatchReport(type(model).__name__)
    if getattr(model, UNDO, None) is not None:
        report.already = True
        return report
    undo, ruled = _Undo(model), Rules(rules)
    layer_norms: set[int] = set()
    shared = fused_linear.storage_counts(model)
    for name, module in model.named_modules():
        recognised = _recognised(module)
        if recognised is not None and recognised[0] in _LAYER_KINDS:
            if recognised[2] is not None:
                report.by_form[type(module).__name__] = recognised[2]
            why, make_forward, fused_norm = _LAYER_KINDS[recognised[0]]
            reason = why(module) or ruled.decline("decoder_layer", module)
            if reason is None:
                _set_forward(module, ruled.forward("decoder_layer", module, make_forward), "decoder_layer", undo)
                layer_norms.add(id(getattr(module, fused_norm)))
                report.patched["add_rms_norm (decoder layer)"] += 1
            else:
                report.skipped.append((name, f"{type(module).__name__}: {reason}"))
    for name, module in model.named_modules():
        cls = type(module).__name__
        if getattr(module, MARK, None) is not None:
            continue
        recognised = _recognised(module)
        form = recognised[0] if recognised is not None else None
        if recognised is not None and recognised[2] is not None and form not in _LAYER_KINDS:
            report.by_form[cls] = recognised[2]
        if form in _LAYER_KINDS:
            continue  # patched, or skipped with its reason, above
        if form is None and cls.endswith(tuple(_KIND_SUFFIXES)) and "transformers" in type(module).__module__:
            kind = next(k for suffix, k in _KIND_SUFFIXES.items() if cls.endswith(suffix))
            report.skipped.append((name, f"{cls}: its code reads as no {kind} form flaggems knows"))
        elif form == "norm":
            kind = _norm_kind(module)
            if kind is None:
                report.skipped.append((name, f"{cls}: not the expected weight/eps attributes"))
            elif id(module) in layer_norms:
                object.__setattr__(module, MARK, "fused_into_layer")  # its layer calls add_rms_norm instead
                undo.forwards.append(module)
            elif declined := ruled.decline("norm", module):
                report.skipped.append((name, f"{cls}: {declined}"))
            else:
                _set_forward(module, ruled.forward("norm", module, functools.partial(_norm_forward, kind=kind)),
                             "rms_norm", undo)
                report.patched["rms_norm"] += 1
        elif form in _MLP_LAYOUTS:
            reason = _mlp_reason(module, form) or ruled.decline("mlp", module)
            if reason is None:
                forward = ruled.forward("mlp", module, functools.partial(_mlp_forward, form=form))
                _set_forward(module, forward, "mlp", undo)
                report.patched[f"{_activation(module, _MLP_LAYOUTS[form][1])}_mul (mlp)"] += 1
                if form == "mlp" and isinstance(getattr(forward, "__self__", None), _MlpForward):
                    forward.__self__.gate_up = _fuse(name, module, ("gate_proj", "up_proj"), shared, report, undo)
            else:
                report.skipped.append((name, f"{cls}: {reason}"))
        elif _rotary_candidate(module):
            if all(isinstance(getattr(module, n, None), nn.Linear) for n in fused_linear.QKV):
                _fuse(name, module, fused_linear.QKV, shared, report, undo)
            reason = _rotary_reason(module) or ruled.decline("rotary", module)
            if reason is None:
                held = (type(module).__module__, "apply_rotary_pos_emb", _rotary)
                if held not in undo.functions:
                    undo.functions.append(held)
                report.patched["rotary_embedding (attention)"] += 1
                _patch_attention_block(name, module, ruled, report, undo)
            else:
                report.skipped.append((name, f"{cls}: {reason}"))
        elif (kind_row := _diffusers_kind(module)) is not None:
            why, make_forward, mark, label = kind_row
            reason = why(module) or ruled.decline(mark, module)
            if reason is None:
                _set_forward(module, ruled.forward(mark, module, make_forward), mark, undo)
                report.patched[label(module)] += 1
            else:
                report.skipped.append((name, f"{cls}: {reason}"))
        elif (own := ruled.new_kind(module)) is not None:
            _patch_new_kind(name, module, *own, ruled, report, undo)
        elif cls in UNETS and getattr(module, "conv_norm_out", None) is not None:
            reason = _unet_reason(module) or ruled.decline("unet_output", module)
            if reason is None:
                norm = module.conv_norm_out
                _set_forward(norm, _GroupNormSiluForward(norm).forward, "group_norm_silu", undo)
                _set_forward(module.conv_act, _identity, "fused_into_norm", undo)
                report.patched["group_norm_silu (unet output)"] += 1
            else:
                report.skipped.append((name, f"{cls}: {reason}"))
    if not report.patched:
        report.skipped.append(("", "no module flaggems knows (by name or by form: Llama's RMSNorm, MLP, decoder "
                                   "layer and rotary embedding, Gemma's RMSNorm, torch's nn.RMSNorm; diffusers' "
                                   "ResnetBlock2D, GEGLU and Attention); the model is left untouched"))
        return report
    undo.hold()
    object.__setattr__(model, UNDO, undo)
    return report


def unpatch(model: nn.Module) -> bool:
    """Undo :func:`patch` on ``model`` (every ``forward`` and module function restored); ``False`` if not patched."""
    _require_module(model, "unpatch")
    undo: _Undo | None = getattr(model, UNDO, None)
    if undo is None:
        return False
    for module in undo.forwards:
        module.__dict__.pop("forward", None)
        module.__dict__.pop(MARK, None)
    for group in undo.fused:
        group.release()  # each projection on storage of its own again
    if undo.release is not None:
        undo.release()  # runs once: restores the module functions this model held
    del model.__dict__[UNDO]
    return True


def is_patched(model: nn.Module) -> bool:
    """Whether :func:`patch` patched ``model`` (and :func:`unpatch` has not undone it)."""
    return getattr(model, UNDO, None) is not None
