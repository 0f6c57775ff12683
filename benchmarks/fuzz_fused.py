"""Differential fuzz of flaggems' fused operators against a float64 oracle, through both entries.

    python benchmarks/fuzz_fused.py [--op rms_norm] [--cases 10000] [--entry compiled --entry python]
                                    [--seed 0] [--start 0] [--json out.json] [--profile 25]

Each case comes from the randomized kit's generator of the op (its op
family's ``generate.py``, drawing with :mod:`flaggems.testing._generators_fused`:
the layouts transformers and diffusers make, q/k cut from a fused qkv projection, ``chunk`` halves of a
merged gate/up projection, size-0 and size-1 dimensions, special values,
inputs that require grad, calls the kernels decline); a share of the cases
(``--large``) is drawn with wide rows (odd and large hidden and intermediate
sizes up to 16,384; an element budget of 2**20 where the op's generator
module has one: rotary, group_norm_silu). Each case runs:

* flaggems (enabled, the entry under test), twice: the first call plans, the
  second replays; both compared;
* torch's reference in the case's dtype (flaggems disabled);
* the oracle: the reference on float64 copies of every floating input.

A result passes when its error against the oracle is at most twice torch's
own plus a few units of its dtype's rounding (relative to the oracle's
magnitude), elementwise, with the same NaN positions, shape, dtype and
strides as torch's; gradients (a random ``grad_output``, rounded as torch's
own backward receives it also for the oracle, backward through autograd) are
judged the same way, and where the kit registers an op's gradient terms
(``rms_norm``, ``add_rms_norm``: an input gradient that cancels terms far
larger than itself), each element's size includes the magnitude of the terms
it adds up. A call torch rejects must raise the same
exception type. The tally lists failures with a reproducer seed. Exit 1 on
any failure. Not a benchmark: no timing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from collections import Counter
from typing import Any

import torch

import flaggems
from flaggems import compiled
from flaggems.binding import native_scope
from flaggems.testing import _generators_fused as fused

#: The fused ops' generators (``flaggems::<op>``): every op family's (:meth:`flaggems.families.OpSpec.generators`).
GENERATORS = {op: gen for record in flaggems.ops.specs() for op, gen in record.generators().items()
              if op.startswith("flaggems::")}
OPS = tuple(name.split("::")[-1] for name in GENERATORS)
#: Wide rows for the ``--large`` share: odd and large hidden sizes, as 1B-70B decoders make them.
LARGE_HIDDEN = (1, 7, 896, 1000, 1536, 2048, 3000, 3584, 4095, 4096, 5120, 8191, 8192, 11008, 16384)
#: The element budget of a wide case (the kit's own is 2,048, for the interpreter).
LARGE_NUMEL = 1 << 20
#: What the ``--large`` share widens in the module of the op's generator, where it has them (and the default
#: budget of :func:`flaggems.testing._generators_fused.lead_shape`).
LARGE_KNOBS = {"MAX_NUMEL": LARGE_NUMEL, "HIDDEN": LARGE_HIDDEN, "INTERMEDIATE": LARGE_HIDDEN}
#: Units of rounding allowed beyond twice torch's own error (the kernels reduce in another order).
SLACK_ULPS = 8
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _float64(value: Any) -> Any:
    """``value`` with every floating tensor as a float64 leaf (requires_grad kept), others unchanged."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        copy = value.detach().to(torch.float64)
        return copy.requires_grad_(value.requires_grad)
    return value


def _leaves(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    return [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.requires_grad]


def _outputs(result: Any) -> list[torch.Tensor]:
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


def _judge(name: str, got: torch.Tensor, ref: torch.Tensor, oracle: torch.Tensor, *, strides: bool = True,
           low: torch.dtype | None = None, terms: torch.Tensor | None = None, inputs_scale: float = 0.0
           ) -> str | None:
    """Why ``got`` is farther from the float64 oracle than torch's ``ref`` allows, or ``None``.

    Element ``i`` may be off the oracle by twice torch's own error there or twice torch's largest error over
    the tensor (the kernels reduce in another order: an element where torch happened to be exact is not a
    failure), plus ``SLACK_ULPS`` of its dtype relative to its size (floored at 1e-3 of the largest). On
    Triton's interpreter, which truncates to bf16/fp16, one more unit of ``low`` (the lowest-precision dtype
    among the inputs) relative to the element. ``terms`` (a gradient's, from the kit's registered gradient
    terms) adds the float64 magnitude of what the element adds up to its size: where a gradient cancels
    terms far larger than itself, rounding of the terms is the error both sides make, in any order. A
    float64 result has no wider oracle (torch's answer reads exact): it is judged against the largest
    magnitude that enters it (the tensor's largest element, or ``inputs_scale``, the largest input: an
    output that cancels its inputs, ``n * w + b`` near 0, is as exact as their rounding).
    ``strides=False`` where the case's layout is the op's documented choice (its
    generator's ``check_strides``: group_norm_silu keeps a channels_last input's layout off the CPU).
    NaN and inf must be where torch has them.
    """
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return f"{name}: shape/dtype {tuple(got.shape)} {got.dtype}, torch {tuple(ref.shape)} {ref.dtype}"
    if got.numel() == 0:
        return None
    if strides and got.stride() != ref.stride() and not any(n <= 1 for n in got.shape):
        return f"{name}: strides {got.stride()}, torch {ref.stride()}"
    g, r, o = got.double(), ref.double(), oracle.double()
    finite = torch.isfinite(o)
    bad_nan = torch.isnan(g) & ~torch.isnan(r)
    if bad_nan.any():
        return f"{name}: NaN where torch has none ({int(bad_nan.sum())} elements)"
    bad_inf = (torch.isinf(g) != torch.isinf(r)) & finite & torch.isfinite(r)
    if bad_inf.any():
        return f"{name}: inf where torch is finite ({int(bad_inf.sum())} elements)"
    both = finite & torch.isfinite(g) & torch.isfinite(r)
    if not both.any():
        return None
    g, r, o = g[both], r[both], o[both]
    scale = o.abs().amax().item()
    size = o.abs() + 1e-3 * scale + 1e-30
    if got.dtype == torch.float64:  # torch's float64 answer is the oracle's own precision: judged norm-wise
        size = torch.full_like(size, max(scale, inputs_scale))
    if terms is not None:
        size = size + terms.to(o.device).double().expand(both.shape)[both]
    err_g, err_r = (g - o).abs(), (r - o).abs()
    slack = SLACK_ULPS * _eps(got.dtype) + (2 * _eps(low) if low is not None and INTERPRETED else 0.0)
    allowed = torch.maximum(2 * err_r, 2 * err_r.amax().expand_as(err_r)) + slack * size
    worst = (err_g - allowed).argmax()
    if err_g[worst] > allowed[worst]:
        return (f"{name}: error {err_g[worst].item():.3g} at an element of size {o[worst].abs().item():.3g}, "
                f"allowed {allowed[worst].item():.3g} (torch's there {err_r[worst].item():.3g}, its largest "
                f"{err_r.max().item():.3g}; largest of the oracle {scale:.3g})")
    return None


def _rms_norm64(input: torch.Tensor, weight: torch.Tensor | None, eps: float, weight_offset: float = 0.0,
                cast_first: bool = True) -> torch.Tensor:
    """rms_norm in float64 throughout (the reference's ``input.float()`` would bring a float64 input to fp32)."""
    x = input.double()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return normed if weight is None else normed * (weight.double() + weight_offset)


def _add_rms_norm64(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                    weight_offset: float = 0.0, cast_first: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    total = input.double() + residual.double()
    return _rms_norm64(total, weight, eps, weight_offset, cast_first), total


def _gelu_mul64(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate) * up`` as ``gate * erfc(-gate / sqrt 2) / 2``: float64's ``1 + erf`` is 0 below -8.3, where the
    GPU fuzz found the kernel's 1e-19 answers (forward and gradient) right and the oracle's zeros wrong."""
    return gate * torch.special.erfc(-gate * 0.5 ** 0.5) * 0.5 * up


def _gelu_tanh_mul64(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` as ``gate * sigmoid(2y)`` (``(1 + tanh y) / 2`` exactly), which float64 does not
    cancel: its ``1 + tanh`` is 0 below y = -19 (gate about -8.6), where the kernel answers 1e-26 rightly."""
    y = (2 / math.pi) ** 0.5 * (gate + 0.044715 * gate ** 3)
    return gate * torch.sigmoid(2 * y) * up


#: The oracle of each op: its torch reference on float64 inputs, except where the reference casts to fp32 or
#: float64 cancels (the GELUs' far negative tails).
ORACLES = {**flaggems.ops.REFERENCES, "rms_norm": _rms_norm64, "add_rms_norm": _add_rms_norm64,
           "gelu_mul": _gelu_mul64, "gelu_tanh_mul": _gelu_tanh_mul64}


def _lowest(args: tuple, kwargs: dict) -> torch.dtype | None:
    """The floating dtype of least precision among the tensor arguments."""
    dtypes = [v.dtype for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.is_floating_point()]
    return max(dtypes, key=_eps, default=None)


def _run(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[Any, BaseException | None]:
    try:
        return op(*args, **kwargs), None
    except Exception as exc:  # noqa: BLE001 - compared with torch's own exception
        return None, exc


def _incoming(outs: list[torch.Tensor], seed: int, dtypes: list[torch.dtype] | None = None) -> list[torch.Tensor]:
    """The random ``grad_output`` of each output, rounded to ``dtypes`` (the reference's outputs': the oracle
    gets the very values torch's and ours get, in float64) or to the outputs' own."""
    gen = torch.Generator(device=outs[0].device).manual_seed(seed)
    dtypes = dtypes or [t.dtype for t in outs]
    return [torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float64).to(d).to(t.dtype)
            for t, d in zip(outs, dtypes)]


def _differentiable(result: Any) -> list[torch.Tensor]:
    return [t for t in _outputs(result) if isinstance(t, torch.Tensor) and t.requires_grad]


def _grads(result: Any, leaves: list[torch.Tensor], seed: int,
           dtypes: list[torch.dtype] | None = None) -> list[torch.Tensor | None]:
    outs = _differentiable(result)
    if not outs or not leaves:
        return []
    return list(torch.autograd.grad(outs, leaves, _incoming(outs, seed, dtypes), allow_unused=True))


def _gradient_terms(op_name: str, args64: tuple, kwargs64: dict, oracle: Any, seed: int,
                    dtypes: list[torch.dtype]) -> list[torch.Tensor | None]:
    """Per leaf of the float64 call, the magnitude of the terms its gradient adds up (the kit's
    :func:`flaggems.testing.gradient_term_scales`), or ``None`` where the op registers none."""
    from flaggems.testing import gradient_term_scales

    leaves, outs = _leaves(args64, kwargs64), _differentiable(oracle)
    if not outs or not leaves:
        return [None] * len(leaves)
    return gradient_term_scales(f"flaggems::{op_name}", args64, kwargs64, _incoming(outs, seed, dtypes), leaves)

def _draw(op: str, seed: int, dev: torch.device, large: bool) -> Any:
    rng = random.Random(seed)
    torch.manual_seed(seed)  # the generators draw values from torch's generator: a seed rebuilds its case
    generate = GENERATORS[f"flaggems::{op}"]
    if not large:
        return generate(rng, dev)
    module = sys.modules[generate.__module__]
    saved = {name: getattr(module, name) for name in LARGE_KNOBS if hasattr(module, name)}
    defaults = fused.lead_shape.__defaults__
    try:
        for name in saved:
            setattr(module, name, LARGE_KNOBS[name])
        fused.lead_shape.__defaults__ = (LARGE_NUMEL,)
        return generate(rng, dev)
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
        fused.lead_shape.__defaults__ = defaults


def check_case(op_name: str, seed: int, dev: torch.device, large: bool) -> tuple[str, str | None]:
    """One case: its outcome (``ok``, ``both-raise``, ``fail``) and the reason of a failure (with the case)."""
    gen = _draw(op_name, seed, dev, large)
    outcome, reason = _check(flaggems.ops.overload(op_name), gen, seed)
    return outcome, None if reason is None else f"{reason} [{gen.kind}]"


def _grads_or_error(result: Any, leaves: list[torch.Tensor], seed: int, dtypes: list[torch.dtype] | None = None
                    ) -> tuple[list[torch.Tensor | None], BaseException | None]:
    try:
        return _grads(result, leaves, seed, dtypes), None
    except Exception as exc:  # noqa: BLE001 - a backward torch rejects: ours must reject it alike
        return [], exc


def _largest_input(args: tuple, kwargs: dict) -> float:
    """The largest finite magnitude among the floating tensor arguments (0 where none)."""
    values = [v.detach().abs().nan_to_num(posinf=0.0).max().item() for v in (*args, *kwargs.values())
              if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel()]
    return max(values, default=0.0)


def _check(op: torch._ops.OpOverload, gen: Any, seed: int) -> tuple[str, str | None]:
    args, kwargs = gen.args, gen.kwargs
    low = _lowest(args, kwargs)
    inputs_scale = _largest_input(args, kwargs) if low == torch.float64 else 0.0
    with native_scope():
        ref, ref_exc = _run(op, args, kwargs)
        ref_grads, ref_grad_exc = _grads_or_error(ref, _leaves(args, kwargs), seed) if ref_exc is None else ([], None)
        args64 = tuple(_float64(a) for a in args)
        kwargs64 = {k: _float64(v) for k, v in kwargs.items()}
        op_name = op.__name__.split(".")[0]
        oracle, oracle_exc = _run(ORACLES[op_name], args64, kwargs64)
        rounded = [t.dtype for t in _differentiable(ref)] if ref_exc is None else None
        oracle_grads, terms = [], []
        if oracle_exc is None and ref_grads:
            oracle_grads = _grads(oracle, _leaves(args64, kwargs64), seed, rounded)
            terms = _gradient_terms(op_name, args64, kwargs64, oracle, seed, rounded)
    for call in ("planned", "replayed"):
        got, exc = _run(op, args, kwargs)
        if ref_exc is not None or exc is not None:
            if ref_exc is None or exc is None or type(ref_exc) is not type(exc):
                return "fail", f"{call}: flaggems {exc!r}, torch {ref_exc!r}"
            continue
        if oracle_exc is not None:  # float64 outside the reference's dtypes (a mixed case): torch's own answer
            oracle, oracle_grads, terms = ref, ref_grads, []
        for i, (g, r, o) in enumerate(zip(_outputs(got), _outputs(ref), _outputs(oracle))):
            reason = _judge(f"{call} output {i}", g, r, o, low=low, strides=gen.check_strides,
                            inputs_scale=inputs_scale)
            if reason:
                return "fail", reason
        grads, grad_exc = _grads_or_error(got, _leaves(args, kwargs), seed)
        if ref_grad_exc is not None or grad_exc is not None:
            if ref_grad_exc is None or grad_exc is None or type(ref_grad_exc) is not type(grad_exc):
                return "fail", f"{call} backward: flaggems {grad_exc!r}, torch {ref_grad_exc!r}"
            continue
        reason = _judge_grads(call, grads, ref_grads, oracle_grads, terms, low)
        if reason:
            return "fail", reason
    return ("both-raise" if ref_exc is not None or ref_grad_exc is not None else "ok"), None


def _judge_grads(call: str, grads: list, ref_grads: list, oracle_grads: list, terms: list,
                 low: torch.dtype | None) -> str | None:
    for i, (g, r, o) in enumerate(zip(grads, ref_grads, oracle_grads)):
        if (g is None) != (r is None):
            return f"{call} grad {i}: defined {g is not None}, torch {r is not None}"
        if g is not None:
            # raw autograd.grad layouts are the op's choice; .backward() lays a leaf's grad out like it
            reason = _judge(f"{call} grad {i}", g, r, o, strides=False, low=low,
                            terms=terms[i] if i < len(terms) else None)
            if reason:
                return reason
    return None


def fuzz(op_name: str, entry: str, cases: int, seed: int, large_share: float, dev: torch.device,
         start: int = 0, progress: Any = None) -> dict[str, Any]:
    """Cases ``start`` to ``start + cases`` of one op through one entry: the tally and the failures (a range of
    the same sequence: shards run side by side cover what one process would). ``progress`` is called with
    the result so far every 200 cases (a run its time limit stops keeps the cases it finished)."""
    os.environ["FLAGGEMS_ENTRY"] = entry
    compiled.reset()
    flaggems.enable()
    active = flaggems.info()["entry"]["active"]
    tally: Counter[str] = Counter()
    failures: list[dict[str, Any]] = []
    began = time.perf_counter()
    try:
        for i in range(start, start + cases):
            case_seed = seed * 1_000_003 + i
            large = random.Random(case_seed ^ 0x5EED).random() < large_share
            try:
                outcome, reason = check_case(op_name, case_seed, dev, large)
            except Exception as exc:  # noqa: BLE001 - a harness error is a failure with its seed
                outcome, reason = "fail", f"harness: {exc!r}"
            tally[outcome] += 1
            tally["large"] += large
            if reason:
                failures.append({"seed": case_seed, "large": large, "reason": reason})
                print(f"  {op_name} {active} seed {case_seed}{' large' if large else ''}: {reason}", flush=True)
            if progress is not None and (i + 1 - start) % 200 == 0:
                progress({"op": op_name, "entry": active, "start": start, "cases": i + 1 - start,
                          "tally": dict(tally), "failures": failures[:50], "failed": len(failures), "partial": True})
            if (i + 1 - start) % 2000 == 0:
                print(f"  {op_name} {active}: {i + 1 - start} cases, {dict(tally)}", flush=True)
        declined = {d["reason"]: d["count"] for d in flaggems.routes(f"flaggems::{op_name}")[0]["declined"]}
    finally:
        flaggems.disable()
    tally["declined"] = sum(declined.values())  # calls (Python entry) or layouts first seen (compiled entry)
    return {"op": op_name, "entry": active, "declines": declined, "start": start, "cases": cases, "tally": dict(tally),
            "failures": failures[:50], "failed": len(failures), "seconds": round(time.perf_counter() - began, 1)}


def main(argv: list[str] | None = None) -> int:
    """Run the fuzz; print one line per op and entry; exit 1 on a failure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", action="append", choices=OPS)
    parser.add_argument("--entry", action="append", choices=("compiled", "python"))
    parser.add_argument("--cases", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", type=int, default=0, help="the first case of the sequence (shards)")
    parser.add_argument("--profile", type=int, default=0, help="print this many functions of a cProfile")
    parser.add_argument("--large", type=float, default=0.1, help="share of cases with wide rows")
    parser.add_argument("--json")
    opts = parser.parse_args(argv)
    dev = torch.device(flaggems.backend().device_type)
    torch.backends.cuda.matmul.allow_tf32 = False
    results = []
    profiler = None
    if opts.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    def save(partial: dict[str, Any] | None = None) -> None:
        if opts.json:  # after every op and entry (and every 200 cases): a stopped run keeps what it did
            with open(opts.json, "w") as fh:
                json.dump({"device": str(dev), "torch": torch.__version__,
                           "results": results + ([partial] if partial else [])}, fh, indent=1)

    for op_name in opts.op or OPS:
        for entry in opts.entry or ("compiled", "python"):
            r = fuzz(op_name, entry, opts.cases, opts.seed, opts.large, dev, opts.start, save)
            results.append(r)
            print(f"{op_name:<16} {r['entry']:<9} {r['cases']} cases: {r['tally']}, {r['failed']} failed, "
                  f"{r['seconds']} s", flush=True)
            for f in r["failures"][:5]:
                print(f"    seed {f['seed']}{' large' if f['large'] else ''}: {f['reason']}", flush=True)
            save()
    if profiler is not None:
        import pstats

        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(opts.profile)
    return 1 if any(r["failed"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
