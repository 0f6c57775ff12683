"""Fast launch of Triton kernels: bind once per specialisation, then launch cheaply.

``kernel[grid](...)`` spends most of its host time per call (12.1 µs on an
H200 host with triton 3.6, against 5.8 µs for torch's own ``copy_``) in
``JITFunction.run``: binding arguments, building the specialisation key,
reading knobs, building launch metadata. A :class:`FastLauncher` does that
work once per *specialisation* (constexpr values, pointer dtypes and 16-byte
alignment, Triton's ``== 1`` / ``% 16`` specialisation of unannotated or
specialised integers, device) and then calls the compiled kernel's launcher
(:mod:`.raw_launch`) with only the per-call values: 5.5 µs on the same host
(``benchmarks/toolkit_notes.md``). Tensors reach the launcher as integer
addresses, which also spares the launcher a ``data_ptr()`` call per pointer.
Per launcher, one generated function computes the key, finds the bound
kernel and makes the raw call with every argument spelled out; it is the
launcher's ``__call__``, so no layer of ``*args`` sits between the caller and
the raw launch (a 6-pointer, 24-integer kernel: 8.2 -> 5.7 µs of Python per
launch on the CI host, raw launch faked; 14.10 -> 13.41 µs per launch, driver
included, on an H200 host: ``benchmarks/launch_ab.py``).

The first call of each specialisation runs through ``kernel[grid](...)``
(which compiles if needed and returns the compiled kernel); later calls take
the fast path. Anything the fast path does not understand (a Triton version
outside the tested range, launch hooks set by a profiler, an argument that is
neither a tensor nor a Python number) goes through ``kernel[grid](...)``.
Under Triton's interpreter every launch is a plain launch inside
the kernel context's native scope (the binding's, handed down), so the torch
ops the interpreter runs on CPU tensors never re-enter flaggems overrides.

Contract: each runtime argument keeps its kind (tensor, ``int``, ``float``)
from call to call; integer arguments fit in 64 signed bits.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import triton

from . import context, recording
from .raw_launch import RawLaunch, bind_raw, compile_hooks_idle, hooks_idle, triton_version

#: Triton (major, minor) range whose launch internals the fast path was checked against.
FAST_PATH_VERSIONS = ((3, 6), (3, 9))

FAST = "fast"
PLAIN = "plain"
INTERPRET = "interpret"

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1

#: Triton's interpreter keeps its launch state in globals: interpreted launches take turns (GPU launches never lock).
_INTERPRETER_LOCK = threading.RLock()


def _is_interpreted(fn: Any) -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - every supported Triton has it
        return False
    return isinstance(fn, InterpretedFunction)


def select_mode(fn: Any) -> tuple[str, str]:
    """How ``fn`` will be launched (``fast``, ``plain`` or ``interpret``) and why."""
    if _is_interpreted(fn):
        return INTERPRET, "Triton interpreter"
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        return PLAIN, f"{type(fn).__name__} is not a plain JITFunction"
    version = triton_version()
    low, high = FAST_PATH_VERSIONS
    if version is None or not low <= version <= high:
        return PLAIN, f"triton {triton.__version__} outside the tested range {low}..{high}"
    if getattr(fn, "pre_run_hooks", None):
        return PLAIN, "kernel has pre-run hooks"
    return FAST, f"triton {triton.__version__}"


class _Device:
    """Current device and stream through Triton's driver (cheap torch calls on CUDA)."""

    def __init__(self) -> None:
        driver = triton.runtime.driver.active
        self.stream: Callable[[int], int] = driver.get_current_stream
        self.current: Callable[[], int] = driver.get_current_device
        self.set: Callable[[int], None] = driver.set_current_device
        get_device = getattr(torch._C, "_cuda_getDevice", None)
        if get_device is not None and driver.get_current_device is torch.cuda.current_device:
            # Measured on the H200 host: 0.13 µs against 0.25 µs for torch.cuda.current_device().
            self.current = get_device

    @contextlib.contextmanager
    def guard(self, device: int) -> Iterator[None]:
        """Make ``device`` current inside the block (no-op when it already is)."""
        previous = self.current()
        if device < 0 or device == previous:
            yield
            return
        self.set(device)
        try:
            yield
        finally:
            self.set(previous)


_DEVICE: _Device | None = None


def _device() -> _Device:
    global _DEVICE
    if _DEVICE is None:
        _DEVICE = _Device()
    return _DEVICE


def _current_device() -> int:
    return _device().current()


class _SignatureParam:
    """The parts of Triton's ``KernelParam`` needed here, for interpreted functions."""

    def __init__(self, param: inspect.Parameter) -> None:
        self.name = param.name
        self.is_constexpr = "constexpr" in str(param.annotation)
        self.has_default = param.default is not inspect.Parameter.empty
        self.default = param.default


def _params_of(fn: Any) -> list[Any]:
    params = getattr(fn, "params", None)
    if params is not None:
        return list(params)
    return [_SignatureParam(p) for p in inspect.signature(fn.fn).parameters.values()]


def _param_plan(fn: Any, constexprs: Mapping[str, Any]) -> tuple[list[Any], list[Any]]:
    """Split ``fn``'s parameters into the runtime ones and the fixed constexpr values.

    Returns ``(runtime_params, slots)``: ``slots`` has one entry per parameter,
    a runtime parameter object or ``_Fixed(value)``.
    """
    params = _params_of(fn)
    unknown = set(constexprs) - {p.name for p in params}
    if unknown:
        raise TypeError(f"{fn}: unknown constexpr argument(s) {sorted(unknown)}")
    runtime, slots = [], []
    for param in params:
        if param.name in constexprs:
            slots.append(_Fixed(constexprs[param.name]))
        elif param.is_constexpr:
            if not param.has_default:
                raise TypeError(f"{fn}: constexpr {param.name!r} needs a value")
            slots.append(_Fixed(param.default))
        else:
            runtime.append(param)
            slots.append(param)
    return runtime, slots


class _Fixed:
    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _key_terms(name: str, param: Any, value: Any, first_tensor: bool = False) -> list[str] | None:
    """Source of the key terms that make ``value`` pick the same compiled kernel.

    At least as fine as Triton's own specialisation; ``None`` for a kind the
    fast path does not handle.
    """
    if isinstance(value, torch.Tensor):
        # The first tensor's device leads the key (it picks the launch device): not repeated here.
        terms = [f"{name}.dtype"] if first_tensor else [f"{name}.dtype", f"{name}.get_device()"]
        if not getattr(param, "do_not_specialize_on_alignment", False):
            terms.append(f"p_{name} & 15 == 0")
        return terms
    if not isinstance(value, (int, float)):
        return None
    annotation = getattr(param, "annotation_type", "")
    specialised = not getattr(param, "do_not_specialize", False)
    if annotation:
        if not specialised or annotation in ("u1", "i1") or annotation[:2] in ("fp", "bf"):
            return []
        return [f"{name} == 1", f"{name} % 16 == 0"]
    terms = [f"{name}.__class__"]
    if isinstance(value, (bool, float)):
        return terms
    if specialised:
        terms += [f"{name} == 1", f"{name} % 16 == 0"]
    terms.append(f"{_INT32_MIN} <= {name} <= {_INT32_MAX}")
    return terms


def _build_call(slots: Sequence[Any], args: Sequence[Any]) -> Callable[..., None] | None:
    """Generate ``call(launcher, grid, *args)`` for the kinds seen in ``args``; ``None`` for an unknown kind.

    Generated once per launcher (like Triton's own binder) and written as one
    function: the specialisation key, the look-up of the bound kernel and the
    raw launch with every argument spelled out. The layers of ``*args`` it
    replaces cost ~0.1 µs per argument each.
    """
    names, pointers, key, launch, namespace = [], [], [], [], {}
    runtime = iter(args)
    for i, slot in enumerate(slots):
        if isinstance(slot, _Fixed):
            namespace[f"c{i}"] = slot.value
            launch.append(f"c{i}")
            continue
        name = f"a{i}"
        value = next(runtime)
        terms = _key_terms(name, slot, value, first_tensor=not pointers)
        if terms is None:
            return None
        names.append(name)
        if isinstance(value, torch.Tensor):
            pointers.append(f"    p_{name} = {name}.data_ptr()")
            launch.append(f"p_{name}")
        else:
            launch.append(name)
        key += terms
    tensors = [n for n, v in zip(names, args, strict=True) if isinstance(v, torch.Tensor)]
    params, kernel_args = ", ".join(names), ", ".join(launch)
    namespace.update(current=_current_device, hooks_idle=hooks_idle, grid3=_grid3, device=_device,
                     recorders=recording.RECORDERS)
    source = "\n".join([
        f"def call(self, grid, {params}):",
        "    if recorders:",
        f"        return self._record(grid, ({params},))",
        "    if not hooks_idle():",
        f"        return self._slow(grid, ({params},))",
        *pointers,
        f"    index = {f'{tensors[0]}.get_device()' if tensors else 'current()'}",
        f"    key = (index, {', '.join(key)},)",
        "    bound = self._bound.get(key)",
        "    if bound is None:",
        f"        return self._bind(key, grid, ({params},))",
        "    raw, prefix = bound",
        "    gx, gy, gz = (grid[0], 1, 1) if len(grid) == 1 else grid3(grid)",
        "    if index == self._current() or index < 0:",
        f"        return raw(gx, gy, gz, self._stream(index), *prefix, {kernel_args})",
        "    with device().guard(index):",
        f"        return raw(gx, gy, gz, self._stream(index), *prefix, {kernel_args})",
    ])
    exec(compile(source, "<flaggems.toolkit.launch>", "exec"), namespace)  # noqa: S102 - generated from our own names
    return namespace["call"]


def _grid3(grid: Sequence[int]) -> tuple[int, int, int]:
    n = len(grid)
    if n == 1:
        return grid[0], 1, 1
    if n == 2:
        return grid[0], grid[1], 1
    return grid[0], grid[1], grid[2]


class FastLauncher:
    """Launch one ``@triton.jit`` kernel with fixed constexprs and options.

    Example::

        launch = FastLauncher(copy_kernel, {"BLOCK": 1024}, num_warps=4)
        launch((cdiv(n, 1024),), dst, src, n)

    Args:
        fn: the ``@triton.jit`` function.
        constexprs: values of its ``tl.constexpr`` parameters (those with a
            default may be left out).
        num_warps, num_stages, options: compile options, as for ``kernel[grid]``.

    Call it with the grid (1 to 3 ints) and the runtime arguments in
    signature order, constexprs left out. The launch goes to the current
    stream of the first tensor argument's device, with that device current.
    """

    def __init__(self, fn: Any, constexprs: Mapping[str, Any] | None = None, *, num_warps: int | None = None,
                 num_stages: int | None = None, **options: Any) -> None:
        self.fn = fn
        self.constexprs = dict(constexprs or {})
        all_options = {"num_warps": num_warps, "num_stages": num_stages, **options}
        self.options = {k: v for k, v in all_options.items() if v is not None}
        self.mode, self.reason = select_mode(fn)
        self.form = ""
        self._runtime_params, self._slots = _param_plan(fn, self.constexprs)
        self._call: Callable[..., None] | None = None
        self._bound: dict[tuple, RawLaunch] = {}
        self._current: Callable[[], int] = _current_device
        self._stream: Callable[[int], int] | None = None

    def __call__(self, grid: Sequence[int], *args: Any) -> None:
        """Launch on ``grid`` with the runtime arguments ``args``.

        Only a launcher's first call, and every call of one without a fast
        path, runs this: binding the fast path gives the launcher the
        generated function as its ``__call__`` (:meth:`_init_fast`).
        """
        self._slow(grid, args)

    @property
    def specialisations(self) -> int:
        """Number of specialisations bound to the fast path so far."""
        return len(self._bound)

    def _full_args(self, args: Sequence[Any]) -> list[Any]:
        if len(args) != len(self._runtime_params):
            raise TypeError(f"{self.fn}: expected {len(self._runtime_params)} runtime arguments, got {len(args)}")
        runtime = iter(args)
        return [slot.value if isinstance(slot, _Fixed) else next(runtime) for slot in self._slots]

    def _plain(self, grid: Sequence[int], args: Sequence[Any]) -> Any:
        """``fn[grid](...)`` on the first tensor's device; returns what Triton returns."""
        if self.mode == INTERPRET:
            with _INTERPRETER_LOCK, context.current().native_scope():
                return self.fn[tuple(grid)](*self._full_args(args), **self.options)
        index = next((a.get_device() for a in args if isinstance(a, torch.Tensor)), -1)
        with _device().guard(index):
            return self.fn[tuple(grid)](*self._full_args(args), **self.options)

    def _slow(self, grid: Sequence[int], args: Sequence[Any]) -> None:
        """First call, a launch hook installed, or no fast path: Triton's own launch."""
        if recording.RECORDERS:
            self._record(grid, args)
            return
        if self.mode == FAST and self._call is None:
            self._init_fast(args)
        if self.mode != FAST or not hooks_idle() or not compile_hooks_idle():
            self._plain(grid, args)
            return
        self._call(self, grid, *args)  # hooks are idle: it binds ``args``' specialisation or launches it

    def _record(self, grid: Sequence[int], args: Sequence[Any]) -> None:
        """Launch through Triton and, when this thread records, describe the launch (:mod:`.recording`)."""
        rec = recording.current()
        if rec is None:  # another thread records
            self._plain(grid, args)
            return
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():  # the planner's dispatch mode watches the call, not Triton's internals
            kernel = self._plain(grid, args)
        compiled = None if self.mode == INTERPRET or not hasattr(kernel, "function") else kernel
        rec.add_launch(self, grid, args, self._full_args(args), compiled)

    def _init_fast(self, args: Sequence[Any]) -> None:
        """Generate the launch function from the first call's arguments, or fall back to plain launches."""
        try:
            if len(args) == len(self._runtime_params):
                self._call = _build_call(self._slots, args)
            self._stream = _device().stream
            self._current = _device().current
            if self._call is not None:
                # Calls now enter the generated function directly: a class of this one launcher whose
                # ``__call__`` it is (Python finds ``__call__`` on the type). Skipping the generic
                # ``__call__(grid, *args)`` saves ~0.7 µs per launch of a 30-argument kernel (CI host).
                self.__class__ = type(type(self).__name__, (type(self),), {"__call__": self._call})
        except Exception as exc:  # noqa: BLE001 - anything unexpected: Triton's own path still works
            self._call, self.reason = None, f"fast path unavailable: {type(exc).__name__}: {exc}"
        else:
            if self._call is None:
                self.reason = "an argument is neither a tensor nor a Python number"
        if self._call is None:
            self.mode = PLAIN

    def _bind(self, key: tuple, grid: Sequence[int], args: Sequence[Any]) -> None:
        """Launch through Triton (compiling if needed) and keep its compiled kernel for ``key``."""
        kernel = self._plain(grid, args)
        try:
            self._bound[key], self.form = bind_raw(kernel)
        except AttributeError:
            # Triton returned no compiled kernel (async compile, a hook skipped it): stay plain.
            self.mode, self.reason = PLAIN, f"launch returned {type(kernel).__name__}, not a compiled kernel"
