"""``flaggems bench``: listing, the no-GPU refusal, a smoke run's JSON and plot, what-ran capture."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import torch

import flaggems
from flaggems import ops
from flaggems.bench import runner, shapes
from flaggems.cli import main
from flaggems_fakes.plugins import CopyPlugin

NO_GPU = flaggems.backend().interpreter


def test_list_names_every_op_and_workload(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    bench_ops = [w.op for record in ops.specs() for w in record.workloads()]
    assert bench_ops
    for op in dict.fromkeys(bench_ops):
        assert f"{op} (" in out
    assert out.rstrip().endswith(f"{len(shapes.all_workloads())} workloads")


def test_seed_workloads_are_all_declared():
    workloads = shapes.all_workloads()
    per_op = Counter(w.op for w in workloads)
    # seed 000: 5 shapes x 3 dtypes x (index_copy, index_copy_), plus two sorted index cases per dtype and API
    assert per_op["index_copy"] == 5 * 3 * 2 + 2 * 3 * 2
    assert "index_copy_ [4096x4096] dim1 idx2048 sorted" in {w.name for w in workloads}
    names = {w.name for w in workloads}
    assert "index_copy_ [1073741824] dim0 idx536870912 random" in names
    assert {"values dynamic 17096->854524", "values output_size 17096->854524",  # seed 002
            "Tensor dynamic 17096->854524", "Tensor output_size 17096->854524"} <= names
    assert len({w.key for w in workloads}) == len(workloads), "workload keys must be unique"


def test_filters_by_aten_op_and_dtype():
    workloads = shapes.all_workloads()
    inplace = shapes.select(workloads, ["index_copy_"], ["half"])
    assert inplace and all(w.routes == ("index_copy_",) and w.dtype == "fp16" for w in inplace)
    casts = shapes.select(workloads, ["copy_"], ["bf16"])
    assert casts and all(w.op == "copy_" and "bf16" in w.dtype for w in casts)


def test_unknown_op_is_a_usage_error(capsys):
    assert main(["bench", "--op", "no_such_op", "--list"]) == 2
    assert "unknown op" in capsys.readouterr().err


def test_every_smoke_workload_builds_and_runs_natively():
    for workload in shapes.all_workloads():
        inputs = workload.make("cpu", smoke=True)
        assert runner.tensors_of(workload.run(inputs)), workload.key
        if workload.torch_run is not None:
            assert runner.tensors_of(workload.call(native=True)(workload.make("cpu", smoke=True))), workload.key
        if workload.bytes_moved is not None:
            assert workload.bytes_moved(inputs) > 0, workload.key


@pytest.mark.skipif(not NO_GPU, reason="a GPU backend is active")
def test_without_gpu_refuses_with_a_clear_message(capsys):
    assert main(["bench", "--op", "copy_"]) != 0
    err = capsys.readouterr().err
    assert "no GPU" in err and "--smoke" in err


def test_smoke_run_writes_json(tmp_path, capsys):
    path = tmp_path / "out.json"
    assert main(["bench", "--smoke", "--op", "copy_", "--json", str(path)]) == 0
    assert "timings below are meaningless" in capsys.readouterr().out
    doc = json.loads(path.read_text())
    meta = doc["meta"]
    assert meta["smoke"] is True and meta["timings_meaningful"] is False
    assert {"date", "device", "torch", "triton", "flaggems", "backend", "timing"} <= meta.keys()
    assert len(doc["results"]) == len(shapes.select(shapes.all_workloads(), ["copy_"]))
    for result in doc["results"]:
        assert {"op", "workload", "dtype", "routes", "params", "bytes", "sides", "speedup", "wall_speedup"} <= \
            result.keys()
        assert set(result["sides"]) == {"torch", "flaggems"}
        for side in result["sides"].values():
            assert side["error"] is None and side["kernel_us"] > 0 and side["wall_us"] > 0 and side["ran"]
        assert result["sides"]["flaggems"]["match"] is True
        assert result["speedup"]["flaggems"] > 0
    assert "flaggems" in doc["summary"]


def test_smoke_run_reports_the_implementation_that_ran(runtime, tmp_path, monkeypatch):
    runtime.manager.register(CopyPlugin(), "fake-copy")
    monkeypatch.setenv("FLAGGEMS_OP_copy_", "fake-copy")  # only the fake, whatever else is installed
    path = tmp_path / "out.json"
    before = dict(os.environ)
    assert main(["bench", "--smoke", "--op", "copy_", "--route", "generic", "--json", str(path)]) == 0
    assert dict(os.environ) == before, "FLAGGEMS_FORCE / FLAGGEMS_LOG must be restored"
    assert not flaggems.is_enabled()
    results = {r["workload"]: r for r in json.loads(path.read_text())["results"]}
    contiguous = results["contiguous 4096 -> 4096"]["sides"]
    assert contiguous["flaggems"]["ran"] == "copy_ -> fake-copy"
    assert contiguous["generic"]["ran"] == "copy_ -> fake-copy"
    assert contiguous["torch"]["ran"] == "native"
    expanded = results["expand 1024 -> 1024x1024"]["sides"]["flaggems"]
    assert expanded["ran"] == "copy_ -> native"
    assert any("declined" in note for note in expanded["notes"])


def test_smoke_run_without_an_implementation_says_native(tmp_path):
    # no vendor plugin has implementations for the CPU interpreter backend
    path = tmp_path / "out.json"
    assert main(["bench", "--smoke", "--op", "_to_copy", "--dtype", "bf16", "--route", "vendor",
                 "--json", str(path)]) == 0
    (result,) = json.loads(path.read_text())["results"]
    assert result["sides"]["vendor"]["ran"] == "native (no flaggems impl)"
    assert set(result["speedup"]) == {"flaggems", "vendor"}


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "speedups.png"
    assert main(["bench", "--smoke", "--op", "_to_copy", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_flags_a_wrong_result():
    reference = [torch.arange(6.0)]
    assert runner.compare(reference, torch.arange(6.0)) == (True, 0.0)
    ok, diff = runner.compare(reference, torch.arange(6.0) + 1)
    assert not ok and diff == 1.0
    assert runner.compare(reference, torch.arange(5.0))[0] is False


def test_summarize_ran_ignores_reentry():
    records = [("dispatch", "copy_ -> native (re-entered)"), ("dispatch", "copy_ -> generic"),
               ("dispatch", "copy_ -> generic")]
    assert runner.summarize_ran(records, {"copy_": "generic"}) == ("copy_ -> generic", [])
    assert runner.summarize_ran([], {"copy_": "native"})[0] == "native (no flaggems impl)"
    scalar = [("dispatch", "add.Tensor -> native (re-entered or Python scalar)")]
    assert runner.summarize_ran(scalar, {"add.Tensor": "generic"})[0] == scalar[0][1]


def test_float64_judge_accepts_a_side_no_farther_from_float64_than_torch():
    exact = [torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)]
    torch_side = [torch.tensor([1.0, 2.0, 3.25], dtype=torch.float16)]  # torch's own rounding error: 0.25
    closer = [torch.tensor([1.0, 2.125, 3.0], dtype=torch.float16)]
    farther = [torch.tensor([1.5, 2.0, 3.0], dtype=torch.float16)]
    assert runner.no_farther(torch_side, closer, exact)
    assert not runner.no_farther(torch_side, farther, exact)
    assert not runner.no_farther(torch_side, [closer[0].float()], exact)  # dtype differs


def test_float64_run_widens_floating_inputs_and_keeps_grad():
    from flaggems.ops.group_norm.shapes import group_norm_silu

    workload = next(w for w in group_norm_silu.WORKLOADS if w.float64_judge)
    exact = runner.float64_run(workload, workload.make("cpu", smoke=True))
    assert [t.dtype for t in exact] == [torch.float64] * 3  # dx, dweight, dbias
