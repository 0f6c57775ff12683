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


def test_a_front_plans_again_after_the_context_resets(monkeypatch):
    from flaggems.plugins.generic.glu import silu_mul  # the generic implementation, called directly

    read = []
    real = tuning.policy

    def counting(key):
        read.append(key)
        return real(key)

    monkeypatch.setattr(tuning, "policy", counting)
    dev = torch.device(flaggems.backend().device_type)
    gate, up = torch.randn(4, 32, device=dev), torch.randn(4, 32, device=dev)
    want = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(silu_mul(gate, up), want)
    torch.testing.assert_close(silu_mul(gate, up), want)
    assert read.count("glu") == 1  # planned once, then served from the front's cache
    context.reset()  # what a tuning change does (enable() with new tuning, the bench's untuned side)
    torch.testing.assert_close(silu_mul(gate, up), want)
    assert read.count("glu") == 2  # the plan was made again, reading the tuning in force
