"""flaggems-ascend's index_copy kernels (``flaggems_ascend.index_copy``).

They run wherever the ``ascend`` backend is active: on the CPU-backed
PrivateUse1 ``npu`` of ``tests/fakes`` (the ``ascend`` tox env), simulated on
a GPU (``FLAGGEMS_VENDOR=ascend``), or on an NPU. The conformance kit runs
them too (tests/test_conformance.py); these tests cover what the kit does not
see: which kernel serves which shape, the AI-core grid cap, float64 and
strided ``self`` declines, and 64-bit offsets.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from conftest import run_compiled, set_kernel_context

import flaggems
from flaggems.binding import native_scope

pytestmark = pytest.mark.skipif(flaggems.backend().name != "ascend",
                                reason="the ascend backend is not active (FLAGGEMS_VENDOR=ascend)")
DEV = torch.device(flaggems.backend().device_type)


@pytest.fixture
def ascend(monkeypatch):
    """flaggems enabled with the ascend plugin's kernels (on a GPU too, whatever the shape); the kernel module."""
    from flaggems_ascend import index_copy as kernels

    monkeypatch.setattr(kernels, "generic_is_faster", lambda *args: False)
    with flaggems.enabled():
        yield kernels


def test_on_a_gpu_only_small_in_place_calls_stay_with_the_ascend_kernels():
    from flaggems_ascend import index_copy as kernels

    assert not kernels.generic_is_faster("npu", False, 1 << 30)  # an NPU: the Ascend kernels, always
    assert not kernels.generic_is_faster("cpu", False, 1 << 30)  # the interpreter: the kernels under test
    assert not kernels.generic_is_faster("cuda", True, kernels.GPU_INPLACE_MAX)
    assert kernels.generic_is_faster("cuda", True, kernels.GPU_INPLACE_MAX + 1)
    assert kernels.generic_is_faster("cuda", False, 16)
    x, index, source = torch.zeros(4, 3), torch.tensor([1]), torch.ones(1, 3)
    assert kernels.supports_in_place(x, 0, index, source) is True
    assert kernels.supports_out_of_place(x, 0, index, source) is True


def _spy(monkeypatch, kernels) -> list[str]:
    """Names of the kernels launched (flat or rows) while the test runs."""
    launched: list[str] = []
    original = kernels._launcher

    def spy(kernel, **constexprs):
        launched.append("flat" if kernel is kernels._flat_kernel else "rows")
        return original(kernel, **constexprs)

    monkeypatch.setattr(kernels, "_launcher", spy)
    return launched


def _expected(x, dim, index, source):
    with native_scope():
        return x.cpu().index_copy(dim, index.cpu(), source.cpu())


CASES = {  # (shape, dim, indices): inner size <= 4 takes the flat kernel, wider rows the row kernel
    "vector": ((100,), 0, [3, 99, 0, 57]),
    "last dim": ((64, 64), 1, list(range(0, 64, 2))),
    "inner 3": ((10, 7, 3), 1, [6, 0, 2]),
    "inner 4": ((5, 9, 4), 1, [8, 1]),
    "inner 33": ((5, 6, 33), 1, [5, 0, 3]),
    "rows of 512": ((40, 512), 0, [39, 1, 20, 7]),
    "one row": ((1, 3, 70), 1, [2]),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int32, torch.bool])
def test_both_kernels_equal_torch(ascend, monkeypatch, name, dtype):
    shape, dim, indices = CASES[name]
    launched = _spy(monkeypatch, ascend)
    x = (torch.randn(shape) * 8).to(dtype).to(DEV)
    index = torch.tensor(indices, device=DEV)
    source_shape = list(shape)
    source_shape[dim] = len(indices)
    source = (torch.randn(source_shape) * 8).to(dtype).to(DEV)
    expected = _expected(x, dim, index, source)
    out = x.index_copy(dim, index, source)
    inplace = x.clone()
    assert inplace.index_copy_(dim, index, source) is inplace
    assert torch.equal(out.cpu(), expected) and torch.equal(inplace.cpu(), expected)
    inner = 1
    for size in shape[dim + 1:]:
        inner *= size
    assert set(launched) == {"flat" if inner <= ascend.FLAT_MAX_INNER else "rows"}, launched


@pytest.mark.parametrize("name", ["vector", "inner 3", "inner 33"])
def test_a_strided_offset_index_is_read_where_its_elements_are(ascend, monkeypatch, name):
    """Both kernels read ``index`` through its stride and storage offset (``base[1::2]``), not as dense."""
    shape, dim, indices = CASES[name]
    launched = _spy(monkeypatch, ascend)
    base = torch.full((2 * len(indices) + 1,), -7, dtype=torch.int64)
    base[1::2] = torch.tensor(indices)
    index = base.to(DEV)[1::2]  # stride 2, offset 1: the dense reading would see -7s and the wrong rows
    assert index.stride() == (2,) and index.storage_offset() == 1
    x = torch.randn(shape, dtype=torch.float16).to(DEV)
    source_shape = list(shape)
    source_shape[dim] = len(indices)
    source = torch.randn(source_shape, dtype=torch.float16).to(DEV)
    expected = _expected(x, dim, index, source)
    inplace = x.clone()
    inplace.index_copy_(dim, index, source)
    assert torch.equal(x.index_copy(dim, index, source).cpu(), expected) and torch.equal(inplace.cpu(), expected)
    assert launched and set(launched) <= {"flat", "rows"}


def test_routes_choose_ascend_and_float64_declines_with_its_reason(ascend):
    chosen = {r["op"]: r["chosen"] for r in flaggems.routes() if r["op"] in ("index_copy", "index_copy_")}
    assert chosen == {"index_copy": "ascend", "index_copy_": "ascend"}
    x = torch.randn(6, 5, dtype=torch.float64, device=DEV)
    index, source = torch.tensor([4, 1], device=DEV), torch.randn(6, 2, dtype=torch.float64, device=DEV)
    assert torch.equal(x.index_copy(1, index, source).cpu(), _expected(x, 1, index, source))
    (row,) = flaggems.routes("index_copy")
    assert row["unsupported_dtypes"] == ["float64"]
    declined = {d["impl"]: d["reason"] for d in row["declined"]}
    assert declined == {"ascend": "torch.float64: the ascend backend computes no float64",
                        "generic": "torch.float64: the ascend backend computes no float64"}, declined


def test_copies_stay_with_torch_npu_by_the_backends_declared_routing(ascend):
    rows = {r["op"]: r for r in flaggems.routes() if r["op"] in ("copy_", "_to_copy")}
    assert set(rows) == {"copy_", "_to_copy"}
    for row in rows.values():
        assert row["chain"] == ["native"] and row["source"] == "backend ascend", row
        assert row["reason"].startswith("native on ascend: torch_npu's own"), row["reason"]
        assert row["candidates"] == ["generic (generic, priority 0)"]
    assert "copy_" not in flaggems.runtime.RUNTIME.registered_ops()


def test_a_strided_self_in_place_goes_to_the_generic_kernels_and_a_strided_source_is_read(ascend, monkeypatch):
    launched = _spy(monkeypatch, ascend)
    base = torch.randn(8, 12, device=DEV)
    view = base[:, ::2]  # not contiguous: declined, generic serves it
    index, source = torch.tensor([5, 0], device=DEV), torch.randn(2, 8, device=DEV).t()  # strided source
    expected = _expected(view, 1, index, source)
    view.index_copy_(1, index, source)
    assert torch.equal(view.cpu(), expected) and launched == []
    out = torch.randn(8, 6, device=DEV).index_copy(1, index, source)  # out of place: the result is dense
    assert launched == ["flat"] and out[:, 5].cpu().equal(source[:, 0].cpu())
    (row,) = flaggems.routes("index_copy_")
    assert any(d["impl"] == "ascend" and "not contiguous" in d["reason"] for d in row["declined"])


def test_grid_is_capped_at_the_ai_cores_and_loops_over_the_tiles(ascend, monkeypatch):
    monkeypatch.setattr(ascend, "ai_cores", lambda device: 2)
    grids = []
    original = ascend._launcher

    def spy(kernel, **constexprs):
        launcher = original(kernel, **constexprs)
        return lambda grid, *args: (grids.append(grid), launcher(grid, *args))

    monkeypatch.setattr(ascend, "_launcher", spy)
    x = torch.zeros(300, 9, device=DEV)
    index = torch.arange(299, -1, -1, device=DEV)
    source = torch.randn(300, 9, device=DEV)
    x.index_copy_(0, index, source)
    y = torch.zeros(3000, device=DEV).index_copy(0, torch.arange(2999, -1, -1, device=DEV),
                                                 torch.arange(3000.0, device=DEV))
    assert grids == [(2,), (2,)]
    assert torch.equal(x.cpu(), _expected(torch.zeros(300, 9), 0, index, source))
    assert torch.equal(y.cpu(), torch.arange(2999.0, -1, -1))


def test_the_grid_cap_is_the_programs_the_device_runs_at_once(ascend, monkeypatch):
    """An NPU's AI cores (one program each); a GPU standing in for it: its resident 4-warp programs."""
    from flaggems.toolkit.context import DeviceFacts

    set_kernel_context(monkeypatch, facts_source=lambda index: DeviceFacts(multiprocessors=20, fp64=False))
    assert ascend.ai_cores(DEV) == 20
    set_kernel_context(monkeypatch, facts_source=lambda index: DeviceFacts(multiprocessors=132,
                                                                           threads_per_multiprocessor=2048))
    assert ascend.ai_cores(DEV) == 132 * 16
    set_kernel_context(monkeypatch, facts_source=lambda index: DeviceFacts())
    assert ascend.ai_cores(DEV) == ascend.DEFAULT_CORES


def test_block_and_tiles_follow_the_workload():
    from flaggems_ascend import index_copy as kernels

    assert kernels.flat_block(100, 24) == kernels.FLAT_MIN_BLOCK
    assert kernels.flat_block(24 * 1000, 24) == 1024
    assert kernels.flat_block(1 << 30, 24) == kernels.FLAT_MAX_BLOCK
    assert kernels.row_tile(33) == (64, 64) and kernels.row_tile(5000) == (4, 1024)


def test_empty_index_and_empty_rows_launch_nothing(ascend, monkeypatch):
    launched = _spy(monkeypatch, ascend)
    x = torch.randn(4, 5, device=DEV)
    x.index_copy_(0, torch.tensor([], dtype=torch.long, device=DEV), torch.randn(0, 5, device=DEV))
    y = torch.randn(4, 0, device=DEV).index_copy(0, torch.tensor([1], device=DEV), torch.randn(1, 0, device=DEV))
    assert launched == [] and y.shape == (4, 0)


def test_invalid_indices_are_never_written(ascend, monkeypatch):
    """With checking off (as on a device by default) an out-of-range index writes nothing; others land."""
    set_kernel_context(monkeypatch, checks=False)
    x = torch.zeros(6, 3, device=DEV)
    x.index_copy_(0, torch.tensor([7, 2, -1], device=DEV), torch.ones(3, 3, device=DEV))
    assert x.cpu().sum().item() == 3 and x[2].cpu().eq(1).all()


@pytest.mark.parametrize("inner", [1, 64])
def test_offsets_past_two_to_the_31(ascend, monkeypatch, inner):
    """Rows beyond 2**31 elements of an int8 target: the flat (inner 1) and row (inner 64) kernels."""
    launched = _spy(monkeypatch, ascend)
    rows = (2**31 + 64 * 3) // inner
    try:
        x = torch.zeros(rows, inner, dtype=torch.int8, device=DEV)
    except (RuntimeError, MemoryError):
        pytest.skip("2 GiB not available")
    index = torch.tensor([rows - 1, 5, rows - 2], device=DEV)
    source = torch.arange(1, 3 * inner + 1, device=DEV).remainder(120).to(torch.int8).reshape(3, inner)
    x.index_copy_(0, index, source)
    assert torch.equal(x[index].cpu(), source.cpu()) and x[rows - 3].cpu().eq(0).all()
    assert launched == ["flat" if inner == 1 else "rows"]


def test_kernels_compile_for_the_gpu():
    """Both kernels compile for sm_90 with runtime (unspecialised) sizes: the simulated GPU path."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    script = textwrap.dedent("""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from flaggems_ascend import index_copy as k

        for fn, constexprs in ((k._flat_kernel, {"BLOCK": 1024}), (k._row_kernel, {"BLOCK_R": 4, "BLOCK_C": 1024})):
            sig = {p.name: "constexpr" if p.name in constexprs else
                   {"dst": "*fp16", "src": "*fp16", "index": "*i64"}.get(p.name, "i64") for p in fn.params}
            src = ASTSource(fn, signature=sig, constexprs=constexprs)
            triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        print("ok")
    """)
    run_compiled(script)


def test_rms_norm_goes_to_torch_npus_fused_kernel_and_declines_what_it_does_not_take(ascend, monkeypatch):
    """``flaggems::rms_norm`` on an NPU: torch_npu's ``npu_rms_norm`` (the stand-in's here) serves plain calls;
    Gemma's weight offset, a call needing a gradient and a strided input go on to the generic kernels."""
    import torch_npu

    from flaggems_ascend import rms_norm as ascend_norm

    called = []
    fused = torch_npu.npu_rms_norm

    def spy(x, gamma, epsilon=1e-6):
        called.append(tuple(x.shape))
        return fused(x, gamma, epsilon=epsilon)

    monkeypatch.setattr(torch_npu, "npu_rms_norm", spy)
    (row,) = flaggems.routes("flaggems::rms_norm")
    assert row["chain"][:2] == ["ascend", "generic"], row
    x, w = torch.randn(2, 3, 64, dtype=torch.bfloat16).to(DEV), torch.randn(64, dtype=torch.bfloat16).to(DEV)
    out = torch.ops.flaggems.rms_norm(x, w, 1e-6)
    assert called == [(2, 3, 64)]
    with native_scope():
        torch.testing.assert_close(out.cpu(), torch.ops.flaggems.rms_norm(x.cpu(), w.cpu(), 1e-6), rtol=2 ** -6,
                                   atol=2 ** -6)
    torch.ops.flaggems.rms_norm(x, w, 1e-6, 1.0, False)  # Gemma's offset
    torch.ops.flaggems.rms_norm(x.transpose(0, 1), w, 1e-6)  # strided
    assert called == [(2, 3, 64)]
    reasons = {d["reason"] for d in flaggems.routes("flaggems::rms_norm")[0]["declined"] if d["impl"] == "ascend"}
    assert any("offset" in r for r in reasons) and any("strided" in r for r in reasons), reasons
    assert ascend_norm.reason(x.requires_grad_(), w, 0.0).startswith("a gradient is needed")


class _NpuGegluLike(torch.nn.Module):
    """A module whose forward branches on ``is_torch_npu_available()`` as diffusers' GEGLU does."""

    def forward(self, x):
        if is_torch_npu_available():  # noqa: F821 - read by the rule as source, never run
            return x
        return x


def test_ascends_patch_rule_is_offered_under_its_backend():
    from flaggems.runtime import RUNTIME

    rules = [(plugin, rule) for plugin, rule in RUNTIME.patch_rules() if rule.kind == "geglu"]
    assert [(rule.vendor, rule.decline.__name__) for _, rule in rules] == [("ascend", "npu_geglu")]


def test_ascends_rule_leaves_a_geglu_that_calls_torch_npu(monkeypatch):
    import sys
    import types

    from flaggems_ascend.patch_rules import npu_geglu

    utils = types.ModuleType("diffusers.utils")
    monkeypatch.setitem(sys.modules, "diffusers", types.ModuleType("diffusers"))
    monkeypatch.setitem(sys.modules, "diffusers.utils", utils)
    utils.is_torch_npu_available = lambda: True
    assert "npu_geglu" in npu_geglu(_NpuGegluLike())
    utils.is_torch_npu_available = lambda: False
    assert npu_geglu(_NpuGegluLike()) is None
    assert npu_geglu(torch.nn.Linear(2, 2)) is None  # no NPU branch in its forward
