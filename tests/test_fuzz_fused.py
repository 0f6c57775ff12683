"""The GPU fuzz's judge (``benchmarks/fuzz_fused.py``): what it accepts where a gradient cancels, what it rejects.

The fuzz runs on the GPU (10,000 cases per op and entry); its judge is tested here, on the CPU, so that a change
that would let it accept a wrong gradient fails in CI.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fuzz_fused  # noqa: E402 - the benchmark script, by path


def _cancelling_rms_norm(rows: int = 64, seed: int = 3):
    """An rms_norm at a hidden size of 1, where the input gradient ``rstd * g * (1 - n**2)`` cancels."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 1, generator=gen, dtype=torch.float64) * 1e-2
    w = torch.randn(1, generator=gen, dtype=torch.float64)
    args64 = (x.requires_grad_(), w.requires_grad_(), 1e-6)
    oracle = fuzz_fused.ORACLES["rms_norm"](*args64)
    grads = fuzz_fused._grads(oracle, fuzz_fused._leaves(args64, {}), seed, [torch.float32])
    terms = fuzz_fused._gradient_terms("rms_norm", args64, {}, oracle, seed, [torch.float32])
    return x.detach(), w.detach(), grads[0], terms[0]


def test_rms_norm_registers_the_terms_of_its_input_gradient():
    x, _, exact, terms = _cancelling_rms_norm()
    assert terms is not None and terms.shape == x.shape
    # the terms dwarf the answer: that is the cancellation the judge has to see
    assert float((terms / exact.abs().clamp_min(1e-300)).median()) > 10


def test_rounding_of_the_terms_is_accepted_with_them_and_rejected_without():
    _, _, exact, terms = _cancelling_rms_norm()
    theirs = (exact + 1e-9 * terms).float()  # torch nearer by chance
    ours = (exact + 6 * torch.finfo(torch.float32).eps * terms).float()  # fp32 rounding of the terms
    assert fuzz_fused._judge("grad", ours, theirs, exact, strides=False, terms=terms) is None
    assert fuzz_fused._judge("grad", ours, theirs, exact, strides=False) is not None


@pytest.mark.parametrize("wrong", ["mean term off by 1e-4", "mean term missing", "sign"])
def test_a_wrong_input_gradient_is_rejected_even_with_the_terms(wrong):
    x, w, exact, terms = _cancelling_rms_norm()
    theirs = exact.float()
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    n = x * rstd
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(n.shape, generator=gen, dtype=torch.float64).float().double() * w
    scale = {"mean term off by 1e-4": 1 + 1e-4, "mean term missing": 0.0, "sign": -1.0}[wrong]
    bad = rstd * (g - scale * n * (g * n).mean(-1, keepdim=True))
    if wrong == "sign":
        bad = -exact
    assert fuzz_fused._judge("grad", bad.float(), theirs, exact, strides=False, terms=terms) is not None


def test_the_oracle_receives_the_rounded_incoming_gradient():
    out = torch.zeros(5, dtype=torch.float64, requires_grad=True)
    rounded = fuzz_fused._incoming([out], seed=1, dtypes=[torch.bfloat16])[0]
    assert torch.equal(rounded, rounded.to(torch.bfloat16).double())
    assert not torch.equal(rounded, fuzz_fused._incoming([out], seed=1)[0])


@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm"])
def test_a_few_fuzz_cases_pass_on_this_machine(op):
    import flaggems

    dev = torch.device(flaggems.backend().device_type)
    flaggems.enable()
    try:
        outcomes = [fuzz_fused.check_case(op, seed, dev, False) for seed in range(6)]
    finally:
        flaggems.disable()
    assert all(reason is None for _, reason in outcomes), outcomes


def test_a_float64_result_is_judged_against_its_largest_element():
    oracle = torch.tensor([1e-3, 2.0], dtype=torch.float64)
    rounding = oracle + torch.tensor([2e-17, 0.0], dtype=torch.float64)  # 0.05 ulp of 2.0 at the small one
    assert fuzz_fused._judge("out", rounding, oracle, oracle) is None
    wrong = oracle + torch.tensor([1e-10, 0.0], dtype=torch.float64)
    assert fuzz_fused._judge("out", wrong, oracle, oracle) is not None


def test_a_backward_torch_rejects_must_be_rejected_alike(monkeypatch):
    class Raising(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("no gradient here")

    x = torch.ones(3, requires_grad=True)
    grads, error = fuzz_fused._grads_or_error(Raising.apply(x), [x], seed=0)
    assert grads == [] and isinstance(error, RuntimeError)
    grads, error = fuzz_fused._grads_or_error(x * 2, [x], seed=0)
    assert error is None and grads[0].shape == x.shape


def test_a_float64_output_that_cancels_its_inputs_is_judged_by_their_size():
    oracle = torch.tensor([4e-7, -3e-7], dtype=torch.float64)  # n * w + b near 0 from terms near 1
    rounding = oracle + 2e-21
    assert fuzz_fused._judge("out", rounding, oracle, oracle) is not None  # by the output alone: 15 ulps
    assert fuzz_fused._judge("out", rounding, oracle, oracle, inputs_scale=1.0) is None
    assert fuzz_fused._judge("out", oracle + 1e-12, oracle, oracle, inputs_scale=1.0) is not None
