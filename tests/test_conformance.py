"""Every installed implementation of every op against native torch (the kit)."""

from __future__ import annotations

import pytest

from flaggems import testing

ITEMS = testing.collect()


@pytest.mark.parametrize("item", ITEMS, ids=str)
def test_conformance(item):
    outcome = testing.check(item)
    if outcome.startswith("declined") and item.case.raises is None:
        pytest.skip(f"{item.label} {outcome}")


def test_every_routed_op_has_cases():
    from flaggems.policy import default_links
    from flaggems.runtime import RUNTIME

    ops = default_links(RUNTIME.implementations(), RUNTIME.active_backend())
    missing = [op for op in ops if not testing.cases_for(op)]
    assert not missing, f"ops without conformance cases: {missing}"


def test_the_native_side_is_atens_cpu_kernel_on_every_cpu():
    """torch's CPU GELU goes to oneDNN where the CPU has its instructions for the dtype (fp16 with AVX512-FP16,
    as on the machine whose tox failed; fp32 on some machines, not on others) and answers NaN at +inf there,
    inf in ATen's kernel: the kit's expected values come from ATen's whatever this CPU does, and oneDNN's flag
    is restored."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    if testing.device().type != "cpu":
        pytest.skip("the oneDNN choice is torch's on the CPU")
    onednn_answers = bool(torch.isnan(F.gelu(torch.full((2,), float("inf")))).all())  # this CPU's choice
    case = next(c for c in testing.cases_for("flaggems::gelu_mul") if c.name == "tails-f32")
    expected, ((gate, up), _) = testing.run_native("flaggems::gelu_mul", case, testing.device())
    at_inf = gate == float("inf")
    assert at_inf.any() and torch.equal(expected[at_inf], (torch.inf * up[at_inf])), f"oneDNN: {onednn_answers}"
    assert torch._C._get_mkldnn_enabled()
