"""Conformance kit: every installed implementation of an op against native torch.

An op declares its contract cases once (:class:`Case`: inputs covering dtypes,
layouts and edge cases, or an expected error). The kit runs **every**
implementation installed for the active backend (not only the one routing
would choose) on each case and compares results, in-place mutations, dtypes,
shapes and strides with the native kernel's.

Cases live in each op family's ``cases`` part (``flaggems/ops/<family>/cases``,
imported lazily: its ``CASES``, op -> cases, and optionally ``FLOAT64_REFERENCES``
and ``GRADIENT_TERMS``, op -> function; see :mod:`flaggems.ops`), come from
plugins (``flaggems_conformance_cases``) or are added with :func:`register_cases`.
Use from pytest::

    from flaggems import testing
    @pytest.mark.parametrize("item", testing.collect(), ids=str)
    def test_conformance(item):
        testing.check(item)
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..types import Case, Inputs  # noqa: F401 - re-exported: plugins build cases from flaggems.testing

#: One-ulp relative tolerance per float dtype.
ULP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-23, torch.float64: 2.0**-52}




_CASES: dict[str, list[Case]] = {}
_FLOAT64: dict[str, Callable[..., Any]] = {}
_GRADIENT_TERMS: dict[str, Callable[..., dict[str, Any]]] = {}
_LOADED = False


def register_cases(op: str, cases: list[Case]) -> None:
    """Add contract cases for ``op`` (aten overload name, e.g. ``"copy_"``)."""
    from ..policy import normalize_op

    bucket = _CASES.setdefault(normalize_op(op), [])
    names = {c.name for c in bucket}
    bucket.extend(c for c in cases if c.name not in names)


def _load_case_modules() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    _load_family_cases()
    _load_plugin_cases()


def _load_family_cases() -> None:
    """What each op family's ``cases`` part declares (:mod:`flaggems.ops`, in report order): ``CASES`` (op ->
    cases), ``FLOAT64_REFERENCES`` and ``GRADIENT_TERMS`` (op -> function), each for ops of the family."""
    from ..families import specs
    from ..policy import normalize_op

    for record in specs():
        module = record.part("cases")
        if module is None:
            continue
        cases = dict(getattr(module, "CASES", {}))
        references = dict(getattr(module, "FLOAT64_REFERENCES", {}))
        terms = dict(getattr(module, "GRADIENT_TERMS", {}))
        covered = {normalize_op(op) for op in record.ops}
        strays = sorted(op for op in (*cases, *references, *terms) if normalize_op(op) not in covered)
        if strays:
            raise ValueError(f"{module.__name__} declares {', '.join(strays)}, not ops of family "
                             f"{record.name!r} ({', '.join(record.ops)})")
        for op, found in cases.items():
            found = list(found)
            bad = [c for c in found if not isinstance(c, Case)]
            if bad:
                raise TypeError(f"{module.__name__}: CASES[{op!r}] holds {type(bad[0]).__name__}, "
                                "expected flaggems.testing.Case")
            register_cases(op, found)
        for op, reference in references.items():
            register_float64_reference(op, reference)
        for op, term in terms.items():
            register_gradient_terms(op, term)


def _load_plugin_cases() -> None:
    """Cases plugins add through ``flaggems_conformance_cases`` (op -> cases)."""
    from ..runtime import RUNTIME

    for plugin, result in RUNTIME.manager.call_each("flaggems_conformance_cases"):
        for op, cases in dict(result).items():
            cases = list(cases)
            bad = [c for c in cases if not isinstance(c, Case)]
            if bad:
                raise TypeError(f"plugin {plugin!r}: flaggems_conformance_cases gave {type(bad[0]).__name__} "
                                f"for {op}, expected flaggems.testing.Case")
            register_cases(op, cases)


def register_float64_reference(op: str, reference: Callable[..., Any]) -> None:
    """The function the kit's float64 judge runs for ``op`` (same arguments as the op) where the op's own
    kernel does not compute float64 in float64: ``flaggems::rms_norm``'s reference casts to float32, as
    transformers' module does, so on float64 copies it would judge against a float32 result."""
    from ..policy import normalize_op

    _FLOAT64[normalize_op(op)] = reference


def register_gradient_terms(op: str, terms: Callable[..., dict[str, Any]]) -> None:
    """For an op whose gradients cancel terms far larger than themselves: ``terms(*args, incoming=...,
    **kwargs)`` (float64 copies of the call's arguments and of the incoming gradients) gives, per argument
    name, the float64 magnitude of the terms each element of that argument's gradient adds up. Any
    floating-point evaluation of the formula rounds at that scale, so the kit's gradient judge allows the
    case's ulps of it (``rms_norm``'s input gradient at a hidden size of 1 is ``rstd * (g - n * g * n)``,
    terms a thousand times the answer; torch's composite and our kernels round them differently)."""
    from ..policy import normalize_op

    _GRADIENT_TERMS[normalize_op(op)] = terms


def gradient_terms(op: str) -> Callable[..., dict[str, Any]] | None:
    """The registered gradient terms of ``op`` (:func:`register_gradient_terms`), or ``None``."""
    from ..policy import normalize_op

    _load_case_modules()
    return _GRADIENT_TERMS.get(normalize_op(op))


def gradient_term_scales(op: str, args: tuple, kwargs: dict, incoming: list[torch.Tensor],
                         leaves: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Per leaf of a float64 call (``leaves``: tensors among ``args``/``kwargs``), the magnitude of the terms
    its gradient adds up (the op's :func:`register_gradient_terms`); ``None`` where the op registers none,
    the terms do not describe the call, or a leaf's scale has another shape."""
    import inspect

    terms = gradient_terms(op)
    if terms is None:
        return [None] * len(leaves)
    try:
        bound = inspect.signature(terms).bind(*args, incoming=[g.double() for g in incoming], **kwargs)
        with torch.no_grad():
            scales = terms(*bound.args, **bound.kwargs)
    except Exception:  # noqa: BLE001 - a call the terms do not describe: no such judge
        return [None] * len(leaves)
    names = {id(value): name for name, value in bound.arguments.items() if isinstance(value, torch.Tensor)}
    found = [scales.get(names.get(id(leaf), "")) for leaf in leaves]
    return [s if s is None or s.shape == leaf.shape else None for s, leaf in zip(found, leaves, strict=True)]


def float64_reference(op: str) -> Callable[..., Any] | None:
    """The registered float64 reference of ``op`` (``None``: the op itself on float64 copies)."""
    from ..policy import normalize_op

    _load_case_modules()
    return _FLOAT64.get(normalize_op(op))


def cases_for(op: str) -> list[Case]:
    """All registered cases of ``op``."""
    from ..policy import normalize_op

    _load_case_modules()
    return list(_CASES.get(normalize_op(op), ()))


@dataclass(frozen=True)
class Item:
    """One (op, implementation, case) triple to check."""

    op: str
    label: str
    fn: Callable[..., Any]
    supports: Callable[..., Any] | None
    case: Case

    def __str__(self) -> str:
        return f"{self.op}[{self.label}]-{self.case.name}"


def installed(ops: Iterable[str] | None = None) -> list[tuple[str, str, Callable[..., Any], Callable[..., Any] | None]]:
    """Every ``(op, label, fn, supports)`` installed for the active backend (the backend's dtype limits hold
    for the kits as for routing: ``supports`` declines them)."""
    from ..binding import dtype_gate
    from ..policy import default_links
    from ..runtime import RUNTIME
    from ..types import resolve_callable

    wanted = None if ops is None else set(ops)
    active = RUNTIME.active_backend()
    banned = unsupported_dtypes()
    found = []
    for op, chain in sorted(default_links(RUNTIME.implementations(), active).items()):
        if wanted is not None and op not in wanted:
            continue
        for link in chain:
            supports = None if link.impl.supports is None else resolve_callable(link.impl.supports)
            if banned:
                supports = dtype_gate(banned, active.name, supports)
            found.append((op, link.label, resolve_callable(link.impl.fn), supports))
    return found


def unsupported_dtypes() -> frozenset[torch.dtype]:
    """The dtypes the active backend declares it does not compute (``Backend.unsupported_dtypes``: float64 on
    Ascend and KunlunXin). Routing declines them on every implementation; the randomized kit draws none of
    them (a case naming one would test only that gate, which the fixed cases and the policy tests cover)."""
    from ..runtime import RUNTIME

    return frozenset(getattr(torch, name) for name in RUNTIME.active_backend().backend.unsupported_dtypes)


def collect(ops: list[str] | None = None) -> list[Item]:
    """Every (op, installed implementation, case) for the active backend."""
    return [Item(op, label, fn, supports, case) for op, label, fn, supports in installed(ops)
            for case in cases_for(op)]


def device() -> torch.device:
    """The device the active backend runs kernels on."""
    from ..runtime import RUNTIME

    return torch.device(RUNTIME.active_backend().device_type)


def _build(case: Case, dev: torch.device) -> Inputs:
    # Equal seeds give both sides equal inputs without sharing tensors.
    torch.manual_seed(zlib.crc32(case.name.encode()))
    return case.make(dev)


class Declined(Exception):
    """The implementation declined the case (its ``supports`` said no)."""


def run_native(op: str, case: Case, dev: torch.device) -> tuple[Any, Inputs]:
    """Run the native kernel of ``op`` on fresh inputs; return (result, inputs).

    On the CPU torch's own (ATen) kernels answer, never oneDNN's: torch hands a contiguous fp32 GELU of two or
    more elements to oneDNN, and a bf16 or fp16 one where the CPU has oneDNN's bf16 or fp16 instructions
    (AVX512-BF16, AVX512-FP16/AMX), whose ``gelu_erf`` answers NaN at ``+inf`` where ATen's kernel, CUDA's and
    float64 answer ``inf``. The expected values would otherwise depend on which CPU runs the kit.
    """
    from ..binding import NativeKernel
    from ..runtime import RUNTIME

    native = NativeKernel.capture(op, RUNTIME.active_backend().dispatch_key)
    args, kwargs = _build(case, dev)
    call_args = args
    if NATIVE_CONTIGUOUS_ON_GPU in case.tags and dev.type != "cpu":
        # torch's kernel reads contiguous copies; the caller's tensors (compared after the call) keep their layout
        call_args = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
    with _aten_cpu_kernels():
        return native(*call_args, **kwargs), (args, kwargs)


@contextlib.contextmanager
def _aten_cpu_kernels() -> Iterator[None]:
    """oneDNN off inside (only that flag: ``torch.backends.mkldnn.flags`` also resets its TF32 and determinism
    settings, with a warning)."""
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


def run_impl(item: Item, dev: torch.device) -> tuple[Any, Inputs]:
    """Run one implementation on fresh inputs (raises :class:`Declined`)."""
    from ..chain import Decline

    args, kwargs = _build(item.case, dev)
    if item.supports is not None:
        verdict = item.supports(*args, **kwargs)
        if verdict is not True:
            raise Declined(verdict if isinstance(verdict, str) else "supports() returned False")
    try:
        return item.fn(*args, **kwargs), (args, kwargs)
    except Decline as exc:
        raise Declined(exc.reason) from exc


def check(item: Item, dev: torch.device | None = None) -> str:
    """Check one item; returns ``"ok"`` or ``"declined: reason"``; raises AssertionError."""
    dev = dev or device()
    if item.case.raises is not None:
        return _check_error(item, dev)
    expected, (exp_args, exp_kwargs) = run_native(item.op, item.case, dev)
    try:
        actual, (act_args, act_kwargs) = run_impl(item, dev)
    except Declined as exc:
        return f"declined: {exc}"
    assert_same(actual, expected, item.case, "result")
    for i, (a, e) in enumerate(zip(act_args, exp_args)):
        assert_same(a, e, item.case, f"argument {i} after the call")
    for key in exp_kwargs:
        assert_same(act_kwargs[key], exp_kwargs[key], item.case, f"argument {key!r} after the call")
    return "ok"


DEVICE_ASSERT = "device-assert"
NATIVE_CONTIGUOUS_ON_GPU = "native-contiguous-on-gpu"


def _check_error(item: Item, dev: torch.device) -> str:
    case = item.case
    if DEVICE_ASSERT in case.tags and dev.type != "cpu":
        from ..toolkit import checks

        if not checks.enabled():
            return "declined: needs FLAGGEMS_CHECK_INDICES=1 on this device"
    else:
        _check_native_raises(item, dev)
    try:
        run_impl(item, dev)
    except Declined as exc:
        return f"declined: {exc}"
    except case.raises as exc:
        _assert_message(exc, case, item.label)
        return "ok"
    except Exception as exc:  # noqa: BLE001
        message = f"{item}: raised {type(exc).__name__} ({exc}); torch raises {_names(case.raises)}"
        raise AssertionError(message) from exc
    raise AssertionError(f"{item}: did not raise; torch raises {_names(case.raises)}")


def _names(types: type | tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))


def _check_native_raises(item: Item, dev: torch.device) -> None:
    case = item.case
    try:
        run_native(item.op, case, dev)
    except case.raises as exc:
        _assert_message(exc, case, "native")
    else:
        raise AssertionError(f"{item}: native torch did not raise {_names(case.raises)}; fix the case")


def _assert_message(exc: BaseException, case: Case, who: str) -> None:
    if case.match is not None and case.match not in str(exc):
        raise AssertionError(f"{who} error {str(exc)!r} lacks {case.match!r}")


def assert_same(actual: Any, expected: Any, case: Case, what: str) -> None:
    """Compare tensors (values, dtype, shape, optionally strides) or nested results."""
    if isinstance(expected, (tuple, list)):
        assert isinstance(actual, (tuple, list)) and len(actual) == len(expected), f"{what}: structure differs"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, case, f"{what}[{i}]")
        return
    if not isinstance(expected, torch.Tensor):
        assert actual == expected or (actual is None and expected is None), f"{what}: {actual!r} != {expected!r}"
        return
    assert isinstance(actual, torch.Tensor), f"{what}: expected a tensor, got {type(actual).__name__}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.device.type == expected.device.type, f"{what}: device {actual.device} != {expected.device}"
    if case.check_strides and actual.numel() > 1:  # a size-1 dimension's stride is never used: not compared
        used = [d for d, n in enumerate(actual.shape) if n != 1]
        assert [actual.stride(d) for d in used] == [expected.stride(d) for d in used], (
            f"{what}: strides {actual.stride()} != {expected.stride()}")
    _assert_values(actual, expected, case, what)


def _assert_values(actual: torch.Tensor, expected: torch.Tensor, case: Case, what: str) -> None:
    ulps = case.ulps
    if ulps > 0 and expected.dtype == torch.bfloat16 and _interpreted():
        ulps += 1.0  # computing kernels' plain fp32->bf16 stores truncate in the interpreter (casts round)
    if ulps == 0 or not (expected.dtype.is_floating_point or expected.dtype.is_complex):
        same = torch.equal(actual, expected) or _equal_nan(actual, expected)
        assert same, f"{what}: values differ (bit-exact expected): {_first_diff(actual, expected)}"
        return
    rtol = ulps * ULP.get(expected.dtype, 2.0**-23)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol, equal_nan=True, msg=lambda m: f"{what}: {m}")


def _interpreted() -> bool:
    """Kernels run in Triton's interpreter (on the CPU or on a device Triton has no driver for)."""
    from ..toolkit import context

    return context.current().interpreter


def _equal_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not (a.dtype.is_floating_point or a.dtype.is_complex):
        return False
    return bool(torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0))
                and torch.equal(a.isnan(), b.isnan()))


def _first_diff(actual: torch.Tensor, expected: torch.Tensor) -> str:
    if actual.numel() == 0:
        return "empty tensors"
    diff = (actual != expected).reshape(-1).nonzero()
    if diff.numel() == 0:
        return "no elementwise difference (NaN pattern?)"
    i = int(diff[0])
    first = f"{actual.reshape(-1)[i]} vs {expected.reshape(-1)[i]}"
    return f"{diff.numel()} of {actual.numel()} differ; first at flat {i}: {first}"
