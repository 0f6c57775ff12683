"""flaggems' own operators (namespace ``flaggems``): the fused pieces of decoder layers.

torch has no single operator for what a transformers decoder layer spells out
in several (an RMSNorm in ~8 ops, a residual add before it, rotary embedding
of q and k in ~14, SiLU(gate) x up in 2). Each is defined here once, as a
torch operator with a schema and a **torch reference** registered as its
``CompositeImplicitAutograd`` kernel: wherever flaggems is disabled, declines
or is not installed for the device, the call runs the reference (torch's own
ops), so a patched model runs everywhere; autograd, fake tensors and
``torch.compile`` see through it (they decompose it into those ops).

They are ops of the contract like any aten op: an implementation is an
``OpImpl("flaggems::rms_norm", ...)`` (chains, vendor implementations,
declines, the conformance kit, ``flaggems routes``); the core registers its
entries on the backend's key and, these being CompositeImplicitAutograd, on
the Autograd key too (:meth:`flaggems.binding.Binding.register`).

Every op family is one folder here (``ops/<family>/``) with one record,
:class:`OpSpec` (``spec.py``), and its parts beside it: the references and
schemas of the ``flaggems::`` ops it defines, contract cases, random
generators, benchmark shapes, launch policies (see :mod:`flaggems.ops._spec`).
:func:`specs` finds the folders; the runtime, the kit, the bench and the
patcher read the records, and no list names the families. The references
follow transformers' module code, rounding included, so that a patched model
keeps its results within the dtype's tolerance.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import threading
from typing import Any

import torch

from ._spec import PARTS, Defined, OpSpec

__all__ = ["NAMESPACE", "PARTS", "Defined", "OpSpec", "define", "defined", "forget_specs", "overload",
           "register_policies", "spec", "specs"]

NAMESPACE = "flaggems"


@functools.cache
def specs() -> tuple[OpSpec, ...]:
    """Every op family's record, in report order (found by iterating the folders of this package)."""
    found = []
    for module in pkgutil.iter_modules(__path__):
        if module.ispkg:
            package = f"{__name__}.{module.name}"
            record = importlib.import_module(f"{package}.spec").SPEC
            if record.name != module.name:
                raise ValueError(f"{package}/spec.py names its family {record.name!r}, not its folder's name")
            found.append(OpSpec(record.name, record.ops, record.order, record.fronts, package))
    return tuple(sorted(found, key=lambda record: (record.order, record.name)))


def spec(name: str) -> OpSpec:
    """The record of family ``name`` (``KeyError`` naming the known ones)."""
    for record in specs():
        if record.name == name:
            return record
    raise KeyError(f"no op family {name!r}; known: {', '.join(r.name for r in specs())}")


@functools.cache
def defined() -> dict[str, Defined]:
    """Every ``flaggems::`` op the families define, by name (``rms_norm``...)."""
    return {op.name: op for record in specs() for op in record.defined()}


def __getattr__(name: str) -> Any:
    """``flaggems.ops.rms_norm`` and the other references, by the name of the op they define."""
    if name == "SCHEMAS":
        return {op: found.schema for op, found in defined().items()}
    if name == "REFERENCES":
        return {op: found.reference for op, found in defined().items()}
    found = defined().get(name)
    if found is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return found.reference


_LOCK = threading.Lock()
_LIBRARY: list[torch.library.Library] = []
_DEFINED: set[str] = set()


def define() -> None:
    """Define the families' operators with torch, each once per process (``import flaggems`` does it, about
    1 ms; a family found later, after :func:`forget_specs`, is defined at the next call)."""
    with _LOCK:
        for name, op in defined().items():
            if name in _DEFINED:
                continue
            if not hasattr(getattr(torch.ops, NAMESPACE), name):  # else defined by another copy (a reload)
                if not _LIBRARY:
                    _LIBRARY.append(torch.library.Library(NAMESPACE, "FRAGMENT"))
                _LIBRARY[0].define(op.schema)
                _LIBRARY[0].impl(name, op.reference, "CompositeImplicitAutograd")
            _DEFINED.add(name)


def forget_specs() -> None:
    """Find the families again at the next :func:`specs` (a folder added to this package's ``__path__``)."""
    specs.cache_clear()
    defined.cache_clear()


def register_policies() -> None:
    """Register each family's launch policies (its ``policy.py``) with the toolkit, so that their tuning keys
    are checked at ``enable()`` and read by the kernels (``import flaggems`` does it, after :func:`define`)."""
    from ..toolkit import tuning

    for record in specs():
        for key, policy in record.policies().items():
            tuning.register_policy(key, policy)


def overload(name: str) -> torch._ops.OpOverload:
    """``torch.ops.flaggems.<name>.default``."""
    define()
    return getattr(getattr(torch.ops, NAMESPACE), name).default
