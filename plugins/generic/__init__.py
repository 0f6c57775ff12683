"""The default plugin: generic Triton kernels, one operator per module.

Registered through the same ``flaggems.plugins`` entry-point group as every
vendor plugin (no special path). Kernel modules are referenced lazily
(``"module:attr"``) so that ``import flaggems`` never compiles or imports them.
"""

from __future__ import annotations

from flaggems import Backend, OpImpl, hookimpl

#: Operators of this plugin: (aten overload, implementation, supports predicate).
OPERATORS: tuple[OpImpl, ...] = ()


@hookimpl
def flaggems_operators(backend: Backend) -> tuple[OpImpl, ...]:
    """Generic implementations apply on every backend."""
    return OPERATORS
