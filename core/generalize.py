"""Plans generic over sizes: one recorded replay serving every call of its layout class.

The compiled entry keys plans by exact sizes; a workload whose sizes change at
every call (a new prompt length, a new batch) would miss every time. On a miss
the entry also hands the planner the call's *layout class* (its class key:
dtypes, rank, which sizes are 0 or 1 and the power-of-two bucket of the others,
the stride order and density, a zero offset, the buckets of numel and of the
memory spanned, alignment, aliasing, scalar arguments). The planner keeps the
replays it recorded per class (:class:`Points`); from two or more it may build
a :class:`~flaggems.toolkit.plans.GenericPlan`:

* the replays must agree on everything but integers (the same kernels, launch
  configurations, allocations' dtypes, views' sources): a size-dependent choice
  made differently (another block size, another kernel) makes them disagree;
* each integer that differs between them must be one expression of the call's
  *atoms* (:func:`atoms`: sizes, strides, offsets, numels and products of
  leading or trailing sizes of each input), ``atom * mul + add`` or
  ``cdiv(atom, 2**k)``, fitted on at least :data:`MIN_POINTS` points and unique
  up to atoms that vary together: every expression that gives it at the points,
  products ``m * cdiv(atom, 2**k)`` included (a grid of rows times column
  blocks), must be one function on sampled sizes around them;
* guards: every atom equal at all points is pinned to its value, every atom
  proportional to another at all points keeps that ratio, every computed
  integer a kernel receives keeps the properties of Triton's specialisation
  classes (1, a multiple of 16, 32-bit) that it had at every point,
  and a division exact at every point stays exact (``aligned``: a launcher picks
  its maskless variant where its block divides the size: ``silu_mul``'s plan
  fitted on three even sizes wrote 256 elements past an odd size's output, CPU
  repro of kit run 31, before this guard).

Within a class, decisions that depend on sizes (block sizes as powers of two,
int32 against int64 indexing) are covered by the buckets of the class key;
a decision at another threshold inside one bucket is only safe where its
kernels are correct for any of the choices' arguments, which the randomized
conformance kit checks by replaying many sizes of one class.
"""

from __future__ import annotations

import functools
import math
import operator
import random
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import torch

from .toolkit import plans

#: Replays a generic plan is fitted on: two points fit any integer slope through consecutive values
#: (``cdiv(x, 4)`` at 100 and 101 looks like ``x - 75``); a third rules such coincidences out.
MIN_POINTS = 3
#: Replays kept per layout class to generalise from; classes kept per op (all dropped when full).
POINTS_PER_CLASS = 4
CLASSES = 512
#: Divisors a grid expression may use (``cdiv(numel, BLOCK)``): powers of two up to 2**24.
DIVISORS = tuple(1 << k for k in range(1, 25))


def atoms(inputs: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """The call's atoms, per input: sizes, strides, offset, numel, products of the 2..dim-1 leading sizes,
    then of the 2..dim-1 trailing sizes (the compiled entry's ``call_atoms`` writes the same)."""
    out: list[int] = []
    for t in inputs:
        sizes = tuple(t.shape)
        dim = len(sizes)
        out += sizes
        out += t.stride()
        out += (t.storage_offset(), t.numel())
        lead = sizes[0] if dim else 1
        for k in range(2, dim):
            lead *= sizes[k - 1]
            out.append(lead)
        trail = sizes[-1] if dim else 1
        for k in range(2, dim):
            trail *= sizes[dim - k]
            out.append(trail)
    return tuple(out)


class _Leaf:
    """An integer that differs between the points: its value at each; ``guarded`` when a compiled kernel
    receives it (Triton specialises it: its class is guarded)."""

    __slots__ = ("values", "guarded")

    def __init__(self, values: tuple[int, ...], guarded: bool) -> None:
        self.values = values
        self.guarded = guarded


class _Fixed(int):
    """An integer equal at every point, in a field whose integers may depend on sizes: it may be a step
    function of an atom that did not step between the points (its guards: :meth:`_Atoms.steady`)."""

    __slots__ = ()


class _Mismatch(Exception):
    """The replays differ in something other than an integer a generic plan may compute."""


#: Fields of a compiled launch whose integers Triton specialises on (1, multiples of 16, 32-bit).
#: A launch through its Python launcher guards its integer arguments too: Triton would specialise anew, but
#: the launcher's own choices may rest on them (glu's ``ALIGNED`` hint for ``cols % 16 == 0``: a plan fitted
#: on multiples of 16 dropped the last elements of ``silu_mul`` of 4170 elements on the CPU).
_SPECIALISED = {plans.CudaStep: {"params", "ints"}, plans.PythonStep: {"values"}}
#: Fields of each record whose integers may differ between points (the rest must be equal).
_SIZED = {
    plans.Allocation: {"sizes", "strides"},
    plans.TensorRef: {"sizes", "strides", "offset"},
    plans.Pointer: {"offset"},
    plans.CudaStep: {"grid", "params", "ints"},
    plans.PythonStep: {"grid", "values", "slots"},
    plans.TensorSlot: {"ref"},
    plans.Replay: {"allocations", "steps", "returns"},
    plans.AutogradPlan: {"forward"},  # the node (its backward op, arguments, saved slots) stays one
}
#: Plans a generic plan may generalise: a replay, or an autograd plan's forward under the same node.
_GENERALISABLE = (plans.Replay, plans.AutogradPlan)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _merge(values: Sequence[Any], sized: bool, guarded: bool = False) -> Any:
    """One template of ``values`` (a record at every point): equal parts as they are, differing integers
    (where ``sized`` allows them) as :class:`_Leaf` (``guarded``: a compiled kernel's argument)."""
    first = values[0]
    kind = type(first)
    if any(type(v) is not kind for v in values):
        raise _Mismatch
    if _is_int(first):
        if all(v == first for v in values):
            return _Fixed(first) if sized else first
        if not sized:
            raise _Mismatch
        return _Leaf(tuple(values), guarded)
    if kind is plans.Const:
        if all(v == first for v in values):
            return plans.Const(first.kind, first.size, _Fixed(first.bits)) if sized and first.kind == "const" else first
        if not sized or first.kind != "const" or any(v[:2] != first[:2] for v in values):
            raise _Mismatch  # a float's bits, or another width
        return plans.Const(first.kind, first.size, _Leaf(tuple(v.bits for v in values), guarded))
    if isinstance(first, tuple):
        if any(len(v) != len(first) for v in values):
            raise _Mismatch
        fields = getattr(kind, "_fields", None)
        if fields is None:
            return tuple(_merge([v[i] for v in values], sized, guarded) for i in range(len(first)))
        open_fields, kernel_fields = _SIZED.get(kind, set()), _SPECIALISED.get(kind, set())
        return kind(*(_merge([v[i] for v in values], sized and name in open_fields, guarded or name in kernel_fields)
                      for i, name in enumerate(fields)))
    if any(v is not first and v != first for v in values):
        raise _Mismatch
    return first


def _cdiv(n: int, d: int) -> int:
    return -(-n // d)


def _simplest(f: tuple[int, int, int, int]) -> tuple[bool, bool, int]:
    """The order among ``(atom, mul, add, div)`` expressions that give the same values: no division, no
    constant, the first atom."""
    return f[3] != 1, f[2] != 0, f[0]


def _alignment(xs: Sequence[int]) -> int:
    """The largest power of two up to 16 dividing every value."""
    return next((k for k in (16, 8, 4, 2) if all(x % k == 0 for x in xs)), 1)


def _blocks_of(value: int, blocks: list[int]) -> bool:
    """Whether ``value`` may be ``m * blocks`` (m >= 2) with the same block count at every point."""
    return len(set(blocks)) == 1 and value % blocks[0] == 0 and value // blocks[0] >= 2


class _Atoms:
    """The atoms at every point: which vary, their proportional groups, the guards."""

    def __init__(self, points: Sequence[tuple[int, ...]]) -> None:
        self.points = points
        count = len(points[0])
        self.varying = [a for a in range(count) if any(p[a] != points[0][a] for p in points)]
        self.pinned = tuple((a, points[0][a]) for a in range(count) if a not in set(self.varying))
        self.group: dict[int, int] = {}
        self.scale: dict[int, Fraction] = {}  # atoms[a] / atoms[group[a]] at every point
        self.same: set[int] = set()
        self.aligned: dict[int, int] = {}  # representative atom -> what it must stay a multiple of
        self.agree: dict[tuple[plans.Sym, plans.Sym], None] = {}  # expressions that must stay equal
        ratios = []
        for a in self.varying:
            for rep in dict.fromkeys(self.group.values()):
                ratio = self._ratio(a, rep)
                if ratio is not None:
                    self.group[a], self.scale[a] = rep, ratio
                    ratios.append((a, ratio.numerator, rep, ratio.denominator))
                    if ratio == 1:
                        self.same.add(a)
                    break
            else:
                self.group[a], self.scale[a] = a, Fraction(1)
        self.ratios = tuple(ratios)
        self.derived: dict[tuple[int, int, int], None] = {}  # (atom, mul, add): linear sizes the plan computes

    def derive(self, leaves: list[_Leaf]) -> None:
        """Note the linear expressions of an atom (other than the atom itself) that some integer of the plan
        follows: sizes the launcher computed from (``3 * n`` elements out of ``repeat_interleave(x, 3)``),
        whose steps an integer equal at every point may follow too (:meth:`steady`)."""
        for leaf in leaves:
            for a in self.varying:
                for mul, add in self._linear([p[a] for p in self.points], leaf.values):
                    if (mul, add) != (1, 0):
                        self.derived[(a, mul, add)] = None

    def _ratio(self, a: int, rep: int) -> Fraction | None:
        """``atoms[a] / atoms[rep]`` when it is the same at every point."""
        if any(p[rep] == 0 for p in self.points):
            return None
        ratio = Fraction(self.points[0][a], self.points[0][rep])
        if ratio == 0 or any(Fraction(p[a], p[rep]) != ratio for p in self.points):
            return None
        return ratio

    def fit(self, values: tuple[int, ...], guarded: bool) -> plans.Sym | None:
        """The one expression of the atoms giving ``values`` at every point, or ``None``; ``guarded`` (a kernel
        receives it): the plan requires the class properties every value had (:func:`plans.int_class` bits:
        equal to 1, a multiple of 16, 32-bit), which Triton or the launcher may have compiled or chosen for
        (glu's ``ALIGNED`` hint); a property not every point had was not relied on (else -1: any)."""
        found = []
        for a in self.varying:
            xs = [p[a] for p in self.points]
            found += [(a, mul, add, 1) for mul, add in self._linear(xs, values)]
            if all(v >= 0 for v in values) and all(x >= 0 for x in xs):
                found += [(a, 1, 0, d) for d in DIVISORS
                          if all(_cdiv(x, d) == v for x, v in zip(xs, values)) and any(_cdiv(x, d) > 1 for x in xs)]
        if not found:
            return None
        cls = functools.reduce(operator.and_, (plans.int_class(v) for v in values)) if guarded else -1
        by_group: dict[int, list[tuple[int, int, int, int]]] = {}
        for f in found:
            by_group.setdefault(self.group[f[0]], []).append(f)
        chosen = []
        for group_found in by_group.values():
            atom, mul, add, div = min(group_found, key=_simplest)
            modulus = self._exact_modulus(atom, div) if div > 1 else 1
            if not self._unambiguous(group_found, values, modulus):
                return None  # two expressions of one group that differ at sizes of the class
            chosen.append(((atom, mul, add, div), modulus))
        for (atom, _, _, _), modulus in chosen:
            if modulus > 1:
                rep = self.group[atom]
                self.aligned[rep] = math.lcm(self.aligned.get(rep, 1), modulus, self._step(rep))
        best = plans.sym(*min((f for f, _ in chosen), key=_simplest), cls)
        for f, _ in chosen:  # groups that vary independently: a call where they disagree plans again
            if f != best[1:5]:
                self.agree[(best._replace(cls=-1), plans.sym(*f, -1))] = None
        return best

    def _exact_modulus(self, atom: int, div: int) -> int:
        """For ``cdiv(atom, div)`` exact at every point: what the group's representative must stay a multiple of
        so that ``atom`` stays a multiple of ``div`` (and of its points' alignment up to 16), else 1. A launcher
        picks its maskless variant where its block divides the size: ``silu_mul``'s plan fitted on three even
        sizes wrote 256 elements past an odd size's output (CPU repro of kit run 31) before this guard."""
        xs = [p[atom] for p in self.points]
        if any(x % div for x in xs):
            return 1
        need = max(div, _alignment(xs))
        scale = self.scale[atom]  # atom = rep * p / q: rep a multiple of q * need / gcd(p, need)
        return scale.denominator * need // math.gcd(scale.numerator, need)

    def _unambiguous(self, found: list[tuple[int, int, int, int]], values: tuple[int, ...], modulus: int) -> bool:
        """Whether every expression giving ``values`` at the points is one function of the sizes around them:
        those a plan computes, and products ``m * cdiv(atom, 2**k)`` (rows times column blocks, a grid no
        plan expression computes). Three points fit both ``cdiv(n, 512)`` and a launcher's
        ``2 * cdiv(n, 1024)``, which differ for half of all n: the H200 kit's repeat_interleave of a
        [1, 203137] row left the last 385 elements unwritten. Checked on sampled sizes of the class (multiples
        of ``modulus``: an exact division's guard)."""
        funcs = {(self.scale[a], "fit", mul, add, div): a for a, mul, add, div in found}
        if math.gcd(*values) >= 2:  # a product m * blocks needs m >= 2 dividing every value
            for a in (a for a in self.varying if self.group[a] == self.group[found[0][0]]):
                xs = [p[a] for p in self.points]
                for d in DIVISORS if all(x > 0 for x in xs) else ():
                    blocks = [_cdiv(x, d) for x in xs]
                    m, rem = divmod(values[0], blocks[0])
                    if not rem and m >= 2 and all(m * b == v for b, v in zip(blocks, values)):
                        funcs.setdefault((self.scale[a], "product", m, 0, d), a)
                    if max(blocks) == 1:
                        break
        if len(funcs) == 1:
            return True

        def value(key: tuple, x: int) -> int:
            scale, form, m, c, d = key
            x = x * scale.numerator // scale.denominator  # exact: samples are multiples of the denominators
            return m * _cdiv(x, d) if form == "product" else _cdiv(x * m + c, d)

        return all(len({value(key, x) for key in funcs}) == 1 for x in self._samples(found[0][0], modulus))

    def _step(self, rep: int) -> int:
        """The points' common alignment of ``rep`` up to 16, times what every ratio's denominator needs."""
        step = _alignment([p[rep] for p in self.points])
        for b in self.varying:
            if self.group[b] == rep:
                step = math.lcm(step, self.scale[b].denominator)
        return step

    def _samples(self, a: int, modulus: int = 1) -> list[int]:
        """Sizes of ``a``'s group representative to compare expressions on: the points, their neighbours and
        random ones in the powers of two around them; multiples of every ratio's denominator, of the
        points' common alignment up to 16 (Triton's specialisation guards keep a multiple of 16 one: there
        ``n`` and ``16 * cdiv(n, 16)`` are one function) and of ``modulus``."""
        rep = self.group[a]
        xs = [p[rep] for p in self.points]
        step = math.lcm(self._step(rep), modulus)
        lo, hi = min(xs), max(xs)
        low, high = (1 << (lo.bit_length() - 1), 1 << hi.bit_length()) if lo > 0 else (lo - (hi - lo), 2 * hi + 1)
        pick = random.Random(hash((lo, hi)))
        near = [x + k for x in xs for k in (-step, step)]
        return [v - v % step for v in [*xs, *near, *(pick.randrange(low, high + 1) for _ in range(64))]]

    def steady(self, value: int) -> list[tuple[plans.Sym, int]]:
        """Guards for an integer equal at every point: each ``cdiv(atom, 2**k)`` and ``atom // 2**k`` (the
        smallest such ``k`` per atom and form) equal to it at every point must stay equal to it; the same
        for the linear sizes the plan computes from an atom (:meth:`derive`)."""
        guards = []
        for a in self.varying:
            xs = [p[a] for p in self.points]
            if any(x < 0 for x in xs) or a in self.same:
                continue  # an atom equal to its group's first (the ratio guard) adds no guard of its own
            guards += self._steps(a, 1, 0, value)
            product = next((d for d in DIVISORS if _blocks_of(value, [_cdiv(x, d) for x in xs])), None)
            if product is not None:  # value = m * cdiv(atom, d) (rows times column blocks): its blocks must stay
                guards.append((plans.sym(a, 1, 0, product, -1), _cdiv(xs[0], product)))
        for a, mul, add in self.derived:
            guards += self._steps(a, mul, add, value)
        return guards

    def _steps(self, a: int, mul: int, add: int, value: int) -> list[tuple[plans.Sym, int]]:
        """``cdiv(y, d) == value`` and ``y // d == value`` for ``y = mul * atom + add``, the smallest ``d`` of
        each form that holds at every point (none where some ``y`` is negative)."""
        ys = [p[a] * mul + add for p in self.points]
        if any(y < 0 for y in ys):
            return []
        guards = []
        ceil = next((d for d in DIVISORS if all(_cdiv(y, d) == value for y in ys)), None)
        if ceil is not None:
            guards.append((plans.sym(a, mul, add, ceil, -1), value))
        floor = next((d for d in DIVISORS if all(y // d == value for y in ys)), None)
        if floor is not None:
            guards.append((plans.sym(a, mul, add + 1 - floor, floor, -1), value))
        return guards

    @staticmethod
    def _linear(xs: list[int], values: tuple[int, ...]) -> list[tuple[int, int]]:
        i = next((i for i in range(1, len(xs)) if xs[i] != xs[0]), None)
        if i is None:
            return []
        step, rem = divmod(values[i] - values[0], xs[i] - xs[0])
        if rem or step == 0:
            return []
        add = values[0] - step * xs[0]
        if any(step * x + add != v for x, v in zip(xs, values)):
            return []
        return [(step, add)]


def _leaves(template: Any) -> list[_Leaf]:
    """Every :class:`_Leaf` of a merged template."""
    if isinstance(template, _Leaf):
        return [template]
    if isinstance(template, tuple):
        return [leaf for item in template for leaf in _leaves(item)]
    return []


def _resolve(template: Any, atoms_: _Atoms, steady: dict[tuple[plans.Sym, int], None]) -> Any:
    """The template with every :class:`_Leaf` replaced by its :class:`~flaggems.toolkit.plans.Sym` and every
    :class:`_Fixed` by its plain value, its guards added to ``steady``."""
    if isinstance(template, _Leaf):
        found = atoms_.fit(template.values, template.guarded)
        if found is None:
            raise _Mismatch
        return found
    if isinstance(template, _Fixed):
        steady.update(dict.fromkeys(atoms_.steady(int(template))))
        return int(template)
    if isinstance(template, tuple):
        fields = getattr(type(template), "_fields", None)
        items = [_resolve(item, atoms_, steady) for item in template]
        return type(template)(*items) if fields is not None else tuple(items)
    return template


def _agree(points: Sequence[tuple[tuple[int, ...], Any]]) -> bool:
    """Whether replays could share a generic plan (the same records but for integers)."""
    try:
        _merge([p for _, p in points], True)
    except _Mismatch:
        return False
    return all(type(p) in _GENERALISABLE for _, p in points)


def generalize(points: Sequence[tuple[tuple[int, ...], Any]]) -> plans.GenericPlan | None:
    """A generic plan from ``(atoms, plan)`` points of one layout class (replays, or autograd plans whose
    forwards differ in integers only), or ``None``."""
    if len(points) < MIN_POINTS or type(points[0][1]) not in _GENERALISABLE or any(
            type(p) is not type(points[0][1]) for _, p in points):
        return None
    if len({len(a) for a, _ in points}) != 1:
        return None
    try:
        template = _merge([p for _, p in points], True)
        found = _Atoms([a for a, _ in points])
        if not found.varying:
            return None
        found.derive(_leaves(template))
        steady: dict[tuple[plans.Sym, int], None] = {}
        plan = _resolve(template, found, steady)
        return plans.GenericPlan("generic", plan, tuple(plans.Pin(*p) for p in found.pinned),
                                 tuple(plans.Ratio(*r) for r in found.ratios),
                                 tuple(plans.Steady(*s) for s in steady),
                                 tuple(plans.Aligned(*a) for a in sorted(found.aligned.items())),
                                 tuple(plans.Agree(*pair) for pair in found.agree))
    except _Mismatch:
        return None


def kernel_signature(plan: plans.Replay | plans.AutogradPlan) -> tuple:
    """What replays must share to generalise, cheaply: each step's kernel (a compiled function: Triton's
    specialisation of it; or the Python launcher, whose constexprs hold the launcher's own choices); an
    autograd plan's backward op and its forward's. Integers of other classes may share a kernel: the plan
    then requires only what held at every point (:meth:`_Atoms.fit`)."""
    if type(plan) is plans.AutogradPlan:
        return ("autograd", plan.backward.name, kernel_signature(plan.forward))
    out: list[Any] = []
    for step in plan.steps:
        if type(step) is plans.CudaStep:
            out.append(step.function)
        elif type(step) is plans.PythonStep:
            out.append(id(step.launcher))
        else:
            out.append(type(step).__name__)
    return tuple(out)


class Points:
    """The replays an op's planner recorded, per layout class, and the generic plans made from them."""

    def __init__(self) -> None:
        self.classes: dict[tuple, list[tuple[tuple[int, ...], plans.Replay]]] = {}

    def add(self, layout: Sequence[int] | None, inputs: Sequence[torch.Tensor], plan: Any) -> Any:
        """Note a replay of class ``layout``; return a generic plan when one generalises the points.

        Points are kept per class and per :func:`kernel_signature`: replays that launched other kernels never
        generalise together, and would push each other out of the kept points."""
        if layout is None or type(plan) not in _GENERALISABLE:
            return None
        key = (tuple(layout), kernel_signature(plan))
        if key not in self.classes and len(self.classes) >= CLASSES:
            self.classes.clear()
        kept = self.classes.setdefault(key, [])
        point = (atoms(inputs), plan)
        chosen = [point]
        for older in reversed(kept):  # the newest points first: the greediest set that still generalises
            if len(chosen) < MIN_POINTS - 1 and _agree([*chosen, older]) or generalize([*chosen, older]):
                chosen.append(older)
        kept.append(point)
        del kept[:-POINTS_PER_CLASS]
        return generalize(chosen)


def evaluate(sym: plans.Sym, atoms_: Sequence[int]) -> int:
    """A :class:`~flaggems.toolkit.plans.Sym`'s value for a call's atoms (the entry's ``evaluate``)."""
    n = (0 if sym.atom < 0 else atoms_[sym.atom]) * sym.mul + sym.add
    return n if sym.div == 1 else _cdiv(n, sym.div)


def admits(generic: plans.GenericPlan, atoms_: Sequence[int]) -> bool:
    """Whether a call with ``atoms_`` passes the generic plan's guards on its atoms (the entry's
    ``bind_generic`` checks these, then each computed integer's specialisation class)."""
    return (all(atoms_[a] == v for a, v in generic.pinned)
            and all(atoms_[a] * q == atoms_[of] * p for a, p, of, q in generic.ratios)
            and all(evaluate(s, atoms_) == v for s, v in generic.steady)
            and all(atoms_[a] % m == 0 for a, m in generic.aligned)
            and all(evaluate(x, atoms_) == evaluate(y, atoms_) for x, y in generic.agree))


def instantiate(template: Any, atoms_: Sequence[int]) -> Any:
    """A generic plan's replay (or any part of it) with every Sym evaluated for ``atoms_``."""
    if isinstance(template, plans.Sym):
        return evaluate(template, atoms_)
    if isinstance(template, tuple):
        items = [instantiate(item, atoms_) for item in template]
        return type(template)(*items) if hasattr(type(template), "_fields") else tuple(items)
    return template
