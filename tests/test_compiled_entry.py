"""The compiled dispatcher entry: registration, keying, misses, replays, declines, fallback, threads.

On the CPU these run on the CPU key with the Triton interpreter: replays there
use the ``python`` step form (the recorded launcher, tensors rebuilt as views
of the replayed inputs and allocations); the ``cuda`` form runs on the GPU.
"""

from __future__ import annotations

import threading

import pytest
import torch

import flaggems
from flaggems import binding, compiled
from flaggems_fakes import kernels
from flaggems_fakes.plugins import ReplayNeg


def dev() -> torch.device:
    """The active backend's device: the ``runtime`` fixture reselects with no plugin installed (CPU where a
    vendor plugin brought the device, e.g. the fake npu), the other tests run on the installed backend's."""
    return torch.device(flaggems.backend().device_type)


def minus(x: torch.Tensor) -> torch.Tensor:
    """torch's own negation (``-x`` would go through the routed neg)."""
    with binding.native_scope():
        return -x


@pytest.fixture
def replay_neg(runtime, monkeypatch):
    """The ReplayNeg fake plugin enabled through the compiled entry."""
    monkeypatch.setenv("FLAGGEMS_ENTRY", "compiled")
    compiled.reset()
    runtime.manager.register(ReplayNeg(), "replay-neg")
    kernels.CALLS.clear()
    flaggems.enable()
    yield runtime
    flaggems.disable()
    kernels.CALLS.clear()
    compiled.reset()


def _stats(runtime, op: str) -> dict[str, int]:
    return runtime.plan_stats()[f"aten::{op}@{runtime.active_backend().dispatch_key}"]


def test_compiled_entry_is_active_and_reported(replay_neg):
    info = flaggems.info()
    assert info["entry"]["active"] == "compiled", info["entry"]
    assert replay_neg._binding.registry is not None and replay_neg._binding.slots == []


def test_second_call_replays_without_python(replay_neg):
    x = torch.randn(100, device=dev())
    first = torch.neg(x)
    second = torch.neg(x)
    assert torch.equal(first, minus(x)) and torch.equal(second, minus(x))
    assert kernels.CALLS == ["fast_neg"], "the replay must not run the Python implementation"
    stats = _stats(replay_neg, "neg")
    assert (stats["miss"], stats["replay"], stats["plans"]) == (1, 1, 1)
    assert first.data_ptr() != second.data_ptr(), "each replay allocates its own output"


def test_replay_follows_new_data_and_addresses(replay_neg):
    torch.neg(torch.randn(64, device=dev()))
    for _ in range(3):
        x = torch.randn(64, device=dev())
        assert torch.equal(torch.neg(x), minus(x))
    assert _stats(replay_neg, "neg")["replay"] == 3


@pytest.mark.parametrize("other", [
    lambda: torch.randn(65, device=dev()),                       # size
    lambda: torch.randn(64, device=dev(), dtype=torch.float16),  # dtype
    lambda: torch.randn(65, device=dev())[1:],                   # storage offset (and address)
    lambda: torch.randn(8, 8, device=dev()),                     # rank
])
def test_key_changes_miss(replay_neg, other):
    torch.neg(torch.randn(64, device=dev()))
    x = other()
    assert torch.equal(torch.neg(x), minus(x))
    stats = _stats(replay_neg, "neg")
    assert (stats["miss"], stats["replay"]) == (2, 0)


def test_key_determined_decline_goes_native_from_cpp(replay_neg):
    x = torch.randn(16, device=dev()).t()[None].expand(2, 16)  # not contiguous: fast_neg declines
    for _ in range(3):
        assert torch.equal(torch.neg(x), minus(x))
    stats = _stats(replay_neg, "neg")
    assert (stats["miss"], stats["native"]) == (1, 2)
    assert kernels.CALLS == ["fast_neg"], "the decline is decided once for the key"


def test_empty_input_replays_with_no_launch(replay_neg):
    x = torch.randn(0, 3, device=dev())
    assert torch.neg(x).shape == (0, 3)
    assert torch.neg(x).shape == (0, 3)
    assert _stats(replay_neg, "neg")["replay"] == 1


def test_persistent_workspace_stays_on_python_path(replay_neg):
    x = torch.randn(32, device=dev())
    for _ in range(3):
        assert torch.equal(torch.abs(x), minus(x))  # the fake computes -(-(minus(x)))
    stats = _stats(replay_neg, "abs")
    assert (stats["miss"], stats["python"], stats["replay"]) == (1, 2, 0)
    assert kernels.CALLS.count("persistent_neg") == 3


def test_state_buffer_becomes_the_plans_and_replays(replay_neg):
    """Launches sharing the workspace's zeroed state replay with a state buffer the plan owns."""
    for _ in range(4):
        x = torch.randn(200, device=dev())
        assert torch.equal(torch.cos(x), minus(x)), "a dirty state word writes NaN"
    stats = _stats(replay_neg, "cos")
    assert (stats["miss"], stats["replay"], stats["python"]) == (1, 3, 0)
    assert kernels.CALLS == ["stateful_neg"]


def test_state_buffer_replays_are_serialised_across_threads(replay_neg):
    torch.cos(torch.randn(300, device=dev()))  # plan
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(5):
                x = torch.randn(300, device=dev())
                assert torch.equal(torch.cos(x), minus(x))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert _stats(replay_neg, "cos")["replay"] == 20


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_state_plan_on_another_stream_takes_the_python_path(replay_neg):
    x = torch.randn(500, device="cuda")
    torch.cos(x)
    torch.cos(x)  # plan on the current stream, then a replay
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = torch.cos(x)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(out, minus(x))
    stats = _stats(replay_neg, "cos")
    assert (stats["replay"], stats["python"]) == (1, 1)


def test_host_read_stays_on_python_path(replay_neg):
    x = torch.randn(32, device=dev())
    for _ in range(2):
        assert torch.equal(torch.sin(x), minus(x))
    stats = _stats(replay_neg, "sin")
    assert (stats["miss"], stats["python"]) == (1, 1)


def test_errors_keep_their_type_and_cache_nothing():
    """An implementation's error crosses the C++ entry with its Python type; the key stays uncached."""
    with flaggems.enabled():
        from flaggems.runtime import RUNTIME

        if RUNTIME._binding.registry is None:
            pytest.skip("compiled entry not active")
        x, index = torch.randn(4, 3, device=dev()), torch.tensor([1, 4], device=dev())
        from flaggems.toolkit import checks

        if not checks.enabled():
            pytest.skip("out-of-range indices raise only when checked (FLAGGEMS_CHECK_INDICES=1)")
        for _ in range(2):
            with pytest.raises(IndexError, match="index out of range in self"):
                torch.index_select(x, 0, index)
        stats = RUNTIME.plan_stats()[f"aten::index_select@{RUNTIME.active_backend().dispatch_key}"]
        assert stats["miss"] == 2 and stats["plans"] == 0


def test_native_scope_bypasses_the_plans(replay_neg):
    x = torch.randn(10, device=dev())
    with binding.native_scope():
        torch.neg(x)
    assert kernels.CALLS == []
    assert _stats(replay_neg, "neg")["miss"] == 0


def test_disable_restores_native_and_drops_plans(replay_neg):
    x = torch.randn(10, device=dev())
    torch.neg(x)
    flaggems.disable()
    assert torch.equal(torch.neg(x), minus(x))
    assert kernels.CALLS == ["fast_neg"]
    assert replay_neg.plan_stats() == {}
    flaggems.enable()
    torch.neg(x)
    assert _stats(replay_neg, "neg")["miss"] == 1, "a new enable() plans again"


def test_full_cache_is_dropped_and_refilled(replay_neg, monkeypatch):
    flaggems.disable()
    monkeypatch.setattr(binding, "PLAN_CAPACITY", 2)
    flaggems.enable()
    for n in (10, 11, 12):
        torch.neg(torch.randn(n, device=dev()))
    stats = _stats(replay_neg, "neg")
    assert stats["evicted"] == 2 and stats["plans"] == 1


def test_threads_share_the_plans(replay_neg):
    inputs = [torch.randn(48, device=dev()) for _ in range(4)]
    torch.neg(inputs[0])
    failures = []

    def work(x):
        for _ in range(10):
            if not torch.equal(torch.neg(x), minus(x)):
                failures.append(x)

    threads = [threading.Thread(target=work, args=(x,)) for x in inputs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    stats = _stats(replay_neg, "neg")
    assert stats["miss"] == 1 and stats["replay"] == 40


def test_python_entry_on_request(runtime, monkeypatch):
    monkeypatch.setenv("FLAGGEMS_ENTRY", "python")
    compiled.reset()
    runtime.manager.register(ReplayNeg(), "replay-neg")
    try:
        with flaggems.enabled():
            assert flaggems.info()["entry"] == {"active": "python", "reason": "FLAGGEMS_ENTRY=python"}
            assert runtime._binding.registry is None
            x = torch.randn(5, device=dev())
            assert torch.equal(torch.neg(x), minus(x))
    finally:
        compiled.reset()


def test_generic_copy_replays_strided_copies(monkeypatch):
    """The generic plugin's copy_ is replayable: a transposed copy replays, results stay right."""
    monkeypatch.setenv("FLAGGEMS_OP_copy_", "generic")  # routed also where the backend leaves it native (Ascend)
    with flaggems.enabled():
        from flaggems.runtime import RUNTIME

        if RUNTIME._binding.registry is None:
            pytest.skip("compiled entry not active")
        src = torch.randn(33, 17, device=dev())
        for _ in range(3):
            dst = torch.empty(17, 33, device=dev())
            dst.copy_(src.t())
            assert torch.equal(dst, src.t())
            src = torch.randn(33, 17, device=dev())
        stats = RUNTIME.plan_stats()[f"aten::copy_@{RUNTIME.active_backend().dispatch_key}"]
        assert stats["replay"] >= 2


def test_small_copy_ops_replay_through_typed_kernels(monkeypatch):
    """copy_, _to_copy, index_copy_, index_copy and index_select are registered unboxed (no boxing on a
    replay); their replays return what torch returns, the in-place ones the very tensor they wrote."""
    for op in ("copy_", "_to_copy", "index_copy_", "index_copy", "index_select"):
        monkeypatch.setenv(f"FLAGGEMS_OP_{op}", "generic")  # routed also where a backend leaves them native
    with flaggems.enabled():
        from flaggems.runtime import RUNTIME

        if RUNTIME._binding.registry is None:
            pytest.skip("compiled entry not active")
        key = RUNTIME.active_backend().dispatch_key
        stats = RUNTIME.plan_stats()
        for op in ("copy_", "_to_copy", "index_copy_", "index_copy", "index_select"):
            assert stats[f"aten::{op}@{key}"]["typed"], op
        assert not stats[f"aten::repeat_interleave.self_int@{key}"]["typed"], "other signatures stay boxed"
        with binding.native_scope():
            index = torch.randperm(16, device=dev())
        for _ in range(3):
            src, rows = torch.randn(16, 8, device=dev()), torch.randn(16, 8, device=dev())
            dst = torch.empty(16, 8, device=dev())
            assert dst.copy_(src) is dst and torch.equal(dst, src)
            half = src.to(torch.float16)
            with binding.native_scope():
                assert torch.equal(half, src.half())
                expected = src.clone().index_copy_(0, index, rows)
                picked = src[index]
            assert torch.equal(src.index_copy(0, index, rows), expected)
            assert dst.index_copy_(0, index, rows) is dst and torch.equal(dst, expected)
            assert torch.equal(torch.index_select(src, 0, index), picked)
        stats = RUNTIME.plan_stats()
        for op in ("copy_", "_to_copy"):  # the index ops replay only unchecked (the interpreter always checks)
            assert stats[f"aten::{op}@{key}"]["typed_replay"] >= 2, (op, stats[f"aten::{op}@{key}"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replay_launches_on_the_current_stream_and_is_graph_capturable():
    """A replayed copy_ inside a CUDA graph capture on a side stream: a launch on any other stream would fail it."""
    with flaggems.enabled():
        from flaggems.runtime import RUNTIME

        if RUNTIME._binding.registry is None:
            pytest.skip("compiled entry not active")
        src = torch.randn(64, 33, device="cuda")
        dst = torch.empty(33, 64, device="cuda")
        for _ in range(2):  # plan, then replay
            dst.copy_(src.t())
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            dst.copy_(src.t())
        src.copy_(torch.randn(64, 33, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        with binding.native_scope():
            assert torch.equal(dst, src.t())
        stats = RUNTIME.plan_stats()["aten::copy_@CUDA"]
        assert stats["replay"] >= 2


def test_autograd_key_keeps_calls_that_need_a_graph_on_python():
    """group_norm at the Autograd key: an input that requires grad is never replayed; gradients stay torch's."""
    x = torch.randn(2, 6, 3, 3, device=dev())
    with binding.native_scope():
        leaf = x.clone().requires_grad_()
        torch.nn.functional.group_norm(leaf, 3).square().sum().backward()
        expected = leaf.grad
    with flaggems.enabled():
        from flaggems.runtime import RUNTIME

        if RUNTIME._binding.registry is None:
            pytest.skip("compiled entry not active")
        for _ in range(2):
            leaf = x.clone().requires_grad_()
            torch.nn.functional.group_norm(leaf, 3).square().sum().backward()
            assert torch.allclose(leaf.grad, expected, rtol=1e-4, atol=1e-5)
        stats = RUNTIME.plan_stats()[f"aten::group_norm@Autograd{RUNTIME.active_backend().dispatch_key}"]
        # keyed (requires grad is in the key), planned native: torch's composite, our kernels beneath it
        assert stats["replay"] == 0 and stats["miss"] == 1 and stats["native"] >= 1
        for _ in range(2):  # no grad: the same metadata replays
            torch.nn.functional.group_norm(x, 3)
        stats = RUNTIME.plan_stats()[f"aten::group_norm@Autograd{RUNTIME.active_backend().dispatch_key}"]
        assert stats["replay"] >= 1


def test_backend_key_replays_calls_whose_inputs_require_grad(monkeypatch):
    """Below autograd (the backend key) the graph is autograd's: ``clone`` of a tensor that requires grad reaches
    ``copy_`` with that tensor, and the call replays; values and gradients stay torch's. (The SD-1.5 training
    step sent every such call down the Python path.)"""
    monkeypatch.setenv("FLAGGEMS_OP_copy_", "generic")  # routed also where the backend leaves it native (Ascend)
    with flaggems.enabled():
        from flaggems.runtime import RUNTIME

        if RUNTIME._binding.registry is None:
            pytest.skip("compiled entry not active")
        key = f"aten::copy_@{RUNTIME.active_backend().dispatch_key}"
        for _ in range(3):
            leaf = torch.randn(5, 7, device=dev()).requires_grad_()
            out = leaf.t().contiguous()  # clone of a transposed view: empty_like, then copy_ below autograd
            (out * 2).sum().backward()
            with binding.native_scope():
                assert torch.equal(out, leaf.t()) and torch.equal(leaf.grad, torch.full_like(leaf, 2))
            assert out.requires_grad and out.grad_fn is not None
        stats = RUNTIME.plan_stats()[key]
        assert stats["replay"] >= 2 and stats["python"] == 0, stats


def _strided_gn_call(x, w, b, dy, create_graph=False):
    """group_norm of a sliced view (torch's composite would copy it: our node serves) and its gradients."""
    y = torch.nn.functional.group_norm(x[..., 1:6], 3, w, b)
    wanted = [t for t in (x, w, b) if t is not None and t.requires_grad]
    return y, torch.autograd.grad(y, wanted, dy, create_graph=create_graph)


def _gn_leaves(weight_grad=True):
    torch.manual_seed(3)
    x = torch.randn(2, 6, 4, 7, device=dev()).requires_grad_()
    w = torch.randn(6, device=dev()).requires_grad_(weight_grad)
    b = torch.randn(6, device=dev()).requires_grad_(weight_grad)
    return x, w, b, torch.randn(2, 6, 4, 5, device=dev())


def _registry_or_skip():
    from flaggems.runtime import RUNTIME

    if RUNTIME._binding.registry is None:
        pytest.skip("compiled entry not active")
    return RUNTIME


@pytest.mark.parametrize("weight_grad", [True, False])
def test_a_differentiable_call_replays_forward_and_backward_under_a_cpp_node(weight_grad):
    """After the first call (our Python node), group_norm's node is C++: the forward replays, and the
    backward op plans on its first call and replays on the next; values equal torch's."""
    x, w, b, dy = _gn_leaves(weight_grad)
    with binding.native_scope():
        expected_y, expected = _strided_gn_call(x, w, b, dy)
    with flaggems.enabled():
        runtime = _registry_or_skip()
        names = []
        for _ in range(3):
            y, grads = _strided_gn_call(x, w, b, dy)
            names.append(y.grad_fn.name())
            assert torch.allclose(y, expected_y, rtol=1e-5, atol=1e-5)
            for actual, want in zip(grads, expected, strict=True):
                assert torch.allclose(actual, want, rtol=1e-4, atol=1e-5)
        stats = runtime.plan_stats()
        key = runtime.active_backend().dispatch_key
    assert names[0] == "FlaggemsFunctionBackward" and all("CppNode" in n and "FlaggemsFunction" in n
                                                         for n in names[1:]), names
    forward = stats[f"aten::group_norm@Autograd{key}"]
    backward = stats["flaggems::group_norm_backward@backward"]
    assert forward["miss"] == 1 and forward["replay"] == 2 and forward["python"] == 0
    assert backward["miss"] == 1 and backward["replay"] == 1 and backward["python"] == 0, backward


def test_the_cpp_node_under_create_graph_is_differentiable_again():
    x, w, b, dy = _gn_leaves()

    def penalty():
        _, (dx, dw, _) = _strided_gn_call(x, w, b, dy, create_graph=True)
        return torch.autograd.grad((dx * dx).sum() + (dw * dw).sum(), (x, w))

    with binding.native_scope():
        expected = penalty()
    with flaggems.enabled():
        _registry_or_skip()
        for _ in range(2):
            actual = penalty()
    for a, e in zip(actual, expected, strict=True):
        assert torch.allclose(a, e, rtol=1e-4, atol=1e-5)


def test_the_cpp_node_checks_saved_versions_and_outlives_disable():
    """An input modified in place after the forward: torch's error at backward. A graph recorded before
    ``disable()`` still runs its backward after it."""
    x, w, b, dy = _gn_leaves()
    with flaggems.enabled():
        _registry_or_skip()
        for _ in range(2):
            leaf = x.detach().clone().requires_grad_()
            base = leaf * 1  # a non-leaf the call saves (a view of it)
            y = torch.nn.functional.group_norm(base[..., 1:6], 3, w, b)
        assert "CppNode" in y.grad_fn.name()
        with torch.no_grad():
            base.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(y, (leaf,), dy)
        y, _ = _strided_gn_call(x, w, b, dy)
        y2 = torch.nn.functional.group_norm(x[..., 1:6], 3, w, b)
    assert "CppNode" in y2.grad_fn.name()
    with binding.native_scope():
        _, expected = _strided_gn_call(x, w, b, dy)
    late = torch.autograd.grad(y2, (x, w, b), dy)
    for a, e in zip(late, expected, strict=True):
        assert torch.allclose(a, e, rtol=1e-4, atol=1e-5)


def test_a_plan_built_with_meta_tensors_on_the_first_call_still_replays():
    """group_norm's Python plan is shaped with meta tensors on a new layout's first call: not device work."""
    x = torch.randn(2, 10, 3, 5, device=dev())
    with flaggems.enabled():
        from flaggems.runtime import RUNTIME

        if RUNTIME._binding.registry is None:
            pytest.skip("compiled entry not active")
        for _ in range(2):
            torch.nn.functional.group_norm(x, 5)
        stats = RUNTIME.plan_stats()[f"aten::group_norm@Autograd{RUNTIME.active_backend().dispatch_key}"]
        assert stats["miss"] == 1 and stats["replay"] == 1 and stats["python"] == 0


def _tight_budget(monkeypatch, free: int = 4, retry: int = 3) -> None:
    flaggems.disable()
    monkeypatch.setattr(binding, "PLAN_FREE_MISSES", free)
    monkeypatch.setattr(binding, "PLAN_RETRY_EVERY", retry)
    flaggems.enable()


def test_shapes_that_never_come_back_stop_being_planned(replay_neg, monkeypatch):
    _tight_budget(monkeypatch)
    for n in range(10, 30):  # 20 keys, each seen once and each its own layout class (another rank)
        x = torch.randn((1,) * (n - 10) + (n,), device=dev())
        assert torch.equal(torch.neg(x), minus(x))
    stats = _stats(replay_neg, "neg")
    # 4 free misses, then one in 3 of the 16 skipped (the 3rd, 6th, ..., 15th) still plans
    assert (stats["miss"], stats["unplanned"], stats["reused"], stats["plans"]) == (9, 11, 0, 9)
    assert kernels.CALLS.count("fast_neg") == 20, "an unplanned miss is served by the Python entry"


def test_planning_resumes_once_plans_are_reused(replay_neg, monkeypatch):
    _tight_budget(monkeypatch)
    for n in range(10, 20):  # a phase of shapes that never come back
        torch.neg(torch.randn(n, device=dev()))
    stable = [torch.randn(n, device=dev()) for n in range(40, 46)]
    for _ in range(10):
        for x in stable:
            assert torch.equal(torch.neg(x), minus(x))
    before = _stats(replay_neg, "neg")
    for x in stable:
        torch.neg(x)
    after = _stats(replay_neg, "neg")
    assert after["replay"] - before["replay"] == len(stable) and after["miss"] == before["miss"]
    assert 2 * after["reused"] >= after["miss"], after


def _malformed_planner(monkeypatch):
    """Every planner answers a plan the entry cannot parse (a planner bug), after serving the call."""
    from flaggems import planner

    real = planner.build_planner

    def build(*args, **kwargs):
        plan = real(*args, **kwargs)

        def malformed(call_args, call_kwargs, inputs, layout=None):
            result = plan(call_args, call_kwargs, inputs, layout)[0]
            return result, ("replay", "not a plan")

        return malformed

    monkeypatch.setattr(planner, "build_planner", build)


def test_a_malformed_plan_is_counted_and_the_call_still_served(runtime, monkeypatch):
    _malformed_planner(monkeypatch)
    monkeypatch.setenv("FLAGGEMS_ENTRY", "compiled")
    compiled.reset()
    runtime.manager.register(ReplayNeg(), "replay-neg")
    flaggems.enable()
    try:
        x = torch.randn(8, device=dev())
        assert torch.equal(torch.neg(x), minus(x))
        stats = _stats(runtime, "neg")
        assert stats["rejected"] == 1 and stats["plans"] == 0
    finally:
        flaggems.disable()
        compiled.reset()


def test_under_strict_a_malformed_plan_raises(runtime, monkeypatch):
    _malformed_planner(monkeypatch)
    monkeypatch.setenv("FLAGGEMS_ENTRY", "compiled")
    monkeypatch.setenv("FLAGGEMS_STRICT", "1")
    compiled.reset()
    runtime.manager.register(ReplayNeg(), "replay-neg")
    flaggems.enable()
    try:
        with pytest.raises(RuntimeError, match="returned a malformed plan"):
            torch.neg(torch.randn(8, device=dev()))
    finally:
        flaggems.disable()
        compiled.reset()
