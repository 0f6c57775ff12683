"""Recognising the modules :func:`flaggems.patching.patch` knows: by class name (the tables below), or by form
(a class whose code, annotations, docstrings, comments and its own name aside, reads as a reference class of the
installed transformers); and the source checks the patches make."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


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
#: Class name endings of the kinds a transformers model names so: one not recognised is reported as skipped.
_KIND_SUFFIXES = {"RMSNorm": "norm", "MLP": "mlp", "DecoderLayer": "layer"}


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


def _folded_source(cls: type, method: str = "forward") -> str | None:
    """``cls.<method>``'s source with white space folded, or ``None`` where it is not available."""
    try:
        return " ".join(inspect.getsource(getattr(cls, method)).split())
    except (AttributeError, OSError, TypeError):
        return None


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
