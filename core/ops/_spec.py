"""The record of one op family: what the runtime, the kit, the bench and the patcher know of it, in one folder.

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

Adding an op family is adding such a folder; nothing else names it.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

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
        name: the family, also its folder name (``rms_norm``, ``index_copy``).
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
