"""``flaggems bench --models``: the smoke run in-process (UNet stack on the CPU interpreter), JSON, options.

The Llama workloads need transformers (not installed on the CPU hosts); their
version-dependent pieces (StaticCache arguments, forward keywords) are checked
here against fake signatures of transformers 4.4x, 4.5x and 5.x.
"""

from __future__ import annotations

import json

import pytest
import torch

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
        assert any("group_norm" in op for op in result["flaggems_ops"]), result["flaggems_ops"]


def test_llama_workloads_skip_with_one_line_each_without_transformers(monkeypatch, capsys):
    monkeypatch.setattr(models, "transformers_available", lambda: False)
    assert main(["bench", "--models", "--smoke", "--only", "llama*"]) == 2  # nothing ran
    skipped = [line for line in capsys.readouterr().out.splitlines() if line.startswith("skipped ")]
    assert len(skipped) == 4 and all("transformers is not installed" in line for line in skipped)


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
    assert main(["bench", "--only", "unet*", "--list"]) == 2
    assert "apply only with --models" in capsys.readouterr().err
    assert main(["bench", "--models", "--op", "copy_", "--list"]) == 2
    assert models.main(["--list", "--only", "llama*"]) == 0
    assert "llama_decode" in capsys.readouterr().out


def test_settings_defaults_and_overrides():
    parser = models.build_parser()
    full = models.Settings.from_args(parser.parse_args([]))
    assert (full.smoke, full.steps, full.rounds, full.warmup) == (False, None, 15, 3)
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
