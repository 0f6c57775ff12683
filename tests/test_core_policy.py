"""Dispatch policy: default order, override precedence, ties, strict mode."""

from __future__ import annotations

import pytest

import flaggems
from flaggems.manager import PluginError
from flaggems.policy import PolicyError, normalize_op
from flaggems_fakes.plugins import AcmeVendor, GenericNeg, OtherGenericNeg


def chain_of(op: str) -> list[str]:
    (row,) = flaggems.routes(op)
    return row["chain"]


def with_vendor(runtime, monkeypatch, vendor, name: str):
    """The fake generic plugin and ``vendor`` (registered as ``name``) installed, the vendor's backend selected."""
    runtime.manager.register(GenericNeg(), "fake-generic")
    runtime.manager.register(vendor, name)
    monkeypatch.setenv("FLAGGEMS_VENDOR", name)
    runtime._active = None
    return runtime


@pytest.fixture
def acme(runtime, monkeypatch):
    return with_vendor(runtime, monkeypatch, AcmeVendor(), "acme")


def test_normalize_op():
    assert normalize_op("aten::copy_.default") == "copy_"
    assert normalize_op("repeat_interleave.Tensor") == "repeat_interleave.Tensor"


def test_default_chain_vendor_then_generic_then_native(acme):
    assert chain_of("neg") == ["acme", "fake-generic", "native"]
    (row,) = flaggems.routes("neg")
    assert row["chosen"] == "acme" and row["source"] == "default"
    assert row["declines"] == ["acme", "fake-generic"]


def test_vendor_impls_ignored_on_other_backend(runtime):
    runtime.manager.register(GenericNeg(), "fake-generic")
    runtime.manager.register(AcmeVendor(), "acme")
    assert chain_of("neg") == ["fake-generic", "native"]


@pytest.mark.parametrize("force, chain", [("generic", ["fake-generic", "native"]),
                                          ("vendor", ["acme", "native"]),  # abs: no vendor impl
                                          ("native", ["native"])])
def test_force(acme, monkeypatch, force, chain):
    monkeypatch.setenv("FLAGGEMS_FORCE", force)
    assert chain_of("neg") == chain
    assert chain_of("abs") == (["native"] if force != "generic" else ["fake-generic", "native"])


def test_precedence_enable_over_env_over_file_over_force(acme, monkeypatch, tmp_path):
    routes = tmp_path / "routes.toml"
    routes.write_text('neg = "vendor"\nabs = "native"\n')
    monkeypatch.setenv("FLAGGEMS_FORCE", "native")
    monkeypatch.setenv("FLAGGEMS_ROUTES", str(routes))
    assert chain_of("neg") == ["acme", "native"]  # file beats force
    assert chain_of("abs") == ["native"]
    monkeypatch.setenv("FLAGGEMS_OP_neg", "generic")
    assert chain_of("neg") == ["fake-generic", "native"]  # env beats file
    (row,) = flaggems.routes("neg")
    assert row["source"] == "FLAGGEMS_OP_neg=generic"
    with flaggems.enabled(exclude=["neg"]):  # enable() beats env
        assert chain_of("neg") == ["native"]
        assert acme.registered_ops() == []  # abs native by file, neg excluded
    with flaggems.enabled(include=["abs"]):  # include beats the file's abs = "native"
        assert chain_of("neg") == ["native"]
        assert chain_of("abs") == ["fake-generic", "native"]


def test_per_op_env_with_overload_dots(runtime, monkeypatch):
    monkeypatch.setenv("FLAGGEMS_OP_repeat_interleave__Tensor", "native")
    from flaggems import config

    assert config.op_overrides() == {"repeat_interleave.Tensor": "native"}


def test_route_naming_a_plugin(acme, monkeypatch):
    monkeypatch.setenv("FLAGGEMS_OP_neg", "fake-generic")
    assert chain_of("neg") == ["fake-generic", "native"]


def test_unmatched_route_warns_and_strict_raises(acme, monkeypatch):
    monkeypatch.setenv("FLAGGEMS_OP_neg", "nosuchvendor")
    with pytest.warns(RuntimeWarning, match="matches no installed implementation"):
        assert chain_of("neg") == ["acme", "fake-generic", "native"]
    monkeypatch.setenv("FLAGGEMS_STRICT", "1")
    with pytest.raises(PolicyError, match="nosuchvendor"):
        flaggems.routes("neg")


def test_equal_priority_is_deterministic_with_warning(runtime, monkeypatch):
    runtime.manager.register(OtherGenericNeg(), "zz-other")
    runtime.manager.register(GenericNeg(), "fake-generic")
    with pytest.warns(RuntimeWarning, match="equal priority"):
        assert chain_of("neg") == ["fake-generic", "zz-other:other", "native"]
    monkeypatch.setenv("FLAGGEMS_STRICT", "true")
    with pytest.raises(PolicyError, match="equal priority"):
        flaggems.routes()


def test_include_of_unknown_op_is_reported(runtime):
    runtime.manager.register(GenericNeg(), "fake-generic")
    with flaggems.enabled(include=["neg", "nosuchop"]):
        (row,) = flaggems.routes("nosuchop")
        assert row["chain"] == ["native"] and "no implementation" in row["reason"]


def test_routes_file_bad_value(acme, monkeypatch, tmp_path):
    routes = tmp_path / "routes.toml"
    routes.write_text("neg = 3\n")
    monkeypatch.setenv("FLAGGEMS_ROUTES", str(routes))
    with pytest.raises(PolicyError, match="must be non-empty strings"):
        flaggems.routes()


def test_tuning_vendor_overrides_generic(acme):
    from flaggems_fakes.plugins import GenericTuning

    acme.manager.register(GenericTuning(), "tuning")
    assert flaggems.tuning("elementwise") == {"max_ctas": 12, "block_size": 1024}


class _BadTuning:
    def __init__(self, key, values):
        self.key, self.values = key, values

    @flaggems.hookimpl
    def flaggems_tuning(self, backend):
        return [flaggems.Tuning(self.key, self.values)]


@pytest.mark.parametrize("key,values,message", [
    ("elementwise", {"blok_size": 256}, r"plugin 'bad-tuning'.*tuning elementwise: unknown field 'blok_size'; "
                                        r"did you mean 'block_size'\?"),
    ("elementwse", {"block_size": 256}, r"plugin 'bad-tuning'.*unknown tuning key 'elementwse'; "
                                        r"did you mean 'elementwise'\?"),
    ("elementwise", {"block_size": 300}, r"plugin 'bad-tuning'.*block_size=300: expected a power of two"),
    ("glu", {"tile": 1000}, r"plugin 'bad-tuning'.*glu.tile=1000: expected a power of two"),
    ("glu", {"num_warps": 3}, r"plugin 'bad-tuning'.*glu.num_warps=3: expected 0 or a power of two"),
    ("rotary_embedding", {"tiles": 512}, r"plugin 'bad-tuning'.*rotary_embedding: unknown field 'tiles'"),
])
def test_bad_tuning_fails_at_enable_naming_the_plugin(acme, key, values, message):
    acme.manager.register(_BadTuning(key, values), "bad-tuning")
    with pytest.raises(PluginError, match=message):
        flaggems.enable()
    flaggems.disable()


@pytest.mark.parametrize("key,values", [("glu", {"tile": 512, "num_warps": 2}),
                                        ("rotary_embedding", {"tile": 1024, "num_warps": 8})])
def test_the_fused_kernels_read_their_tuning_as_typed_policies(acme, key, values):
    from flaggems.toolkit import tuning

    acme.manager.register(_BadTuning(key, values), "good-tuning")
    flaggems.enable()
    try:
        policy = tuning.policy(key)
        assert (policy.tile, policy.num_warps) == (values["tile"], values["num_warps"])
    finally:
        flaggems.disable()


def test_overrides_naming_an_unknown_op_warn_with_the_closest_names(runtime, monkeypatch):
    from flaggems_fakes.plugins import GenericNeg

    runtime.manager.register(GenericNeg(), "fake-generic")
    monkeypatch.setenv("FLAGGEMS_OP_ne", "native")
    with pytest.warns(RuntimeWarning, match=r"FLAGGEMS_OP_ne names 'ne', which no installed plugin implements; "
                                            r"did you mean neg"):
        flaggems.routes()
    with pytest.warns(RuntimeWarning, match=r"enable\(include=...\) names 'abss'.*did you mean abs"):
        flaggems.enable(include=["abss"])  # the routes computed again at enable() warn about FLAGGEMS_OP_ne too
    flaggems.disable()


@pytest.fixture
def limited(runtime, monkeypatch):
    from flaggems_fakes.plugins import LimitedVendor

    return with_vendor(runtime, monkeypatch, LimitedVendor(), "limited")


def test_a_backends_unsupported_dtype_goes_native_on_every_link(limited):
    import torch

    from flaggems_fakes import kernels

    (row,) = flaggems.routes("neg")
    assert row["chain"] == ["limited", "fake-generic", "native"] and row["unsupported_dtypes"] == ["float64"]
    assert row["declines"] == ["limited", "fake-generic"]
    from flaggems import testing

    dev = testing.device()
    kernels.CALLS.clear()
    with flaggems.enabled():
        x64, x32 = torch.randn(5, dtype=torch.float64, device=dev), torch.randn(5, device=dev)
        assert torch.equal(torch.neg(x64), x64 * -1) and torch.equal(torch.neg(x32), x32 * -1)
        (row,) = flaggems.routes("neg")
    assert kernels.CALLS == ["vendor_neg"]  # the float32 call only
    declined = {(d["impl"], d["reason"]) for d in row["declined"]}
    reason = "torch.float64: the limited backend computes no float64"
    assert declined == {("limited", reason), ("fake-generic", reason)}


def test_the_kit_holds_a_backends_dtype_limits(limited, monkeypatch):
    import torch

    from flaggems import testing

    testing.cases_for("neg")  # the kit's own and the plugins' cases are loaded first
    monkeypatch.setitem(testing._CASES, "neg", [testing.Case("vector", lambda dev: ((torch.randn(3),), {}))])
    item = next(i for i in testing.collect(["neg"]) if i.label == "fake-generic")
    assert item.supports(torch.zeros(2, dtype=torch.float64)).endswith("computes no float64")
    assert item.supports(torch.zeros(2)) is True


def test_a_backends_native_ops_stay_native_unless_overridden(limited, monkeypatch):
    (row,) = flaggems.routes("abs")
    assert row["chain"] == ["native"] and row["source"] == "backend limited"
    assert row["reason"] == "native on limited: its own torch serves abs better"
    assert row["candidates"] == ["fake-generic (generic, priority 0)"]
    flaggems.enable(include=["abs", "neg"])  # naming it routes it
    assert chain_of("abs") == ["fake-generic", "native"]
    flaggems.disable()
    monkeypatch.setenv("FLAGGEMS_OP_abs", "generic")
    assert chain_of("abs") == ["fake-generic", "native"]


def test_an_unknown_unsupported_dtype_is_an_error_naming_the_plugin(runtime):
    from flaggems_fakes.plugins import MisdeclaredDtypes

    runtime.manager.register(MisdeclaredDtypes(), "misdeclared")
    with pytest.raises(PluginError, match=r"backend 'misdeclared' of plugin 'misdeclared'.*'float65', not torch"):
        flaggems.backend()
