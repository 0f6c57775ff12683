"""``flaggems.patch(model)`` on transformers decoders built from configs (random weights, nothing downloaded)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import textwrap

import pytest
import torch
from torch import nn

import flaggems
from flaggems import ops, patching
from flaggems.testing.steady import off_replay

transformers = pytest.importorskip("transformers")
DEV = torch.device(flaggems.backend().device_type)
FAMILIES = ["Llama", "Qwen2", "Qwen3", "Mistral", "Gemma"]


def tiny(family: str, dtype: torch.dtype = torch.float32, layers: int = 2, config: str = "",
         **config_args) -> nn.Module:
    """A two-layer ``<family>ForCausalLM`` with random weights (seed 0)."""
    config = getattr(transformers, config or f"{family}Config")(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, head_dim=16, **config_args)
    torch.manual_seed(0)
    return getattr(transformers, f"{family}ForCausalLM")(config).to(device=DEV, dtype=dtype).eval()


def ids(batch: int = 2, length: int = 7) -> torch.Tensor:
    return torch.randint(0, 96, (batch, length), generator=torch.Generator().manual_seed(1)).to(DEV)


def forward_attrs(model: nn.Module) -> int:
    return sum("forward" in module.__dict__ for module in model.modules())


def patched_between_runs(model: nn.Module, prompt: torch.Tensor) -> tuple:
    """``(report, want, got, state)``: ``flaggems.patch(model)``'s report, the logits of ``prompt`` before and
    after it (flaggems disabled: the patched model runs the operators' torch references), the state before."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        want = model(prompt).logits
        report = flaggems.patch(model)
        got = model(prompt).logits
    return report, want, got, state


def routed_after_patch(model: nn.Module, prompt: torch.Tensor, ops: tuple[str, ...], runs: int = 1) -> tuple:
    """``(want, got, declined, before, stats)``: the logits of ``prompt`` (flaggems disabled), then those of
    ``runs`` runs of the patched model with flaggems enabled, the declines of ``ops`` there and the compiled
    entry's plan counters before and after those runs; unpatched after."""
    with torch.no_grad():
        want = model(prompt).logits
        flaggems.patch(model)
        before = flaggems.runtime.RUNTIME.plan_stats()
        with flaggems.enabled():
            got = [model(prompt).logits for _ in range(runs)]
            declined = {op: flaggems.routes(op)[0]["declined"] for op in ops}
            stats = flaggems.runtime.RUNTIME.plan_stats()
    flaggems.unpatch(model)
    return want, got, declined, before, stats


@pytest.mark.parametrize("family", FAMILIES)
def test_patch_reports_every_fused_kind_and_keeps_results_and_state(family):
    model, prompt = tiny(family), ids()
    report, want, got, state = patched_between_runs(model, prompt)
    layers = 2
    # each layer's input norm and the final one; Qwen3's q_norm/k_norm too (post-attention norms: in add_rms_norm)
    norms = layers + 1 + (2 * layers if family == "Qwen3" else 0)
    activation = "gelu_tanh_mul (mlp)" if family == "Gemma" else "silu_mul (mlp)"
    assert dict(report.patched) == {"add_rms_norm (decoder layer)": layers, "rms_norm": norms, activation: layers,
                                    "rotary_embedding (attention)": layers, "q_k_v_proj (one GEMM)": layers,
                                    "rotary_cache_append (attention)": layers,
                                    "gate_up_proj (one GEMM)": layers}, str(report)
    assert not report.skipped, str(report)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert list(model.state_dict()) == list(state)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


@pytest.mark.parametrize("family", ["Llama", "Gemma"])
def test_patch_is_idempotent_and_unpatch_restores_exactly(family):
    model = tiny(family)
    module = sys.modules[type(model.model.layers[0].self_attn).__module__]
    original, served = module.apply_rotary_pos_emb, rotary_of(module)
    assert flaggems.patch(model).patched
    assert flaggems.patch(model).already
    assert rotary_of(module) is patching._rotary and forward_attrs(model) > 0
    assert flaggems.unpatch(model)
    assert module.apply_rotary_pos_emb is original and rotary_of(module) == served
    assert forward_attrs(model) == 0
    assert not any(patching.MARK in m.__dict__ for m in model.modules())
    assert not flaggems.unpatch(model)


def test_a_module_function_stays_patched_while_another_model_uses_it():
    first, second = tiny("Llama"), tiny("Llama")
    module = sys.modules[type(first.model.layers[0].self_attn).__module__]
    original, served = module.apply_rotary_pos_emb, rotary_of(module)
    flaggems.patch(first)
    flaggems.patch(second)
    flaggems.unpatch(first)
    assert rotary_of(module) is patching._rotary
    flaggems.unpatch(second)
    assert module.apply_rotary_pos_emb is original and rotary_of(module) == served


def rotary_of(module) -> object:
    """What computes the modeling module's ``apply_rotary_pos_emb`` (the function, or the forward of the module
    transformers' ``kernels`` hub wrapper made of it)."""
    return patching.served_function(module, "apply_rotary_pos_emb")


def test_an_unknown_model_is_left_untouched():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    report = flaggems.patch(model)
    assert not report.patched and "left untouched" in str(report)
    assert forward_attrs(model) == 0 and not patching.is_patched(model)


@pytest.mark.parametrize("act,kind", [("gelu", "gelu_mul (mlp)"), ("gelu_pytorch_tanh", "gelu_tanh_mul (mlp)")])
def test_an_mlp_of_each_gelu_is_served_by_its_fused_op(act, kind):
    """``hidden_act="gelu"`` (exact, erf) goes to ``gelu_mul``, the tanh approximation to ``gelu_tanh_mul``; the
    kernels give torch's logits."""
    model, prompt = tiny("Llama", hidden_act=act), ids()
    with torch.no_grad():
        want = model(prompt).logits
        report = flaggems.patch(model)
        try:
            route = f"flaggems::{kind.split()[0]}"
            with flaggems.enabled(include=[route]):
                got = model(prompt).logits
                declined = flaggems.routes(route)[0]["declined"]
        finally:
            flaggems.unpatch(model)
    assert report.patched[kind] == 2, str(report)
    assert not declined
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_layer_of_another_form_is_skipped_with_its_reason_and_its_norms_patched_alone():
    model = tiny("Llama", layers=1)
    layer_class = type(model.model.layers[0])

    class OtherLayer(layer_class):  # the same name, another forward: not the pre-norm residual form
        def forward(self, hidden_states, **kwargs):
            return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))

    OtherLayer.__name__ = layer_class.__name__
    model.model.layers[0].__class__ = OtherLayer
    report = flaggems.patch(model)
    assert any("not the pre-norm residual form" in why for _, why in report.skipped), str(report)
    assert report.patched["rms_norm"] == 3 and "add_rms_norm (decoder layer)" not in report.patched


def test_save_pretrained_writes_the_same_tensors(tmp_path):
    model = tiny("Qwen2")
    model.save_pretrained(tmp_path / "plain")
    flaggems.patch(model)
    model.save_pretrained(tmp_path / "patched")
    from safetensors.torch import load_file

    plain, patched = load_file(tmp_path / "plain" / "model.safetensors"), load_file(
        tmp_path / "patched" / "model.safetensors")
    assert plain.keys() == patched.keys() and all(torch.equal(plain[k], patched[k]) for k in plain)
    flaggems.unpatch(model)


def test_training_step_gradients_match_the_unpatched_model():
    model, prompt = tiny("Llama"), ids()
    model.train()
    loss = model(prompt, labels=prompt).loss
    loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    flaggems.patch(model)
    with flaggems.enabled():
        model(prompt, labels=prompt).loss.backward()
    flaggems.unpatch(model)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, want[name], rtol=2e-4, atol=2e-5, msg=name)


@pytest.mark.parametrize("family", ["Llama", "Qwen3", "Gemma"])
def test_enabled_patched_model_routes_the_fused_operators(family):
    model, prompt = tiny(family), ids()
    want, (got, got_again), declined, _, stats = routed_after_patch(
        model, prompt, ("flaggems::rms_norm", "flaggems::add_rms_norm"), runs=2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got, got_again)
    assert not any(declined.values()), declined  # the generic kernels served the norms
    if stats:  # the compiled entry: its counters say the fused operators were planned and replayed
        served = {key: row["replay"] + row["python"] for key, row in stats.items() if key.startswith("flaggems::")}
        fused = {key.partition("@")[0] for key, count in served.items() if count}
        activation = "flaggems::gelu_tanh_mul" if family == "Gemma" else "flaggems::silu_mul"
        assert fused >= {"flaggems::rms_norm", "flaggems::add_rms_norm", "flaggems::rotary_embedding",
                         activation}, served


@pytest.mark.parametrize("family", ["Llama", "Qwen2"])
def test_a_patched_model_steady_step_runs_no_python(family):
    """The third training step and the third forward of a patched model with every route enabled: every routed
    call replays (or goes native) from the compiled entry; none reaches Python or the planner."""
    model, prompt = tiny(family), ids()
    flaggems.patch(model)
    try:
        with flaggems.enabled():
            from flaggems.runtime import RUNTIME

            if RUNTIME._binding.registry is None:
                pytest.skip("compiled entry not active")
            model.train()

            def train_step():
                model(prompt, labels=prompt).loss.backward()
                model.zero_grad()

            for _ in range(2):
                train_step()
            assert off_replay(train_step) == {}
            model.eval()
            with torch.no_grad():
                for _ in range(2):
                    model(prompt)
                assert off_replay(lambda: model(prompt)) == {}
    finally:
        flaggems.unpatch(model)


def test_torch_compile_traces_a_patched_model_without_new_graph_breaks():
    model, prompt = tiny("Llama"), ids()

    def breaks(m: nn.Module) -> int:
        torch._dynamo.reset()
        return torch._dynamo.explain(m)(prompt).graph_break_count

    plain = breaks(model)
    flaggems.patch(model)
    assert breaks(model) == plain
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(prompt).logits, model(prompt).logits, rtol=1e-5, atol=1e-5)
    flaggems.unpatch(model)
    torch._dynamo.reset()


def test_the_operators_are_defined_at_import_with_their_references():
    for name in ops.SCHEMAS:
        assert ops.overload(name)._schema.name == f"flaggems::{name}"
    x, w = torch.randn(3, 8), torch.randn(8)
    torch.testing.assert_close(torch.ops.flaggems.rms_norm(x, w, 1e-6), ops.rms_norm(x, w, 1e-6))


#: Families no table names, patched by form (their classes read as Llama's, Mixtral's, Gemma's or Gemma 2's):
#: what transformers 5.x models of two layers get. Granite's layer is of another form (a residual
#: multiplier): its norms, MLPs and rotary embeddings are patched alone. Gemma 2's and 3's layers (a norm
#: before and after the attention and the MLP each) fuse the residual add with the pre-feedforward norm.
QKV, GATE_UP = {"q_k_v_proj (one GEMM)": 2}, {"gate_up_proj (one GEMM)": 2}
#: Attentions whose forward reads as Llama's (Mixtral's, Granite's): rotary and cache append fused.
CACHE = {"rotary_cache_append (attention)": 2}
FORM_FAMILIES = {
    "Mixtral": {"add_rms_norm (decoder layer)": 2, "rms_norm": 3, "rotary_embedding (attention)": 2, **QKV,
                **CACHE},
    "Gemma2": {"add_rms_norm (decoder layer)": 2, "gelu_tanh_mul (mlp)": 2, "rms_norm": 7,
               "rotary_embedding (attention)": 2, **QKV, **GATE_UP},
    "Gemma3": {"add_rms_norm (decoder layer)": 2, "gelu_tanh_mul (mlp)": 2, "rms_norm": 11,
               "rotary_embedding (attention)": 2, **QKV, **GATE_UP},
    "Granite": {"rms_norm": 5, "silu_mul (mlp)": 2, "rotary_embedding (attention)": 2, **QKV, **GATE_UP, **CACHE},
    "SmolLM3": {"add_rms_norm (decoder layer)": 2, "rms_norm": 3, "silu_mul (mlp)": 2,
                "rotary_embedding (attention)": 2, **QKV, **GATE_UP},
    # one gate_up projection, chunked (Phi-3's MLP form); its layer and partial rotary are other forms
    "Phi3": {"rms_norm": 5, "silu_mul (mlp)": 2},
}


def form_family(family: str) -> nn.Module:
    config = "Gemma3TextConfig" if family == "Gemma3" else f"{family}Config"  # Gemma 3's text-only model
    if not hasattr(transformers, config):
        pytest.skip(f"transformers {transformers.__version__} has no {config}")
    return tiny(family, pad_token_id=None, bos_token_id=None, eos_token_id=None, config=config)


@pytest.mark.parametrize("family", FORM_FAMILIES)
def test_families_no_table_names_are_patched_by_form(family):
    model, prompt = form_family(family), ids()
    report, want, got, state = patched_between_runs(model, prompt)
    if int(transformers.__version__.split(".")[0]) >= 5:
        assert dict(report.patched) == FORM_FAMILIES[family], str(report)
    assert report.patched["rms_norm"] and report.by_form, str(report)
    assert set(report.by_form.values()) <= {"LlamaRMSNorm", "GemmaRMSNorm", "LlamaMLP", "LlamaDecoderLayer",
                                            "MixtralDecoderLayer", "Gemma2DecoderLayer"}
    assert all(why.endswith(("form flaggems knows", "rotate-half form")) for _, why in report.skipped), str(report)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert flaggems.unpatch(model) and forward_attrs(model) == 0


@pytest.mark.parametrize("family", ["Mixtral", "Gemma3", "Phi3"])
def test_a_family_patched_by_form_runs_the_kernels_with_torchs_results(family):
    model, prompt = form_family(family), ids()
    want, (got,), declined, before, stats = routed_after_patch(model, prompt,
                                                               ("flaggems::rms_norm", "flaggems::silu_mul"))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not any(declined.values()), declined  # the generic kernels served the norms (and Phi-3's halves)
    if stats:  # the compiled entry: its counters say the fused norm was served (planned or replayed)
        calls = {k: sum(v[f] for f in ("replay", "python", "miss")) - sum(before.get(k, {}).get(f, 0)
                 for f in ("replay", "python", "miss")) for k, v in stats.items()}
        assert any(n > 0 for k, n in calls.items() if k.startswith("flaggems::rms_norm@")), calls


def _norm_module(tmp_path, name: str, change: str = "") -> type:
    """Llama's RMSNorm renamed ``name`` in a module file of its own, with a comment and a docstring of its own
    and ``change`` (``"old -> new"``) applied."""
    llama = importlib.import_module("transformers.models.llama.modeling_llama")
    source = textwrap.dedent(inspect.getsource(llama.LlamaRMSNorm)).replace("LlamaRMSNorm", name)
    source = "\n".join(line for line in source.splitlines() if not line.startswith("@"))  # hub decorators
    source = source.replace("    def forward(self, hidden_states):", "    # a comment of its own\n"
                            '    def forward(self, hidden_states):\n        """A docstring of its own."""', 1)
    if change:
        old, new = change.split(" -> ")
        assert old in source
        source = source.replace(old, new)
    path = tmp_path / f"norm_{name.lower()}.py"
    path.write_text("import torch\nfrom torch import nn\n\n\n" + source + "\n")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return getattr(module, name)


def test_a_form_is_the_code_not_its_comments_docstrings_or_name(tmp_path):
    tiny("Llama", layers=1)  # transformers' Llama imported: the reference forms
    same = nn.Sequential(_norm_module(tmp_path, "MyRMSNorm")(8))
    report = flaggems.patch(same)
    assert report.by_form == {"MyRMSNorm": "LlamaRMSNorm"} and report.patched["rms_norm"] == 1, str(report)
    x = torch.randn(3, 8)
    patched = same(x)
    assert flaggems.unpatch(same)
    torch.testing.assert_close(patched, same(x))
    changed = nn.Sequential(_norm_module(tmp_path, "OtherRMSNorm",
                                         "+ self.variance_epsilon -> + 2 * self.variance_epsilon")(8))
    report = flaggems.patch(changed)
    assert not report.patched and not report.by_form and "left untouched" in str(report)


def _model_of(family: str) -> nn.Module:
    return form_family(family) if family in FORM_FAMILIES else tiny(family)


@pytest.mark.parametrize("family", ["Llama", "Qwen2", "Mistral", "Gemma", "Phi3"])
@pytest.mark.parametrize("enabled", [False, True], ids=["disabled", "enabled"])
def test_a_deep_copy_of_a_patched_model_computes_with_its_own_modules(family, enabled):
    import copy

    model, prompt = _model_of(family), ids()
    flaggems.patch(model)
    twin = copy.deepcopy(model)
    with torch.no_grad(), flaggems.enabled() if enabled else _nothing():
        want = twin(prompt).logits
        for parameter in model.parameters():
            parameter.add_(1)  # the original changes: the copy must not see it
        got = twin(prompt).logits
        edited = model(prompt).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.allclose(edited, want)
    patched = [m for m in twin.modules() if "forward" in m.__dict__]
    assert patched and all(m.forward.__self__.module is m for m in patched)  # bound to the copy's own modules
    assert patching.is_patched(twin) and flaggems.unpatch(twin) and forward_attrs(twin) == 0
    assert patching.is_patched(model) and forward_attrs(model) > 0


def _nothing():
    import contextlib

    return contextlib.nullcontext()


@pytest.mark.parametrize("family", ["Llama", "Phi3"])
def test_a_patched_model_pickles_and_loads_patched_with_equal_results(family, tmp_path):
    import pickle

    model, prompt = _model_of(family), ids()
    report = flaggems.patch(model)
    with torch.no_grad():
        want = model(prompt).logits
    loaded = pickle.loads(pickle.dumps(model))
    torch.save(model, tmp_path / "model.pt")
    reloaded = torch.load(tmp_path / "model.pt", weights_only=False)
    for copy_ in (loaded, reloaded):
        with torch.no_grad():
            torch.testing.assert_close(copy_(prompt).logits, want, rtol=0, atol=0)
        assert patching.is_patched(copy_) and forward_attrs(copy_) == forward_attrs(model)
    module = sys.modules[type(model.model.layers[0].self_attn).__module__]
    if report.patched["rotary_embedding (attention)"]:
        flaggems.unpatch(model)
        flaggems.unpatch(loaded)
        assert rotary_of(module) is patching._rotary  # the reloaded copy still holds it
        flaggems.unpatch(reloaded)
        assert rotary_of(module) is not patching._rotary


def test_a_model_saved_patched_loads_patched_in_a_fresh_process(tmp_path):
    import subprocess
    import textwrap

    model, prompt = tiny("Llama"), ids()
    flaggems.patch(model)
    with torch.no_grad():
        torch.save({"model": model, "prompt": prompt, "logits": model(prompt).logits}, tmp_path / "saved.pt")
    script = textwrap.dedent(f"""
        import sys, torch
        saved = torch.load({str(tmp_path / "saved.pt")!r}, weights_only=False)
        model = saved["model"]
        module = sys.modules[type(model.model.layers[0].self_attn).__module__]
        from flaggems import patching
        assert patching.served_function(module, "apply_rotary_pos_emb") is patching._rotary
        with torch.no_grad():
            torch.testing.assert_close(model(saved["prompt"]).logits, saved["logits"], rtol=0, atol=0)
        import flaggems
        assert patching.is_patched(model) and flaggems.unpatch(model)
        assert patching.served_function(module, "apply_rotary_pos_emb") is not patching._rotary
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@pytest.mark.parametrize("bad", [None, torch.zeros(3), "model", {"model": None}], ids=["None", "tensor", "str", "dict"])
def test_patch_and_unpatch_refuse_what_is_no_module_with_a_type_error(bad):
    with pytest.raises(TypeError, match="torch.nn.Module"):
        flaggems.patch(bad)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        flaggems.unpatch(bad)
    assert not patching.is_patched(bad)


class _TorchNormBlock(nn.Module):
    """A block of torch's own norms: affine and not, eps given and defaulted, and one over two dimensions."""

    def __init__(self, hidden: int = 48) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        self.norm_default_eps = nn.RMSNorm(hidden)
        self.norm_plain = nn.RMSNorm(hidden, elementwise_affine=False)
        self.norm_2d = nn.RMSNorm((4, hidden))
        with torch.no_grad():
            for norm in (self.norm, self.norm_default_eps, self.norm_2d):
                norm.weight.normal_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm_plain(self.norm_default_eps(self.norm(self.proj(x))))
        return self.norm_2d(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=lambda d: str(d).split(".")[-1])
def test_torchs_rms_norm_is_patched_with_its_results(dtype):
    torch.manual_seed(0)
    model = _TorchNormBlock().to(device=DEV, dtype=dtype)
    x = torch.randn(2, 4, 48, device=DEV, dtype=dtype)
    with torch.no_grad():
        want = model(x)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        report = flaggems.patch(model)
        assert report.patched["rms_norm"] == 3, report  # the norm over (4, hidden) keeps its own forward
        assert [name for name, _ in report.skipped] == ["norm_2d"], report
        with flaggems.enabled():
            got, again = model(x), model(x)
            declined = flaggems.routes("flaggems::rms_norm")[0]["declined"]
    flaggems.unpatch(model)
    assert "forward" not in model.norm.__dict__
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.float64:  # the module's own forward serves float64 (the fused op computes in fp32)
        assert torch.equal(got, want)
    else:
        ulp = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
        torch.testing.assert_close(got, want, rtol=ulp, atol=ulp)
        assert not declined
    assert torch.equal(got, again)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_a_subclass_of_torchs_rms_norm_with_its_own_forward_is_not_patched():
    class Scaled(nn.RMSNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    model = nn.Sequential(Scaled(16), nn.RMSNorm(16))
    report = flaggems.patch(model)
    assert report.patched["rms_norm"] == 1 and "forward" not in model[0].__dict__
    flaggems.unpatch(model)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("family", ["Llama", "Qwen2", "Qwen3"])
def test_qkv_and_gate_up_run_as_one_gemm_over_the_modules_own_parameters(family):
    """q/k/v and gate/up: one weight each whose rows are the modules' parameters (the same ``Parameter``
    objects, same state_dict), one GEMM a group in inference; training calls each module; unpatch gives each
    parameter storage of its own, values unchanged."""
    model, prompt = tiny(family), ids()
    params = dict(model.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        want = model(prompt).logits
    flaggems.patch(model)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert _storage(attn.q_proj.weight) == _storage(attn.k_proj.weight) == _storage(attn.v_proj.weight)
    assert _storage(mlp.gate_proj.weight) == _storage(mlp.up_proj.weight)
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    with torch.no_grad():
        got = model(prompt).logits
    gemms_inference = _gemm_calls(model, prompt, grad=False)
    gemms_training = _gemm_calls(model, prompt, grad=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert gemms_training - gemms_inference == 3 * 2  # per layer: q/k/v one GEMM (two fewer), gate/up one (one)
    model.load_state_dict({k: v + 1 for k, v in state.items()})  # writes into the shared storage
    with torch.no_grad():
        torch.testing.assert_close(model(prompt).logits, _fresh(family, {k: v + 1 for k, v in state.items()})(prompt)
                                   .logits, rtol=1e-5, atol=1e-5)
    assert flaggems.unpatch(model)
    assert len({_storage(attn.q_proj.weight), _storage(attn.k_proj.weight), _storage(attn.v_proj.weight)}) == 3
    assert _storage(mlp.gate_proj.weight) != _storage(mlp.up_proj.weight)
    assert dict(model.named_parameters()) == params


def _fresh(family: str, state: dict) -> nn.Module:
    model = tiny(family)
    model.load_state_dict(state)
    return model


def _gemm_calls(model: nn.Module, prompt: torch.Tensor, grad: bool) -> int:
    """``aten::mm``/``addmm``/``linear`` GEMMs of one forward (a profiler count)."""
    from torch.profiler import profile

    with profile() as prof, torch.set_grad_enabled(grad):
        model(prompt)
    return sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm"))


def test_projections_tied_quantized_or_hooked_are_not_fused():
    """A projection that is no plain nn.Linear, has hooks, or shares its weight stays as it is (with a reason)."""
    model = tiny("Llama")
    attn = model.model.layers[0].self_attn
    attn.k_proj.register_forward_hook(lambda m, i, o: None)
    mlp = model.model.layers[1].mlp
    mlp.up_proj.weight = mlp.gate_proj.weight  # tied
    report = flaggems.patch(model)
    reasons = [why for _, why in report.skipped if "not fused" in why]
    assert any("hooks" in why for why in reasons) and any("shares memory" in why for why in reasons), str(report)
    assert report.patched["q_k_v_proj (one GEMM)"] == 1 and report.patched["gate_up_proj (one GEMM)"] == 1
    assert _storage(attn.q_proj.weight) != _storage(attn.k_proj.weight)
    with torch.no_grad():
        flaggems.unpatch(model)
        want = model(ids()).logits
        flaggems.patch(model)
        torch.testing.assert_close(model(ids()).logits, want, rtol=1e-5, atol=1e-5)
    flaggems.unpatch(model)


def test_a_patched_model_moved_or_copied_fuses_its_projections_again():
    """``model.to(...)`` and ``copy.deepcopy`` give the parameters storage of their own; the first inference
    call fuses them again (its results unchanged)."""
    import copy

    model, prompt = tiny("Llama"), ids()
    with torch.no_grad():
        want = model(prompt).logits
    flaggems.patch(model)
    model.to(torch.float64).to(torch.float32)
    attn = model.model.layers[0].self_attn
    assert _storage(attn.q_proj.weight) != _storage(attn.k_proj.weight)
    twin = copy.deepcopy(model)
    for m in (model, twin):
        with torch.no_grad():
            torch.testing.assert_close(m(prompt).logits, want, rtol=1e-5, atol=1e-5)
        a = m.model.layers[0].self_attn
        assert _storage(a.q_proj.weight) == _storage(a.v_proj.weight)
    flaggems.unpatch(model)
    flaggems.unpatch(twin)
