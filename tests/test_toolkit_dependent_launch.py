"""When kernels may use programmatic dependent launch (``flaggems.toolkit.dependent_launch``)."""

from __future__ import annotations

import pytest
import torch

from flaggems.toolkit import dependent_launch as dl

SM90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None
                          or torch.cuda.get_device_capability(0)[0] < 9, reason="needs an NVIDIA sm_90+ GPU")


@pytest.fixture(autouse=True)
def fresh_answers():
    dl.reset()
    yield
    dl.reset()


def test_never_for_cpu_tensors():
    assert dl.dependent_launch(-1) is False


def test_the_answer_is_cached_per_device(monkeypatch):
    calls = []
    monkeypatch.setattr(dl, "_available", lambda device: calls.append(device) or False)
    assert not dl.dependent_launch(-1) and not dl.dependent_launch(-1)
    assert calls == [-1]


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("FLAGGEMS_DEPENDENT_LAUNCH", "0")
    devices = [-1] + list(range(torch.cuda.device_count()))
    assert not any(dl.dependent_launch(d) for d in devices)


@SM90
def test_on_by_default_on_hopper(monkeypatch):
    monkeypatch.delenv("FLAGGEMS_DEPENDENT_LAUNCH", raising=False)
    assert dl.dependent_launch(0) is True
