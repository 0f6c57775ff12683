"""When kernels may use programmatic dependent launch (``flaggems.toolkit.dependent_launch``)."""

from __future__ import annotations

import pytest
import torch
from conftest import set_kernel_context

from flaggems.toolkit import context
from flaggems.toolkit import dependent_launch as dl

SM90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None
                          or torch.cuda.get_device_capability(0)[0] < 9, reason="needs an NVIDIA sm_90+ GPU")


@pytest.fixture(autouse=True)
def fresh_answers():
    context.reset()
    yield
    context.reset()


def test_never_off_cuda(monkeypatch):
    """CPU tensors (and any other non-CUDA device) never ask the CUDA runtime anything."""
    monkeypatch.setattr(dl, "_available", lambda device: pytest.fail("asked about a non-CUDA device"))
    assert dl.dependent_launch(torch.empty(1)) is False
    assert dl.dependent_launch(torch.empty(1, device="meta")) is False


@pytest.fixture
def hopper(monkeypatch):
    """A compiled (not interpreted) backend on an sm_90 device with a Triton that has ``launch_pdl``."""
    if torch.version.hip is not None or not dl._GDC:
        pytest.skip("ROCm torch or a Triton without grid dependency control")
    set_kernel_context(monkeypatch, interpreter=False)
    monkeypatch.setattr(dl, "_triton_has_pdl_option", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    monkeypatch.delenv("FLAGGEMS_DEPENDENT_LAUNCH", raising=False)


def test_the_decision(hopper, monkeypatch):
    assert dl._available(0) is True
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    assert dl._available(0) is False


def test_a_failing_capability_query_means_no(hopper, monkeypatch):
    def broken(device):
        raise RuntimeError("no driver")

    monkeypatch.setattr(torch.cuda, "get_device_capability", broken)
    assert dl._available(0) is False


def test_turned_off_by_the_environment(hopper, monkeypatch):
    monkeypatch.setenv("FLAGGEMS_DEPENDENT_LAUNCH", "0")
    monkeypatch.setattr(context, "_CURRENT", None)  # the context reads the variable again
    set_kernel_context(monkeypatch, interpreter=False)
    assert dl._available(0) is False


def test_never_under_the_interpreter(hopper, monkeypatch):
    set_kernel_context(monkeypatch, interpreter=True)
    assert dl._available(0) is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_answer_is_cached_per_device(monkeypatch):
    calls = []
    monkeypatch.setattr(dl, "_available", lambda device: calls.append(device) or False)
    x = torch.empty(1, device="cuda")
    assert not dl.dependent_launch(x) and not dl.dependent_launch(x)
    assert calls == [x.get_device()]


@SM90
def test_on_by_default_on_hopper(monkeypatch):
    monkeypatch.delenv("FLAGGEMS_DEPENDENT_LAUNCH", raising=False)
    assert dl.dependent_launch(torch.empty(1, device="cuda")) is True
