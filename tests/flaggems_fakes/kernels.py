"""Triton kernels and implementations used by the fake plugins.

Imported lazily (through ``"module:attr"`` references) after the backend is
selected, so ``TRITON_INTERPRET`` is already set on CPU machines.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flaggems.binding import Decline, native_scope

CALLS: list[str] = []


@triton.jit
def _neg_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    # Negate in fp32: triton 3.9's interpreter negates bf16 values wrongly.
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, -x, mask=mask)


def _launch_neg(x: torch.Tensor, out: torch.Tensor) -> None:
    n = x.numel()
    if n:
        with native_scope():
            _neg_kernel[(triton.cdiv(n, 64),)](x, out, n, BLOCK=64)


def triton_neg(x: torch.Tensor) -> torch.Tensor:
    """aten::neg through a Triton kernel (contiguous inputs only)."""
    CALLS.append("triton_neg")
    return _neg(x)


def _neg(x: torch.Tensor) -> torch.Tensor:
    dense = x.contiguous()
    result = torch.empty_like(dense)
    _launch_neg(dense, result)
    out = torch.empty_like(x)  # torch keeps a dense input's strides
    with native_scope():
        out.copy_(result)
    return out


def neg_supports(x: torch.Tensor) -> bool | str:
    """Accept float tensors; decline others with a reason."""
    return True if x.dtype.is_floating_point else f"dtype {x.dtype} not supported"


def vendor_neg(x: torch.Tensor) -> torch.Tensor:
    """A 'vendor' neg: records the call, then computes like the generic one."""
    CALLS.append("vendor_neg")
    return _neg(x)


def vendor_neg_supports(x: torch.Tensor) -> bool | str:
    """The vendor declines float64 (like a backend that cannot compile it)."""
    if x.dtype == torch.float64:
        return "float64 not supported on this vendor"
    return neg_supports(x)


def reentrant_abs(x: torch.Tensor) -> torch.Tensor:
    """Calls torch.abs inside its own implementation: must go native, not recurse."""
    CALLS.append("reentrant_abs")
    return torch.abs(x) + 0


def declining_add(self: torch.Tensor, other, alpha=1):
    """add.Tensor that always declines at call time (tests scalar re-wrapping)."""
    CALLS.append("declining_add")
    raise Decline("test impl declines every call")


def always_supported(*args, **kwargs) -> bool:
    """A ``supports`` predicate that accepts every call."""
    return True


def copy_via_interpreter(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """copy_ through an interpreted kernel, *without* native_scope: the
    interpreter's own copy_ of CPU storages re-enters aten::copy_, which the
    re-entry guard must send to the native kernel."""
    CALLS.append("copy_via_interpreter")
    if self.shape != src.shape or self.dtype != src.dtype or not self.is_contiguous() or not src.is_contiguous():
        raise Decline("only same-shape contiguous copies")
    n = src.numel()
    if n:
        _copy_kernel[(triton.cdiv(n, 64),)](src, self, n, BLOCK=64)
    return self


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=mask), mask=mask)


# -- replayable implementations (the compiled entry's tests) -------------------------------------------------------
_PERSISTENT: dict[str, torch.Tensor] = {}


def _neg_launcher():
    from flaggems.toolkit import FastLauncher

    return FastLauncher(_neg_kernel, {"BLOCK": 64})


_NEG = []


def fast_neg(x: torch.Tensor) -> torch.Tensor:
    """neg through the toolkit's launcher into a fresh output: a call the compiled entry may replay."""
    CALLS.append("fast_neg")
    if not x.is_contiguous() or not x.dtype.is_floating_point:
        raise Decline("contiguous float input only")
    if not _NEG:
        _NEG.append(_neg_launcher())
    out = torch.empty_like(x)
    if x.numel():
        _NEG[0]((triton.cdiv(x.numel(), 64),), x, out, x.numel())
    return out


def neg_with_persistent_workspace(x: torch.Tensor) -> torch.Tensor:
    """neg through a workspace the implementation keeps between calls: never replayable."""
    CALLS.append("persistent_neg")
    if not _NEG:
        _NEG.append(_neg_launcher())
    if "ws" not in _PERSISTENT or _PERSISTENT["ws"].numel() < x.numel():
        _PERSISTENT["ws"] = torch.empty(x.numel(), device=x.device, dtype=x.dtype)
    ws = _PERSISTENT["ws"]
    _NEG[0]((triton.cdiv(x.numel(), 64),), x, ws, x.numel())
    out = torch.empty_like(x)
    _NEG[0]((triton.cdiv(x.numel(), 64),), ws, out, x.numel())
    return -out


def neg_reading_data(x: torch.Tensor) -> torch.Tensor:
    """neg that reads a value on the host before launching (a sync): never replayable."""
    CALLS.append("reading_neg")
    if x.numel() and bool(x.reshape(-1)[0] > 1e30):
        raise Decline("huge first element")
    return fast_neg(x)


@triton.jit
def _claim_and_neg_kernel(x_ptr, out_ptr, status_ptr, n, BLOCK: tl.constexpr):
    """out = -x; a program finding its status word already set (dirty state) writes NaN instead."""
    pid = tl.program_id(0)
    before = tl.atomic_add(status_ptr + pid, 1)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, tl.where(before == 0, -x, float("nan")), mask=mask)


@triton.jit
def _release_kernel(status_ptr, words, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(status_ptr + offsets, tl.zeros([BLOCK], tl.int64), mask=offsets < words)


_STATEFUL = []


def neg_with_scan_state(x: torch.Tensor) -> torch.Tensor:
    """neg in two launches sharing zeroed state (the workspace contract, like repeat_interleave's scan)."""
    from flaggems.toolkit import FastLauncher
    from flaggems.toolkit.workspace import claim_scratch

    CALLS.append("stateful_neg")
    if not x.is_contiguous() or not x.dtype.is_floating_point or x.numel() > 64 * 64:
        raise Decline("contiguous float input of at most 4096 elements")
    if not _STATEFUL:
        _STATEFUL.extend((FastLauncher(_claim_and_neg_kernel, {"BLOCK": 64}),
                          FastLauncher(_release_kernel, {"BLOCK": 64})))
    claim, release = _STATEFUL
    out = torch.empty_like(x)
    words = triton.cdiv(x.numel(), 64)
    if words:
        status, lock = claim_scratch(x, words)
        with lock:
            claim((words,), x, out, status, x.numel())
            release((1,), status, words)
    return out
