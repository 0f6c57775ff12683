"""flaggems inside the compiler: opcheck on every operator, inductor and aot_eager on patched decoders.

The CPU half of what ``benchmarks/compile_checks.py checks`` runs on a GPU (reduce-overhead, CUDA graphs
and transformers' own compile of a static-cache ``generate`` happen only there). Every op passes
``torch.library.opcheck`` with flaggems enabled (schema, fake tensors, autograd registration, AOT dispatch
static and dynamic); a patched tiny Llama, Qwen2 and Qwen3 compile with ``dynamic=True`` under inductor
(CPU codegen) and aot_eager and equal eager torch; a patched decoder layer traces with 0 graph breaks and
compiles with ``fullgraph=True``.
"""

from __future__ import annotations

import pytest
import torch
from test_patching import ids, tiny

import flaggems
from flaggems.binding import native_scope

DEV = torch.device(flaggems.backend().device_type)
A, FG = torch.ops.aten, torch.ops.flaggems


def _t(*shape: int, grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape, device=DEV, requires_grad=grad)


def _cases() -> dict[str, tuple]:
    """One call of every routed aten op and every flaggems operator (inputs that require grad where the op
    has a gradient)."""
    x4 = _t(2, 4, 3, 3, grad=True)
    _, mean, rstd = A.native_group_norm(x4.detach(), None, None, 2, 4, 9, 2, 1e-5)
    index = torch.tensor([1, 3], device=DEV)
    repeats = torch.tensor([1, 2, 0], device=DEV)
    return {
        "copy_": (A.copy_.default, (torch.empty(4, 5, device=DEV), _t(5, 4).t())),
        "_to_copy": (A._to_copy.default, (_t(4, 5),), {"dtype": torch.float16}),
        "index_copy": (A.index_copy.default, (_t(5, 4, grad=True), 0, index, _t(2, 4, grad=True))),
        "index_copy_": (A.index_copy_.default, (_t(5, 4), 0, index, _t(2, 4))),
        "index_select": (A.index_select.default, (_t(5, 4, grad=True), 1, index)),
        "repeat_interleave.Tensor": (A.repeat_interleave.Tensor, (repeats,)),
        "repeat_interleave.self_Tensor": (A.repeat_interleave.self_Tensor, (_t(3, grad=True), repeats)),
        "repeat_interleave.self_int": (A.repeat_interleave.self_int, (_t(3, 2, grad=True), 2, 1)),
        "native_group_norm": (A.native_group_norm.default, (x4, _t(4, grad=True), _t(4, grad=True), 2, 4, 9, 2,
                                                            1e-5)),
        "native_group_norm_backward": (A.native_group_norm_backward.default,
                                       (_t(2, 4, 3, 3), x4.detach(), mean, rstd, _t(4), 2, 4, 9, 2,
                                        [True, True, True])),
        "group_norm": (A.group_norm.default, (x4, 2, _t(4, grad=True), _t(4, grad=True), 1e-5, True)),
        "unfold_backward": (A.unfold_backward.default, (_t(3, 2, 2), [4, 2], 0, 2, 1)),
        "flaggems::rms_norm": (FG.rms_norm.default, (_t(2, 3, 32, grad=True), _t(32, grad=True), 1e-6)),
        "flaggems::add_rms_norm": (FG.add_rms_norm.default, (_t(2, 3, 32, grad=True), _t(2, 3, 32, grad=True),
                                                             _t(32, grad=True), 1e-6)),
        "flaggems::rotary_embedding": (FG.rotary_embedding.default, (_t(1, 4, 3, 16, grad=True),
                                                                     _t(1, 2, 3, 16, grad=True), _t(1, 3, 16),
                                                                     _t(1, 3, 16))),
        "flaggems::rotary_cache_append": (FG.rotary_cache_append.default, (_t(1, 4, 1, 16), _t(1, 2, 1, 16),
                                                                           _t(1, 2, 1, 16), _t(1, 1, 16),
                                                                           _t(1, 1, 16), _t(1, 2, 5, 16),
                                                                           _t(1, 2, 5, 16), 1)),
        "flaggems::silu_mul": (FG.silu_mul.default, (_t(2, 32, grad=True), _t(2, 32, grad=True))),
        "flaggems::gelu_tanh_mul": (FG.gelu_tanh_mul.default, (_t(2, 32, grad=True), _t(2, 32, grad=True))),
        "flaggems::gelu_mul": (FG.gelu_mul.default, (_t(2, 32, grad=True), _t(2, 32, grad=True))),
        "flaggems::group_norm_silu": (FG.group_norm_silu.default, (x4, 2, _t(4, grad=True), _t(4, grad=True))),
    }


CASES = list(_cases())


@pytest.fixture
def enabled():
    flaggems.enable()
    yield
    flaggems.disable()


def test_every_routed_op_has_an_opcheck_case(enabled):
    """The opcheck cases cover every op flaggems routes here (a new op must add its case)."""
    routed = {row["op"].removeprefix("aten::") for row in flaggems.routes() if row["chosen"] != "native"}
    assert routed <= set(CASES) | {"unfold"}, sorted(routed - set(CASES))


@pytest.mark.parametrize("name", CASES)
def test_opcheck_with_flaggems_enabled(enabled, name):
    """schema, fake tensors, autograd registration, aot_dispatch static and dynamic: no host read on a fake
    or meta tensor (the Autograd-key routes go to torch while opcheck's modes are on the stack)."""
    op, args, *rest = _cases()[name]
    torch.library.opcheck(op, args, rest[0] if rest else {})


@pytest.mark.parametrize("family", ["Llama", "Qwen2", "Qwen3"])
@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_a_patched_decoder_compiles_with_dynamic_shapes_and_equals_eager_torch(family, backend):
    model = tiny(family)
    with torch.no_grad(), native_scope():
        want = [model(ids(2, n)).logits for n in (7, 11)]
    flaggems.enable()
    flaggems.patch(model)
    try:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend, dynamic=True)
        with torch.no_grad():
            for n, expected in zip((7, 11), want):
                torch.testing.assert_close(compiled(ids(2, n)).logits, expected, rtol=1e-4, atol=1e-4)
    finally:
        flaggems.unpatch(model)
        flaggems.disable()
        torch._dynamo.reset()


def test_a_patched_decoder_layer_has_no_graph_break_and_compiles_fullgraph():
    model = tiny("Llama")
    layer = model.model.layers[0]
    hidden = torch.randn(2, 5, 64, device=DEV)
    positions = torch.arange(5, device=DEV)[None].expand(2, -1)
    cos, sin = model.model.rotary_emb(hidden, positions)

    def run(h, c, s):
        out = layer(h, attention_mask=None, position_ids=positions, position_embeddings=(c, s))
        return out[0] if isinstance(out, tuple) else out

    with torch.no_grad(), native_scope():
        want = run(hidden, cos, sin)
    flaggems.enable()
    flaggems.patch(model)
    try:
        torch._dynamo.reset()
        with torch.no_grad():
            assert torch._dynamo.explain(run)(hidden, cos, sin).graph_break_count == 0
            torch._dynamo.reset()
            got = torch.compile(run, fullgraph=True)(hidden, cos, sin)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    finally:
        flaggems.unpatch(model)
        flaggems.disable()
        torch._dynamo.reset()


def test_a_patched_training_step_under_compile_equals_eager_torch():
    model = tiny("Qwen2").train()
    prompt = ids(2, 9)
    loss = model(prompt, labels=prompt).loss
    loss.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    flaggems.enable()
    flaggems.patch(model)
    try:
        torch._dynamo.reset()
        got_loss = torch.compile(model, backend="aot_eager", dynamic=True)(prompt, labels=prompt).loss
        got_loss.backward()
        torch.testing.assert_close(got_loss, loss, rtol=1e-5, atol=1e-5)
        for p, g in zip(model.parameters(), want):
            torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5)
    finally:
        flaggems.unpatch(model)
        flaggems.disable()
        torch._dynamo.reset()


def test_static_cache_generate_with_a_patched_model_equals_torch():
    model = tiny("Llama")
    prompt = ids(1, 6)
    kwargs = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "cache_implementation": "static",
              "attention_mask": torch.ones_like(prompt)}
    with torch.no_grad():
        want = model.generate(prompt, **kwargs)
        flaggems.enable()
        flaggems.patch(model)
        try:
            got = model.generate(prompt, **kwargs)
        finally:
            flaggems.unpatch(model)
            flaggems.disable()
    assert torch.equal(got, want)
