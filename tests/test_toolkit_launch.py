"""FastLauncher: results, interpreter scope, and the fast path's binding logic.

The binding logic (specialisation keys, when to re-bind, the launcher call)
is checked on any machine with a fake compiled kernel; the real fast path
runs where the active backend has a GPU.
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
from conftest import in_threads, set_kernel_context

import flaggems

ACTIVE = flaggems.backend()  # before decorating kernels: may switch Triton to its interpreter

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from flaggems import binding  # noqa: E402
from flaggems.toolkit import FastLauncher, launch, raw_launch  # noqa: E402

DEVICE = ACTIVE.device_type


@triton.jit
def scale_kernel(out, x, n, factor, BLOCK: tl.constexpr):  # noqa: N803
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out + offs, tl.load(x + offs, mask=mask) * factor, mask=mask)


def test_results_match_the_reference():
    launcher = FastLauncher(scale_kernel, {"BLOCK": 64}, num_warps=2)
    for n in (100, 64, 1, 300, 100, 100):
        x = torch.randn(n, device=DEVICE)
        out = torch.full_like(x, float("nan"))
        launcher((triton.cdiv(n, 64),), out, x, n, 2.0)
        torch.testing.assert_close(out, x * 2.0)
    if ACTIVE.interpreter:
        assert launcher.mode == launch.INTERPRET
    elif launch.triton_version() is not None and launch.FAST_PATH_VERSIONS[0] <= launch.triton_version():
        assert launcher.mode == launch.FAST and launcher.specialisations >= 1


@pytest.mark.skipif(not ACTIVE.interpreter, reason="interpreter only")
def test_interpreted_launch_runs_in_native_scope(monkeypatch):
    inside = [False]
    seen = []

    @contextlib.contextmanager
    def recording_scope():
        with binding.native_scope():
            inside[0] = True
            try:
                yield
            finally:
                inside[0] = False

    set_kernel_context(monkeypatch, native_scope=recording_scope)  # the scope the core hands down
    scale_kernel.add_pre_run_hook(lambda *args, **kwargs: seen.append(inside[0]))
    try:
        x = torch.randn(8)
        FastLauncher(scale_kernel, {"BLOCK": 8})((1,), torch.empty_like(x), x, 8, 1.0)
    finally:
        scale_kernel.pre_run_hooks.clear()
    assert seen == [True]


def test_constexpr_arguments_are_checked():
    with pytest.raises(TypeError, match="NOPE"):
        FastLauncher(scale_kernel, {"BLOCK": 8, "NOPE": 1})
    with pytest.raises(TypeError, match="BLOCK"):
        FastLauncher(scale_kernel)


# -- the fast path with a fake compiled kernel ------------------------------


def _probe(out, x, n, m: tl.int64, factor, BLOCK: tl.constexpr):  # noqa: N803
    pass


class FakeCompiled:
    """Stands for Triton's CompiledKernel: records raw launcher calls."""

    function = 1234
    packed_metadata = "metadata"

    def __init__(self, launches: list) -> None:
        self.run = lambda *args: launches.append(args)


class FakeDevice:
    def current(self) -> int:
        return 0

    def stream(self, index: int) -> int:
        return 77

    @contextlib.contextmanager
    def guard(self, index: int):
        yield


@pytest.fixture
def probe(monkeypatch):
    """A real (compiled-mode) JITFunction whose ``run`` is faked; returns (launcher, slow calls, raw launches)."""
    fn = triton.runtime.jit.JITFunction(_probe, do_not_specialize=["m"])
    slow, raw = [], []

    def fake_run(*args, grid, warmup, **kwargs):
        slow.append((grid, args, kwargs))
        return FakeCompiled(raw)

    monkeypatch.setattr(fn, "run", fake_run)
    monkeypatch.setattr(launch, "_DEVICE", FakeDevice())
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    return FastLauncher(fn, {"BLOCK": 32}, num_warps=4), slow, raw


def test_first_call_binds_then_launches_raw(probe):
    launcher, slow, raw = probe
    out, x = torch.empty(64), torch.randn(64)
    launcher((2,), out, x, 50, 7, 2.0)
    assert len(slow) == 1 and not raw
    grid, args, kwargs = slow[0]
    assert grid == (2,) and args[:3] == (out, x, 50) and args[5] == 32 and kwargs == {"num_warps": 4}
    launcher((3, 2), out, x, 50, 7, 2.0)
    assert len(slow) == 1
    assert raw == [(3, 2, 1, 77, 1234, "metadata", None, None, None, out.data_ptr(), x.data_ptr(), 50, 7, 2.0, 32)]


def test_specialisation_keys(probe):
    launcher, slow, raw = probe
    out, x = torch.empty(64), torch.randn(64)

    def binds_after(*args) -> bool:
        before = len(slow)
        launcher((1,), *args)
        return len(slow) > before

    assert binds_after(out, x, 50, 7, 2.0)
    assert not binds_after(out, x, 51, 1 << 40, 3.5)  # n % 16 unchanged; m is annotated, not specialised
    assert binds_after(out, x, 48, 7, 2.0)  # n % 16 == 0 is a specialisation
    assert binds_after(out, x, 1, 7, 2.0)  # so is n == 1
    assert binds_after(out, x.double(), 50, 7, 2.0)  # pointer dtype
    assert binds_after(out, x[1:], 50, 7, 2.0)  # pointer alignment
    assert binds_after(out, x, 50, 7, 2)  # an int where a float was
    assert binds_after(out, x, 2**40 + 3, 7, 2.0)  # a 64-bit n
    assert not binds_after(out, x, 50, 7, 2.0)
    assert launcher.specialisations == 7 and len(raw) == 2


def test_hooks_send_launches_through_triton(probe, monkeypatch):
    launcher, slow, raw = probe
    out, x = torch.empty(64), torch.randn(64)
    launcher((1,), out, x, 50, 7, 2.0)
    # A profiler's launch hook, installed where Triton keeps it (the fast path reads it there on every call).
    monkeypatch.setattr(raw_launch, "_RUNTIME", types.SimpleNamespace(launch_enter_hook=print, launch_exit_hook=None))
    launcher((1,), out, x, 50, 7, 2.0)
    assert len(slow) == 2 and not raw


def test_unknown_triton_version_stays_plain(monkeypatch):
    fn = triton.runtime.jit.JITFunction(_probe)
    calls = []
    monkeypatch.setattr(fn, "run", lambda *a, grid, warmup, **k: calls.append(grid))
    monkeypatch.setattr(launch, "_DEVICE", FakeDevice())
    monkeypatch.setattr(triton, "__version__", "4.1.0")
    launcher = FastLauncher(fn, {"BLOCK": 32})
    assert launcher.mode == launch.PLAIN and "outside" in launcher.reason
    for _ in range(3):
        launcher((1,), torch.empty(4), torch.empty(4), 4, 7, 1.0)
    assert calls == [(1,)] * 3 and launcher.specialisations == 0


def test_unsupported_argument_kind_goes_plain(probe):
    launcher, slow, raw = probe
    launcher((1,), torch.empty(4), None, 4, 7, 1.0)
    launcher((1,), torch.empty(4), None, 4, 7, 1.0)
    assert launcher.mode == launch.PLAIN and len(slow) == 2 and not raw


# -- raw launch forms -------------------------------------------------------


class CudaLauncher:
    """Named like triton's launcher: records calls of its C launch function."""

    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self, scratch: int = 0) -> None:
        self.global_scratch_size = scratch
        self.profile_scratch_size = 0
        self.calls: list = []
        self.launch = lambda *args: self.calls.append(args)


def test_driver_form_only_for_checked_versions(monkeypatch):
    kernel = FakeCompiled([])
    kernel.run = CudaLauncher()
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    launch_fn, form = raw_launch.bind_launch(kernel)
    launch_fn(4, 1, 1, 77, "a", 2)
    assert form == "driver"
    assert kernel.run.calls == [(4, 1, 1, 77, 1234, False, True, None, None, "metadata", None, None, None, "a", 2)]
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    assert raw_launch.bind_launch(kernel)[1] == "compiled"
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    kernel.run = CudaLauncher(scratch=64)
    assert raw_launch.bind_launch(kernel)[1] == "compiled"


def test_hooks_idle(monkeypatch):
    runtime = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    monkeypatch.setattr(raw_launch, "_RUNTIME", runtime)
    assert raw_launch.hooks_idle()
    runtime.launch_exit_hook = print
    assert not raw_launch.hooks_idle()
    chain = getattr(getattr(triton, "knobs", None), "HookChain", None)
    if chain is not None:
        runtime.launch_exit_hook = chain()
        assert raw_launch.hooks_idle()
        runtime.launch_exit_hook.add(print)
        assert not raw_launch.hooks_idle()


def test_zeroed_scratch_is_one_buffer_per_stream_and_grows_keeping_the_old():
    """Handed out zeroed, the same buffer again while big enough; outgrown ones stay alive for graphs."""
    from flaggems.toolkit import workspace

    like = torch.empty(1, device=DEVICE)
    first = workspace.zeroed_scratch(like, 10)
    assert first.dtype == torch.int64 and first.numel() >= max(10, workspace.MIN_WORDS)
    assert not bool(first.any())
    assert workspace.zeroed_scratch(like, 10).data_ptr() == first.data_ptr()
    bigger = workspace.zeroed_scratch(like, first.numel() + 1)
    assert bigger.numel() >= 2 * first.numel() and not bool(bigger.any())
    assert any(old is first for old in workspace._OUTGROWN)
    assert workspace.zeroed_scratch(like, 10).data_ptr() == bigger.data_ptr()


def test_claim_scratch_is_the_same_buffer_with_one_lock_per_stream():
    from flaggems.toolkit import workspace

    like = torch.empty(1, device=DEVICE)
    buffer, lock = workspace.claim_scratch(like, 10)
    assert buffer.data_ptr() == workspace.zeroed_scratch(like, 10).data_ptr()
    again, same_lock = workspace.claim_scratch(like, 10)
    assert again.data_ptr() == buffer.data_ptr() and same_lock is lock
    with lock:
        assert lock.locked()
    assert not lock.locked()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_zeroed_scratch_differs_between_streams():
    from flaggems.toolkit import workspace

    like = torch.empty(1, device="cuda")
    here, here_lock = workspace.claim_scratch(like, 10)
    with torch.cuda.stream(torch.cuda.Stream()):
        there = workspace.zeroed_scratch(like, 10)
        there_lock = workspace.claim_scratch(like, 10)[1]
    assert here.data_ptr() != there.data_ptr() and here_lock is not there_lock


def test_interpreted_launches_from_many_threads():
    """Triton's interpreter keeps launch state in globals: concurrent routed calls must all come out right."""
    import flaggems
    from flaggems.binding import native_scope

    if not flaggems.backend().interpreter:
        pytest.skip("the interpreter's lock only matters on the CPU backend")
    failures: list[str] = []

    def work(seed: int) -> None:
        try:
            steps(seed)
        except Exception as exc:  # noqa: BLE001 - a thread's exception must fail the test, not only warn
            failures.append(f"thread {seed}: {type(exc).__name__}: {exc}")

    def steps(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for step in range(6):
            src = torch.randn(5 + seed, 7 + step, generator=gen)
            index = torch.randint(0, 5 + seed, (4,), generator=gen)
            dst = torch.empty(7 + step, 5 + seed)
            dst.copy_(src.t())
            picked = torch.index_select(src, 0, index)
            with native_scope():
                if not torch.equal(dst, src.t()) or not torch.equal(picked, src[index]):
                    failures.append(f"thread {seed} step {step}")

    with flaggems.enabled():
        in_threads(work, 8)
    assert not failures


def test_triton_imported_before_flaggems_still_interprets():
    """``import triton`` first, then flaggems selects the interpreter: Triton's own helpers must be interpreted."""
    import os
    import subprocess
    import sys

    if not flaggems.backend().interpreter:
        pytest.skip("only the CPU interpreter backend is concerned")
    script = (
        "import triton, torch, flaggems\n"
        "flaggems.enable()\n"
        "x = torch.randn(2, 6, 4, 4)\n"
        "y = torch.nn.functional.group_norm(x, 3)\n"
        "r = torch.repeat_interleave(torch.tensor([1, 2]), torch.tensor([2, 1]))\n"
        "assert r.tolist() == [1, 1, 2]\n"
        "with flaggems.binding.native_scope():\n"
        "    assert torch.allclose(y, torch.nn.functional.group_norm(x, 3), atol=1e-5)\n"
        "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_the_toolkit_never_imports_the_core_above_it():
    """The toolkit sits under the binding and the runtime: it reads the kernel context, never them."""
    import ast
    from pathlib import Path

    import flaggems.toolkit

    upward = []
    for path in Path(flaggems.toolkit.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level >= 2 or (node.module or "").startswith("flaggems")):
                if not (node.module or "").startswith("flaggems.toolkit"):
                    upward.append(f"{path.name}: from {'.' * node.level}{node.module or ''} import ...")
            elif isinstance(node, ast.Import):
                upward += [f"{path.name}: import {a.name}" for a in node.names
                           if a.name.startswith("flaggems") and not a.name.startswith("flaggems.toolkit")]
    assert not upward, upward


def test_device_facts_count_the_programs_a_device_runs_at_once():
    from flaggems.toolkit.context import DeviceFacts

    h200 = DeviceFacts(multiprocessors=132, threads_per_multiprocessor=2048)
    assert h200.resident_programs(128) == 132 * 16 and h200.resident_programs(4096) == 132
    assert DeviceFacts(multiprocessors=24).resident_programs(128) == 24  # one program a core (Ascend)
    assert DeviceFacts().resident_programs(128) is None
