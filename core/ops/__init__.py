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
generators, benchmark shapes, launch policies, patch rules (see
:mod:`flaggems.families`, which finds the folders and whose names this package
hands on); the runtime, the kit, the bench and the
patcher read the records, and no list names the families. The references
follow transformers' module code, rounding included, so that a patched model
keeps its results within the dtype's tolerance.
"""

from __future__ import annotations

from typing import Any

from ..families import (
    NAMESPACE,
    PARTS,
    Defined,
    OpSpec,
    define,
    defined,
    forget_specs,
    overload,
    register_policies,
    spec,
    specs,
)

__all__ = ["NAMESPACE", "PARTS", "Defined", "OpSpec", "define", "defined", "forget_specs", "overload",
           "register_policies", "spec", "specs"]


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
