"""Shared fixtures.

The backend is selected before any test module imports Triton kernels, so
that on a machine without a GPU ``TRITON_INTERPRET=1`` is in force when the
kernels are decorated.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable

import pytest

sys.path.insert(0, os.path.dirname(__file__))
if os.environ.get("FAKE_TORCH_NPU") == "1" and importlib.util.find_spec("torch_npu") is None:
    # A CPU-backed PrivateUse1 ``npu`` device and a torch_npu stand-in (tests/fakes/torch_npu): the Ascend
    # probe finds it and the suite runs on a real PrivateUse1 key without Ascend hardware (a real
    # torch_npu, where installed, is used instead).
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fakes"))

import flaggems  # noqa: E402
from flaggems import log  # noqa: E402
from flaggems.runtime import RUNTIME  # noqa: E402

flaggems.backend()


def set_kernel_context(monkeypatch, **changes) -> None:
    """Replace fields of the kernel context for one test (``checks=False``: as on a GPU by default)."""
    import dataclasses

    from flaggems.toolkit import context

    changed = dataclasses.replace(context.current(), **changes, _facts={})
    monkeypatch.setattr(context, "_CURRENT", context._CURRENT)  # restored after the test (then reset, below)
    context.install(changed)


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Every test plans its calls anew: tests change planner constants the compiled entry's keys cannot see."""
    RUNTIME.clear_plans()
    from flaggems.toolkit import context

    context.reset()  # and every cache derived from the kernel context (a test may have replaced it)
    yield


@pytest.fixture
def compiled_for(monkeypatch):
    """``compiled_for(ops)``: flaggems enabled for ``ops`` through the compiled entry (the test skips where
    the entry cannot be built); disabled and the entry's load decision forgotten after."""
    from flaggems import compiled

    monkeypatch.setenv("FLAGGEMS_ENTRY", "compiled")
    compiled.reset()
    flaggems.disable()
    if compiled.load()[0] is None:
        pytest.skip("the compiled entry cannot be built here")
    yield lambda ops: flaggems.enable(include=ops)
    flaggems.disable()
    compiled.reset()


@pytest.fixture
def runtime(monkeypatch):
    """The process runtime with no installed plugin (core tests register fakes).

    Restores plugins, records, backend choice and FLAGGEMS_* variables after.
    """
    saved_records = dict(RUNTIME.manager.records)
    saved_plugins = list(RUNTIME.manager.pm.list_name_plugin())
    for key in [k for k in os.environ if k.startswith("FLAGGEMS_") and k != "FLAGGEMS_CHECK_INDICES"]:
        monkeypatch.delenv(key)
    RUNTIME.disable()
    for name, _ in saved_plugins:
        RUNTIME.manager.unregister(name)
    RUNTIME._active = None  # tests register backends, then select
    yield RUNTIME
    RUNTIME.disable()
    for name, _ in list(RUNTIME.manager.pm.list_name_plugin()):
        RUNTIME.manager.pm.unregister(name=name)
    for name, plugin in saved_plugins:
        RUNTIME.manager.pm.register(plugin, name=name)
    RUNTIME.manager.records.clear()
    RUNTIME.manager.records.update(saved_records)
    RUNTIME._active = None
    monkeypatch.undo()
    for channel in log.CHANNELS:  # enable() under FLAGGEMS_LOG switched them on for the process
        log.logger(channel).setLevel(logging.NOTSET)
    flaggems.backend()


def install_acme(runtime, monkeypatch, **backend_changes):
    """The vendor guide's plugin (examples/acme_gems) registered beside the generic one and selected
    (``FLAGGEMS_VENDOR=acme``), for a fixture to ``yield from``; forgotten after. ``backend_changes``: fields of
    its backend record replaced (the plugin's operators, cases, tuning and variables are the example's own)."""
    import dataclasses
    from pathlib import Path

    from flaggems import config, testing

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "examples" / "acme_gems" / "src"))
    import acme_gems

    import flaggems.plugins.generic as generic

    if backend_changes:
        monkeypatch.setattr(acme_gems, "ACME", dataclasses.replace(acme_gems.ACME, **backend_changes))
    runtime.manager.register(generic, "generic")
    runtime.manager.register(acme_gems, "acme")
    runtime.declare_env_vars()
    monkeypatch.setenv("FLAGGEMS_VENDOR", "acme")
    monkeypatch.setattr(testing, "_LOADED", False)  # the kit reads the plugin's cases anew
    yield runtime
    config.REGISTRY.pop("FLAGGEMS_ACME_NEG_BLOCK", None)
    sys.modules.pop("acme_gems", None)


@pytest.fixture
def dispatch_log(monkeypatch, caplog):
    """Enable flaggems with the dispatch and fallback channels recorded."""
    monkeypatch.setenv("FLAGGEMS_LOG", "dispatch,fallback")
    with caplog.at_level(logging.INFO, logger="flaggems"):
        flaggems.enable()
        yield caplog
        flaggems.disable()
    for channel in log.CHANNELS:  # enable() switched them on; later enables must not see them on
        log.logger(channel).setLevel(logging.NOTSET)


def ran(caplog) -> set[str]:
    """Dispatch/fallback messages recorded (the interpreter's re-entered internal copies left out)."""
    return {r.getMessage() for r in caplog.records if "re-entered" not in r.getMessage()}


def in_threads(work: Callable[[int], None], count: int) -> None:
    """Run ``work(0)`` to ``work(count - 1)`` each in a thread of its own, all started at once; return when every
    one has finished."""
    threads = [threading.Thread(target=work, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


#: The head of a :func:`run_compiled` script: ``sm90_ptx(fn, constexprs, dtype, pointers)``, the PTX of the Triton
#: kernel ``fn`` built for an H100/H200 target (4 warps), its arguments named in ``pointers`` pointers to ``dtype``
#: aligned to 16 bytes, the others of their annotated type (``i64`` where none).
SM90_PTX = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def sm90_ptx(fn, constexprs, dtype, pointers):
    types = {n: "*" + dtype for n in pointers}
    sig = {p.name: "constexpr" if p.name in constexprs else types.get(p.name, p.annotation_type or "i64")
           for p in fn.params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params) if sig[p.name][0] == "*"}
    src = ASTSource(fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
"""


def run_compiled(script: str) -> None:
    """Run ``script`` in a fresh Python without ``TRITON_INTERPRET``; it must print ``ok`` last.

    The sm_90 compile checks use it: Triton compiles for a GPU target without
    needing one, which the interpreter in this process would skip.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@pytest.fixture
def unchecked(monkeypatch):
    """Run as on a GPU without FLAGGEMS_CHECK_INDICES: no synchronous checks."""
    from flaggems.toolkit import context

    set_kernel_context(monkeypatch, checks=False)
    with flaggems.enabled():
        yield
    context.reset()
