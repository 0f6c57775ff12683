"""Plugins' :class:`~flaggems.types.PatchRule` records, applied by :func:`flaggems.patching.patch`.

A vendor declines a kind of module where its stack takes another path (Ascend: diffusers calls
``torch_npu``'s own GEGLU on an NPU) or makes the patched forward of a kind itself; an op family's
``patch.py`` (``RULES``) adds a kind of its own, recognised by its ``matches``, before the plugins' rules.
The runtime collects the rules once per :func:`flaggems.patch`
(:meth:`flaggems.runtime.Runtime.patch_rules`); nothing here runs per call of a patched module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from .types import PATCH_KINDS, PatchRule


class Rules:
    """The rules of one :func:`flaggems.patch`, by kind, in the order the runtime gave them (vendor last)."""

    def __init__(self, rules: Sequence[tuple[str, PatchRule]] = ()) -> None:
        self.by_kind: dict[str, list[tuple[str, PatchRule]]] = {}
        for plugin, rule in rules:
            self.by_kind.setdefault(rule.kind, []).append((plugin, rule))

    def decline(self, kind: str, module: nn.Module) -> str | None:
        """The first reason a rule of ``kind`` gives to leave ``module`` as it is, naming its plugin."""
        for plugin, rule in self.by_kind.get(kind, ()):
            reason = None if rule.decline is None else rule.decline(module)
            if reason:
                return f"{reason} (plugin {plugin!r})"
        return None

    def new_kind(self, module: nn.Module) -> tuple[str, PatchRule] | None:
        """The first ``(plugin, rule)`` of a kind the core does not know whose ``matches`` takes ``module``."""
        for kind, rules in self.by_kind.items():
            if kind not in PATCH_KINDS:
                for plugin, rule in rules:
                    if rule.matches is not None and rule.matches(module):
                        return plugin, rule
        return None

    def forward(self, kind: str, module: nn.Module,
                make: Callable[[nn.Module], Callable[..., Any]]) -> Callable[..., Any]:
        """The patched forward of ``module``: the last rule of ``kind`` that makes one, else the core's."""
        made = [rule.forward for _, rule in self.by_kind.get(kind, ()) if rule.forward is not None]
        return (made[-1] if made else make)(module)
