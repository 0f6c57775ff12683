"""``flaggems.patch(unet)`` on diffusers UNets built from configs (random weights, CPU, nothing downloaded)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import flaggems
from flaggems import patching
from flaggems.runtime import RUNTIME
from flaggems.testing.steady import off_replay

diffusers = pytest.importorskip("diffusers")
from diffusers.models.activations import GEGLU  # noqa: E402 - after the importorskip
from diffusers.models.attention_processor import Attention, AttnProcessor  # noqa: E402
from diffusers.models.resnet import ResnetBlock2D  # noqa: E402

DEV = torch.device(flaggems.backend().device_type)
ROUTE = "flaggems::group_norm_silu"
GEGLU_ROUTE = "flaggems::gelu_mul"
#: The tiny UNet's ResnetBlock2Ds: one per down block, two in the mid block, two per up block.
RESNETS = 1 + 1 + 2 + 2 + 2
#: Its GEGLUs, one per transformer block: the cross-attention down block, the mid block, the up block (two).
GEGLUS = 1 + 1 + 2
#: Its attentions: a self- and a cross-attention per transformer block.
ATTENTIONS = 2 * GEGLUS


def tiny_unet() -> nn.Module:
    """A ``UNet2DConditionModel`` with SD's block kinds at a tiny size (seed 0, fp32, eval mode)."""
    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8).to(DEV).eval()


def inputs(batch: int = 2) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {"sample": torch.randn(batch, 4, 8, 8, generator=generator).to(DEV).contiguous(
                memory_format=torch.channels_last),
            "timestep": torch.tensor([10, 500][:batch], device=DEV),
            "encoder_hidden_states": torch.randn(batch, 5, 32, generator=generator).to(DEV)}


def forward_attrs(model: nn.Module) -> int:
    return sum("forward" in module.__dict__ for module in model.modules())


@pytest.fixture(scope="module")
def unet() -> nn.Module:
    return tiny_unet()


def test_patch_reports_every_block_and_keeps_results_and_state(unet):
    state = {k: v.clone() for k, v in unet.state_dict().items()}
    with torch.no_grad():
        want = unet(**inputs()).sample
        report = flaggems.patch(unet)
        try:
            got = unet(**inputs()).sample  # flaggems disabled: the operator's torch reference
        finally:
            flaggems.unpatch(unet)
    assert dict(report.patched) == {"group_norm_silu (resnet block)": RESNETS, "group_norm_silu (unet output)": 1,
                                    "gelu_mul (geglu)": GEGLUS, "attention (inline sdpa)": ATTENTIONS}, str(report)
    assert not report.skipped, str(report)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert list(unet.state_dict()) == list(state)
    assert {type(p).__name__ for p in unet.attn_processors.values()} == {"AttnProcessor2_0"}  # processors kept
    assert all(torch.equal(unet.state_dict()[k], v) for k, v in state.items())


def test_enabled_patched_unet_routes_the_fused_operator_and_matches_torch(unet):
    with torch.no_grad():
        want = unet(**inputs()).sample
        flaggems.patch(unet)
        try:
            with flaggems.enabled(include=[ROUTE]):
                got = unet(**inputs()).sample
                again = unet(**inputs()).sample
                served = {key: row["replay"] + row["python"] + row["miss"] for key, row in RUNTIME.plan_stats().items()
                          if key.startswith(ROUTE)}
                declined = flaggems.routes(ROUTE)[0]["declined"]
        finally:
            flaggems.unpatch(unet)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got, again) and not declined
    if served:  # the compiled entry: 2 fused calls per block and the output norm, per forward
        assert sum(served.values()) == 2 * (2 * RESNETS + 1), served


def test_patch_is_idempotent_and_unpatch_restores_exactly(unet):
    first = flaggems.patch(unet)
    assert first.patched and flaggems.patch(unet).already and patching.is_patched(unet)
    assert forward_attrs(unet) == RESNETS + GEGLUS + ATTENTIONS + 2  # every block, conv_norm_out and conv_act
    assert flaggems.unpatch(unet)
    assert forward_attrs(unet) == 0 and not patching.is_patched(unet)
    assert not any(patching.MARK in m.__dict__ for m in unet.modules())
    assert type(unet.conv_act).forward is nn.SiLU.forward and unet.conv_act(torch.tensor([1.0])).item() != 1.0
    assert not flaggems.unpatch(unet)


def test_training_step_gradients_match_the_unpatched_model():
    model = tiny_unet().train()
    step_inputs = inputs(batch=1)

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        model(**step_inputs).sample.square().mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    want = grads()
    flaggems.patch(model)
    try:
        with flaggems.enabled(include=[ROUTE, GEGLU_ROUTE]):
            got = grads()
    finally:
        flaggems.unpatch(model)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def _block(**options) -> nn.Module:
    torch.manual_seed(0)
    return ResnetBlock2D(in_channels=16, out_channels=32, temb_channels=24, groups=4, **options).to(DEV).eval()


@pytest.mark.parametrize("options,kind", [
    ({}, "group_norm_silu (resnet block)"),
    ({"down": True}, "group_norm_silu (resnet block)"),
    ({"up": True}, "group_norm_silu (resnet block)"),
    ({"time_embedding_norm": "scale_shift"}, "group_norm_silu (resnet block, norm1 only: scale_shift)"),
    ({"skip_time_act": True, "output_scale_factor": 2.0}, "group_norm_silu (resnet block)"),
], ids=["plain", "down", "up", "scale-shift", "skip-time-act"])
def test_each_resnet_form_keeps_its_result(options, kind):
    block = _block(**options)
    x = torch.randn(2, 16, 6, 6, device=DEV)
    temb = torch.randn(2, 24, device=DEV)
    with torch.no_grad():
        want = block(x, temb)
        report = flaggems.patch(block)
        with flaggems.enabled(include=[ROUTE]):
            got = block(x, temb)
        plain = block(x, temb)  # disabled: the references, the same steps (a division by 1.0 left out)
        flaggems.unpatch(block)
    assert dict(report.patched) == {kind: 1}, str(report)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(plain, want)


def test_a_block_called_with_the_deprecated_scale_runs_its_own_forward():
    block = _block()
    x, temb = torch.randn(1, 16, 4, 4, device=DEV), torch.randn(1, 24, device=DEV)
    with torch.no_grad():
        want = block(x, temb)
        flaggems.patch(block)
        with pytest.warns(FutureWarning):
            got = block(x, temb, 1.0)  # diffusers' own forward: it warns that ``scale`` is ignored
        flaggems.unpatch(block)
    torch.testing.assert_close(got, want)


def test_structures_that_do_not_match_are_skipped_with_their_reason():
    model = nn.ModuleDict({"mish": _block(non_linearity="mish"), "plain": _block()})
    model["layer_norm"] = _block()
    model["layer_norm"].norm2 = nn.LayerNorm(32)

    class Other(ResnetBlock2D):  # the same name, another forward: not the form flaggems knows
        def forward(self, input_tensor, temb):
            return self.conv2(self.nonlinearity(self.norm1(input_tensor)))

    Other.__name__ = "ResnetBlock2D"
    model["other"] = _block()
    model["other"].__class__ = Other
    report = flaggems.patch(model)
    reasons = dict(report.skipped)
    assert report.patched == {"group_norm_silu (resnet block)": 1}, str(report)
    assert "activation Mish is not SiLU" in reasons["mish"]
    assert "norm2: LayerNorm is not an nn.GroupNorm" in reasons["layer_norm"]
    assert "not the form flaggems knows" in reasons["other"]
    assert flaggems.unpatch(model) and forward_attrs(model) == 0


def test_a_model_without_resnet_blocks_is_left_untouched():
    model = nn.Sequential(nn.Conv2d(4, 8, 3), nn.GroupNorm(2, 8), nn.SiLU())
    report = flaggems.patch(model)
    assert not report.patched and "left untouched" in str(report) and "ResnetBlock2D" in str(report)
    assert forward_attrs(model) == 0 and not patching.is_patched(model)


def test_a_patched_unet_training_step_runs_no_python_in_the_steady_state():
    """The third training step of a patched UNet with every route enabled: every routed call (the fused norms
    and their backward, ``copy_`` of tensors that require grad, ``native_group_norm`` under the attention
    blocks' GroupNorm) replays from the compiled entry."""
    unet = tiny_unet().train()
    flaggems.patch(unet)
    try:
        with flaggems.enabled():
            if RUNTIME._binding.registry is None:
                pytest.skip("compiled entry not active")

            def step():
                unet(**inputs()).sample.square().mean().backward()
                unet.zero_grad()

            for _ in range(2):
                step()
            assert off_replay(step) == {}
    finally:
        flaggems.unpatch(unet)


def _geglu() -> nn.Module:
    torch.manual_seed(0)
    return GEGLU(24, 40).to(DEV)


def test_a_geglu_is_one_fused_call_with_its_result_and_gradients():
    module = _geglu()
    x = torch.randn(2, 5, 24, device=DEV, requires_grad=True)
    want = module(x)
    want_grads = torch.autograd.grad(want.square().sum(), (x, module.proj.weight))
    report = flaggems.patch(module)
    try:
        assert dict(report.patched) == {"gelu_mul (geglu)": 1}, str(report)
        with flaggems.enabled(include=[GEGLU_ROUTE]):
            got = module(x)
            got_grads = torch.autograd.grad(got.square().sum(), (x, module.proj.weight))
            declined = flaggems.routes(GEGLU_ROUTE)[0]["declined"]
        plain = module(x)  # flaggems disabled: the operator's torch reference, bit for bit
    finally:
        assert flaggems.unpatch(module)
    assert not declined and "forward" not in module.__dict__
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(plain, want)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_a_geglu_of_another_form_is_skipped_and_the_deprecated_scale_runs_its_own_forward():
    class Tanh(GEGLU):  # the same name, a tanh GELU: not the exact GELU gelu_mul computes
        def gelu(self, gate):
            return torch.nn.functional.gelu(gate, approximate="tanh")

    Tanh.__name__ = "GEGLU"
    model = nn.ModuleDict({"plain": _geglu(), "tanh": _geglu()})
    model["tanh"].__class__ = Tanh
    report = flaggems.patch(model)
    try:
        assert report.patched == {"gelu_mul (geglu)": 1}, str(report)
        assert "not the form flaggems knows" in dict(report.skipped)["tanh"]
        x = torch.randn(3, 24, device=DEV)
        with pytest.deprecated_call():
            torch.testing.assert_close(model["plain"](x, scale=1.0), GEGLU.forward(model["plain"], x))
    finally:
        flaggems.unpatch(model)


def _attention(**options) -> nn.Module:
    torch.manual_seed(0)
    return Attention(24, heads=3, dim_head=8, **options).to(DEV)


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_an_inline_attention_is_the_processors_result_bit_for_bit_with_its_gradients(cross):
    module = _attention(cross_attention_dim=16 if cross else None)
    x = torch.randn(2, 6, 24, device=DEV, requires_grad=True)
    context = torch.randn(2, 5, 16, device=DEV) if cross else None

    def run():
        out = module(x, encoder_hidden_states=context)
        return out, torch.autograd.grad(out.square().sum(), (x, module.to_q.weight, module.to_out[0].bias))

    want, want_grads = run()
    report = flaggems.patch(module)
    try:
        assert dict(report.patched) == {"attention (inline sdpa)": 1}, str(report)
        got, got_grads = run()
    finally:
        assert flaggems.unpatch(module)
    assert "forward" not in module.__dict__
    assert torch.equal(got, want)  # the same calls, less a division by 1.0
    for g, w in zip(got_grads, want_grads, strict=True):
        assert torch.equal(g, w)


def test_an_inline_attention_leaves_masks_other_processors_and_other_forms_to_diffusers():
    model = nn.ModuleDict({"plain": _attention(), "scaled": _attention(out_bias=False),
                           "residual": _attention(residual_connection=True), "normed": _attention(qk_norm="layer_norm"),
                           "classic": _attention()})
    model["scaled"].rescale_output_factor = 2.0
    model["classic"].set_processor(AttnProcessor())
    x = torch.randn(2, 6, 24, device=DEV)
    mask = torch.zeros(2, 6, device=DEV)
    mask[:, -2:] = -1e4
    with torch.no_grad():
        want = {name: module(x) for name, module in model.items()}
        want_masked = model["plain"](x, attention_mask=mask)
        report = flaggems.patch(model)
        try:
            reasons = dict(report.skipped)
            assert report.patched == {"attention (inline sdpa)": 2}, str(report)
            assert "residual_connection is set" in reasons["residual"], reasons
            assert "norm_q is set" in reasons["normed"] and "AttnProcessor is not" in reasons["classic"], reasons
            for name, module in model.items():
                assert torch.equal(module(x), want[name]), name
            assert torch.equal(model["plain"](x, attention_mask=mask), want_masked)
            model["plain"].set_processor(AttnProcessor())  # set after patching: the module's own forward serves it
            torch.testing.assert_close(model["plain"](x), want["plain"], rtol=1e-5, atol=1e-6)
        finally:
            flaggems.unpatch(model)
    assert forward_attrs(model) == 0


def test_a_patched_unet_deep_copies_and_pickles_with_its_own_modules():
    import copy
    import pickle

    model = tiny_unet()
    flaggems.patch(model)
    with torch.no_grad():
        want = model(**inputs()).sample
        twin, loaded = copy.deepcopy(model), pickle.loads(pickle.dumps(model))
        for parameter in model.parameters():
            parameter.add_(1)
        for other in (twin, loaded):
            torch.testing.assert_close(other(**inputs()).sample, want, rtol=0, atol=0)
            patched = [m for m in other.modules() if "forward" in m.__dict__ and hasattr(m.forward, "__self__")]
            assert patched and all(m.forward.__self__.module is m for m in patched)
            assert flaggems.unpatch(other) and forward_attrs(other) == 0
