"""``flaggems bench --models``: smoke runs in-process (on the CPU interpreter here), sides, checks, JSON, options.

The decoder workloads need transformers (those tests import-skip without it);
their version-dependent pieces (StaticCache arguments, forward keywords) are
checked against fake signatures of transformers 4.4x, 4.5x and 5.x. The liger
side is exercised with a fake Liger that rebinds a modeling-module global and a
class attribute.
"""

from __future__ import annotations

import functools
import json
import sys
from types import SimpleNamespace

import pytest
import torch

import flaggems
from flaggems import patching
from flaggems.bench import models
from flaggems.cli import main

NO_GPU = models.runner.detect().gpu is False


def test_smoke_run_matches_torch_and_writes_json(tmp_path, capsys):
    path = tmp_path / "models.json"
    assert main(["bench", "--models", "--smoke", "--only", "unet*", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "timings below are meaningless" in out and "unet_fwd_bwd_fp32" in out
    doc = json.loads(path.read_text())
    meta = doc["meta"]
    assert meta["smoke"] is True and meta["timings_meaningful"] is False
    assert {"date", "device", "torch", "triton", "flaggems", "backend", "timing", "steps", "rounds",
            "transformers", "routes"} <= meta.keys()
    assert {"geomean_ratio", "workloads_timed", "skipped", "failed"} <= doc["summary"].keys()
    results = {r["workload"]: r for r in doc["results"]}
    assert set(results) == {"unet_fwd_fp16", "unet_fwd_bwd_fp32"}
    for result in results.values():
        assert result["status"] == "ok" and result["match"] is True, result
        assert {"description", "params", "check", "max_diff", "metrics", "flaggems_ops", "native_calls",
                "declines", "error"} <= result.keys()
        metric = result["metrics"][0]
        assert metric["name"] == "ms/step" and metric["torch_ms"] > 0 and metric["flaggems_ms"] > 0
        assert metric["ratio"] == pytest.approx(metric["torch_ms"] / metric["flaggems_ms"])
        assert set(metric["ms"]) == {"torch", "flaggems"} and set(metric["ratios"]) == {"flaggems"}
        assert metric["ratios"]["flaggems"]["median"] == metric["ratio"]
        assert set(metric["calls"]) == {"torch", "flaggems"} and metric["calls"]["torch"] > 0
        assert any("group_norm" in op for op in result["flaggems_ops"]), result["flaggems_ops"]
        # the UNet stack is no transformers model: patched and liger do not apply to it
        assert result["sides"]["patched"]["status"] == "omitted"
        assert result["sides"]["flaggems"]["calls"] == result["metrics"][0]["calls"]["flaggems"]


def test_llama_workloads_skip_with_one_line_each_without_transformers(monkeypatch, capsys):
    monkeypatch.setattr(models._deps, "transformers_available", lambda: False)
    assert main(["bench", "--models", "--smoke", "--only", "llama*"]) == 2  # nothing ran
    skipped = [line for line in capsys.readouterr().out.splitlines() if line.startswith("skipped ")]
    assert len(skipped) == len(models.select(["llama*"])) == 12
    assert all("transformers is not installed" in line for line in skipped)


@pytest.mark.skipif(not NO_GPU, reason="a GPU backend is active")
def test_without_gpu_every_workload_is_skipped(capsys):
    assert main(["bench", "--models", "--only", "unet_fwd_fp16"]) == 2
    assert "skipped unet_fwd_fp16: no GPU" in capsys.readouterr().out


def test_list_and_usage_errors(capsys):
    assert main(["bench", "--models", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(w.name in listed for w in models.WORKLOADS)
    assert main(["bench", "--models", "--only", "nope"]) == 2
    assert "no workload matches" in capsys.readouterr().err
    assert main(["bench", "--rounds", "3", "--list"]) == 2
    assert "apply only with --models" in capsys.readouterr().err
    assert main(["bench", "--only", "unet*", "--list"]) == 2  # seed workloads' names: none is a model's
    assert "no workload matches" in capsys.readouterr().err
    assert main(["bench", "--op", "rms_norm", "--only", "*vs F.rms_norm*", "--list"]) == 0
    assert "24 workloads" in capsys.readouterr().out
    assert main(["bench", "--models", "--op", "copy_", "--list"]) == 2
    assert models.main(["--list", "--only", "llama*"]) == 0
    assert "llama_decode" in capsys.readouterr().out


def test_settings_defaults_and_overrides():
    parser = models.build_parser()
    full = models.Settings.from_args(parser.parse_args([]))
    assert (full.smoke, full.steps, full.rounds, full.warmup) == (False, None, None, None)
    decode, prefill = models.select(["qwen2_decode_b8_static"])[0], models.select(["llama_prefill"])[0]
    assert (full.rounds_for(decode), full.warmup_for(decode), full.rounds_for(prefill)) == (8, 1, 15)
    assert models.Settings.from_args(parser.parse_args(["--rounds", "4"])).rounds_for(prefill) == 4
    assert full.sides == models.DEFAULT_SIDES == ("torch", "flaggems", "patched", "liger")  # compiled: opt-in
    assert models.Settings.from_args(parser.parse_args(["--side", "compiled"])).sides == ("torch", "compiled")
    assert models.Settings.from_args(parser.parse_args(["--side", "patched"])).sides == ("torch", "patched")
    assert full.steps_for(150.0) == 1 and full.steps_for(20.0) == 10 and full.steps_for(0.01) == full.max_steps
    assert models.Settings(smoke=False, steps=4).steps_for(0.01) == 4
    smoke = models.Settings.from_args(parser.parse_args(["--smoke", "--rounds", "2"]))
    assert (smoke.smoke, smoke.steps, smoke.rounds, smoke.warmup) == (True, 1, 2, 0)
    with pytest.raises(SystemExit):
        parser.parse_args(["--steps", "0"])


def test_dispatch_counts_separate_flaggems_native_and_declines():
    records = [("dispatch", "copy_ -> generic"), ("dispatch", "copy_ -> generic"),
               ("dispatch", "copy_ -> native (re-entered or Python scalar)"), ("dispatch", "index_copy_ -> native"),
               ("fallback", "copy_: generic declined: complex")]
    served, native, declines = models.dispatch_counts(records)
    assert served == {"copy_ -> generic": 2}
    assert native == {"copy_ -> native (re-entered or Python scalar)": 1, "index_copy_ -> native": 1}
    assert declines == {"copy_: generic declined: complex": 1}


def test_checks():
    ref = [torch.ones(4, dtype=torch.float16), torch.arange(3)]
    assert models.close(ref, [torch.ones(4, dtype=torch.float16) * 1.001, torch.arange(3)]).match
    assert not models.close(ref, [torch.ones(4, dtype=torch.float16) * 1.5, torch.arange(3)]).match
    assert not models.close(ref, [ref[0]]).match
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert models.tokens_equal(tokens, tokens.clone()).match
    other = tokens.clone()
    other[1, 2] = 9
    check = models.tokens_equal(tokens, other)
    assert not check.match and "sequence 1, position 2" in check.detail


# -- fake transformers signatures ---------------------------------------------------------
class Cache446:
    def __init__(self, config, batch_size=None, max_cache_len=None, device=None, dtype=torch.float32,
                 max_batch_size=None, layer_device_map=None): ...


class Cache453:
    def __init__(self, config, max_batch_size, max_cache_len=None, device=None, dtype=torch.float32,
                 layer_device_map=None): ...


class Cache5:
    def __init__(self, config, max_cache_len, offloading=False, offload_only_non_sliding=True, **kwargs): ...


class CacheUnknown:
    def __init__(self, config, max_cache_len, page_size): ...


@pytest.mark.parametrize(("cls", "expected"), [
    (Cache446, {"config", "batch_size", "max_cache_len", "device", "dtype"}),
    (Cache453, {"config", "max_batch_size", "max_cache_len", "device", "dtype"}),
    (Cache5, {"config", "max_cache_len"}),
])
def test_static_cache_arguments_fit_each_version(cls, expected):
    kwargs = models.static_cache_kwargs(cls, "cfg", 4, 280, torch.device("cpu"), torch.bfloat16)
    assert set(kwargs) == expected
    assert kwargs["max_cache_len"] == 280 and kwargs.get("batch_size", kwargs.get("max_batch_size", 4)) == 4


def test_static_cache_unknown_required_argument_is_a_clear_error():
    with pytest.raises(models.ModelApiError, match="cannot fill \\['page_size'\\]"):
        models.static_cache_kwargs(CacheUnknown, "cfg", 4, 280, torch.device("cpu"), torch.bfloat16)


def test_forward_keywords_per_version():
    def forward4(input_ids=None, past_key_values=None, cache_position=None, num_logits_to_keep=0): ...

    def forward5(input_ids=None, cache=None, logits_to_keep=0, **kwargs): ...

    def forward_none(input_ids=None): ...

    assert models.LlamaApi.of(forward4) == models.LlamaApi("past_key_values", True, "num_logits_to_keep")
    assert models.LlamaApi.of(forward5) == models.LlamaApi("cache", False, "logits_to_keep")
    with pytest.raises(models.ModelApiError, match="neither cache="):
        models.LlamaApi.of(forward_none)


def test_generate_keywords_per_version():
    class WithDisable:
        disable_compile = False
        compile_config = None

    class AutoCompileOnly:
        compile_config = None

    class Old:
        pass

    assert models.generate_kwargs(WithDisable, 24)["disable_compile"] is True
    assert "disable_compile" not in models.generate_kwargs(Old, 24)
    with pytest.raises(models.Skip, match="disable_compile"):
        models.generate_kwargs(AutoCompileOnly, 24)
    # the dynamic cache is never compiled automatically: no Skip, and no static cache asked for
    dynamic = models.generate_kwargs(AutoCompileOnly, 24, static=False)
    assert "cache_implementation" not in dynamic and dynamic["max_new_tokens"] == 24
    assert models.generate_kwargs(WithDisable, 24)["cache_implementation"] == "static"


# -- sides ------------------------------------------------------------------------------------
def test_rotation_puts_each_side_in_each_position_alike():
    sides = ["torch", "flaggems", "patched", "liger"]
    orders = [models.rotation(sides, i) for i in range(4)]
    assert orders[0] == sides and orders[1] == ["flaggems", "patched", "liger", "torch"]
    assert all(sorted(order[k] for order in orders) == sorted(sides) for k in range(4))
    assert [models.rotation(["torch", "flaggems"], i) for i in range(2)] == [["torch", "flaggems"],
                                                                               ["flaggems", "torch"]]


def test_patched_and_liger_are_omitted_without_a_transformers_model():
    case = models.build_unet_forward(torch.device("cpu"), smoke=True)
    result = models.ModelResult("unet", "")
    chosen = models.choose_sides(case, models.SIDE_NAMES, torch.device("cpu"), result)
    assert [s.name for s in chosen] == ["torch", "flaggems"]
    assert {n: s.status for n, s in result.sides.items()} == {"torch": "ok", "flaggems": "ok",
                                                              "patched": "omitted", "liger": "omitted",
                                                              "compiled": "omitted", "patched+compiled": "omitted"}
    assert "no transformers model" in result.sides["patched"].reason


def test_liger_is_absent_without_liger_kernel_and_skipped_off_cuda(monkeypatch):
    monkeypatch.setattr(models._deps, "liger_unavailable", lambda: "liger_kernel is not installed")
    names, absent = models.run_sides(models.Settings(smoke=True))
    assert names == ["torch", "flaggems", "patched"] and absent == {"liger": "liger_kernel is not installed"}
    with pytest.raises(models.Skip, match="CUDA"):
        models.liger_apply("llama", torch.device("cpu"))


def test_swapped_by_takes_back_module_globals_and_class_attributes():
    module = type(sys)("fake_modeling")
    module.apply_rotary_pos_emb = original = object()

    class Norm:
        def forward(self):
            return "torch"

    module.Norm = Norm
    Norm.__module__ = module.__name__

    def apply():
        module.apply_rotary_pos_emb = "liger rope"
        module.added = 1
        Norm.forward = lambda self: "liger"

    swaps = models.swapped_by(apply, [module, Norm])
    assert module.apply_rotary_pos_emb is original and not hasattr(module, "added") and Norm().forward() == "torch"
    assert {s.describe() for s in swaps} >= {"fake_modeling.apply_rotary_pos_emb", "fake_modeling.added"}
    for swap in swaps:
        swap.put(liger=True)
    assert module.apply_rotary_pos_emb == "liger rope" and module.added == 1 and Norm().forward() == "liger"
    for swap in swaps:
        swap.put(liger=False)
    assert module.apply_rotary_pos_emb is original and not hasattr(module, "added") and Norm().forward() == "torch"


# -- checks ----------------------------------------------------------------------------------
def test_decode_check_lets_a_row_part_only_at_a_near_tie():
    logits = torch.randn(2, 3, 50)
    logits[1, 1, :2] = torch.tensor([5.0, 4.999])  # a near-tie at sequence 1, token 1
    tokens = logits.argmax(-1)
    reference = {"tokens": tokens, "logits": logits}
    flipped = logits.clone()
    flipped[1, 1, 1] = 5.001
    flipped[1, 2] = torch.randn(50)  # after parting, the row's inputs differ: not compared
    parted = models.decode_check(reference, {"tokens": flipped.argmax(-1), "logits": flipped})
    assert parted.match and "near-ties" in parted.detail and "sequence 1 at token 1" in parted.detail
    wrong = logits.clone()
    wrong[0, 0] = torch.randn(50) * 3
    assert not models.decode_check(reference, {"tokens": wrong.argmax(-1), "logits": wrong}).match
    same = models.decode_check(reference, {"tokens": tokens.clone(), "logits": logits.clone()})
    assert same.match and "identical" in same.detail


def test_logits_and_grads_checks_fall_back_to_accuracy_against_fp32():
    exact = torch.randn(4, 100)
    torch_out = exact + 0.03 * exact.abs().amax(-1, keepdim=True) * torch.randn(4, 100).sign()
    side = exact + 0.035 * exact.abs().amax(-1, keepdim=True) * torch.randn(4, 100).sign()
    assert not models.logits_check(torch_out, side).match  # beyond 2e-2 of torch's...
    check = models.logits_check(torch_out, side, lambda: exact)
    assert check.match and "as accurate as torch" in check.detail  # ...but as close to fp32 as torch is
    assert not models.logits_check(torch_out, exact + 0.3 * side, lambda: exact).match
    grad = torch.randn(64)
    ref = [torch.tensor(2.0), grad]
    assert models.grads_check(ref, [torch.tensor(2.001), grad * 1.01]).match
    assert not models.grads_check(ref, [torch.tensor(2.0), grad * 1.2]).match
    exact_grads = [torch.tensor(2.0), grad * 1.1]
    assert models.grads_check(ref, [torch.tensor(2.0), grad * 1.2], lambda: exact_grads).match


def test_call_and_kernel_counts_from_profiler_events():
    cpu, cuda = models.torch.autograd.DeviceType.CPU, models.torch.autograd.DeviceType.CUDA

    def event(name, start, device=cpu, parent=None):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start), device_type=device,
                               cpu_parent=parent)

    linear = event("aten::linear", 1)
    events = [event(models.MARKER + "start", 0), linear, event("aten::addmm", 1.5, parent=linear),
              event(models.MARKER + "prefill", 2), event("flaggems::rms_norm", 3),
              event("autograd::engine::evaluate_function: MmBackward0", 3.5),
              event("aten::mm", 3.6, parent=event("MmBackward0", 3.5)), event(models.MARKER + "decode", 4),
              event("kernel_a", 1.2, cuda), event("Memcpy HtoD", 1.3, cuda), event("kernel_b", 3.1, cuda)]
    calls, phases, top = models.call_activity(events)
    assert calls == 3 and phases == {"prefill": 1, "decode": 2} and top["aten::linear"] == 1
    assert models.device_activity(events) == (2, 1, {"prefill": 1, "decode": 1})


# -- decoder workloads (transformers) ------------------------------------------------------------
def _smoke(tmp_path, pattern, *sides):
    path = tmp_path / "models.json"
    argv = ["bench", "--models", "--smoke", "--only", pattern, "--json", str(path)]
    code = main([*argv, *[a for s in sides for a in ("--side", s)]])
    return code, json.loads(path.read_text())


@pytest.mark.parametrize("workload", ["qwen2_prefill_512", "qwen2_prefill_varlen", "qwen2_train",
                                      "qwen2_decode_b1_static", "qwen2_decode_b8_dynamic", "mixtral_prefill_512",
                                      "mixtral_decode_b1_dynamic"])
def test_new_decoder_workloads_pass_their_checks_on_every_side(tmp_path, workload):
    pytest.importorskip("transformers")
    code, doc = _smoke(tmp_path, workload)
    (result,) = doc["results"]
    assert code == 0, result
    sides = result["sides"]
    assert [n for n, s in sides.items() if s["status"] == "ok"] == ["torch", "flaggems", "patched"]
    assert all(s["match"] is True for n, s in sides.items() if n != "torch"), sides
    assert sides["patched"]["info"]["patch"]["patched"]["rms_norm"] >= 1
    assert any(op.startswith("flaggems::") for op in sides["patched"]["flaggems_ops"]), sides["patched"]
    for metric in result["metrics"]:
        assert set(metric["ms"]) == set(metric["calls"]) == {"torch", "flaggems", "patched"}
        assert set(metric["ratios"]) == {"flaggems", "patched"}
    if "decode" in workload:
        assert [m["name"] for m in result["metrics"]] == list(models.DECODE_METRICS)
        assert result["params"]["cache"] == ("StaticCache" if "static" in workload else "DynamicCache")
        assert sides["torch"]["calls"] > result["metrics"][2]["calls"]["torch"] > 0  # per decode step < per generate
    assert doc["meta"]["sides"] == ["torch", "flaggems", "patched"] and doc["summary"]["sides"]["patched"]


def test_a_new_llama_workload_matches_with_flaggems(tmp_path):
    pytest.importorskip("transformers")  # the other Llama workloads differ from it and Qwen2's only in sizes
    path = tmp_path / "models.json"
    code = main(["bench", "--models", "--smoke", "--only", "llama_decode_b1_dynamic", "--side", "flaggems",
                 "--json", str(path)])
    results = json.loads(path.read_text())["results"]
    assert code == 0 and [r["workload"] for r in results] == ["llama_decode_b1_dynamic"]
    assert all(r["match"] is True for r in results), [r["error"] or r["check"] for r in results]
    assert len(models.select(["llama_*_512", "llama_*_varlen", "llama_train", "llama_decode_b*"])) == 7


def test_the_varlen_prefill_walks_the_same_lengths_on_every_side():
    pytest.importorskip("transformers")
    case = models.build_prefill_varlen(models.QWEN2, torch.device("cpu"), smoke=True)
    seen = {}
    for side in (models.Side(), models.FlaggemsSide()):
        with side.active(case):
            seen[side.name] = [case.step(models.OFF).shape[1] for _ in range(3)]
    low, high = models.RUNS_SMOKE["varlen"]
    assert seen["torch"] == seen["flaggems"] and all(low <= n <= high for n in seen["torch"])
    assert case.checked_step().shape[1] == case.params["checked_length"]


def test_the_varlen_prefill_serves_no_length_twice_before_all_were_served():
    """A seeded permutation: the checked length and the next ``high - low`` steps are every length once."""
    pytest.importorskip("transformers")
    case = models.build_prefill_varlen(models.QWEN2, torch.device("cpu"), smoke=True)
    low, high = models.RUNS_SMOKE["varlen"]
    with models.Side().active(case):
        walked = [case.step(models.OFF).shape[1] for _ in range(high - low)]
    assert sorted([case.params["checked_length"], *walked]) == list(range(low, high + 1))


def test_the_varlen_prefills_twin_cycles_over_the_first_lengths_of_the_same_walk():
    pytest.importorskip("transformers")
    new = models.build_prefill_varlen(models.QWEN2, torch.device("cpu"), smoke=True)
    seen = models.build_prefill_varlen(models.QWEN2, torch.device("cpu"), smoke=True, seen=3)
    walks = {}
    for name, case in (("new", new), ("seen", seen)):
        with models.Side().active(case):
            walks[name] = [case.step(models.OFF).shape[1] for _ in range(7)]
    assert walks["seen"] == walks["new"][:3] * 2 + walks["new"][:1] and seen.params["lengths_walked"] == 3
    assert len(models.select(["qwen2_prefill_varlen*"])) == 2


def test_the_timed_rounds_of_a_varlen_prefill_never_come_back_to_a_length():
    """Steps per round fit the lengths left: 9 walked, 2 served in warm-up, 2 rounds of (1 settling + 2 timed)."""
    pytest.importorskip("transformers")
    case = models.build_prefill_varlen(models.QWEN2, torch.device("cpu"), smoke=True)
    sides = [models.Side(), models.FlaggemsSide()]
    for side in sides:
        with side.active(case):
            case.step(models.OFF), case.step(models.OFF)
    settings = models.Settings(smoke=False, round_ms=1e6)
    _, steps = models.time_sides(case, sides, torch.device("cpu"), settings, rounds=2)
    assert steps == 2 and case.fresh_steps() == 1


def test_patched_side_patches_inside_and_unpatches_after():
    pytest.importorskip("transformers")
    case = models.build_prefill(models.QWEN2, torch.device("cpu"), smoke=True)
    side = models.PatchedSide()
    side.prepare(case)
    assert side.report["patched"] and not patching.is_patched(case.slot.model)
    with side.active(case):
        assert patching.is_patched(case.slot.model) and flaggems.is_enabled() and case.side == "patched"
    assert not patching.is_patched(case.slot.model) and not flaggems.is_enabled() and case.side == "torch"


def test_a_fake_liger_is_swapped_in_on_its_side_only(monkeypatch, tmp_path):
    pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

    original_rope, calls = modeling_llama.apply_rotary_pos_emb, []

    def fake_apply(model, rope, rms_norm, swiglu, cross_entropy, fused_linear_cross_entropy):
        assert (rope, rms_norm, swiglu, cross_entropy, fused_linear_cross_entropy) == (True, True, True, False, False)

        def rope_fn(*args, **kwargs):
            calls.append(flaggems.is_enabled())
            return original_rope(*args, **kwargs)

        modeling_llama.apply_rotary_pos_emb = rope_fn
        modeling_llama.LlamaRMSNorm.liger_marker = True  # a class attribute, as older Liger releases set
        model.liger_applied = True

    monkeypatch.setattr(models._deps, "liger_unavailable", lambda: None)
    monkeypatch.setattr(models._deps, "liger_apply",
                        lambda family, device: functools.partial(fake_apply, **models.LIGER_OPTIONS))
    case = models.build_prefill(models.LLAMA, torch.device("cpu"), smoke=True)
    side = models.LigerSide(torch.device("cpu"))
    side.prepare(case)
    assert modeling_llama.apply_rotary_pos_emb is original_rope
    assert not hasattr(modeling_llama.LlamaRMSNorm, "liger_marker") and not calls
    with side.active(case):
        assert modeling_llama.apply_rotary_pos_emb is not original_rope and case.slot.model.liger_applied
        assert modeling_llama.LlamaRMSNorm.liger_marker is True
        case.step(models.OFF)
    assert calls and not any(calls)  # called on the liger side, flaggems off there
    assert modeling_llama.apply_rotary_pos_emb is original_rope and case.slot.model is case.slot.original
    assert not hasattr(modeling_llama.LlamaRMSNorm, "liger_marker")
    calls.clear()
    code, doc = _smoke(tmp_path, "llama_prefill", "liger")
    (result,) = doc["results"]
    assert code == 0 and result["sides"]["liger"]["match"] is True, result["sides"]["liger"]
    assert "transformers.models.llama.modeling_llama.apply_rotary_pos_emb" in result["sides"]["liger"]["info"][
        "swapped"]
    assert len(calls) == 3 * models.LLAMA_SMOKE["layers"]  # checked, census, one timed round, once per layer
    assert not any(calls)  # never with flaggems enabled: only the liger side called it
    assert modeling_llama.apply_rotary_pos_emb is original_rope


def test_liger_with_an_unknown_api_skips_its_side_with_one_line(monkeypatch, capsys):
    pytest.importorskip("transformers")
    monkeypatch.setattr(models._deps, "liger_unavailable", lambda: None)

    def unknown(family, device):
        raise models.Skip("apply_liger_kernel_to_llama takes no swiglu (an API this benchmark does not know)")

    monkeypatch.setattr(models._deps, "liger_apply", unknown)
    assert main(["bench", "--models", "--smoke", "--only", "llama_prefill", "--side", "liger"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("skipped side liger")]
    assert len(lines) == 1 and "takes no swiglu" in lines[0]


def test_sd15_train_check_judges_a_tensor_beyond_the_tolerance_against_fp32_without_tf32():
    exact = [torch.ones(4, dtype=torch.float64)]
    reference = [torch.ones(4) * 1.01]  # torch's own TF32 error: 1%
    close_to_fp32 = [torch.ones(4) * 1.005]  # 1.5% from torch, as accurate as it against fp32
    far = [torch.ones(4) * 1.05]
    assert not models._relative_norms(reference, close_to_fp32, 1e-3).match
    assert models._relative_norms(reference, close_to_fp32, 1e-3, exact=lambda: exact).match
    verdict = models._relative_norms(reference, far, 1e-3, exact=lambda: exact)
    assert not verdict.match and "less accurate than torch" in verdict.detail


def test_the_compiled_sides_run_a_prefill_and_match_torch(tmp_path):
    """``--side compiled --side patched+compiled``: torch.compile of the model, and of a patched copy with
    flaggems enabled (inductor's CPU codegen here); each matches torch and reports its compile's seconds;
    ``generate()`` workloads omit them."""
    pytest.importorskip("transformers")
    path = tmp_path / "models.json"
    code = main(["bench", "--models", "--smoke", "--only", "llama_prefill", "--side", "compiled",
                 "--side", "patched+compiled", "--json", str(path)])
    (result,) = json.loads(path.read_text())["results"]
    assert code == 0, result
    sides = result["sides"]
    assert [n for n, s in sides.items() if s["status"] == "ok"] == ["torch", "compiled", "patched+compiled"]
    assert all(sides[n]["match"] is True and sides[n]["info"]["compile_s"] > 0
               for n in ("compiled", "patched+compiled")), sides
    case = SimpleNamespace(slot=object(), params={"generate": {}})
    assert "generate" in models.make_side("compiled", torch.device("cpu")).omitted(case)
