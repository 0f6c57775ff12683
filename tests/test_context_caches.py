"""Caches derived from the kernel context die with it: a tuning change reaches every plan a front keeps."""

from __future__ import annotations

import torch

import flaggems
from flaggems.toolkit import context, tuning


def test_a_context_cache_is_emptied_at_every_reset():
    derived = context.cache()
    derived["plan"] = object()
    context.reset()
    assert derived == {}


def test_a_tuning_change_reaches_the_plans_a_front_keeps(monkeypatch):
    from flaggems.plugins.generic import glu  # the generic implementation, called directly

    warps, policies = [], {"glu": tuning.GluPolicy()}
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
    policies["glu"] = tuning.GluPolicy(num_warps=2)
    context.reset()  # what a tuning change does (enable() with new tuning, the bench's untuned side)
    torch.testing.assert_close(glu.silu_mul(gate, up), want)
    assert warps[1:] == [2]  # planned again, with the tuning in force
