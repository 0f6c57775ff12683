"""``flaggems.patch`` of decoder attention blocks: the rotary embedding and the ``DynamicCache`` append as one
``flaggems::rotary_cache_append`` (:mod:`flaggems.patching.attention`), on tiny transformers decoders."""

from __future__ import annotations

import inspect
import pickle

import pytest
import torch
from torch.profiler import profile

import flaggems
from flaggems import patching

transformers = pytest.importorskip("transformers")
from test_patching import DEV, forward_attrs, ids, tiny  # noqa: E402 - after the importorskip

OP = "flaggems::rotary_cache_append"
FAMILIES = ["Llama", "Qwen2", "Qwen3", "Mistral", "Gemma"]
NEW_TOKENS = 5


def _generate(model, prompt, **kwargs):
    """Greedy tokens and their scores, and how many fused and rotary-alone calls the run made."""
    with torch.no_grad(), profile() as prof:
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0, **kwargs)
    names = [event.name for event in prof.events()]
    return out, names.count(OP), names.count("flaggems::rotary_embedding")


def _declined() -> int:
    return flaggems.routes(OP)[0]["declined"]


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_steps_append_in_one_served_call_with_torch_results(family):
    # Mistral's default sliding window gives sliding-window cache layers (the module's own forward: tested below)
    model, prompt = tiny(family, **({"sliding_window": None} if family == "Mistral" else {})), ids()
    want, _, _ = _generate(model, prompt)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    report = flaggems.patch(model)
    assert report.patched["rotary_cache_append (attention)"] == 2, str(report)
    with flaggems.enabled():
        declined = _declined()
        got, fused, rotary = _generate(model, prompt)
        assert _declined() == declined  # every decode step's call served by the kernel
    layers = 2
    assert fused == layers * (NEW_TOKENS - 1)  # each decode step of each layer; the prefill's cache starts empty
    assert rotary == layers  # the prefill: rotary embedding alone, then the cache's own update
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), rtol=1e-5, atol=1e-5)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert flaggems.unpatch(model) and forward_attrs(model) == 0


def test_disabled_the_reference_serves_and_equals_the_module():
    model, prompt = tiny("Llama"), ids()
    want, _, _ = _generate(model, prompt)
    flaggems.patch(model)
    got, fused, _ = _generate(model, prompt)  # flaggems disabled: the op's torch reference
    assert fused == 2 * (NEW_TOKENS - 1)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), rtol=1e-5, atol=1e-5)
    flaggems.unpatch(model)


@pytest.mark.parametrize("cache", ["static", "sliding"])
def test_other_caches_run_the_modules_own_forward(cache):
    kwargs = {"sliding_window": 4} if cache == "sliding" else {}
    model, prompt = tiny("Mistral", **kwargs), ids()
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    want, _, _ = _generate(model, prompt, **extra)
    flaggems.patch(model)
    with flaggems.enabled():
        got, fused, _ = _generate(model, prompt, **extra)
    assert fused == 0
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), rtol=1e-5, atol=1e-5)
    flaggems.unpatch(model)


def test_compiled_forward_traces_the_modules_own_forward():
    model, prompt = tiny("Qwen3"), ids()
    cache = transformers.DynamicCache(config=model.config)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # 5.2x: cache
    with torch.no_grad():
        model(prompt, use_cache=True, **{name: cache})
        step = prompt[:, -1:]
        want = model(step, use_cache=True, **{name: pickle.loads(pickle.dumps(cache))}).logits
        flaggems.patch(model)
        compiled = torch.compile(model, backend="aot_eager", dynamic=True)
        with flaggems.enabled():
            got = compiled(step, use_cache=True, **{name: pickle.loads(pickle.dumps(cache))}).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    flaggems.unpatch(model)
    torch._dynamo.reset()


def test_a_patched_attention_pickles_and_unpatch_restores():
    model = tiny("Llama")
    flaggems.patch(model)
    attention = model.model.layers[0].self_attn
    assert attention.__dict__[patching.MARK] == "decoder_attention"
    copy = pickle.loads(pickle.dumps(model))
    prompt = ids()
    want, _, _ = _generate(model, prompt)
    got, fused, _ = _generate(copy, prompt)
    assert fused == 2 * (NEW_TOKENS - 1) and torch.equal(got.sequences, want.sequences)
    flaggems.unpatch(model)
    assert "forward" not in attention.__dict__


def test_the_op_passes_opcheck_with_flaggems_enabled():
    q = torch.randn(2, 4, 1, 16, device=DEV)
    k, v = torch.randn(2, 2, 1, 16, device=DEV), torch.randn(2, 2, 1, 16, device=DEV)
    cos, sin = torch.randn(2, 1, 16, device=DEV), torch.randn(2, 1, 16, device=DEV)
    keys, values = torch.randn(2, 2, 5, 16, device=DEV), torch.randn(2, 2, 5, 16, device=DEV)
    with flaggems.enabled():
        torch.library.opcheck(torch.ops.flaggems.rotary_cache_append.default, (q, k, v, cos, sin, keys, values, 1))
