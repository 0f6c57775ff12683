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

import ast
import functools
import importlib
import inspect
import sys
import textwrap
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling
from torch import nn

from . import fused_linear, ops
from .patch_rules import Rules
from .types import PatchRule

#: Attribute a patched module carries (the kind of patch); plain attributes are not part of ``state_dict()``.
MARK = "_flaggems_patched"
#: Attribute of the root module holding what :func:`unpatch` undoes.
UNDO = "_flaggems_undo"


@dataclass(frozen=True)
class NormKind:
    """How a family's RMSNorm rounds: see :func:`flaggems.ops.rms_norm`."""

    eps_attr: str
    weight_offset: float = 0.0
    cast_first: bool = True
    #: Input dtypes the fused op computes the module's result for (``None``: every dtype, as transformers'
    #: norms compute in fp32 whatever the input); the module's own forward serves the others.
    dtypes: frozenset[torch.dtype] | None = None

    def eps(self, module: nn.Module) -> float:
        """The module's epsilon; torch's ``nn.RMSNorm(eps=None)`` uses fp32's machine epsilon (its math type
        for every dtype :attr:`dtypes` admits)."""
        eps = getattr(module, self.eps_attr)
        return float(torch.finfo(torch.float32).eps if eps is None else eps)

    def serves(self, x: torch.Tensor) -> bool:
        """Whether the fused op computes what the module computes for ``x``."""
        return self.dtypes is None or x.dtype in self.dtypes


_LLAMA_NORM = NormKind("variance_epsilon")
_GEMMA_NORM = NormKind("eps", weight_offset=1.0, cast_first=False)
#: torch's ``nn.RMSNorm`` (``F.rms_norm``): normalised and weighted in fp32, rounded once to the input's dtype
#: (what Gemma's rounding does with no offset); float64 keeps its own precision, so it runs the module's forward.
_TORCH_NORM = NormKind("eps", cast_first=False, dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}))

#: RMSNorm classes by name (transformers 4.4x-5.x spell these forwards the same way).
NORMS: dict[str, NormKind] = {
    "LlamaRMSNorm": _LLAMA_NORM, "MistralRMSNorm": _LLAMA_NORM, "Qwen2RMSNorm": _LLAMA_NORM,
    "Qwen3RMSNorm": _LLAMA_NORM, "Qwen3MoeRMSNorm": _LLAMA_NORM, "GemmaRMSNorm": _GEMMA_NORM,
}
#: MLP classes of the gated form ``down(act(gate(x)) * up(x))``.
MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "GemmaMLP"})
#: Decoder layers of the pre-norm residual form (checked against their source as well).
LAYERS = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer",
                    "GemmaDecoderLayer"})
#: Attention classes whose modeling module's ``apply_rotary_pos_emb`` is the rotate-half form.
ATTENTIONS = frozenset({"LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention",
                        "GemmaAttention"})
#: What a layer's ``forward`` must say (and not say) for the fused residual form to be equivalent.
_LAYER_SOURCE_HAS = ("residual = hidden_states", "self.input_layernorm(hidden_states)", "self.self_attn(",
                     "hidden_states = residual + hidden_states", "self.post_attention_layernorm(hidden_states)",
                     "self.mlp(hidden_states)", "return hidden_states")
_LAYER_SOURCE_LACKS = ("outputs", "feedforward_layernorm", "dropout")
#: The reference classes of each form, by transformers modeling module: (module, class, kind, norm rounding).
_REFERENCES = (
    ("transformers.models.llama.modeling_llama", "LlamaRMSNorm", "norm", _LLAMA_NORM),
    ("transformers.models.gemma.modeling_gemma", "GemmaRMSNorm", "norm", _GEMMA_NORM),
    ("transformers.models.llama.modeling_llama", "LlamaMLP", "mlp", None),
    ("transformers.models.llama.modeling_llama", "LlamaDecoderLayer", "layer", None),
    ("transformers.models.mixtral.modeling_mixtral", "MixtralDecoderLayer", "layer", None),  # Llama's, no use_cache
    ("transformers.models.gemma2.modeling_gemma2", "Gemma2DecoderLayer", "sandwich_layer", None),
    ("transformers.models.phi3.modeling_phi3", "Phi3MLP", "gate_up_mlp", None),  # one projection, chunked
)
#: MLP forms: their ``nn.Linear`` attributes and their activation's attribute.
_MLP_LAYOUTS = {"mlp": (("gate_proj", "up_proj", "down_proj"), "act_fn"),
                "gate_up_mlp": (("gate_up_proj", "down_proj"), "activation_fn")}
#: The norms of a layer of Gemma 2's sandwich form (a norm before and after the attention and the MLP each).
_SANDWICH_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                   "post_feedforward_layernorm")
#: Class name endings of the kinds a transformers model names so: one not recognised is reported as skipped.
_KIND_SUFFIXES = {"RMSNorm": "norm", "MLP": "mlp", "DecoderLayer": "layer"}
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


class _Undo:
    """The inverse of one :func:`patch`: instance ``forward`` attributes set, module functions replaced.

    A copy of the model (``copy.deepcopy``, ``pickle``, ``torch.save`` then ``torch.load``) carries a copy of
    it that holds the module functions again, for the copy's lifetime."""

    def __init__(self, model: nn.Module) -> None:
        self.model = weakref.ref(model)  # no cycle: a model nobody holds is freed (and its finalizer runs) at once
        self.forwards: list[nn.Module] = []
        self.functions: list[tuple[str, str, Callable[..., Any]]] = []  # (module name, attribute, replacement)
        self.fused: list[fused_linear.FusedLinear] = []  # projections sharing one weight (storage split back)
        self.release: weakref.finalize | None = None  # gives the module functions back (unpatch, or model freed)

    def hold(self) -> None:
        """Replace the module functions (or count one more user of them) until :meth:`release` or the model
        is freed (the finalizer holds no model)."""
        for module_name, attr, replacement in self.functions:
            _replace_function(module_name, attr, replacement)
        held = [(module_name, attr) for module_name, attr, _ in self.functions]
        self.release = weakref.finalize(self.model(), _restore_functions, held)

    def __getstate__(self) -> dict[str, Any]:
        return {"model": self.model(), "forwards": self.forwards, "functions": self.functions, "fused": self.fused}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, model=weakref.ref(state["model"]))
        for module_name, _, _ in self.functions:
            importlib.import_module(module_name)  # a fresh process: the modeling module the copy's classes use
        self.hold()


# Module functions replaced while at least one patched model uses them: (module, attr) -> (original, users).
_FUNCTIONS: dict[tuple[str, str], list[Any]] = {}
_LOCK = threading.Lock()


class PatchedForward:
    """What a patched module's ``forward`` is bound to: the module and the few values its fused form needs, as
    attributes (no closure), so that ``copy.deepcopy``, ``pickle`` and ``torch.save`` of a patched model copy
    the patch with the model, bound to the copy's modules. The flaggems operators it calls are kept by name
    across pickling (torch's operator handles do not pickle)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __getstate__(self) -> dict[str, Any]:
        return {key: _OpName(value.__name__.split(".")[0]) if isinstance(value, torch._ops.OpOverload) else value
                for key, value in self.__dict__.items()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({key: ops.overload(value) if isinstance(value, _OpName) else value
                              for key, value in state.items()})


class _OpName(str):
    """A flaggems operator's name in a pickled :class:`PatchedForward` (resolved again when loaded)."""


def _set_forward(module: nn.Module, forward: Callable[..., Any], kind: str, undo: _Undo) -> None:
    object.__setattr__(module, "forward", forward)  # an instance attribute shadows the class's method
    object.__setattr__(module, MARK, kind)
    undo.forwards.append(module)


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


class _Normalised(ast.NodeTransformer):
    """Drops what does not change what code computes: annotations, docstrings (any lone string statement);
    writes ``own_name`` as ``<cls>``."""

    def __init__(self, own_name: str) -> None:
        self.own_name = own_name

    def generic_visit(self, node: ast.AST) -> ast.AST:
        for field_name in ("body", "orelse", "finalbody"):
            statements = getattr(node, field_name, None)
            if isinstance(statements, list) and statements and isinstance(statements[0], ast.stmt):
                kept = [s for s in statements
                        if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                and isinstance(s.value.value, str))]
                setattr(node, field_name, kept or [ast.Pass()])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None
        if isinstance(node, ast.arg):
            node.annotation = None
        if isinstance(node, ast.Name) and node.id == self.own_name:
            node.id = "<cls>"
        return super().generic_visit(node)


def _code_form(source: str, own_name: str) -> str:
    """``source``'s syntax tree without annotations, docstrings, comments and layout, ``own_name`` written
    ``<cls>``: two sources of one form compute the same thing."""
    tree = _Normalised(own_name).visit(ast.parse(textwrap.dedent(source)))
    return ast.dump(tree, annotate_fields=False, include_attributes=False)


@functools.cache
def _form(cls: type) -> tuple[tuple[str, str], ...] | None:
    """What instances of ``cls`` compute, as code: the form (:func:`_code_form`) of every method it has below
    ``nn.Module`` but ``__init__`` and ``extra_repr``, by name; ``None`` where a source is not available.
    Two classes of one form compute the same function of the same attributes."""
    methods: dict[str, Callable[..., Any]] = {}
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            break
        for name, value in vars(klass).items():
            if inspect.isfunction(value) and name not in methods and name not in ("__init__", "extra_repr"):
                methods[name] = value
    try:
        return tuple(sorted((name, _code_form(inspect.getsource(fn), cls.__name__)) for name, fn in methods.items()))
    except Exception:  # noqa: BLE001 - a class whose source cannot be read or parsed has no form (never patched)
        return None


_REFERENCE_FORMS: dict[Any, tuple[str, str, NormKind | None]] = {}


def _reference_forms() -> dict[Any, tuple[str, str, NormKind | None]]:
    """Form -> (kind, reference class, norm rounding) from the installed transformers; empty while
    transformers is not imported (a model of it has imported it)."""
    if not _REFERENCE_FORMS and "transformers" in sys.modules:
        for module_name, class_name, kind, norm in _REFERENCES:
            try:
                form = _form(getattr(importlib.import_module(module_name), class_name))
            except (ImportError, AttributeError):
                continue
            if form is not None:
                _REFERENCE_FORMS.setdefault(form, (kind, class_name, norm))
    return _REFERENCE_FORMS


def _recognised(module: nn.Module) -> tuple[str, NormKind | None, str | None] | None:
    """``(kind, norm rounding, reference)`` of a module flaggems knows: by class name (reference ``None``)
    or by form (the reference class it reads as); ``None`` for any other module."""
    name = type(module).__name__
    if name in NORMS:
        return "norm", NORMS[name], None
    if isinstance(module, nn.RMSNorm) and type(module).forward is nn.RMSNorm.forward:
        return "norm", _TORCH_NORM, None
    if name in MLPS:
        return "mlp", None, None
    if name in LAYERS:
        return "layer", None, None
    forms = _reference_forms()
    found = forms.get(_form(type(module))) if forms else None
    return None if found is None else (found[0], found[2], None if found[1] == name else found[1])


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


def _folded_source(cls: type, method: str = "forward") -> str | None:
    """``cls.<method>``'s source with white space folded, or ``None`` where it is not available."""
    try:
        return " ".join(inspect.getsource(getattr(cls, method)).split())
    except (AttributeError, OSError, TypeError):
        return None


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
_ROTARY_OP = ops.overload("rotary_embedding")


def _rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary_pos_emb`` of the patched modeling modules, through ``flaggems::rotary_embedding``."""
    return _ROTARY_OP(q, k, cos, sin, unsqueeze_dim, False)


def _plain_function(obj: Any) -> Callable[..., Any] | None:
    """The function as written behind a module function: with the ``kernels`` package installed,
    transformers' hub decorator makes it a module whose forward calls the original (held in the forward's
    closure); without it the function stays as written."""
    if not isinstance(obj, nn.Module):
        return inspect.unwrap(obj) if callable(obj) else None
    cells = getattr(type(obj).forward, "__closure__", None) or ()
    return next((c.cell_contents for c in cells if inspect.isfunction(c.cell_contents)), None)


def _function_form(obj: Any) -> str | None:
    """The form of a module function (:func:`_code_form`), or ``None`` where its source is not available."""
    function = _plain_function(obj)
    try:
        return None if function is None else _code_form(inspect.getsource(function), "")
    except Exception:  # noqa: BLE001 - as in _form: no source, no form
        return None


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


def _replace_function(module_name: str, attr: str, replacement: Any) -> None:
    """``module.attr`` computed by ``replacement`` until :func:`_restore_functions`. A function is replaced; a
    module function that the ``kernels`` hub wrapper made a module keeps its object, whose ``forward`` is
    replaced: ``kernels`` pickles each attention's own copy of it by rebuilding ``type(module.attr)()``."""
    with _LOCK:
        entry = _FUNCTIONS.get((module_name, attr))
        if entry is None:
            module = sys.modules[module_name]
            entry = _FUNCTIONS[(module_name, attr)] = [getattr(module, attr), 0]
            if isinstance(entry[0], nn.Module):
                object.__setattr__(entry[0], "forward", replacement)
            else:
                setattr(module, attr, replacement)
        entry[1] += 1


def _restore_functions(functions: list[tuple[str, str]]) -> None:
    """One patched model's hold on module functions released; the last holder restores each."""
    with _LOCK:
        for module_name, attr in functions:
            entry = _FUNCTIONS[(module_name, attr)]
            entry[1] -= 1
            if entry[1] == 0:
                if isinstance(entry[0], nn.Module):
                    entry[0].__dict__.pop("forward", None)
                else:
                    setattr(sys.modules[module_name], attr, entry[0])
                del _FUNCTIONS[(module_name, attr)]


def served_function(module: Any, attr: str) -> Callable[..., Any] | None:
    """What computes ``module.attr`` (a module function :func:`patch` may replace): the function, or the
    ``forward`` of the module the ``kernels`` hub wrapper made of it."""
    value = getattr(module, attr, None)
    return value.forward if isinstance(value, nn.Module) else value


#: diffusers modules patched one instance at a time: class names -> (why not, the forward, its mark, report label).
_DIFFUSERS_KINDS: tuple[tuple[frozenset[str], Callable[[nn.Module], str | None],
                              Callable[[nn.Module], Callable[..., torch.Tensor]], str,
                              Callable[[nn.Module], str]], ...] = (
    (RESNETS, _resnet_reason, _resnet_forward, "resnet_block", lambda m: _RESNET_FUSED[m.time_embedding_norm]),
    (GEGLUS, _geglu_reason, _geglu_forward, "geglu", lambda m: "gelu_mul (geglu)"),
    (DIFFUSERS_ATTENTIONS, _attention_reason, _attention_forward, "attention", lambda m: "attention (inline sdpa)"),
)


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


def _diffusers_kind(module: nn.Module) -> tuple | None:
    """The row of :data:`_DIFFUSERS_KINDS` for a module of one of its classes (an ``Attention`` only from
    diffusers: other libraries name theirs so too), else ``None``."""
    cls = type(module)
    for names, *row in _DIFFUSERS_KINDS:
        if cls.__name__ in names and (names is not DIFFUSERS_ATTENTIONS or "diffusers" in cls.__module__):
            return tuple(row)
    return None


#: Decoder layer forms: why one is not patched, its patched forward, the norm ``add_rms_norm`` takes over.
_LAYER_KINDS = {"layer": (_layer_reason, _layer_forward, "post_attention_layernorm"),
                "sandwich_layer": (_sandwich_reason, functools.partial(_layer_forward, sandwich=True),
                                   "pre_feedforward_layernorm")}


def _patch_new_kind(name: str, module: nn.Module, plugin: str, rule: PatchRule, ruled: Rules, report: PatchReport,
                    undo: _Undo) -> None:
    """Patch ``module`` by the rule of a kind an op family or a plugin added (its forward: the last rule's)."""
    reason = ruled.decline(rule.kind, module)
    if reason is None:
        _set_forward(module, ruled.forward(rule.kind, module, rule.forward), rule.kind, undo)
        report.patched[rule.label or rule.kind] += 1
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
