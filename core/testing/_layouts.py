"""Re-lay tensor arguments out with the same values (the randomized kit's op-agnostic part).

Every tensor argument of a case can be rebuilt as a view into a larger
*poisoned* buffer (NaN for floats, a sentinel for integers and bool) whose
shape, dtype and values are those of the original, with a random layout:

* ``strided``: steps between elements, gaps between rows and a storage offset;
* ``permuted``: another storage order of the dimensions (``channels-last`` for
  rank 4 is one of them);
* ``neg``: ``torch._neg_view`` of a buffer holding the negated values;
* ``expanded``: stride 0 on a dimension whose values are all equal (only for
  arguments the op does not write).

The buffers are kept so the kit can compare them whole after the call: an
implementation that writes outside its destination changes the poison. All
decisions come from a :class:`random.Random`, so two builds from the same seed
give both sides (native and flaggems) identical layouts.
"""

from __future__ import annotations

import dataclasses
import random
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

#: Layout modes and their weights (``as-is`` keeps the case's own tensor).
MODES = (("as-is", 1), ("strided", 4), ("permuted", 2), ("channels-last", 2), ("neg", 2), ("expanded", 2))


@dataclass
class Built:
    """One side's inputs: the arguments, the buffers behind them and a description of each tensor."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    buffers: list[torch.Tensor] = field(default_factory=list)
    layouts: dict[str, str] = field(default_factory=dict)
    draws: list[tuple[str, Plan]] = field(default_factory=list)  # each tensor's (mode, plan), in build order


def written_arguments(op: str) -> frozenset:
    """Positions and names of the arguments ``aten::op`` writes (its schema's ``Tensor(a!)``)."""
    from ..binding import _overload

    written = set()
    for i, arg in enumerate(_overload(op)._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            written.update((i, arg.name))
    return frozenset(written)


def poison(dtype: torch.dtype) -> Any:
    """The fill value of a buffer's unused elements."""
    if dtype == torch.bool:
        return True
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    return 101 if dtype == torch.uint8 else -77


def negatable(t: torch.Tensor) -> bool:
    """Whether ``-t`` holds the same information (floats; signed integers without their minimum).

    Integer tensors only on the CPU: torch's CUDA kernels read an integer index or repeats tensor's raw
    memory whatever its negative bit (its CPU ones too, raising), so on a GPU the native side of such a case
    ends in a device-side assert (``Repeat.cu``: ``repeat >= 0``, H200) that poisons the process.
    """
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return True
    if t.dtype in (torch.bool, torch.uint8) or t.device.type != "cpu":
        return False
    return t.numel() == 0 or bool((t != torch.iinfo(t.dtype).min).all())


def constant_dims(t: torch.Tensor) -> list[int]:
    """Dimensions along which every value equals the first (candidates for stride 0)."""
    if t.numel() == 0:
        return []
    t = t.cpu()  # one copy: a device tensor's per-dimension checks cost a synchronisation each
    dims = []
    for d in range(t.dim()):
        first = t.narrow(d, 0, 1)
        if t.size(d) == 1:
            dims.append(d)
        elif _equal(t.narrow(d, 1, 1), first) and _equal(t, first):  # the second slice rules most out cheaply
            dims.append(d)
    return dims


def _equal(t: torch.Tensor, first: torch.Tensor) -> bool:
    """Every element of ``t`` equals ``first`` broadcast along a dimension (NaN equal to NaN)."""
    return bool((t == first).all()) or _same_nan(t, first)


def _same_nan(t: torch.Tensor, first: torch.Tensor) -> bool:
    if not (t.dtype.is_floating_point or t.dtype.is_complex):
        return False
    return bool(((t == first) | (t.isnan() & first.isnan())).all())


#: Share of cases whose tensors may be negative views (the dispatcher declines them: mostly wanted elsewhere).
NEG_SHARE = 0.2


def choose_mode(t: torch.Tensor, rng: random.Random, written: bool, neg: bool = True) -> str:
    """A layout mode valid for ``t`` (``written``: the op writes it, so no stride 0; ``neg``: may be negative)."""
    allowed = {"as-is", "strided"}
    if t.dim() >= 2:
        allowed.add("permuted")
    if t.dim() == 4:
        allowed.add("channels-last")
    if neg and negatable(t):
        allowed.add("neg")
    if not written and constant_dims(t):
        allowed.add("expanded")
    names = [m for m, _ in MODES if m in allowed]
    weights = [w for m, w in MODES if m in allowed]
    return rng.choices(names, weights)[0]


@dataclass(frozen=True)
class Plan:
    """Where a tensor's elements go in its buffer."""

    order: tuple[int, ...]  # storage order, outermost first
    steps: tuple[int, ...]  # element step per dimension
    gaps: tuple[int, ...]  # extra elements after each dimension's extent
    offset: int
    zero: tuple[int, ...] = ()  # dimensions given stride 0
    neg: bool = False


def plan_for(t: torch.Tensor, mode: str, rng: random.Random) -> Plan:
    """Draw the layout plan of one mode."""
    rank = t.dim()
    order = tuple(range(rank))
    steps, gaps = (1,) * rank, (0,) * rank
    offset = rng.randrange(0, 6)
    if mode in ("strided", "neg", "expanded"):
        steps = tuple(rng.choice((1, 1, 2, 3)) for _ in range(rank))
        gaps = tuple(rng.choice((0, 0, 1, 3)) for _ in range(rank))
    if mode == "permuted" or (mode in ("strided", "neg") and rank >= 2 and rng.random() < 0.3):
        order = tuple(rng.sample(range(rank), rank))
    if mode == "channels-last":
        order = (0, 2, 3, 1)
    zero = ()
    if mode == "expanded":
        dims = constant_dims(t)
        zero = tuple(sorted(rng.sample(dims, rng.randint(1, len(dims)))))
    return Plan(order, steps, gaps, offset, zero, mode == "neg")


def strides_of(sizes: tuple[int, ...], plan: Plan) -> tuple[int, ...]:
    """Strides of the plan's view (stride 0 on its zero dimensions)."""
    strides = [0] * len(sizes)
    running = 1
    for d in reversed(plan.order):
        if d in plan.zero:
            continue
        strides[d] = running * plan.steps[d]
        running = strides[d] * max(sizes[d], 1) + plan.gaps[d]
    return tuple(strides)


def place(t: torch.Tensor, plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """``(view, buffer)``: a view with ``t``'s values laid out by ``plan`` in a poisoned buffer."""
    sizes = tuple(t.shape)
    strides = strides_of(sizes, plan)
    extent = 0 if t.numel() == 0 else sum((s - 1) * st for s, st in zip(sizes, strides)) + 1
    buffer = torch.full((plan.offset + extent + 3,), poison(t.dtype), dtype=t.dtype, device=t.device)
    stored = tuple(1 if d in plan.zero else s for d, s in enumerate(sizes))
    source = t
    for d in plan.zero:
        source = source.narrow(d, 0, 1)
    target = buffer.as_strided(stored, strides, plan.offset)
    target.copy_(-source if plan.neg else source)
    view = buffer.as_strided(sizes, strides, plan.offset)
    return (torch._neg_view(view) if plan.neg else view), buffer


def describe(t: torch.Tensor, mode: str = "") -> str:
    """``f16[3, 7] strides (7, 1) offset 0 neg`` style text for reproducers."""
    from . import _inputs

    try:
        name = _inputs.short_name(t.dtype)
    except KeyError:
        name = str(t.dtype).removeprefix("torch.")
    flags = " neg" if t.is_neg() else ""
    flags += " conj" if t.is_conj() else ""
    how = f" ({mode})" if mode else ""
    return f"{name}{list(t.shape)} strides {tuple(t.stride())} offset {t.storage_offset()}{flags}{how}"


def _shared(tensors: list[torch.Tensor]) -> set[int]:
    """ids of tensors that share storage with a *different* tensor object (kept as they are)."""
    keep = set()
    for i, a in enumerate(tensors):
        for b in tensors[i + 1:]:
            if a is not b and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr():
                keep.update((id(a), id(b)))
    return keep


def neg_views_work(dev: torch.device) -> bool:
    """Whether ``dev``'s torch resolves negative views. Not on the test suite's fake ``npu``
    (``tests/fakes/torch_npu``): its one boxed fallback runs torch's CPU kernels, and ``resolve_neg()``
    there crashes the process; a real torch_npu resolves them."""
    module = sys.modules.get("torch_npu")
    return not (dev.type == "npu" and str(getattr(module, "__version__", "")).endswith("+fake"))


def relayout(args: tuple, kwargs: dict, rng: random.Random, written: frozenset,
             fixed: frozenset = frozenset(), like: Built | None = None) -> Built:
    """Rebuild every tensor argument with a random layout (same values, same shape, same dtype).

    The same tensor object given twice keeps being one tensor; tensors that share
    memory otherwise keep their layout (the case's aliasing is part of it), and so do
    the arguments named in ``fixed`` (positions or names: their layout is the case).
    ``like``: take the layouts ``like`` drew (the same case built from other values) instead of drawing them:
    a draw depends on values (stride 0 only where values repeat, say a bf16 rstd equal in every group), and
    the kit's two calls of a case must have one layout. Where a replayed stride 0 meets values that differ,
    a floating tensor takes its first slice's values on that dimension (both sides alike); an integer one
    (indices, repeats: other arguments depend on their values, an ``output_size`` on a sum) keeps its values
    and gets its stride back.
    """
    tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    keep = _shared(tensors)
    built = Built((), {})
    neg = rng.random() < NEG_SHARE and all(neg_views_work(t.device) for t in tensors)
    memo: dict[int, tuple[torch.Tensor, str]] = {}
    replay = iter(like.draws) if like is not None else None

    def convert(key: int | str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) not in memo:
            drawn = next(replay, None) if replay is not None else None
            memo[id(value)] = _convert_tensor(value, key, rng, written, keep, built, fixed, neg, drawn)
        view, mode = memo[id(value)]
        built.layouts[str(key)] = describe(view, mode)
        return view

    built.args = tuple(convert(i, v) for i, v in enumerate(args))
    built.kwargs = {k: convert(k, v) for k, v in kwargs.items()}
    return built


def _convert_tensor(t: torch.Tensor, key: int | str, rng: random.Random, written: frozenset, keep: set[int],
                    built: Built, fixed: frozenset, neg: bool,
                    drawn: tuple[str, Plan] | None = None) -> tuple[torch.Tensor, str]:
    if drawn is None or len(drawn[1].order) != t.dim():
        mode = choose_mode(t, rng, key in written, neg)
        drawn = mode, plan_for(t, mode, rng)  # drawn even when unused: later arguments' draws must not depend on it
    elif drawn[1].zero and not (t.dtype.is_floating_point or t.dtype.is_complex) and \
            not set(drawn[1].zero) <= set(constant_dims(t)):
        drawn = drawn[0], dataclasses.replace(drawn[1], zero=())  # an index or a count keeps its values
    mode, plan = drawn
    built.draws.append(drawn)
    if mode == "as-is" or id(t) in keep or key in fixed or t.requires_grad or t.layout != torch.strided:
        return t, "as-is"
    view, buffer = place(t.detach(), plan)
    built.buffers.append(buffer)
    return view, mode


def twin(built: Built) -> Built | None:
    """A copy of ``built`` with its own memory: each storage behind its tensors copied once (so tensors that
    shared one still do), each tensor the same view of the copy (sizes, strides, offset, negative bit, a leaf
    that requires grad). ``None`` where a tensor is not a plain one (a subclass, another layout, a conjugate
    or zero tensor, a view that is not a leaf, a container of tensors): that side is built again instead.
    Twice as fast as a second build on the GPU, whose inputs come from generators and relayouts."""
    copies: dict[tuple[int, int], torch.Tensor] = {}
    made: dict[int, torch.Tensor] = {}

    def copy(t: torch.Tensor) -> torch.Tensor | None:
        if id(t) in made:
            return made[id(t)]
        if not _twinnable(t):
            return None
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes()) if storage.nbytes() else (id(t), 0)
        if key not in copies:
            copies[key] = torch.empty(storage.nbytes(), dtype=torch.uint8, device=t.device)
            copies[key].untyped_storage().copy_(storage)
        view = torch.empty(0, dtype=t.dtype, device=t.device)
        view.set_(copies[key].untyped_storage(), t.storage_offset(), t.shape, t.stride())
        view = torch._neg_view(view) if t.is_neg() else view
        made[id(t)] = view.requires_grad_() if t.requires_grad else view
        return made[id(t)]

    values = [*built.args, *built.kwargs.values(), *built.buffers]
    if any(isinstance(v, (list, tuple, dict)) and _holds_tensor(v) for v in values):
        return None
    twins = [copy(v) if isinstance(v, torch.Tensor) else v for v in values]
    if any(isinstance(v, torch.Tensor) and w is None for v, w in zip(values, twins)):
        return None
    n, k = len(built.args), len(built.kwargs)
    return Built(tuple(twins[:n]), dict(zip(built.kwargs, twins[n:n + k])), list(twins[n + k:]),
                 dict(built.layouts))


def _twinnable(t: torch.Tensor) -> bool:
    return (type(t) is torch.Tensor and t.layout == torch.strided and t.device.type != "meta" and not t.is_conj()
            and not t._is_zerotensor() and (t.is_leaf or not t.requires_grad)
            and not torch._C._functorch.is_functorch_wrapped_tensor(t))


def _holds_tensor(value: Any) -> bool:
    items = value.values() if isinstance(value, dict) else value
    return any(isinstance(v, torch.Tensor) or isinstance(v, (list, tuple, dict)) and _holds_tensor(v) for v in items)
