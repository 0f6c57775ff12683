"""The randomized, differential conformance kit.

For every routed op and every installed implementation (as :func:`flaggems.testing.collect`
enumerates them, vendor chains included) it runs seeded random cases and compares each
with native torch: values, shape, dtype, strides, every input after the call, the whole
buffers behind the inputs (nothing outside a destination written) and error types.

Cases come from two sources, alternating by seed:

* **relayout** (every op, plugin-added ones included): a registered :class:`~flaggems.testing.Case`,
  built with a varied seed, each tensor argument re-laid out with the same values
  (:mod:`flaggems.testing._layouts`: strided/offset views into poisoned buffers,
  permuted storage orders, channels_last, negative views, stride-0 dimensions);
* **generated** (the ops whose family has random case generators): each op family's ``generate.py``
  (:meth:`flaggems.families.OpSpec.generators`; shared helpers in :mod:`flaggems.testing._generators`).

Both draw only dtypes the active backend computes (:func:`flaggems.testing.unsupported_dtypes`, the
backend's declared ``unsupported_dtypes``): a registered case naming another is not re-laid out, a generated
one is drawn again (:func:`generate`). Routing would decline such a case on every implementation, so on that
backend (float64 on Ascend) it would test nothing.

Each case runs through three *modes*: ``direct`` (the implementation's function,
after the central gate :func:`flaggems.binding.unservable` and its ``supports``),
and ``compiled`` / ``python``: the dispatcher (``torch.ops.aten...``) with flaggems
enabled for that op alone, routed to that implementation alone
(``FLAGGEMS_OP_<op>=<label>`` and ``enable(include=[op])``) under that entry,
called twice with one layout and two sets of values (the first call plans, the
second replays). Native results are computed inside
:func:`flaggems.binding.native_scope`. Where torch's result requires grad, both
sides then run their backward with the same incoming gradients and the leaves'
gradients are compared too (the dispatcher modes: what autograd reaches).

Run it with ``flaggems kit`` or :func:`run_kit`; ``FLAGGEMS_KIT_CASES`` sets the
number of cases per op and implementation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..families import specs
from . import (
    DEVICE_ASSERT,
    NATIVE_CONTIGUOUS_ON_GPU,
    Case,
    Declined,
    _sweep,
    assert_same,
    cases_for,
    device,
    unsupported_dtypes,
)
from ._cpu_safety import cpu_safe_kwargs, torch_cpu_overruns  # noqa: F401 - torch_cpu_overruns re-exported
from ._generators import Gen
from ._layouts import Built, relayout, twin, written_arguments

#: Modes a case runs through: the implementation's function, then the dispatcher under each entry.
MODES = ("direct", "compiled", "python")
GENERATED = "generated"


def generators() -> dict[str, Callable[[random.Random, torch.device], Gen]]:
    """Every op's random case generator: each op family's (:meth:`flaggems.families.OpSpec.generators`), in the
    families' report order (an op two families generate is an error)."""
    found: dict[str, Callable[[random.Random, torch.device], Gen]] = {}
    for record in specs():
        for op, gen in record.generators().items():
            if op in found:
                raise ValueError(f"op family {record.name!r} generates {op!r}, which another family generates")
            found[op] = gen
    return found


#: Every op's random case generator (:func:`generators`, built at import).
GENERATORS = generators()

#: Ops whose native kernel computes the expected values from contiguous copies, on every device. torch
#: calls these kernels only from its composites, with contiguous (or matching channels_last) tensors, and
#: its CPU kernels assume that: ``native_group_norm`` raises for a strided input and reads a strided weight
#: or bias wrongly; ``native_group_norm_backward`` returns wrong gradients (or crashes) for any other
#: layout, e.g. a channels_last input with a contiguous grad_out (see :mod:`flaggems.ops.group_norm.cases.native`).
#: flaggems' kernels read every layout in place, so their values are checked against the contiguous answer;
#: through the dispatcher a call they decline reaches torch's kernel, so there only layouts it takes are
#: sent where the implementation would decline (:func:`native_takes`).
NATIVE_FROM_CONTIGUOUS = frozenset({"native_group_norm", "native_group_norm_backward"})


@dataclass(frozen=True)
class Target:
    """One installed implementation of one op."""

    op: str
    label: str
    fn: Callable[..., Any]
    supports: Callable[..., Any] | None

    def __str__(self) -> str:
        return f"{self.op}[{self.label}]"


def targets(ops: list[str] | None = None, impl: str | None = None) -> list[Target]:
    """Every (op, installed implementation) for the active backend, as :func:`~flaggems.testing.collect` sees
    them (the backend's dtype limits included); ``impl``: only that implementation label."""
    from ..policy import normalize_op
    from . import installed

    wanted = None if ops is None else [normalize_op(op) for op in ops]
    return [Target(op, label, fn, supports) for op, label, fn, supports in installed(wanted)
            if impl in (None, label)]


@dataclass(frozen=True)
class RandomCase:
    """One random case of an op: a seed and its source (``generated`` or a registered case's name);
    ``variant`` >= 0: a point of a size sweep (:mod:`flaggems.testing._sweep`) of the generated case ``seed``."""

    op: str
    index: int
    seed: int
    source: str
    variant: int = -1


#: Share of generated cases run as size sweeps, and the points of a sweep (each counted as a case): the
#: first points of a layout class plan, the later ones replay the generic plan made from them.
SWEEP_SHARE = 0.25
SWEEP_POINTS = 6
#: Elements of a swept shape at most: under Triton's interpreter, and on a device.
SWEEP_NUMEL = {"interpreted": 1 << 14, "device": 1 << 18}


@dataclass
class Prepared:
    """One side's built inputs and the tolerances that hold for them."""

    built: Built
    case: Case
    kind: str


def case_seed(seed: int, op: str, index: int) -> int:
    """The seed of case ``index`` of ``op`` in the run seeded ``seed``."""
    return zlib.crc32(f"{seed}/{op}/{index}".encode())


#: Under Triton's interpreter, registered cases with more tensor elements than this are not re-laid out
#: (the fixed-list kit runs them as written; a GPU run re-lays them out too).
INTERPRETED_MAX_NUMEL = 1 << 15
#: On a device, nor those with more than this: a relayout places each tensor's elements in a buffer of its
#: own, and an expanded view of 2**31 elements over one row of storage (index_select's) would allocate them.
DEVICE_MAX_NUMEL = 1 << 26
_FACTS: dict[tuple[str, str], tuple[int, frozenset[torch.dtype]]] = {}


def _case_facts(op: str, case: Case) -> tuple[int, frozenset[torch.dtype]]:
    """Tensor elements of a registered case's inputs and the dtypes they name (built once, on the CPU)."""
    key = (op, case.name)
    if key not in _FACTS:
        from ..binding import native_scope

        with native_scope():
            args, kwargs = case.make(torch.device("cpu"))
        values = (*args, *kwargs.values())
        _FACTS[key] = (sum(v.numel() for v in values if isinstance(v, torch.Tensor)), named_dtypes(values))
    return _FACTS[key]


def case_numel(op: str, case: Case) -> int:
    """Tensor elements of a registered case's inputs (built once, on the CPU)."""
    return _case_facts(op, case)[0]


def named_dtypes(values: Any) -> frozenset[torch.dtype]:
    """The dtypes a call's arguments name: each tensor's (in lists too) and each ``dtype`` argument."""
    found: set[torch.dtype] = set()
    for value in values:
        if isinstance(value, (list, tuple)):
            found |= named_dtypes(value)
        elif isinstance(value, torch.Tensor):
            found.add(value.dtype)
        elif isinstance(value, torch.dtype):
            found.add(value)
    return frozenset(found)


def relayout_pool(op: str, unsupported: frozenset[torch.dtype] | None = None) -> list[Case]:
    """The registered cases of ``op`` the kit re-lays out: none naming a dtype of ``unsupported`` (default:
    the active backend's :func:`~flaggems.testing.unsupported_dtypes`), small ones only (smaller still under
    the interpreter)."""
    from . import _interpreted

    banned = unsupported_dtypes() if unsupported is None else unsupported
    most = INTERPRETED_MAX_NUMEL if _interpreted() else DEVICE_MAX_NUMEL
    return [c for c in cases_for(op) if not (banned & _case_facts(op, c)[1]) and case_numel(op, c) <= most]


def random_cases(op: str, count: int, seed: int = 0, unsupported: frozenset[torch.dtype] | None = None
                 ) -> list[RandomCase]:
    """``count`` cases of ``op``: generated and re-laid-out registered ones, about half each (registered ones
    naming no dtype of ``unsupported``, default the active backend's: see :func:`relayout_pool`)."""
    hand = relayout_pool(op, unsupported)
    if op not in GENERATORS and not hand:
        return []
    out: list[RandomCase] = []
    draw = 0
    while len(out) < count:
        s = case_seed(seed, op, draw)
        draw += 1
        pick = random.Random(s ^ 0x5EED)
        if op in GENERATORS and (not hand or pick.random() < 0.5):
            points = SWEEP_POINTS if pick.random() < SWEEP_SHARE else 0
            out += [RandomCase(op, len(out) + v, s, GENERATED, v) for v in range(min(points, count - len(out)))]
            if not points:
                out.append(RandomCase(op, len(out), s, GENERATED))
        else:
            out.append(RandomCase(op, len(out), s, hand[pick.randrange(len(hand))].name))
    return out


def build(rc: RandomCase, dev: torch.device, values_seed: int, like: Prepared | None = None) -> Prepared:
    """Build one side's inputs: the layout from ``rc.seed`` (``like``: the layouts ``like`` drew), the values
    from ``values_seed``."""
    from ..binding import native_scope

    with native_scope():
        if rc.source == GENERATED:
            rng, gen = generate(rc, dev, values_seed)
            case = Case(f"{GENERATED}:{gen.kind}", _no_make, ulps=gen.ulps, check_strides=gen.check_strides,
                        tags=gen.tags)
            args, kwargs, fixed, kind = gen.args, gen.kwargs, gen.fixed, gen.kind
        else:
            rng = random.Random(rc.seed)
            torch.manual_seed(values_seed)
            case = next(c for c in cases_for(rc.op) if c.name == rc.source)
            (args, kwargs), fixed, kind = case.make(dev), frozenset(), case.name
        built = relayout(tuple(args), dict(kwargs), rng, written_arguments(rc.op), fixed,
                         like.built if like is not None else None)
    return Prepared(built, case, kind)


#: Draws of a generated case at most before one naming a dtype the backend does not compute is kept (and then
#: declined): a generator draws such a dtype for a tenth of its cases or fewer.
DTYPE_DRAWS = 16


def generate(rc: RandomCase, dev: torch.device, values_seed: int) -> tuple[random.Random, Any]:
    """The generator's case of ``rc`` and the random stream after it (the relayout draws from it next): from
    ``rc.seed``, or where that draw names a dtype the active backend does not compute
    (:func:`~flaggems.testing.unsupported_dtypes`), from the first of the seeds derived from it whose draw
    names none. The choice depends on the structural draws only (dtypes come from the stream, never from
    values), so both sides, both calls and every point of a sweep make the same one; where no backend limit
    holds the stream is ``rc.seed``'s, as it always was."""
    banned = unsupported_dtypes()
    for attempt in range(DTYPE_DRAWS):
        rng = random.Random(rc.seed if not attempt else case_seed(rc.seed, rc.op, -attempt))
        torch.manual_seed(values_seed)
        with _swept(rc):
            gen = GENERATORS[rc.op](rng, dev)
        if not banned & named_dtypes((*gen.args, *gen.kwargs.values())):
            break
    return rng, gen


def build_pair(rc: RandomCase, dev: torch.device, values_seed: int, built: Prepared | None = None,
               like: Prepared | None = None) -> tuple[Prepared, Prepared]:
    """Both sides' inputs (``built``: the first, built already and not called with; ``like``: a build of
    the case whose layouts to take): the second is a copy of the first in its own memory
    (:func:`~flaggems.testing._layouts.twin`), or built again where it cannot be."""
    from ..binding import native_scope

    first = built if built is not None else build(rc, dev, values_seed, like)
    with native_scope():
        copied = twin(first.built)
    return first, (Prepared(copied, first.case, first.kind) if copied is not None
                   else build(rc, dev, values_seed, like))


def _swept(rc: RandomCase) -> contextlib.AbstractContextManager:
    """The size sweep a case's shapes are drawn under (none for a plain case)."""
    from . import _interpreted

    if rc.variant < 0:
        return contextlib.nullcontext()
    return _sweep.active(rc.seed, rc.variant, SWEEP_NUMEL["interpreted" if _interpreted() else "device"])


def _no_make(dev: torch.device) -> Any:
    raise NotImplementedError("a generated case is built by its generator")


# -- native side ---------------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    """What one side did: a result, or the exception it raised."""

    result: Any = None
    error: BaseException | None = None


def call_native(op: str, prep: Prepared, dev: torch.device) -> Outcome:
    """Run the native kernel (``torch.ops.aten`` inside :func:`~flaggems.binding.native_scope`)."""
    from ..binding import _overload, native_scope

    args, kwargs = native_inputs(op, prep, dev)
    if DEVICE_ASSERT in prep.case.tags and dev.type != "cpu":
        raised = _cpu_error(op, args, kwargs)  # torch answers with a device-side assert there
        if raised is not None:
            return raised
    if dev.type == "cpu":
        kwargs = cpu_safe_kwargs(op, args, kwargs)
    with native_scope():
        try:
            return Outcome(_overload(op)(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - the error type is part of the contract
            return Outcome(error=exc)


def native_inputs(op: str, prep: Prepared, dev: torch.device) -> tuple[tuple, dict]:
    """The native side's arguments: contiguous copies where torch's kernel needs them."""
    args, kwargs = prep.built.args, prep.built.kwargs
    if op in NATIVE_FROM_CONTIGUOUS or (NATIVE_CONTIGUOUS_ON_GPU in prep.case.tags and dev.type != "cpu"):
        return tuple(_dense(a) for a in args), {k: _dense(v) for k, v in kwargs.items()}
    return args, kwargs


def _suggested_format(result: torch.Tensor, args: tuple) -> None:
    """``aten::group_norm``'s documented layout: the input's suggested memory format (torch's CPU composite
    does the same; its CUDA one copies the input and returns a contiguous output)."""
    from torch._prims_common import suggest_memory_format

    wanted = suggest_memory_format(args[0])
    assert result.is_contiguous(memory_format=wanted), (
        f"result: strides {result.stride()} are not {wanted} (the input's suggested memory format)")


#: Ops whose documented output layout differs from torch's off the CPU: the result is checked against the
#: documented choice there instead of torch's strides (docs/architecture.md, "Operators").
LAYOUT_CHOICES = {"group_norm": _suggested_format}


def contiguous_native(op: str, prep: Prepared, dev: torch.device) -> bool:
    """Whether the native side read contiguous copies of inputs that were not contiguous."""
    args, _ = native_inputs(op, prep, dev)
    originals = [a for a in prep.built.args if isinstance(a, torch.Tensor)]
    copies = [a for a in args if isinstance(a, torch.Tensor)]
    return any(a is not b for a, b in zip(originals, copies))


def native_takes(prep: Prepared) -> bool:
    """Whether torch's kernel of a :data:`NATIVE_FROM_CONTIGUOUS` op takes these tensors as they are: each
    contiguous in its suggested memory format (channels_last only where torch's rule says so); no negative bit."""
    tensors = [v for v in (*prep.built.args, *prep.built.kwargs.values()) if isinstance(v, torch.Tensor)]
    if any(t.is_neg() or t.is_conj() for t in tensors):
        return False
    if all(t.is_contiguous() for t in tensors):
        return True
    from torch._prims_common import suggest_memory_format  # torch's rule, size-1 dimensions included

    return all(t.is_contiguous(memory_format=suggest_memory_format(t)) for t in tensors)


def _dense(value: Any) -> Any:
    from ..binding import native_scope

    if not isinstance(value, torch.Tensor) or value.is_contiguous():
        return value
    with native_scope():
        return value.contiguous()


def _cpu_error(op: str, args: tuple, kwargs: dict) -> Outcome | None:
    """torch's CPU error for these inputs (the index checking contract's error type), or ``None``."""
    from ..binding import _overload, native_scope

    def to_cpu(v: Any) -> Any:
        return v.cpu() if isinstance(v, torch.Tensor) else v

    args, kwargs = tuple(to_cpu(a) for a in args), {k: to_cpu(v) for k, v in kwargs.items()}
    with native_scope():
        try:
            _overload(op)(*args, **cpu_safe_kwargs(op, args, kwargs))
        except Exception as exc:  # noqa: BLE001
            return Outcome(error=exc)
    return None


# -- implementation side ----------------------------------------------------------------------------------------

def gate(args: tuple, kwargs: dict) -> str | None:
    """The dispatcher's central gate (:func:`flaggems.binding.unservable`)."""
    from ..binding import unservable

    return unservable(args, kwargs)


def call_impl(target: Target, prep: Prepared) -> Outcome:
    """Call the implementation's function directly (raises :class:`~flaggems.testing.Declined`)."""
    from ..chain import Decline

    args, kwargs = prep.built.args, prep.built.kwargs
    reason = gate(args, kwargs)
    if reason is not None:
        raise Declined(f"unservable: {reason}")
    if target.supports is not None:
        verdict = target.supports(*args, **kwargs)
        if verdict is not True:
            raise Declined(verdict if isinstance(verdict, str) else "supports() returned False")
    try:
        return Outcome(target.fn(*args, **kwargs))
    except Decline as exc:
        raise Declined(exc.reason) from exc
    except Exception as exc:  # noqa: BLE001
        return Outcome(error=exc)


def call_dispatcher(op: str, prep: Prepared) -> Outcome:
    """Call ``torch.ops.aten.<op>`` (flaggems enabled and routed by :func:`routed`)."""
    from ..binding import _overload

    try:
        return Outcome(_overload(op)(*prep.built.args, **prep.built.kwargs))
    except Exception as exc:  # noqa: BLE001
        return Outcome(error=exc)


# -- comparison ------------------------------------------------------------------------------------------------

def compare(op: str, actual: Outcome, expected: Outcome, act: Prepared, exp: Prepared, dev: torch.device,
            served: bool = True) -> None:
    """Assert both sides agree: error types, or result, arguments after the call and whole buffers;
    ``served``: flaggems served the call (a documented layout choice is checked only then)."""
    if expected.error is not None:
        if actual.error is None:
            raise AssertionError(f"did not raise; torch raises {type(expected.error).__name__}: {expected.error}")
        if not isinstance(actual.error, type(expected.error)):
            raise AssertionError(f"raised {type(actual.error).__name__} ({actual.error}); torch raises "
                                 f"{type(expected.error).__name__} ({expected.error})") from actual.error
        return
    if actual.error is not None:
        raise AssertionError(f"raised {type(actual.error).__name__}: {actual.error}; torch did not") from actual.error
    case = exp.case
    if contiguous_native(op, exp, dev) or op in LAYOUT_CHOICES and dev.type != "cpu":
        case = dataclasses.replace(case, check_strides=False)  # torch's output layout is that of its copies
    if served and op in LAYOUT_CHOICES and isinstance(actual.result, torch.Tensor):
        LAYOUT_CHOICES[op](actual.result, act.built.args)
    try:
        assert_same(actual.result, expected.result, case, "result")
    except AssertionError as exc:
        if "not close" not in str(exc) or not closer_than_torch(op, actual.result, expected.result, exp, dev):
            raise
    for i, (a, e) in enumerate(zip(act.built.args, exp.built.args)):
        assert_same(a, e, exp.case, f"argument {i} after the call")
    for key, e in exp.built.kwargs.items():
        assert_same(act.built.kwargs[key], e, exp.case, f"argument {key!r} after the call")
    for i, (a, e) in enumerate(zip(act.built.buffers, exp.built.buffers)):
        assert_same(a, e, exp.case, f"the whole buffer behind tensor argument {i} (poison outside the view)")


def closer_than_torch(op: str, actual: Any, expected: Any, exp: Prepared, dev: torch.device) -> bool:
    """A result outside the case's tolerance of torch's, judged against float64: the native op run on float64
    copies of the floating inputs. It passes where every element of ours is no farther from that than twice
    torch's distance plus the tolerance (torch's own rounding was the difference: an fp16 group of three
    elements, a sum of 75,000 gradients, GELU's tail). ``False`` where float64 cannot be computed."""
    if exp.case.ulps <= 0:
        return False
    from ..binding import native_scope

    wide = _widener()
    args, kwargs = native_inputs(op, exp, dev)
    try:
        with native_scope():
            truth = _float64_call(op)(*(wide(a) for a in args), **{k: wide(v) for k, v in kwargs.items()})
    except Exception:  # noqa: BLE001 - no float64 kernel: no judge
        return False
    return _no_farther(actual, expected, truth, exp.case.ulps)


def _widener() -> Callable[[Any], Any]:
    """A function giving each floating tensor's float64 copy (a leaf that requires grad where the tensor was
    one; one copy per tensor, so arguments that share a tensor still do), other values as they are."""
    made: dict[int, torch.Tensor] = {}

    def wide(v: Any) -> Any:
        if not isinstance(v, torch.Tensor) or not v.dtype.is_floating_point:
            return v
        if id(v) not in made:
            w = v.detach().double()
            made[id(v)] = w.requires_grad_() if v.requires_grad and v.is_leaf else w
        return made[id(v)]

    return wide


def _float64_call(op: str) -> Callable[..., Any]:
    """What the float64 judge runs: the op's registered float64 reference, else the op."""
    from ..binding import _overload
    from . import float64_reference

    return float64_reference(op) or _overload(op)


def _no_farther(actual: Any, expected: Any, truth: Any, ulps: float, terms: torch.Tensor | None = None) -> bool:
    """Every element of ours no farther from float64 than twice torch's distance plus ``ulps`` of the
    truth's magnitude (at least 1), and of ``terms`` where given: the magnitudes the element adds up."""
    from . import ULP

    if isinstance(expected, (tuple, list)):
        return all(_no_farther(a, e, t, ulps) for a, e, t in zip(actual, expected, truth))
    if not isinstance(expected, torch.Tensor) or not expected.dtype.is_floating_point:
        return True  # compared exactly by assert_same already
    if not isinstance(truth, torch.Tensor) or truth.shape != expected.shape:
        return False
    ours, theirs, truth = actual.double(), expected.double(), truth.double()
    scale = truth.abs().clamp_min(1.0) if terms is None else truth.abs().clamp_min(1.0) + terms.to(truth.device)
    tolerance = ulps * ULP.get(expected.dtype, 2.0**-23) * scale
    bad = ((ours - truth).abs() > 2 * (theirs - truth).abs() + tolerance) | (ours.isnan() & ~theirs.isnan())
    return not bool(bad.any())


# -- gradients -------------------------------------------------------------------------------------------------

#: Added to a call's values seed for the incoming gradients its backward is called with.
GRAD_SEED = 7919
#: Gradients' tolerance, in bfloat16 ulps, under Triton's interpreter where the call has bfloat16 tensors: its
#: casts to bfloat16 truncate, a backward rounds several times a term (the reference's roundings, repeated)
#: and a weight's gradient sums those terms over rows, so truncation's errors add up (an rms_norm weight
#: gradient of 176 rows: 1.2 ulps from float64 where torch is 0.4; on the GPU's round-to-nearest ours is the
#: closer). Gross errors still fail; devices compare at the case's tolerance.
INTERPRETED_BF16_GRAD_ULPS = 2**5


def compare_gradients(op: str, actual: Outcome, expected: Outcome, act: Prepared, exp: Prepared,
                      dev: torch.device, values_seed: int) -> bool:
    """Where torch's result requires grad, run both sides' backward with the same random incoming gradients
    and compare the gradients of every leaf that requires grad (values, shape, dtype; not strides: autograd
    lays out what it accumulates), or the backward's error types. A result of ours that does not require
    grad there is a lost derivative. Gradients outside the case's tolerance are judged against float64
    (:func:`_gradients_no_farther`). ``True`` where gradients were compared."""
    from ..binding import native_scope
    from . import _interpreted

    outs = _differentiable(expected.result)
    if expected.error is not None or not outs or (_host_kernels(dev) and torch_cpu_backward_crashes(op, exp)):
        return False
    ours = _differentiable(actual.result)
    if len(ours) != len(outs):
        raise AssertionError(f"{len(ours)} outputs require grad, torch's {len(outs)}: a lost derivative")
    torch.manual_seed(values_seed + GRAD_SEED)
    incoming = [torch.randn_like(o) for o in outs]
    with native_scope():
        want = _backward(outs, _grad_leaves(exp.built), incoming)
    got = _backward(ours, _grad_leaves(act.built), [g.clone() for g in incoming])
    if want.error is not None or got.error is not None:
        compare(op, got, want, act, exp, dev, served=False)
        return True
    truncated = _interpreted() and any(t.dtype == torch.bfloat16 for t in (*_tensors(exp.built), *outs))
    truth: tuple | None = None
    terms = max(o.numel() for o in outs)  # output elements a gradient element sums, on average
    for i, (a, e) in enumerate(zip(got.result, want.result)):
        case = dataclasses.replace(exp.case, check_strides=False, ulps=_gradient_ulps(exp.case.ulps, e, truncated))
        try:
            assert_same(a, e, case, f"the backward: gradient of differentiable input {i}")
        except AssertionError as exc:
            truth = truth if truth is not None else _exact_gradients(op, exp, incoming)
            if "not close" not in str(exc) or truth is None:
                raise
            if not _gradients_no_farther((a,), (e,), (truth[i],), case.ulps, terms):
                scale = _term_scales(op, exp, incoming)[i]
                if scale is None or not _no_farther(a, e, truth[i], case.ulps, scale):
                    raise
    return True


def _tensors(built: Built) -> list[torch.Tensor]:
    return [t for t in (*built.args, *built.kwargs.values()) if isinstance(t, torch.Tensor)]


def _gradient_ulps(ulps: float, gradient: Any, truncated: bool) -> float:
    """A gradient's tolerance: the case's, or under the interpreter with bfloat16 tensors in the call
    (``truncated``) at least :data:`INTERPRETED_BF16_GRAD_ULPS` bfloat16 ulps, in the gradient's own ulps
    (a float32 weight's gradient sums products of bfloat16 values the interpreter truncated: 1.2% from
    torch's over 2,488 rows of ``add_rms_norm``, each product biased the same way)."""
    from . import ULP

    if not truncated or not isinstance(gradient, torch.Tensor):
        return ulps
    return max(ulps, INTERPRETED_BF16_GRAD_ULPS * ULP[torch.bfloat16] / ULP.get(gradient.dtype, 2.0**-23))


def _gradients_no_farther(actual: tuple, expected: tuple, truth: tuple, ulps: float, terms: int) -> bool:
    """Gradients judged against float64: element by element as forward values (:func:`_no_farther`), or, a
    tensor whose elements are ill-conditioned, norm-wise: its largest distance from float64 at most twice
    torch's plus the tolerance relative to the tensor's largest element, times ``sqrt(m)`` for a gradient
    that sums ``m`` output elements into each of its own (a broadcast weight's).

    ``rms_norm``'s input gradient at a hidden size of 1 or 2 cancels terms up to a thousand times its size:
    ours was off by at most 1.8e-5 and torch by 3.5e-5, yet ours was the farther on 62 of 32,064
    elements. Its weight gradient at a hidden size of 1 sums 24,150 rounded products: 20.02286 ours,
    20.02288 torch, 20.02289 float64 (14 and 4 fp32 ulps: each a random walk of the products' roundings,
    about sqrt(m) of them)."""
    from . import ULP

    for a, e, t in zip(actual, expected, truth):
        if _no_farther(a, e, t, ulps) or not isinstance(e, torch.Tensor) or not isinstance(t, torch.Tensor):
            continue
        ours, theirs, t = a.double(), e.double(), t.double()
        if bool((ours.isnan() & ~theirs.isnan()).any()):
            return False
        summed = max(1.0, terms / max(t.numel(), 1)) ** 0.5
        slack = ulps * ULP.get(e.dtype, 2.0**-23) * max(float(t.abs().nan_to_num().max()), 1.0) * summed
        if float((ours - t).abs().nan_to_num().max()) > 2 * float((theirs - t).abs().nan_to_num().max()) + slack:
            return False
    return True


def _term_scales(op: str, exp: Prepared, incoming: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Per leaf that requires grad, the float64 magnitude of the terms its gradient adds up, from the op's
    registered gradient terms (:func:`flaggems.testing.gradient_term_scales`); ``None`` where unknown."""
    from . import gradient_term_scales

    wide = _widener()
    args = tuple(wide(a) for a in exp.built.args)
    kwargs = {k: wide(v) for k, v in exp.built.kwargs.items()}
    return gradient_term_scales(op, args, kwargs, incoming, [wide(leaf) for leaf in _grad_leaves(exp.built)])


def _host_kernels(dev: torch.device) -> bool:
    """Whether torch's CPU kernels serve ``dev``'s native side: the CPU, or a device of host memory under
    Triton's interpreter (the tests' stand-in npu runs every op flaggems does not route on the CPU's)."""
    from . import _interpreted

    return dev.type == "cpu" or _interpreted()


def torch_cpu_backward_crashes(op: str, prep: Prepared) -> bool:
    """Whether torch's CPU backward would crash (a segmentation fault, torch 2.13) for this case:
    ``native_group_norm_backward`` of a channels_last input whose own gradient is not needed (only the
    weight's or the bias's), reached by ``group_norm``'s composite: by the native side, and by ours where the
    routed op alone declines to that composite (with flaggems enabled for every op, flaggems' kernel would
    serve that backward: it does not crash). The float32 ``[2, 4, 2, 4]`` channels_last input with weight and
    bias requiring grad crashes (channels_last_3d too); the same with the input's gradient too, or
    contiguous, does not."""
    if op not in ("group_norm", "flaggems::group_norm_silu") or not prep.built.args:
        return False
    from torch._prims_common import suggest_memory_format

    x = prep.built.args[0]
    return (isinstance(x, torch.Tensor) and x.dim() in (4, 5) and not x.requires_grad
            and suggest_memory_format(x) != torch.contiguous_format)


def _differentiable(result: Any) -> list[torch.Tensor]:
    items = result if isinstance(result, (tuple, list)) else (result,)
    return [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]


def _grad_leaves(built: Built) -> list[torch.Tensor]:
    """The leaves that require grad among the call's arguments, each once, in argument order."""
    seen: dict[int, torch.Tensor] = {}
    for t in (*built.args, *built.kwargs.values()):
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf:
            seen.setdefault(id(t), t)
    return list(seen.values())


def _backward(outs: list[torch.Tensor], leaves: list[torch.Tensor], incoming: list[torch.Tensor]) -> Outcome:
    try:
        return Outcome(torch.autograd.grad(outs, leaves, incoming, allow_unused=True))
    except Exception as exc:  # noqa: BLE001 - the error type is part of the contract
        return Outcome(error=exc)


def _exact_gradients(op: str, exp: Prepared, incoming: list[torch.Tensor]) -> tuple | None:
    """The gradients torch's kernel computes on float64 copies of the inputs (``None`` where it cannot)."""
    from ..binding import native_scope

    wide = _widener()
    args = tuple(wide(a) for a in exp.built.args)
    kwargs = {k: wide(v) for k, v in exp.built.kwargs.items()}
    leaves = [wide(t) for t in _grad_leaves(exp.built)]
    try:
        with native_scope():
            outs = _differentiable(_float64_call(op)(*args, **kwargs))
            return torch.autograd.grad(outs, leaves, [g.double() for g in incoming], allow_unused=True)
    except Exception:  # noqa: BLE001 - no float64 kernel: no judge
        return None


def device_assert_declined(prep: Prepared, dev: torch.device) -> str | None:
    """On a device where torch asserts, a bad-index case needs flaggems' synchronous checks."""
    if DEVICE_ASSERT not in prep.case.tags or dev.type == "cpu":
        return None
    from ..toolkit import checks

    return None if checks.enabled() else "needs FLAGGEMS_CHECK_INDICES=1 on this device"


def check_direct(target: Target, rc: RandomCase, dev: torch.device) -> str:
    """Check one case on one implementation's function: ``"passed"`` or ``"declined: ..."``; raises
    AssertionError on a difference."""
    exp, act = build_pair(rc, dev, rc.seed)
    reason = device_assert_declined(exp, dev)
    if reason is not None:
        return f"declined: {reason}"
    expected = call_native(rc.op, exp, dev)
    try:
        actual = call_impl(target, act)
    except Declined as exc:
        return f"declined: {exc}"
    compare(rc.op, actual, expected, act, exp, dev)
    return "passed"


def check_dispatched(target: Target, rc: RandomCase, dev: torch.device) -> str:
    """Check one case through the dispatcher (already routed): two calls, one layout, two sets of values."""
    from .. import binding

    probe = build(rc, dev, rc.seed)
    if rc.op in NATIVE_FROM_CONTIGUOUS and not native_takes(probe):
        try:
            call_impl(target, probe)
        except Declined as exc:
            return f"declined: {exc}; torch's kernel, which would serve it, takes no such layout"
        probe = build(rc, dev, rc.seed)  # the call may have written its arguments
    if DEVICE_ASSERT in probe.case.tags and dev.type != "cpu":
        try:  # a call the implementation declines would reach torch's kernel, which asserts on the device
            call_impl(target, probe)
        except Declined as exc:
            return f"declined: {exc}; torch's kernel, which would serve it, asserts on this device"
        probe = None  # written by the call
    elif dev.type == "cpu" and torch_cpu_overruns(rc.op, probe.built.args, probe.built.kwargs):
        try:  # a call the implementation declines (a negative view, say) would reach torch's CPU kernel
            call_impl(target, probe)
        except Declined as exc:
            return f"declined: {exc}; torch's CPU kernel, which would serve it, writes out of bounds"
        probe = None
    before = sum(count for (op, _, _), count in binding.DECLINES.items() if op == rc.op)
    first = None
    for values_seed in (rc.seed, rc.seed + 1):
        exp, act = build_pair(rc, dev, values_seed, probe if first is None else None, first)
        first = first or exp
        reason = device_assert_declined(exp, dev)
        if reason is not None:
            return f"declined: {reason}"
        expected = call_native(rc.op, exp, dev)
        fallbacks = _torch_served(rc.op)
        actual = call_dispatcher(rc.op, act)
        served = gate(act.built.args, act.built.kwargs) is None and _torch_served(rc.op) == fallbacks
        try:
            compare(rc.op, actual, expected, act, exp, dev, served)
            differentiated = compare_gradients(rc.op, actual, expected, act, exp, dev, values_seed)
        except AssertionError as exc:
            call = "first (plans)" if values_seed == rc.seed else "second (replays)"
            raise AssertionError(f"{call} call: {exc}") from exc
    after = sum(count for (op, _, _), count in binding.DECLINES.items() if op == rc.op)
    if after > before:
        return "declined: the chain declined it to native (compared anyway)"
    return "passed with gradients" if differentiated else "passed"


def _torch_served(op: str) -> int:
    """Calls of ``op`` torch's kernel served so far: declined by a chain, or (compiled entry) by a native
    plan or as unservable."""
    from .. import binding
    from ..runtime import RUNTIME

    declined = sum(count for (name, _, _), count in binding.DECLINES.items() if name == op)
    native = sum(stats.get("native", 0) + stats.get("unservable", 0) for key, stats in RUNTIME.plan_stats().items()
                 if _stats_op(key) == _stats_op(op))
    return declined + native


def _stats_op(key: str) -> str:
    """The op name of a plan-stats key (``aten::copy_@CUDA`` -> ``copy_``)."""
    return key.split("@")[0].split("::")[-1].split(".")[0]


class Unroutable(Exception):
    """The op cannot be routed to exactly this implementation under this entry here."""


@contextlib.contextmanager
def routed(op: str, label: str, entry: str) -> Iterator[None]:
    """flaggems enabled for ``op`` alone, routed to ``label`` alone, under ``entry`` (``compiled`` or
    ``python``); the environment, the entry decision and the previous enable state restored after."""
    from .. import compiled, config
    from ..runtime import RUNTIME

    names = (config.op_env_name(op), "FLAGGEMS_ENTRY")
    saved = {name: os.environ.get(name) for name in names}
    previous = RUNTIME.enabled_with
    os.environ.update({names[0]: label, names[1]: entry})
    try:
        compiled.reset()
        RUNTIME.disable()
        _enable_one(RUNTIME, op, label, entry)
        yield
    finally:
        RUNTIME.disable()
        for name, value in saved.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)
        compiled.reset()
        if previous is not None:
            RUNTIME.enable(*previous)


def _enable_one(runtime: Any, op: str, label: str, entry: str) -> None:
    try:
        runtime.enable(include=[op])
    except RuntimeError as exc:  # FLAGGEMS_ENTRY=compiled where the entry cannot be built
        raise Unroutable(f"the {entry} entry is unavailable: {exc}") from exc
    chain = [link.label for link in runtime.routes()[op].chain]
    if chain != [label]:
        raise Unroutable(f"routing {op} to {label!r} gives the chain {chain}, not that implementation alone")
    active = runtime.entry()["active"]
    if active != entry:
        raise Unroutable(f"the {entry} entry is not active ({active}: {runtime.entry()['reason']})")


# -- running and reporting ------------------------------------------------------------------------------------

@dataclass
class Tally:
    """Counts of one op x implementation x mode."""

    op: str
    impl: str
    mode: str
    passed: int = 0
    declined: int = 0
    failed: int = 0
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    cpu_s: float = 0.0
    #: Compiled entry: the op's calls served by a generic plan at a size no plan was made for.
    generic: int = 0
    #: Passed cases whose gradients were compared too (torch's result required grad).
    gradients: int = 0

    @property
    def total(self) -> int:
        """Cases counted."""
        return self.passed + self.declined + self.failed


def reproducer(rc: RandomCase, target: Target, mode: str, seed: int, dev: torch.device, message: str) -> str:
    """A failure's description: op, implementation, mode, seeds, and each argument's layout."""
    prep = build(rc, dev, rc.seed)
    lines = [f"{rc.op} [{target.label}] mode={mode} case #{rc.index} (seed {seed}, case seed {rc.seed}) "
             f"source={rc.source} kind={prep.kind}" + (f" sweep point {rc.variant}" if rc.variant >= 0 else "")]
    for i, value in enumerate(prep.built.args):
        lines.append(f"  arg {i}: {prep.built.layouts.get(str(i), _short(value))}")
    for key, value in prep.built.kwargs.items():
        lines.append(f"  {key}=: {prep.built.layouts.get(key, _short(value))}")
    lines += [f"  {line}" for line in message.strip().splitlines()[:6] if line.strip()]
    lines.append(f"  rerun: flaggems kit --op {rc.op} --impl {target.label} --seed {seed} --cases {rc.index + 1}"
                 + ("" if mode == "direct" else f" --entry {mode}"))
    return "\n".join(lines)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def run_target(target: Target, cases: list[RandomCase], mode: str, seed: int, dev: torch.device,
               max_failures: int = 5, seconds: float | None = None) -> Tally:
    """Run ``cases`` on one implementation in one mode (those begun within ``seconds`` of wall time, if given)."""
    tally = Tally(target.op, target.label, mode)
    start, deadline = time.process_time(), None if seconds is None else time.monotonic() + seconds
    try:
        with _mode_context(target, mode):
            for index, rc in enumerate(cases):
                if deadline is not None and time.monotonic() > deadline:
                    tally.notes.append(f"time budget of {seconds:g} s reached after {index} of {len(cases)} cases")
                    break
                _count(tally, target, rc, mode, seed, dev, max_failures)
            if mode == "compiled":
                tally.generic = _generic_calls(target.op)
    except Unroutable as exc:
        tally.notes.append(str(exc))
    tally.cpu_s = time.process_time() - start
    return tally


def _generic_calls(op: str) -> int:
    from ..policy import normalize_op
    from ..runtime import RUNTIME

    name = normalize_op(op).split(".")[0]
    return sum(stats.get("generic", 0) for key, stats in RUNTIME.plan_stats().items()
               if key.split("@")[0].removeprefix("aten::").split(".")[0] == name)


def _mode_context(target: Target, mode: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if mode == "direct" else routed(target.op, target.label, mode)


def _count(tally: Tally, target: Target, rc: RandomCase, mode: str, seed: int, dev: torch.device,
           max_failures: int) -> None:
    try:
        outcome = check_direct(target, rc, dev) if mode == "direct" else check_dispatched(target, rc, dev)
    except AssertionError as exc:
        tally.failed += 1
        if len(tally.failures) < max_failures:
            tally.failures.append(reproducer(rc, target, mode, seed, dev, str(exc)))
        return
    except torch.OutOfMemoryError:  # a case too large for what the device has free (processes share it)
        tally.declined += 1
        if not any(n.startswith("out of memory") for n in tally.notes):
            tally.notes.append(f"out of memory building or running case #{rc.index}: counted as declined")
        return
    if outcome.startswith("declined"):
        tally.declined += 1
    else:
        tally.passed += 1
        tally.gradients += outcome.endswith("gradients")


def run_kit(cases: int | None = None, ops: list[str] | None = None, seed: int = 0, modes: tuple[str, ...] = MODES,
            impl: str | None = None, progress: Callable[[Tally], None] | None = None,
            seconds: float | None = None) -> list[Tally]:
    """Run the randomized kit; ``cases`` per op and implementation (default ``FLAGGEMS_KIT_CASES``).

    ``seconds``: wall-time budget per op, implementation and mode (a long run reports what it reached).
    """
    from .. import config

    count = config.get("FLAGGEMS_KIT_CASES") if cases is None else cases
    dev = device()
    tallies = []
    for target in targets(ops, impl):
        stream = random_cases(target.op, count, seed)
        for mode in modes:
            tally = run_target(target, stream, mode, seed, dev, seconds=seconds)
            if not stream:
                tally.notes.append("no registered cases and no generator for this op")
            tallies.append(tally)
            if progress is not None:
                progress(tally)
    return tallies


def idle_ops(tallies: list[Tally]) -> list[str]:
    """Ops on which no implementation ran a single case (every case declined, or none at all)."""
    ran: dict[str, int] = {}
    for tally in tallies:
        ran[tally.op] = ran.get(tally.op, 0) + tally.passed + tally.failed
    return sorted(op for op, count in ran.items() if count == 0)
