"""Enabling and disabling while other threads call routed ops (issue: a toggling thread crashed the process).

Each run is a fresh process: a crash in the dispatcher must fail the test, not end the test session.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

STRESS = r"""
import sys, threading, time
import torch
import flaggems
from flaggems.binding import native_scope

flaggems.enable()
stop = threading.Event()
errors, calls = [], [0]

def work(seed):
    gen = torch.Generator().manual_seed(seed)
    index = torch.tensor([3, 0, 2])
    while not stop.is_set():
        x = torch.randn(4, 8, generator=gen)
        try:
            out = torch.empty(4, 8)
            out.copy_(x)
            picked = x.index_select(0, index)
            half = x.to(torch.float16)
            with native_scope():
                want = (x.clone(), x.index_select(0, index), x.to(torch.float16))
            if not (torch.equal(out, want[0]) and torch.equal(picked, want[1]) and torch.equal(half, want[2])):
                errors.append("wrong result")
            calls[0] += 1
        except Exception as exc:  # noqa: BLE001 - every error is a failure of the test
            errors.append(f"{type(exc).__name__}: {exc}")

threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
for t in threads:
    t.start()
deadline = time.monotonic() + float(sys.argv[1])
toggles = 0
while time.monotonic() < deadline:
    flaggems.disable()
    time.sleep(0.005)
    flaggems.enable()
    toggles += 1
stop.set()
for t in threads:
    t.join()
flaggems.release()
x = torch.randn(5)
assert torch.equal(x.to(torch.float16), x.half())
print("toggles", toggles, "calls", calls[0], "errors", len(errors), errors[:3])
print("ok" if not errors and calls[0] > 0 and toggles > 10 else "failed")
"""


@pytest.mark.parametrize("entry", ["auto", "python"])
def test_toggling_under_running_calls_neither_crashes_nor_errs(entry, monkeypatch):
    monkeypatch.setenv("FLAGGEMS_ENTRY", entry)
    done = subprocess.run([sys.executable, "-c", STRESS, "4"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stdout[-2000:]} {done.stderr[-3000:]}"
    assert done.stdout.strip().endswith("ok"), done.stdout[-2000:]


def test_disable_keeps_registrations_and_release_removes_them():
    import torch

    import flaggems
    from flaggems.binding import _PY_SLOTS, NativeKernel

    flaggems.enable()
    flaggems.disable()
    native = NativeKernel.capture("index_select", flaggems.backend().dispatch_key)
    device = flaggems.backend().device_type
    x, index = torch.randn(6, 3, device=device), torch.tensor([5, 1], device=device)
    assert torch.equal(x.index_select(0, index), native(x, 0, index))
    flaggems.release()
    assert not _PY_SLOTS
    flaggems.enable()
    assert torch.equal(x.index_select(0, index), x[[5, 1]])
    flaggems.disable()


@pytest.mark.parametrize("entry", ["compiled", "python"])
def test_a_disabled_composite_op_records_torchs_graph(entry, monkeypatch):
    """After ``disable()`` a CompositeImplicitAutograd op decomposes as torch's own (no "autograd kernel was
    not registered" node): the slot on its Autograd key forwards to the kernel captured before any
    registration, not to the fallback that key gets once its backend key holds one."""
    import warnings

    import torch

    import flaggems
    from flaggems import compiled

    monkeypatch.setenv("FLAGGEMS_ENTRY", entry)
    compiled.reset()
    device = flaggems.backend().device_type
    x = torch.randn(3, 8, device=device, requires_grad=True)
    flaggems.enable()
    torch.repeat_interleave(x, 2, dim=0).sum().backward()
    flaggems.disable()
    compiled.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.repeat_interleave(x, 2, dim=0).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 4.0))


def test_the_compiled_entry_still_serves_after_the_python_entry_registered_over_it(monkeypatch):
    """Registrations of both entries stack (a process that switched ``FLAGGEMS_ENTRY``): a switched-off
    Python registration made over the compiled one forwards to it, not past it to torch's kernel."""
    import torch

    import flaggems
    from flaggems import binding, compiled
    from flaggems.runtime import RUNTIME

    x = torch.randn(6, 3, device=flaggems.backend().device_type)
    for entry in ("compiled", "python", "compiled"):
        monkeypatch.setenv("FLAGGEMS_ENTRY", entry)
        compiled.reset()
        flaggems.enable()
        for _ in range(2):
            with binding.native_scope():
                want = x.to(torch.float16)
            assert torch.equal(x.to(torch.float16), want)
        if entry == "python":
            flaggems.disable()
    stats = RUNTIME.plan_stats()[f"aten::_to_copy@{flaggems.backend().dispatch_key}"]
    flaggems.disable()
    compiled.reset()
    assert stats["miss"] == 1 and stats["replay"] == 1, stats
