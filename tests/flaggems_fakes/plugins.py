"""Fake plugins registered directly with the plugin manager by the tests."""

from __future__ import annotations

from flaggems import Backend, OpImpl, ProbeResult, Tuning, hookimpl

K = "flaggems_fakes.kernels"


class GenericNeg:
    """A generic plugin offering neg (float only) and a re-entrant abs."""

    @hookimpl
    def flaggems_operators(self, backend):
        return [
            OpImpl("neg", f"{K}:triton_neg", supports=f"{K}:neg_supports"),
            OpImpl("abs", f"{K}:reentrant_abs"),
        ]


class AcmeVendor:
    """A vendor plugin whose hardware is absent (probe says no)."""

    available = False

    @hookimpl
    def flaggems_backends(self):
        return [Backend("acme", vendor="acme", device_type="acme", dispatch_key="PrivateUse1",
                        probe=self.probe, priority=5)]

    def probe(self):
        return ProbeResult(self.available, "acme device found" if self.available else "no acme device")

    @hookimpl
    def flaggems_operators(self, backend):
        return [OpImpl("neg", f"{K}:vendor_neg", supports=f"{K}:vendor_neg_supports", vendor="acme", priority=1)]

    @hookimpl
    def flaggems_tuning(self):
        return [Tuning("elementwise", {"max_ctas": 12}, vendor="acme")]


class GenericTuning:
    """Generic tuning defaults."""

    @hookimpl
    def flaggems_tuning(self, backend):
        return [Tuning("elementwise", {"max_ctas": None, "block_size": 1024})]


class OtherGenericNeg:
    """A second generic neg at the same priority as GenericNeg (a tie)."""

    @hookimpl
    def flaggems_operators(self):
        return [OpImpl("neg", f"{K}:triton_neg", name="other")]


class Misspelled:
    """Its hook name has a typo: the plugin must be rejected, naming it."""

    @hookimpl
    def flaggems_operator(self, backend):
        return []


class Raising:
    """Its hook raises: the plugin must be disabled, others unaffected."""

    @hookimpl
    def flaggems_operators(self, backend):
        raise RuntimeError("boom")


class BrokenProbe:
    """A vendor whose probe raises: counted as unavailable with the reason."""

    @hookimpl
    def flaggems_backends(self):
        return [Backend("brokenprobe", vendor="brokenprobe", device_type="x", dispatch_key="PrivateUse1",
                        probe=self._probe)]

    @staticmethod
    def _probe():
        raise OSError("driver missing")


class CopyPlugin:
    """copy_ through an interpreted kernel (re-entry from the interpreter)."""

    @hookimpl
    def flaggems_operators(self):
        return [OpImpl("copy_", f"{K}:copy_via_interpreter")]


class DecliningAdd:
    """add.Tensor that always declines: exercises the native call path.

    ``with_supports``: the implementation carries a ``supports`` predicate,
    so the core builds its chain entry rather than the single-implementation one.
    """

    def __init__(self, with_supports: bool = False) -> None:
        self.supports = f"{K}:always_supported" if with_supports else None

    @hookimpl
    def flaggems_operators(self):
        return [OpImpl("add.Tensor", f"{K}:declining_add", supports=self.supports)]


class ReplayNeg:
    """neg (replayable, through the toolkit's launcher), abs with a persistent workspace, sin reading data,
    and cos: neg through the workspace's zeroed state (replayable with a plan-owned state buffer)."""

    @hookimpl
    def flaggems_operators(self):
        return [
            OpImpl("neg", f"{K}:fast_neg", replayable=True),
            OpImpl("abs", f"{K}:neg_with_persistent_workspace", replayable=True),
            OpImpl("sin", f"{K}:neg_reading_data", replayable=True),
            OpImpl("cos", f"{K}:neg_with_scan_state", replayable=True),
        ]


class LimitedVendor:
    """A vendor whose device computes no float64 and whose own torch serves ``abs`` better."""

    @hookimpl
    def flaggems_backends(self):
        return [Backend("limited", vendor="limited", device_type="limited", dispatch_key="PrivateUse1",
                        probe=lambda: ProbeResult(False, "no limited device"), unsupported_dtypes=("float64",),
                        native_ops={"abs": "its own torch serves abs better"})]

    @hookimpl
    def flaggems_operators(self, backend):
        return [OpImpl("neg", f"{K}:vendor_neg", vendor="limited")]


class MisdeclaredDtypes:
    """A backend naming a dtype torch does not have."""

    @hookimpl
    def flaggems_backends(self):
        return [Backend("misdeclared", vendor="misdeclared", device_type="x", dispatch_key="PrivateUse1",
                        probe=lambda: ProbeResult(False, "none"), unsupported_dtypes=("float65",))]
