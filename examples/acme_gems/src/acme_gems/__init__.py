"""acme-gems: a complete flaggems vendor plugin (docs/vendor-guide.md runs this package).

It declares the ``acme`` backend, adds ``aten::neg`` (an op the generic
plugin lacks) with its conformance cases and a bench workload, tunes the
shared elementwise copy kernel instead of copying it, and declares its own
variable ``FLAGGEMS_ACME_NEG_BLOCK``.
"""

from __future__ import annotations

from flaggems import Backend, OpImpl, Tuning, hookimpl
from flaggems.config import EnvVar

ACME = Backend("acme", vendor="acme", device_type="acme", dispatch_key="PrivateUse1",
               probe="acme_gems.probe:probe", description="Acme accelerators through torch_acme")


def _block(name: str, text: str) -> int:
    value = int(text)
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name}={text}: expected a power of two >= 16")
    return value


@hookimpl
def flaggems_backends():
    """The backend this plugin drives (its probe is imported only at selection)."""
    return [ACME]


@hookimpl
def flaggems_operators(backend):
    """neg, lazily imported: ``import flaggems`` loads no kernel."""
    return [OpImpl("neg", "acme_gems.neg:neg", vendor="acme", supports="acme_gems.neg:supports", replayable=True)]


@hookimpl
def flaggems_tuning(backend):
    """The generic strided copy, with a grid of 12 programs walking the tiles."""
    return [Tuning("elementwise", {"max_ctas": 12}, vendor="acme")]


@hookimpl
def flaggems_conformance_cases():
    """The kit's cases for the op this plugin adds."""
    from .cases import CASES

    return {"neg": CASES}


@hookimpl
def flaggems_bench_workloads():
    """``flaggems bench --op neg`` rows."""
    from .cases import WORKLOADS

    return WORKLOADS


@hookimpl
def flaggems_env_vars():
    """This plugin's variables (named FLAGGEMS_ACME_*)."""
    return [EnvVar("FLAGGEMS_ACME_NEG_BLOCK", "int", 1024, "Elements per program of acme's neg kernel.", _block)]
