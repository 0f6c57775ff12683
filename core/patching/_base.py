"""The records every patch shares: the marks a patched module and model carry, what :func:`flaggems.patching.unpatch`
undoes, a patched ``forward``'s picklable base, and the module functions replaced while a patched model uses them.

Imports no other module of :mod:`flaggems.patching`."""

from __future__ import annotations

import importlib
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import fused_linear, ops

#: Attribute a patched module carries (the kind of patch); plain attributes are not part of ``state_dict()``.
MARK = "_flaggems_patched"
#: Attribute of the root module holding what :func:`unpatch` undoes.
UNDO = "_flaggems_undo"


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
