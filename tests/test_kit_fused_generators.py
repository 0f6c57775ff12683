"""The randomized kit's generators of flaggems' fused ops (the ``flaggems::`` ops of the families' ``generate.py``).

Generated cases only: the registered cases' relayouts run in ``test_conformance_random``. Each fused op
gets :data:`CASES` generated cases through :func:`~flaggems.testing.random_cases.run_kit` (the
implementation's function, then the dispatcher under each entry), which must all agree with the op's
torch reference, and some must be served (not all declined). About 40 s on the CPU interpreter.

Known layout bugs of the fronts the generators reach with other seeds (not in these seed-0 streams):

* ``flaggems::rms_norm`` (with a weight; ``add_rms_norm`` also without): ``x = torch.randn(8, 1).t()``
  (``[1, 8]``, strides ``(1, 1)``) gives strides ``(8, 1)``, the reference ``(1, 1)``:
  :func:`flaggems.fronts.rms_norm.layout` takes them from the reference run on ``meta`` tensors, which
  stride size-1 dimensions unlike TensorIterator;
* ``flaggems::group_norm_silu`` (and ``aten::group_norm``): ``torch.empty_strided((2, 2, 1, 5), (10, 1, 40,
  2))`` gives a channels_last output, the reference a contiguous one: :func:`flaggems.fronts.group_norm.
  suggest_memory_format` takes channels_last contiguity for torch's stride-order test.
"""

from __future__ import annotations

import random

import pytest
import torch

from flaggems.binding import native_scope
from flaggems.testing import Case
from flaggems.testing import random_cases as kit
from flaggems.testing._layouts import Built

SEED = 0
#: The fused ops' generators (``flaggems::<op>``), from the kit's table of every family's.
FUSED_GENERATORS = {op: gen for op, gen in kit.GENERATORS.items() if op.startswith("flaggems::")}
#: Generated cases per op (and implementation, and mode).
CASES = 20


@pytest.fixture
def generated_only(monkeypatch):
    """The kit's streams of generated cases alone (no registered case is re-laid out)."""
    monkeypatch.setattr(kit, "relayout_pool", lambda op, unsupported=None: [])


def test_every_fused_op_has_a_generator():
    """Every installed ``flaggems::`` op has a generator in the kit's table."""
    fused = {target.op for target in kit.targets() if target.op.startswith("flaggems::")}
    assert fused, "no fused op is installed"
    assert fused <= set(kit.GENERATORS), f"fused ops without a generator: {sorted(fused - set(kit.GENERATORS))}"


@pytest.mark.parametrize("op", sorted(FUSED_GENERATORS))
def test_values_change_layout_stays(op):
    """Two value seeds, one ``rng`` seed: the same arguments' shapes, strides, dtypes and tolerances."""
    def signature(values_seed: int, seed: int) -> tuple:
        """What the case's layout is: everything the generator returns but the tensors' values."""
        torch.manual_seed(values_seed)
        with native_scope():
            gen = FUSED_GENERATORS[op](random.Random(seed), torch.device("cpu"))
        tensors = [(tuple(t.shape), t.stride(), t.dtype, t.requires_grad) if isinstance(t, torch.Tensor) else t
                   for t in (*gen.args, *gen.kwargs.values())]
        return tensors, sorted(gen.kwargs), gen.kind, gen.ulps, gen.fixed, gen.check_strides

    for seed in range(40):
        assert signature(seed, seed) == signature(seed + 1, seed), f"{op}: case seed {seed}"


@pytest.mark.parametrize("op", sorted(FUSED_GENERATORS))
def test_generated_cases_agree_with_the_reference(op, generated_only):
    """:data:`CASES` generated cases in every mode: none differs from the reference, some are served."""
    stream = kit.random_cases(op, CASES, SEED)
    assert stream and all(rc.source == kit.GENERATED for rc in stream)
    tallies = kit.run_kit(CASES, [op], SEED)
    assert tallies, f"{op}: no implementation installed"
    failures = [text for tally in tallies for text in tally.failures]
    failed = sum(tally.failed for tally in tallies)
    assert not failed, f"{op}: {failed} generated cases differ from the reference:\n" + "\n\n".join(failures)
    assert sum(tally.passed for tally in tallies) > 0, f"{op}: every generated case was declined"


# --------------------------------------------------------------------------- gradients
class _Doubled(torch.autograd.Function):
    """``x * w`` whose backward returns twice the weight's gradient: a wrong derivative the kit must catch."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w, 2 * (grad * x).sum(0)


def _sides(ours):
    """The kit's two prepared sides of ``x * w`` (``x`` [3, 4], ``w`` [4], both requiring grad) and the outcomes:
    torch's product, and ``ours(x, w)``."""
    from flaggems.testing import Case
    from flaggems.testing._layouts import Built

    def side():
        torch.manual_seed(0)
        x, w = torch.randn(3, 4).requires_grad_(), torch.randn(4).requires_grad_()
        return kit.Prepared(Built((x, w), {}), Case("product", lambda dev: None, ulps=2), "product")

    exp, act = side(), side()
    return kit.Outcome(exp.built.args[0] * exp.built.args[1]), kit.Outcome(ours(*act.built.args)), act, exp


def test_the_kit_compares_gradients_where_torchs_result_requires_grad():
    dev = torch.device("cpu")
    expected, actual, act, exp = _sides(lambda x, w: x * w)
    assert kit.compare_gradients("mul.Tensor", actual, expected, act, exp, dev, 0)

    expected, actual, act, exp = _sides(_Doubled.apply)
    with pytest.raises(AssertionError, match="gradient of differentiable input 1"):
        kit.compare_gradients("mul.Tensor", actual, expected, act, exp, dev, 0)

    expected, actual, act, exp = _sides(lambda x, w: (x * w).detach())
    with pytest.raises(AssertionError, match="lost derivative"):
        kit.compare_gradients("mul.Tensor", actual, expected, act, exp, dev, 0)


def test_grad_cases_reach_the_backward_in_the_compiled_entry(generated_only):
    """``silu_mul``'s generated stream has cases that require grad: their backward runs (planned, then
    replayed) and the gradients are compared with the reference's."""
    tallies = kit.run_kit(60, ["flaggems::silu_mul"], SEED, modes=("compiled",))
    assert tallies and not any(t.failed for t in tallies), [t.failures for t in tallies]
    assert sum(t.gradients for t in tallies) > 0


def test_the_norm_wise_gradient_judge_still_rejects_a_wrong_sum():
    """A weight gradient summing 24,150 products, as measured (ours 20.02286, torch 20.02288, float64
    20.02289: ours the farther, by rounding) passes; a sum off by 0.1% (one product of 24,150 lost) fails."""
    truth = torch.tensor([20.02289], dtype=torch.float64)
    torch_answer = torch.tensor([20.02288])
    assert kit._gradients_no_farther((torch.tensor([20.02286]),), (torch_answer,), (truth,), 4, 24150)
    assert not kit._gradients_no_farther((torch.tensor([20.04289]),), (torch_answer,), (truth,), 4, 24150)
    nan = torch.tensor([float("nan")])
    assert not kit._gradients_no_farther((nan,), (torch_answer,), (truth,), 4, 24150)


def _rms_backward_fp32(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, ds: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """The input gradient of ``add_rms_norm`` (weight offset 1) as our kernels order it, in float32 on the CPU:
    ``ds + rstd * (gn - n * mean(gn * n))``."""
    s = x + res
    rstd = torch.rsqrt(s.square().mean(-1, keepdim=True) + eps)
    n, gn = s * rstd, dy * (w + 1.0)
    return ds + rstd * (gn - n * (gn * n).mean(-1, keepdim=True))


def test_the_terms_judge_takes_ill_conditioned_gradients_and_rejects_wrong_ones():
    """``add_rms_norm``'s input gradient at a hidden size of 1 cancels ``gn`` against ``n**2 gn`` (up to a
    thousand times the answer for small sums): float32 evaluations of the formula (ours, torch's composite)
    round at the terms' scale and can be more than twice torch's distance from float64 apart (the GPU kit's
    one failure in run 41, case #1223 of seed 300). The judge allows the case's ulps of the terms: it takes
    every such gradient, and rejects one that loses the residual's gradient or is off by 0.1%."""
    op, eps = "flaggems::add_rms_norm", 1e-6
    generator = torch.Generator().manual_seed(3)
    old_judge_failed = 0
    for _ in range(40):
        scale = 10 ** (torch.rand(1, generator=generator).item() * 2 - 2)
        x, res = (torch.randn(3, 1, generator=generator) * scale for _ in range(2))
        w, dy, ds = torch.randn(1, generator=generator), *(torch.randn(3, 1, generator=generator) for _ in range(2))
        args = tuple(t.clone().requires_grad_() for t in (x, res, w))
        exp = kit.Prepared(Built((*args, eps, 1.0), {}), Case("h1", lambda dev: None, ulps=4), "h1")
        with native_scope():
            want = torch.autograd.grad(torch.ops.flaggems.add_rms_norm(*args, eps, 1.0), args[:1], (dy, ds))[0]
        truth = kit._exact_gradients(op, exp, [dy, ds])[0]
        scales = kit._term_scales(op, exp, [dy, ds])
        assert scales[0] is not None and scales[1] is not None and scales[2] is not None
        ours = _rms_backward_fp32(x, res, w, dy, ds, eps)
        old_judge_failed += not kit._gradients_no_farther((ours,), (want,), (truth,), 4, 3)
        assert kit._no_farther(ours, want, truth, 4, scales[0])
        assert not kit._no_farther(ours - ds, want, truth, 4, scales[0])
        assert not kit._no_farther(ours * 1.001 + 1e-3, want, truth, 4, scales[0])
    assert old_judge_failed  # the cases the judge exists for are among these
