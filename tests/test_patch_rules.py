"""Plugins' patch rules (``flaggems_patch_rules``): a vendor declines a kind of module or makes its forward."""

from __future__ import annotations

import pytest
import torch
from test_patching import ids, tiny

import flaggems
from flaggems import PatchRule, hookimpl


class _Rules:
    """A generic plugin returning the rules it was given."""

    def __init__(self, *rules: PatchRule) -> None:
        self.rules = rules

    @hookimpl
    def flaggems_patch_rules(self, backend):
        return list(self.rules)


def _acme_declines_mlps(module):
    return "acme runs its own MLP kernel"


def _marking_norm_forward(module):
    def forward(hidden_states):
        forward.calls += 1
        return type(module).forward(module, hidden_states)
    forward.calls = 0
    return forward


class Scaled(torch.nn.Module):
    """A model module of a kind the core does not know: ``x * scale``."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.full((size,), 0.5))

    def forward(self, x):
        return x * self.scale


def _is_scaled(module):
    return isinstance(module, Scaled)


def _scaled_forward(module):
    def forward(x):
        forward.calls += 1
        return torch.mul(x, module.scale)
    forward.calls = 0
    return forward


def _odd_sizes_decline(module):
    return "odd size" if module.scale.numel() % 2 else None


@pytest.fixture
def with_rules(runtime):
    def register(*rules: PatchRule) -> None:
        runtime.manager.register(_Rules(*rules), "acme-rules")
        runtime._active = None
    return register


def test_a_rule_declines_a_kind_with_its_reason_naming_the_plugin(with_rules):
    with_rules(PatchRule("mlp", decline=_acme_declines_mlps))
    model = tiny("Llama")
    report = flaggems.patch(model)
    try:
        assert not any("mlp" in kind for kind in report.patched)
        reasons = [why for _, why in report.skipped if "acme runs its own MLP kernel" in why]
        assert len(reasons) == 2 and all("plugin 'acme-rules'" in why for why in reasons)
        assert report.patched["add_rms_norm (decoder layer)"] == 2  # the other kinds are patched as before
        assert "forward" not in model.model.layers[0].mlp.__dict__
    finally:
        flaggems.unpatch(model)


def test_a_rule_makes_the_forward_of_a_kind_and_unpatch_restores(with_rules):
    with_rules(PatchRule("norm", forward=_marking_norm_forward))
    model = tiny("Llama")
    with torch.no_grad():
        want = model(ids()).logits
    flaggems.patch(model)
    norm = model.model.norm  # the final norm: no layer fuses it
    try:
        with torch.no_grad():
            got = model(ids()).logits
        assert norm.forward.calls == 1
        torch.testing.assert_close(got, want)
    finally:
        flaggems.unpatch(model)
    assert "forward" not in norm.__dict__


def test_a_rule_that_does_not_resolve_is_left_out_with_a_warning(with_rules):
    with_rules(PatchRule("mlp", decline="no_such_module:decline"))
    model = tiny("Llama")
    with pytest.warns(RuntimeWarning, match=r"flaggems_patch_rules: mlp: .*left out"):
        report = flaggems.patch(model)
    try:
        assert any("mlp" in kind for kind in report.patched)
    finally:
        flaggems.unpatch(model)


def test_a_vendor_rule_applies_only_under_its_backend(with_rules):
    with_rules(PatchRule("mlp", decline=_acme_declines_mlps, vendor="acme"))  # acme's backend is not active
    model = tiny("Llama")
    report = flaggems.patch(model)
    try:
        assert any("mlp" in kind for kind in report.patched)
    finally:
        flaggems.unpatch(model)


@pytest.mark.parametrize("kwargs,message", [({"kind": "mlps", "decline": _acme_declines_mlps}, "expected one of"),
                                            ({"kind": "scaled", "matches": _is_scaled}, "with matches and forward"),
                                            ({"kind": "mlp", "decline": _acme_declines_mlps, "matches": _is_scaled},
                                             "matches is for a new kind"),
                                            ({"kind": "mlp"}, "neither a decline nor a forward"),
                                            ({"kind": "rotary", "forward": _marking_norm_forward},
                                             "cannot make a forward")])
def test_a_malformed_rule_is_refused_when_made(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PatchRule(**kwargs)


def test_patch_works_where_no_backend_can_be_chosen(runtime, monkeypatch):
    monkeypatch.setenv("FLAGGEMS_VENDOR", "no-such-vendor")
    runtime._active = None
    model = tiny("Llama")
    with pytest.warns(RuntimeWarning, match="patch rules were not read"):
        report = flaggems.patch(model)
    try:
        assert report.patched
    finally:
        flaggems.unpatch(model)


def test_a_rule_adds_a_kind_the_core_does_not_know(with_rules):
    """A new kind: its ``matches`` picks the modules, its ``forward`` patches them (counted under its label),
    another rule of the kind may decline one; ``unpatch`` restores them all."""
    with_rules(PatchRule("scaled", matches=_is_scaled, forward=_scaled_forward, label="mul (scaled)"),
               PatchRule("scaled", decline=_odd_sizes_decline, matches=_is_scaled, forward=_scaled_forward))
    model = torch.nn.Sequential(Scaled(4), torch.nn.ReLU(), Scaled(3))
    x = torch.randn(2, 4)
    report = flaggems.patch(model)
    try:
        assert report.patched == {"mul (scaled)": 1}
        assert any("Scaled: odd size (plugin 'acme-rules')" in why for _, why in report.skipped)
        assert "forward" in model[0].__dict__ and "forward" not in model[2].__dict__
        torch.testing.assert_close(model[0](x), x * 0.5)
        assert model[0].forward.calls == 1
    finally:
        assert flaggems.unpatch(model)
    assert "forward" not in model[0].__dict__
