"""Vendors extend the generic kernels through tuning, never by copying them."""

from __future__ import annotations

import pytest
import torch

import flaggems
from flaggems.toolkit import reset_policy
from flaggems.toolkit.tuning import elementwise_policy

# Installed means loaded as a plugin (the repository's flaggems_kunlunxin/ folder
# is importable as a namespace package from the root even when not installed).
_RECORD = flaggems.info()["plugins"]
pytestmark = pytest.mark.skipif(
    not any(p["name"] == "kunlunxin" and p["status"] == "loaded" for p in _RECORD),
    reason="flaggems-kunlunxin is not installed")


@pytest.fixture
def kunlunxin(monkeypatch):
    from flaggems.runtime import RUNTIME

    monkeypatch.setenv("FLAGGEMS_VENDOR", "kunlunxin")
    RUNTIME.reset()
    reset_policy()
    yield
    monkeypatch.undo()
    RUNTIME.reset()
    reset_policy()
    flaggems.backend()


def test_kunlunxin_supplies_a_fixed_cta_grid(kunlunxin):
    assert flaggems.tuning("elementwise")["max_ctas"] == 12
    assert elementwise_policy().max_ctas == 12


def test_copy_from_expand_under_the_kunlunxin_policy(kunlunxin):
    # Seed 001: an expanded (non-contiguous) source through the shared strided kernel.
    dev = torch.device(flaggems.backend().device_type)
    src = torch.randn(128, device=dev).expand(40, 128)
    expected = src.clone()
    with flaggems.enabled():
        dst = torch.empty(40, 128, device=dev)
        dst.copy_(src)
        big = torch.empty(300, 70, device=dev)
        big.copy_(torch.arange(70.0, device=dev))  # more tiles than CTAs: the grid-stride loop
    assert torch.equal(dst, expected)
    assert torch.equal(big, torch.arange(70.0, device=dev).expand(300, 70))
