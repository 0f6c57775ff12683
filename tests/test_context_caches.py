"""Caches derived from the kernel context die with it: a tuning change reaches every plan a front keeps."""

from __future__ import annotations

import torch

import flaggems
from flaggems.ops.glu.policy import GluPolicy
from flaggems.toolkit import context, tuning


def test_a_context_cache_is_emptied_at_every_reset():
    derived = context.cache()
    derived["plan"] = object()
    context.reset()
    assert derived == {}


def test_a_tuning_change_reaches_the_plans_a_front_keeps(monkeypatch):
    from flaggems.plugins.generic import glu  # the generic implementation, called directly

    warps, policies = [], {"glu": GluPolicy()}
    real_launcher = glu._launcher

    def recording(kernel, num_warps, **flags):
        warps.append(num_warps)
        return real_launcher(kernel, num_warps, **flags)

    monkeypatch.setattr(glu, "_launcher", recording)
    monkeypatch.setattr(tuning, "policy", lambda key: policies[key])
    dev = torch.device(flaggems.backend().device_type)
    gate, up = torch.randn(4, 32, device=dev), torch.randn(4, 32, device=dev)
    want = torch.nn.functional.silu(gate) * up
    for _ in range(2):
        torch.testing.assert_close(glu.silu_mul(gate, up), want)
    assert len(warps) == 1 and warps[0] != 2  # planned once (the derived warps), then served from the cache
    policies["glu"] = GluPolicy(num_warps=2)
    context.reset()  # what a tuning change does (enable() with new tuning, the bench's untuned side)
    torch.testing.assert_close(glu.silu_mul(gate, up), want)
    assert warps[1:] == [2]  # planned again, with the tuning in force


def test_a_tuning_change_empties_every_cache_and_the_compiled_plans(compiled_for):
    """One invalidation: a new context (new tuning) leaves no cache derived from the old one, compiled plans
    included; the calls after it plan again and give torch's results."""
    import dataclasses

    from flaggems.runtime import RUNTIME

    dev = torch.device(flaggems.backend().device_type)
    x = torch.randn(6, 64, device=dev)
    index = torch.tensor([0, 5, 2], device=dev)

    def calls():
        torch.testing.assert_close(x.index_select(0, index), x.cpu().index_select(0, index.cpu()).to(dev))
        torch.testing.assert_close(x.t().contiguous(), x.cpu().t().contiguous().to(dev))
        gate, up = x[:, :32], x[:, 32:]
        torch.testing.assert_close(torch.ops.flaggems.silu_mul(gate, up), torch.nn.functional.silu(gate) * up)
        weight = torch.ones(64, device=dev)
        torch.testing.assert_close(torch.ops.flaggems.rms_norm(x, weight, 1e-6),
                                   flaggems.ops.rms_norm(x, weight, 1e-6))

    compiled_for(["index_select", "copy_", "flaggems::silu_mul", "flaggems::rms_norm"])
    for _ in range(2):
        calls()
    planned = sum(stats.get("plans", 0) for stats in RUNTIME._binding.plan_stats().values())
    filled = [derived for derived in list(context._CACHES.values()) if derived]
    assert planned and len(filled) >= 3  # the calls went through plans and the fronts' caches

    tuned = lambda key: {"num_warps": 2} if key == "glu" else {}  # noqa: E731 - one line of tuning
    context.install(dataclasses.replace(context.current(), tuning=tuned, _facts={}))
    assert [derived for derived in list(context._CACHES.values()) if derived] == []
    assert sum(stats.get("plans", 0) for stats in RUNTIME._binding.plan_stats().values()) == 0
    assert tuning.policy("glu").num_warps == 2
    calls()  # planned anew under the new context: still torch's results
    context.reset()
