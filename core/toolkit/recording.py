"""Recording a call's kernel launches, so that the compiled entry can replay them.

While a thread records (:func:`recording`), every :class:`~.launch.FastLauncher`
launch of that thread runs as usual and is also described as a *step*: which
kernel, which grid, and for each argument where it comes from, namely a
pointer into an input of the call or into a tensor allocated during it (found
by address), or a constant. Anything a step cannot describe (an address in
neither, a launch form the replay does not know) *taints* the recording: the
planner then keeps the call on the Python path.

State the call keeps between calls (a scan's status words, zero again when
its launches end: :mod:`.workspace`) is *pinned*: while recording, the
workspace hands out a buffer owned by the plan (:meth:`Recording.pin`), and
pointers into it are described as such. The plan then holds that buffer and
the stream it was recorded on; its replays run on that stream only, one at a
time (another stream takes the Python path, whose buffers are per stream).

Two step forms:

* ``cuda``: the compiled kernel's function handle, launch configuration and
  packed parameters, launched by the compiled entry through the CUDA driver
  (``cuLaunchKernelEx``) with no Python;
* ``python``: the launcher itself with its arguments, tensors rebuilt as views
  of the replayed inputs/allocations (the interpreter, other drivers, kernels
  that need Triton's scratch memory).

The toolkit knows nothing of the dispatcher: the planner
(:mod:`flaggems.planner`) fills ``inputs`` and ``allocations`` and turns a clean
recording into a plan.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .plans import (  # noqa: F401 - INPUT, ALLOCATION, PINNED re-exported
    ALLOCATION,
    INPUT,
    NULL_ARG,
    PINNED,
    CudaStep,
    PythonStep,
    TensorRef,
    TensorSlot,
    const,
    fconst,
    pointer,
)

#: Byte width of the constants a ``cuda`` step may pass (Triton signature types).
_CONSTANT_BYTES = {"i1": 1, "i8": 1, "i16": 2, "i32": 4, "i64": 8, "u1": 1, "u8": 1, "u16": 2, "u32": 4, "u64": 8,
                   "fp32": 4, "f32": 4, "fp64": 8}
#: Largest dynamic shared memory a ``cuda`` step launches without Triton's extra attribute.
_MAX_SHARED = 228 * 1024

#: Thread ident -> the recording of that thread (empty when nothing records: the launchers test it per launch).
RECORDERS: dict[int, Recording] = {}


@dataclass
class Allocation:
    """A tensor allocated during the recorded call (weakly held: a live one after the call is persistent)."""

    ref: weakref.ref
    begin: int
    end: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


@dataclass
class Recording:
    """What one call did on the device, as far as the planner can replay it."""

    inputs: Sequence[torch.Tensor]
    allocations: list[Allocation] = field(default_factory=list)
    steps: list[tuple] = field(default_factory=list)
    taint: str | None = None
    #: Buffers the plan owns (state zero between calls) and the stream they serve (a native handle; 0 on CPU).
    pinned: list[torch.Tensor] = field(default_factory=list)
    stream: int | None = None
    #: Above zero while the recording makes its own buffers (the planner's watch ignores those ops).
    quiet: int = 0

    def spoil(self, reason: str) -> None:
        """Mark the call as not replayable (the first reason is kept)."""
        if self.taint is None:
            self.taint = reason

    def allocated(self, tensor: torch.Tensor) -> None:
        """Note a tensor allocated by the call (its storage is the allocation)."""
        storage = tensor.untyped_storage()
        begin = storage.data_ptr()
        self.allocations.append(Allocation(weakref.ref(tensor), begin, begin + storage.nbytes(),
                                           tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype,
                                           tensor.device))

    def pin(self, like: torch.Tensor, words: int, stream: int) -> torch.Tensor:
        """A zeroed int64 buffer of ``words`` owned by the plan being recorded, for ``stream``.

        Its users keep the workspace contract (the words they set are zero
        again when their launches end), so every replay finds it zeroed. One
        stream per recording: a second one, or a stream being captured into a
        CUDA graph (the buffer would come from the graph's pool), spoils it.
        """
        if self.stream is not None and stream != self.stream:
            self.spoil("state buffers of two streams")
        if like.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            self.spoil("state buffer asked for during CUDA graph capture")
        self.quiet += 1
        try:
            buffer = torch.zeros(words, dtype=torch.int64, device=like.device)
        finally:
            self.quiet -= 1
        self.pinned.append(buffer)
        self.stream = stream
        return buffer

    def locate(self, tensor: torch.Tensor) -> tuple[int, int, int] | None:
        """``(source, index, byte delta from its data pointer)`` of the memory ``tensor`` points at."""
        address = tensor.data_ptr()
        for index, buffer in enumerate(self.pinned):
            begin = buffer.data_ptr()
            if begin <= address < begin + buffer.numel() * buffer.element_size():
                return PINNED, index, address - begin
        for index in range(len(self.allocations) - 1, -1, -1):  # the newest live one: addresses are reused
            alloc = self.allocations[index]
            if alloc.begin <= address < max(alloc.end, alloc.begin + 1) and alloc.ref() is not None:
                return ALLOCATION, index, address - alloc.begin
        for index, source in enumerate(self.inputs):
            storage = source.untyped_storage()
            begin = storage.data_ptr()
            if begin <= address < max(begin + storage.nbytes(), begin + 1):
                return INPUT, index, address - source.data_ptr()
        return None

    def view(self, tensor: torch.Tensor) -> tuple | None:
        """How the replay rebuilds ``tensor``: ``(source, index, as_is, sizes, strides, storage_offset)``."""
        where = self.locate(tensor)
        if where is None:
            return None
        source, index, _ = where
        if source == PINNED:
            base = self.pinned[index]
            if tensor.dtype != base.dtype:
                return None
            if tensor.storage_offset() == 0 and tensor.shape == base.shape and tensor.stride() == base.stride():
                return TensorRef(PINNED, index, True, (), (), 0)
            return TensorRef(PINNED, index, False, tuple(tensor.shape), tuple(tensor.stride()),
                             tensor.storage_offset())
        base_dtype = self.inputs[index].dtype if source == INPUT else self.allocations[index].dtype
        if tensor.dtype != base_dtype:
            return None
        if source == INPUT and tensor is self.inputs[index]:
            return TensorRef(INPUT, index, True, (), (), 0)
        if source == ALLOCATION:
            alloc = self.allocations[index]
            if (tensor.storage_offset() == 0 and tuple(tensor.shape) == alloc.sizes
                    and tuple(tensor.stride()) == alloc.strides):
                return TensorRef(ALLOCATION, index, True, (), (), 0)
        return TensorRef(source, index, False, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())

    def add_launch(self, launcher: Any, grid: Sequence[int], args: Sequence[Any], full_args: Sequence[Any],
                   kernel: Any) -> None:
        """Describe one launch (``args``: the runtime arguments; ``full_args``: every kernel parameter)."""
        if self.taint is not None:
            return
        grid3 = (tuple(grid) + (1, 1))[:3]
        if grid3[0] * grid3[1] * grid3[2] == 0:
            return  # Triton launches nothing for an empty grid
        step = _cuda_step(self, kernel, grid3, full_args, args) if kernel is not None else None
        if step is None:
            step = self._python_step(launcher, tuple(grid), args)
        if step is not None:
            self.steps.append(step)

    def _python_step(self, launcher: Any, grid: tuple, args: Sequence[Any]) -> tuple | None:
        values, slots = [], []
        for position, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                view = self.view(arg)
                if view is None:
                    self.spoil("a launch argument points outside the call's inputs and allocations")
                    return None
                slots.append(TensorSlot(position, view))
                values.append(None)
            else:
                values.append(arg)
        return PythonStep("python", launcher, grid, tuple(values), tuple(slots))


def _signature(kernel: Any) -> list[tuple[int, str]] | None:
    """``(parameter index, type)`` of the parameters the compiled kernel takes, in order."""
    src = getattr(kernel, "src", None)
    fn = getattr(src, "fn", None)
    if src is None or fn is None:
        return None
    names = list(fn.arg_names)

    def index(key: Any) -> int:
        if isinstance(key, str):
            return names.index(key)
        return key[0] if isinstance(key, tuple) else key

    constants = {index(k) for k in getattr(src, "constants", {})}
    signature = {index(k): v for k, v in src.signature.items()}
    return [(i, signature[i]) for i in sorted(signature) if signature[i] != "constexpr" and i not in constants]


def _constant(kind: str, value: Any) -> tuple | None:
    size = _CONSTANT_BYTES.get(kind)
    if size is None:
        return None
    if kind in ("fp32", "f32"):
        import struct

        return fconst(4, int.from_bytes(struct.pack("<f", float(value)), "little"))
    if kind == "fp64":
        import struct

        return fconst(8, int.from_bytes(struct.pack("<d", float(value)), "little", signed=True))
    return const(size, int(value))


def _cuda_step(rec: Recording, kernel: Any, grid: tuple, full_args: Sequence[Any],
               args: Sequence[Any]) -> tuple | None:
    """A ``cuda`` step for a compiled NVIDIA kernel, or ``None`` where only the ``python`` form is sure."""
    metadata = getattr(kernel, "metadata", None)
    function = getattr(kernel, "function", None)
    signature = _signature(kernel)
    if metadata is None or not function or signature is None or getattr(metadata, "num_ctas", 1) != 1:
        return None
    if getattr(metadata, "backend_name", "cuda") != "cuda" or getattr(metadata, "shared", 0) > _MAX_SHARED:
        return None
    params = []
    for index, kind in signature:
        value = full_args[index]
        if kind.startswith("*"):
            if not isinstance(value, torch.Tensor):
                return None
            where = rec.locate(value)
            if where is None:
                rec.spoil("a kernel pointer outside the call's inputs and allocations")
                return None
            params.append(pointer(*where))
        else:
            const = _constant(kind, value)
            if const is None or isinstance(value, torch.Tensor):
                return None
            params.append(const)
    for name in ("global_scratch_size", "profile_scratch_size"):
        if hasattr(metadata, name):
            if getattr(metadata, name):
                return None  # the kernel needs Triton's scratch allocator: the python form allocates it
            params.append(NULL_ARG)
    return CudaStep("cuda", int(function), grid, 32 * int(metadata.num_warps), int(metadata.shared),
                    bool(getattr(metadata, "launch_pdl", False)),
                    bool(getattr(metadata, "launch_cooperative_grid", False)), tuple(params),
                    tuple(a for a in args if isinstance(a, int) and not isinstance(a, bool)))


def current() -> Recording | None:
    """The calling thread's recording, if it records."""
    return RECORDERS.get(threading.get_ident()) if RECORDERS else None


def host_values(tensor: torch.Tensor) -> list:
    """``tensor.tolist()``, noted as a host read: a call that reads values back cannot replay its launches
    alone. Fronts and kernels read device values through this: a CPU tensor's ``tolist()`` reaches no torch
    op the planner's watch sees (a replay of ``repeat_interleave(repeats)`` kept the first call's total)."""
    rec = current()
    if rec is not None:
        rec.spoil("reads values back to the host")
    return tensor.tolist()


@contextlib.contextmanager
def recording(inputs: Sequence[torch.Tensor]) -> Iterator[Recording]:
    """Record this thread's launches inside the block."""
    me = threading.get_ident()
    rec = Recording(inputs)
    outer = RECORDERS.get(me)
    RECORDERS[me] = rec
    try:
        yield rec
    finally:
        if outer is None:
            RECORDERS.pop(me, None)
        else:
            RECORDERS[me] = outer
