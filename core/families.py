"""The op families: their records and the registry that finds them (``flaggems/ops/<family>/`` folders).

What the runtime, the kit, the bench and the patcher know of an op, in one folder.

An op family is a folder ``flaggems/ops/<name>/`` whose ``spec.py`` holds one
:class:`OpSpec` (``SPEC``). Its other parts sit beside it under fixed names,
each optional, each imported only by the tool that reads it (``import flaggems``
loads the specs and the references, never a tool):

* ``reference.py``: the torch references of the ``flaggems::`` ops it defines
  (:class:`Defined` records in ``DEFINED``);
* ``cases.py``: its contract cases (the conformance kit);
* ``generate.py``: ``GENERATORS``, op -> random case generator (the randomized kit);
* ``shapes.py``: ``WORKLOADS``, its benchmark workloads (``flaggems bench``);
* ``policy.py``: ``POLICIES``, tuning key -> launch policy class of its kernels;
* ``patch.py``: ``RULES``, :class:`~flaggems.types.PatchRule` records of the model modules
  ``flaggems.patch`` routes through its ops (a kind of its own: ``matches`` and ``forward``).

Adding an op family is adding such a folder; nothing else names it
(``docs/adding-an-aten-op.md``, ``docs/adding-a-fused-op.md``). This module
sits low (the binding, the runtime and the kits read it); the folders' parts
import the tools that read them, never the other way round.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import pkgutil
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

#: The parts a family folder may hold, besides ``spec.py`` (see the module docstring).
PARTS = ("reference", "cases", "generate", "shapes", "policy", "patch")


@dataclass(frozen=True)
class Defined:
    """One ``flaggems::`` operator a family defines: its schema and its torch reference.

    The reference is registered as the op's ``CompositeImplicitAutograd`` kernel: wherever no implementation
    serves, it runs (and autograd, fake tensors and ``torch.compile`` decompose the op into it).
    """

    schema: str
    reference: Callable[..., Any]

    @property
    def name(self) -> str:
        """The op's name in the ``flaggems`` namespace (the schema's, before its arguments)."""
        return self.schema.split("(", 1)[0]


@dataclass(frozen=True)
class OpSpec:
    """What flaggems declares of one op family (one folder under ``flaggems/ops``).

    Attributes:
        name: the family, also its folder name (``rms_norms``, ``index_copy``).
        ops: the contract ops it covers, as implementations name them (``index_copy_``,
            ``repeat_interleave.Tensor``, ``flaggems::rms_norm``).
        order: where the family stands in reports (``flaggems bench``, the kit): lower first.
        fronts: the modules with the torch semantics every implementation shares (``flaggems.fronts.<op>``).
        package: the folder's import name (filled in by the registry).
    """

    name: str
    ops: tuple[str, ...]
    order: int = 100
    fronts: tuple[str, ...] = ()
    package: str = field(default="", compare=False)

    def has(self, part: str) -> bool:
        """Whether the family's folder holds ``part`` (one of :data:`PARTS`), without importing it."""
        if part not in PARTS:
            raise ValueError(f"unknown op-family part {part!r}; known: {', '.join(PARTS)}")
        return importlib.util.find_spec(f"{self.package}.{part}") is not None

    def part(self, part: str) -> ModuleType | None:
        """The family's ``part`` module, imported on first use (``None`` where the folder has none)."""
        return importlib.import_module(f"{self.package}.{part}") if self.has(part) else None

    def read(self, part: str, name: str, default: Any) -> Any:
        """``name`` of the family's ``part`` module, or ``default`` where the folder has no such part."""
        module = self.part(part)
        return default if module is None else getattr(module, name)

    def defined(self) -> tuple[Defined, ...]:
        """The ``flaggems::`` ops the family defines (its ``reference.py``'s ``DEFINED``)."""
        return tuple(self.read("reference", "DEFINED", ()))

    def generators(self) -> Mapping[str, Callable[..., Any]]:
        """Op -> random case generator (its ``generate.py``'s ``GENERATORS``)."""
        return dict(self.read("generate", "GENERATORS", {}))

    def workloads(self) -> list[Any]:
        """Its benchmark workloads (its ``shapes.py``'s ``WORKLOADS``)."""
        return list(self.read("shapes", "WORKLOADS", ()))

    def policies(self) -> Mapping[str, type]:
        """Tuning key -> launch policy class of its kernels (its ``policy.py``'s ``POLICIES``)."""
        return dict(self.read("policy", "POLICIES", {}))


NAMESPACE = "flaggems"


@functools.cache
def specs() -> tuple[OpSpec, ...]:
    """Every op family's record, in report order (found by iterating the folders of :mod:`flaggems.ops`)."""
    found = []
    folders = importlib.import_module(f"{NAMESPACE}.ops")
    for module in pkgutil.iter_modules(folders.__path__):
        if module.ispkg:
            package = f"{folders.__name__}.{module.name}"
            record = importlib.import_module(f"{package}.spec").SPEC
            if record.name != module.name:
                raise ValueError(f"{package}/spec.py names its family {record.name!r}, not its folder's name")
            found.append(dataclasses.replace(record, package=package))
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
    """Find the families again at the next :func:`specs` (a folder added to ``flaggems.ops.__path__``)."""
    specs.cache_clear()
    defined.cache_clear()


def register_policies() -> None:
    """Register each family's launch policies (its ``policy.py``) with the toolkit, so that their tuning keys
    are checked at ``enable()`` and read by the kernels (``import flaggems`` does it, after :func:`define`)."""
    from .toolkit import tuning

    for record in specs():
        for key, policy in record.policies().items():
            tuning.register_policy(key, policy)


def overload(name: str) -> torch._ops.OpOverload:
    """``torch.ops.flaggems.<name>.default``."""
    define()
    return getattr(getattr(torch.ops, NAMESPACE), name).default
