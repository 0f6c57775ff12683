"""The output checks: a side's tensors, logits, greedy tokens and gradients against torch's, and the fp32
criterion (as accurate as torch against an fp32 run).
"""

from __future__ import annotations

import copy
import functools
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .. import runner
from ..runner import TOLERANCES
from ._common import ACCURACY_FACTOR, GRAD_TOLERANCE, LOGITS_TOLERANCE, Check, ModelSlot


# -- checks ---------------------------------------------------------------------------
def tensors_of(value: Any) -> list[torch.Tensor]:
    """Every tensor in a (nested) tuple, list or dict, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in tensors_of(item)]
    return []


def detached_copy(value: Any) -> Any:
    """A copy of ``value`` with every tensor detached and cloned (the next step may overwrite them)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return {k: detached_copy(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(detached_copy(v) for v in value)
    return value


def close(reference: Any, output: Any, tolerance: tuple[float, float] | None = None) -> Check:
    """Tensors equal within their dtype's tolerance, ``atol`` scaled by the reference's largest magnitude.

    ``|out - ref| <= atol * max|ref| + rtol * |ref|`` elementwise, with (rtol, atol)
    ``tolerance`` or from :data:`flaggems.bench.runner.TOLERANCES`; integers must be equal.
    """
    refs, outs = tensors_of(reference), tensors_of(output)
    if len(refs) != len(outs):
        return Check(False, f"{len(outs)} output tensors, torch gave {len(refs)}")
    worst, worst_rel, bad = 0.0, 0.0, []
    for i, (ref, out) in enumerate(zip(refs, outs)):
        if ref.shape != out.shape or ref.dtype != out.dtype:
            return Check(False, f"output {i}: {tuple(out.shape)} {out.dtype}, torch {tuple(ref.shape)} {ref.dtype}")
        diff, scale, ok = _tensor_close(ref, out, tolerance)
        worst, worst_rel = max(worst, diff), max(worst_rel, diff / scale if scale else diff)
        if not ok:
            bad.append(i)
    detail = f"{len(refs)} tensors, max abs diff {worst:.3g} ({worst_rel:.3g} of the largest magnitude)"
    return Check(not bad, detail if not bad else f"{detail}; outside tolerance: outputs {bad}", worst)


def _tensor_close(ref: torch.Tensor, out: torch.Tensor,
                  tolerance: tuple[float, float] | None) -> tuple[float, float, bool]:
    """(max abs difference, max |ref|, within tolerance) of one tensor pair."""
    if not ref.numel():
        return 0.0, 0.0, True
    if not ref.is_floating_point():
        return float((ref.long() - out.long()).abs().max().item()), 0.0, bool(torch.equal(ref, out))
    r, o = ref.double(), out.double()
    diff = float((r - o).abs().max().item())
    scale = float(r.abs().max().item())
    rtol, atol = tolerance or TOLERANCES.get(ref.dtype, (1e-4, 1e-4))
    return diff, scale, bool(torch.allclose(o, r, rtol=rtol, atol=atol * max(scale, 1e-30), equal_nan=True))


def tokens_equal(reference: torch.Tensor, output: torch.Tensor) -> Check:
    """Token ids identical; otherwise where the first difference is."""
    if reference.shape != output.shape:
        return Check(False, f"generated {tuple(output.shape)} tokens, torch {tuple(reference.shape)}")
    same = reference == output
    if bool(same.all()):
        return Check(True, f"{reference.shape[0]} sequences x {reference.shape[-1]} tokens identical", 0.0)
    row, col = (int(i) for i in (~same).nonzero()[0].tolist())
    return Check(False, f"tokens differ first at sequence {row}, position {col} "
                 f"(side {int(output[row, col])}, torch {int(reference[row, col])})")


def both(first: Check, second: Check) -> Check:
    """Two checks that must both pass, reported together."""
    return Check(first.match and second.match, f"{first.detail}; {second.detail}", second.max_diff)


def row_errors(reference: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """Per row (every index but the last): max |output - reference| over the last dim / max |reference| there."""
    ref, out = reference.float(), output.float()
    return (out - ref).abs().amax(-1) / ref.abs().amax(-1).clamp_min(1e-30)


class Exact:
    """The fp32 reference of a workload, computed once and only when a check needs it.

    ``compute(reference_output)`` runs an fp32 copy of the model (made on first
    use, flaggems off) and returns what the outputs' floating tensors are compared with.
    """

    def __init__(self, slot: ModelSlot, compute: Callable[[nn.Module, Any], Any]) -> None:
        self.slot, self.compute = slot, compute
        self._value: Any = None

    def __call__(self, reference: Any) -> Any:
        """The fp32 values (cached), teacher-forced on ``reference`` where it holds generated tokens."""
        if self._value is None:
            with runner.flaggems_off():
                model = copy.deepcopy(self.slot.original).float()
                self._value = detached_copy(self.compute(model, reference))
                del model
        return self._value


def logits_check(reference: torch.Tensor, output: torch.Tensor, exact: Callable[[], torch.Tensor] | None = None,
                 rows: torch.Tensor | None = None) -> Check:
    """Logits within :data:`LOGITS_TOLERANCE` per row, or as accurate as torch's against ``exact()`` (fp32).

    ``rows``: a boolean mask of the rows compared (the others are not).
    """
    if reference.shape != output.shape:
        return Check(False, f"logits {tuple(output.shape)}, torch {tuple(reference.shape)}")
    errors = row_errors(reference, output)
    errors = errors if rows is None else errors[rows]
    worst = float(errors.max()) if errors.numel() else 0.0
    text = f"logits: max relative error over the vocabulary {worst:.3g}"
    if worst <= LOGITS_TOLERANCE:
        return Check(True, f"{text} <= {LOGITS_TOLERANCE:g}", worst)
    if exact is None:
        return Check(False, f"{text} > {LOGITS_TOLERANCE:g}", worst)
    return _as_accurate(text, *_against_exact(reference, output, exact(), rows), worst)


def _against_exact(reference: torch.Tensor, output: torch.Tensor, exact: torch.Tensor,
                   rows: torch.Tensor | None) -> tuple[float, float]:
    """(the side's, torch's) largest row error against the fp32 logits."""
    side, base = row_errors(exact, output), row_errors(exact, reference)
    if rows is not None:
        side, base = side[rows], base[rows]
    return float(side.max()), float(base.max())


def _as_accurate(text: str, side: float, base: float, worst: float) -> Check:
    """The fp32 criterion: the side's error against fp32 at most :data:`ACCURACY_FACTOR` x torch's."""
    ok = side <= ACCURACY_FACTOR * base
    verdict = "as accurate as torch" if ok else "less accurate than torch"
    return Check(ok, f"{text} > {LOGITS_TOLERANCE:g}; against fp32 {side:.3g}, torch's own {base:.3g} "
                     f"({verdict}: {'<=' if ok else '>'} {ACCURACY_FACTOR:g}x)", worst)


def decode_check(reference: Mapping[str, torch.Tensor], output: Mapping[str, torch.Tensor],
                 exact: Callable[[Any], torch.Tensor] | None = None) -> Check:
    """Greedy tokens equal, a row parting only at a near-tie; logits of every step compared up to there.

    ``reference``/``output``: ``tokens`` (batch x new) and ``logits`` (batch x new x vocab,
    the logits each token was chosen from). ``exact(reference)``: fp32 logits teacher-forced
    on torch's tokens (the same shape).
    """
    ref, out = reference["tokens"], output["tokens"]
    if ref.shape != out.shape:
        return Check(False, f"generated {tuple(out.shape)} tokens, torch {tuple(ref.shape)}")
    differ = ref != out
    parted = differ.any(1)
    last = torch.where(parted, differ.int().argmax(1), torch.full_like(parted, ref.shape[1] - 1, dtype=torch.long))
    rows = torch.arange(ref.shape[1], device=ref.device)[None, :] <= last[:, None]
    logits = logits_check(reference["logits"], output["logits"],
                          None if exact is None else functools.partial(exact, reference), rows.to(
                              reference["logits"].device))
    if not bool(parted.any()):
        return Check(logits.match, f"{ref.shape[0]} sequences x {ref.shape[1]} tokens identical; {logits.detail}",
                     logits.max_diff)
    where = ", ".join(f"sequence {int(r)} at token {int(last[r])}" for r in parted.nonzero().flatten()[:4])
    verdict = "near-ties that rounding flipped" if logits.match else "NOT near-ties"
    return Check(logits.match, f"tokens identical but for {int(parted.sum())} of {ref.shape[0]} sequences that part "
                               f"({where}; later tokens not compared): {verdict}; {logits.detail}", logits.max_diff)


def prefill_check(exact: Exact | None) -> Callable[[torch.Tensor, torch.Tensor], Check]:
    """The check of logits outputs, with the fp32 criterion when ``exact`` is given."""
    def check(reference: torch.Tensor, output: torch.Tensor) -> Check:
        return logits_check(reference, output, None if exact is None else functools.partial(exact, reference))

    return check


def _relative_norm(reference: torch.Tensor, output: torch.Tensor) -> float:
    ref = reference.double()
    return float((output.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def grads_check(reference: Sequence[torch.Tensor], output: Sequence[torch.Tensor],
                exact: Callable[[], Sequence[torch.Tensor]] | None = None) -> Check:
    """``[loss, *grads]``: each within :data:`GRAD_TOLERANCE` (loss: :data:`LOGITS_TOLERANCE`), relative norm.

    A tensor outside it still passes when its error against ``exact()`` (fp32) is at
    most :data:`ACCURACY_FACTOR` x torch's own.
    """
    refs, outs = tensors_of(reference), tensors_of(output)
    if len(refs) != len(outs) or any(r.shape != o.shape for r, o in zip(refs, outs)):
        return Check(False, f"{len(outs)} loss/gradient tensors, torch gave {len(refs)} (or shapes differ)")
    errors = [_relative_norm(r, o) for r, o in zip(refs, outs)]
    limits = [LOGITS_TOLERANCE, *[GRAD_TOLERANCE] * (len(refs) - 1)]
    outside = [i for i, (e, limit) in enumerate(zip(errors, limits)) if e > limit]
    worst = max(errors[1:], default=0.0)
    text = (f"loss relative error {errors[0]:.3g}; {len(refs) - 1} gradients, max relative norm error "
            f"{worst:.3g} (median {statistics.median(errors[1:]) if errors[1:] else 0:.3g}), tolerance "
            f"{GRAD_TOLERANCE:g}")
    if not outside:
        return Check(True, text, worst)
    if exact is None:
        return Check(False, f"{text}; outside: {len(outside)} tensors (first: {outside[0]})", worst)
    return _judged_against(text, worst, outside, refs, outs, tensors_of(exact()), "fp32")


def _judged_against(text: str, worst: float, outside: Sequence[int], refs: Sequence[torch.Tensor],
                    outs: Sequence[torch.Tensor], exact: Sequence[torch.Tensor], what: str) -> Check:
    """The tensors ``outside`` the tolerance pass when each is at most :data:`ACCURACY_FACTOR` x as far from
    ``exact`` (relative norm) as torch's own."""
    side = [_relative_norm(exact[i], outs[i]) for i in outside]
    base = [_relative_norm(exact[i], refs[i]) for i in outside]
    worse = [i for i, a, b in zip(outside, side, base) if a > ACCURACY_FACTOR * b]
    verdict = (f"the {len(outside)} outside it are as accurate as torch against {what} (worst {max(side):.3g}, "
               f"torch's {max(base):.3g}; <= {ACCURACY_FACTOR:g}x each)" if not worse else
               f"{len(worse)} less accurate than torch against {what} (first: tensor {worse[0]})")
    return Check(not worse, f"{text}; {verdict}", worst)
