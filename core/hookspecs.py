"""The plugin contract: pluggy hook specifications of flaggems.

A plugin is a module or object exposed through the ``flaggems.plugins``
entry-point group whose functions are decorated with :data:`hookimpl`.
Every hook runs at discovery or ``enable()`` time, never per operator call.
Hook implementations may accept a subset of the arguments listed here, which
keeps plugins working when a hook gains arguments.

Example (a whole vendor plugin)::

    from flaggems import hookimpl, Backend, OpImpl, ProbeResult

    @hookimpl
    def flaggems_backends():
        return [Backend("acme", vendor="acme", device_type="acme",
                        dispatch_key="PrivateUse1", probe="acme_gems.probe:probe")]

    @hookimpl
    def flaggems_operators(backend):
        return [OpImpl("copy_", "acme_gems.copy:copy_", vendor="acme")]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # (the bench's Workload is named, not imported: the contract sits below the bench)
    from .config import EnvVar
    from .types import Backend, Case, OpImpl, PatchRule, Tuning

PROJECT = "flaggems"

#: Marker for hook specifications (used by the core only).
hookspec = pluggy.HookspecMarker(PROJECT)
#: Marker plugins put on their hook implementations.
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def flaggems_backends() -> Sequence[Backend]:
    """Describe the hardware backends this plugin can drive.

    Return a sequence of :class:`~flaggems.types.Backend` records (empty if the
    plugin only provides kernels). Each record's ``probe`` must be cheap: it
    runs when the backend is selected and may not start subprocesses or
    compile kernels. The core, not the plugin, chooses the active backend.
    """


@hookspec
def flaggems_operators(backend: Backend) -> Sequence[OpImpl]:
    """Return the operator implementations this plugin offers on ``backend``.

    ``backend`` is the active :class:`~flaggems.types.Backend`. Return
    :class:`~flaggems.types.OpImpl` records; reference kernel modules lazily
    (``"module:attr"``) so that ``import flaggems`` stays fast. Implementations
    with ``vendor`` set are used only when ``backend.vendor`` matches.
    """


@hookspec
def flaggems_tuning(backend: Backend) -> Sequence[Tuning]:
    """Optional: return :class:`~flaggems.types.Tuning` records for shared kernels.

    Lets a vendor change launch policy (tile sizes, a fixed number of CTAs
    with a grid-stride loop, ...) of the generic kernels without copying them.
    """


@hookspec
def flaggems_patch_rules(backend: Backend) -> Sequence[PatchRule]:
    """Optional: :class:`~flaggems.types.PatchRule` records that change what :func:`flaggems.patch` does on
    ``backend``: a module kind to leave alone where the vendor's stack takes another path, or the patched
    forward of a kind made by the vendor's own factory. Called once per :func:`flaggems.patch`, never per
    call of a patched module.
    """


@hookspec
def flaggems_conformance_cases() -> Mapping[str, Sequence[Case]]:
    """Optional: contract cases (:class:`flaggems.testing.Case`) per aten op, for ops the plugin adds.

    The kit (``flaggems.testing``) runs them against native torch on every
    installed implementation of the op, like the core's own cases. A routed op
    with no case anywhere fails the kit. Called once, when cases are first read.
    """


@hookspec
def flaggems_bench_workloads() -> Sequence[Any]:
    """Optional: :class:`flaggems.bench.workload.Workload` records that ``flaggems bench`` runs beside the core's.

    Each names the aten ops it routes (``routes``), so ``--op`` selects it and
    the report shows which implementation ran.
    """


@hookspec
def flaggems_env_vars() -> Sequence[EnvVar]:
    """Optional: the plugin's own environment variables (:class:`flaggems.config.EnvVar`).

    Each name must start with ``FLAGGEMS_<PLUGIN>_`` (the entry-point name in
    upper case); they join the registry at discovery, so ``flaggems env`` lists
    them, ``enable()`` validates them and they are not reported as unknown.
    """
