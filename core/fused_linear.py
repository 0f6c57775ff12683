"""Several ``nn.Linear`` over one input as one GEMM: q/k/v and gate/up projections of a decoder layer.

A decode step is host-bound: each projection is a ``linear`` call and a GEMM
launch, seven a layer. :class:`FusedLinear` gives the projections one weight
whose rows are theirs: the weights are concatenated once into one tensor and
each module's parameter is made a view of its rows (``param.data = rows``:
the ``Parameter`` objects stay the same, so ``state_dict()`` keys, shapes and
values are unchanged, ``load_state_dict`` writes into the shared storage the
fused GEMM reads, and an optimizer built before or after sees the same
parameters). One ``F.linear`` then computes every output, split into views.

It serves a call only where that is exactly the modules' computation:

* no gradient wanted (inference: ``torch.no_grad``, ``inference_mode``, or
  parameters that do not require grad); a step that needs gradients calls the
  modules one by one, so autograd records each parameter's use;
* the parameters still view the fused storage (``model.to(...)``, FSDP or a
  reload that replaced ``.data`` puts them elsewhere: each module alone then);
* the input is the one the first module saw (the q/k/v form: ``q_proj(x)``
  computes all three; ``k_proj(x)`` and ``v_proj(x)`` of the same ``x`` take
  their part; any other call computes its own).

:meth:`FusedLinear.release` gives each parameter storage of its own again
(``unpatch``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling
from torch import nn

#: An attention's projections: ``q_proj(x)`` computes the three, ``k_proj(x)``/``v_proj(x)`` take their parts.
QKV = ("q_proj", "k_proj", "v_proj")


def group_of(module: nn.Module, names: Sequence[str], shared: dict[int, int]) -> tuple[FusedLinear | None,
                                                                                         str | None]:
    """``module``'s projections ``names`` over one weight, or ``None`` and why not."""
    linears = [getattr(module, n, None) for n in names]
    if not all(isinstance(m, nn.Module) for m in linears):
        return None, "not every projection is a module"
    reason = fuse_reason(linears, shared)
    return (None, reason) if reason is not None else (FusedLinear(linears), None)


def projection_forwards(group: FusedLinear) -> list[tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]]:
    """``(module, forward)`` for each projection of a q/k/v group: the first computes all, the others take
    their parts of it."""
    first = [(group.linears[0], FirstProjection(group).forward)]
    return first + [(m, LaterProjection(group, i).forward) for i, m in enumerate(group.linears[1:], start=1)]


def fuse_reason(linears: Sequence[nn.Module], shared: dict[int, int] | None) -> str | None:
    """Why ``linears`` cannot share one weight, or ``None``.

    ``shared`` counts, per storage address, the model's parameters on it (a tied or already shared weight
    is left alone); ``None``: not checked (a copy of a model checked when it was patched).
    """
    first = linears[0]
    for m in linears:
        if type(m) is not nn.Linear:
            return f"{type(m).__name__} is not a plain nn.Linear (quantized or adapted)"
        if m._forward_hooks or m._forward_pre_hooks or getattr(m, "_hf_hook", None) is not None:
            return "a projection has hooks (offloaded or instrumented)"
        w = m.weight
        if type(w.data) is not torch.Tensor or w.device.type == "meta" or not w.is_contiguous():
            return "a projection weight is not a plain dense tensor (meta, sharded or a subclass)"
        if shared is not None and shared.get(w.untyped_storage().data_ptr(), 0) != 1:
            return "a projection weight shares memory with another parameter (tied)"
        if w.dtype != first.weight.dtype or w.device != first.weight.device or m.in_features != first.in_features:
            return "the projections differ in dtype, device or input size"
        if (m.bias is None) != (first.bias is None):
            return "some projections have a bias and some not"
    return None


class FusedLinear:
    """One weight for ``linears`` (their rows, in order), and the GEMM over it (see the module docstring)."""

    def __init__(self, linears: Sequence[nn.Linear]) -> None:
        self.linears = tuple(linears)
        self.sizes = [m.out_features for m in linears]
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.disabled = False
        self.pending: list[torch.Tensor] = []
        self.pending_input: torch.Tensor | None = None
        self._fuse()

    def _fuse(self) -> None:
        """Concatenate the modules' weights (and biases) and make each parameter a view of its rows."""
        linears = self.linears
        with torch.no_grad():
            self.weight = torch.cat([m.weight.detach() for m in linears])
            self.bias = None if linears[0].bias is None else torch.cat([m.bias.detach() for m in linears])
        for m, rows in zip(linears, self.weight.split(self.sizes)):
            m.weight.data = rows
        if self.bias is not None:
            for m, rows in zip(linears, self.bias.split(self.sizes)):
                m.bias.data = rows

    def __deepcopy__(self, memo: dict[int, Any]) -> FusedLinear:
        """A copy over the copied modules, fused again at its first call (``Parameter``'s deepcopy gives each
        weight storage of its own; ``pickle`` keeps shared storage as it is)."""
        new = FusedLinear.__new__(FusedLinear)
        memo[id(self)] = new
        new.linears = copy.deepcopy(self.linears, memo)
        new.sizes, new.weight, new.bias, new.disabled = list(self.sizes), None, None, self.disabled
        new.pending, new.pending_input = [], None
        return new

    def _shared(self) -> bool:
        weight = self.weight
        if weight is None:
            return False
        last = weight.data_ptr() + (weight.shape[0] - self.sizes[-1]) * weight.stride(0) * weight.element_size()
        return self.linears[0].weight.data_ptr() == weight.data_ptr() and self.linears[-1].weight.data_ptr() == last

    def serves(self) -> bool:
        """Whether the fused GEMM computes exactly what the modules would (no gradient, storage shared).

        Under ``torch.compile`` the modules run one by one: the compiler sees the unpatched model's
        projections (a storage address cannot be read while tracing). Parameters moved to storage of their
        own (``model.to(...)``, a deep copy) are fused again at the first call outside a CUDA-graph capture,
        where they still are plain dense tensors (not after FSDP or a quantizer replaced them).
        """
        weight = self.linears[0].weight
        if (torch.is_grad_enabled() and weight.requires_grad) or torch.compiler.is_compiling() or self.disabled:
            return False
        try:
            if self._shared():
                return True
        except RuntimeError:  # a wrapper subclass without storage now (FSDP's DTensor): the modules alone
            self.disabled = True
            return False
        if weight.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        if fuse_reason(self.linears, None) is not None:
            self.disabled = True
            return False
        self._fuse()
        return True

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every module's output of ``x``: one GEMM, split into views of its last dimension."""
        return list(F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1))

    def release(self) -> None:
        """Each parameter on storage of its own again (values unchanged)."""
        with torch.no_grad():
            if self._shared():
                for m in self.linears:
                    m.weight.data = m.weight.data.clone()
                    if m.bias is not None:
                        m.bias.data = m.bias.data.clone()
        self.weight = self.bias = None
        self.pending, self.pending_input = [], None


class FirstProjection:
    """``forward`` of the first module of a group (``q_proj``): computes every output, keeps the others for the
    group's next modules called on the same input."""

    def __init__(self, group: FusedLinear) -> None:
        self.group, self.module = group, group.linears[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.group
        if not group.serves():
            group.pending, group.pending_input = [], None
            return F.linear(x, group.linears[0].weight, group.linears[0].bias)
        first, *rest = group(x)
        group.pending, group.pending_input = rest, x
        return first


class LaterProjection:
    """``forward`` of a later module of a group (``k_proj``, ``v_proj``): its part of the first module's GEMM
    when called on the same input, in order; else its own ``linear``."""

    def __init__(self, group: FusedLinear, index: int) -> None:
        self.group, self.index, self.module = group, index, group.linears[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.group
        if x is group.pending_input and len(group.pending) == len(group.sizes) - self.index:
            out = group.pending.pop(0)
            if not group.pending:
                group.pending_input = None
            return out
        module = group.linears[self.index]
        return F.linear(x, module.weight, module.bias)


def storage_counts(model: nn.Module) -> dict[int, int]:
    """Per storage address, how many of ``model``'s parameter slots hold a tensor on it (a parameter tied to
    two modules counts twice)."""
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        if type(p.data) is not torch.Tensor or p.device.type == "meta":
            continue  # a DTensor, a quantized or meta weight: fuse_reason refuses it without its address
        key = p.untyped_storage().data_ptr()
        counts[key] = counts.get(key, 0) + 1
    return counts
