"""The op guides (docs/adding-a-fused-op.md, docs/adding-an-aten-op.md) work as written.

Their files are in ``examples/op_guide/`` at the paths they take in the
repository. These tests check that the guides show those files, then follow the
guides' steps on them: the family folders and kernel files are added to
scratch copies of ``flaggems.ops``' and ``flaggems.plugins.generic``'s search
paths, the guides' ``OPERATORS`` line is added, and nothing else is touched.
The op is then defined, routed to the generic plugin, conformant on the kit's
contract cases and on the randomized kit (each implementation and entry),
listed and smoke-run by ``flaggems bench``, and (the fused op) patched into a
DINOv2 model with torch's results; ``unpatch`` restores it.
"""

from __future__ import annotations

import importlib
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

import flaggems
import flaggems.plugins.generic as generic
from flaggems import cli, ops, testing
from flaggems.testing import random_cases

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "op_guide"
GUIDES = {"layer_scale": ROOT / "docs" / "adding-a-fused-op.md", "abs": ROOT / "docs" / "adding-an-aten-op.md"}
OPS = {"layer_scale": "flaggems::layer_scale", "abs": "abs"}


def _shown_files(guide: Path) -> dict[str, str]:
    blocks = re.findall(r"```python\n# (examples/op_guide/[^\n]+)\n(.*?)```", guide.read_text(), re.S)
    return dict(blocks)


def _operators_line(guide: Path) -> str:
    lines = [line for line in re.findall(r"```python\n(OpImpl\([^\n]+)\n```", guide.read_text())]
    assert len(lines) == 1, f"{guide.name} shows one OPERATORS line"
    return lines[0]


@pytest.mark.parametrize("family", sorted(GUIDES))
def test_the_guide_shows_the_example_files_as_they_are(family):
    shown = _shown_files(GUIDES[family])
    folder = EXAMPLE / "core" / "ops" / family
    expected = {str(p.relative_to(ROOT)) for p in folder.glob("*.py")}
    expected.add(f"examples/op_guide/plugins/generic/{family}.py")
    assert set(shown) == expected
    for path, body in shown.items():
        assert (ROOT / path).read_text() == body, f"the guide's {path} differs from the file"


def test_the_readme_and_the_architecture_point_to_the_guides():
    for text in ((ROOT / "README.md").read_text(), (ROOT / "docs" / "architecture.md").read_text()):
        assert "docs/adding-a-fused-op.md" in text and "docs/adding-an-aten-op.md" in text


@pytest.fixture
def added(tmp_path, monkeypatch):
    """``added(family)``: the guide's steps done on scratch search paths; undone after the test."""
    folders: list[tuple[list[str], str]] = []
    saved_cases = (dict(testing._CASES), dict(testing._FLOAT64), dict(testing._GRADIENT_TERMS))

    def add(family: str) -> str:
        ops_dir, kernels_dir = tmp_path / "ops", tmp_path / "generic"
        shutil.copytree(EXAMPLE / "core" / "ops" / family, ops_dir / family)
        kernels_dir.mkdir(exist_ok=True)
        shutil.copy(EXAMPLE / "plugins" / "generic" / f"{family}.py", kernels_dir / f"{family}.py")
        for path, folder in ((ops.__path__, str(ops_dir)), (generic.__path__, str(kernels_dir))):
            if folder not in path:
                path.append(folder)
                folders.append((path, folder))
        line = _operators_line(GUIDES[family]).rstrip(",")
        monkeypatch.setattr(generic, "OPERATORS", (*generic.OPERATORS, eval(line, vars(generic))))  # noqa: S307
        ops.forget_specs()
        ops.define()
        ops.register_policies()
        monkeypatch.setattr(random_cases, "GENERATORS", random_cases.generators())
        monkeypatch.setattr(testing, "_LOADED", False)  # the kit reads the families' cases anew
        flaggems.disable()
        flaggems.runtime.RUNTIME._active = None
        return OPS[family]

    yield add
    flaggems.disable()
    for path, folder in folders:
        path.remove(folder)
    for name in [m for m in sys.modules if m.split(".")[-1] in GUIDES or ".layer_scale" in m or ".abs" in m]:
        if name.startswith(("flaggems.ops.", "flaggems.plugins.generic.")):
            del sys.modules[name]
    ops.forget_specs()
    testing._CASES.clear(), testing._CASES.update(saved_cases[0])
    testing._FLOAT64.clear(), testing._FLOAT64.update(saved_cases[1])
    testing._GRADIENT_TERMS.clear(), testing._GRADIENT_TERMS.update(saved_cases[2])
    flaggems.runtime.RUNTIME._active = None


def _check_contract(op: str) -> None:
    """Every contract case passes on the generic implementation; the served ones ran its kernel."""
    items = [item for item in testing.collect([op]) if item.label == "generic"]
    assert len(items) == len(testing.cases_for(op)) >= 6
    outcomes = [testing.check(item) for item in items]  # raises AssertionError on a difference
    served = [outcome for outcome in outcomes if outcome == "ok"]
    assert len(served) >= 3 and all(o == "ok" or o.startswith(("declined", "raises")) for o in outcomes), outcomes


def _counted(monkeypatch, module: str, name: str) -> list[int]:
    """Count the calls the kernel entry ``module:name`` served (patched before ``enable()`` resolves it; the
    plans kept from earlier runs dropped, so that each new layout's first call plans through it)."""
    kernels = importlib.import_module(module)
    real, calls = getattr(kernels, name), []

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)  # a Decline propagates uncounted
        calls.append(1)
        return out

    monkeypatch.setattr(kernels, name, counting)
    flaggems.runtime.RUNTIME.clear_plans()
    return calls


def _never_native(op: str) -> None:
    """No call of ``op`` went to its native kernel or reference through a plan (the compiled entry's counts)."""
    stats = flaggems.runtime.RUNTIME.plan_stats()
    assert all(row["native"] == 0 for key, row in stats.items() if key.startswith(f"{op}@")), stats


def _run_cli(capsys, *argv: str) -> str:
    code = cli.main(list(argv))
    out = capsys.readouterr().out
    assert code == 0, out
    return out


def _check_kit_and_bench(capsys, op: str, name: str) -> None:
    """The new op's contract (:func:`_check_contract`), 12 random cases of the CLI's kit and its smoke bench
    (``name``: the bench's workload)."""
    _check_contract(op)
    out = _run_cli(capsys, "kit", "--op", op, "--cases", "12")
    assert "0 failed" in out and f"{op} [generic]" in out
    assert name in _run_cli(capsys, "bench", "--smoke", "--op", name)


def test_a_new_fused_op_is_one_folder_one_kernel_file_and_one_line(added, capsys, monkeypatch):
    op = added("layer_scale")
    x, gamma = torch.randn(2, 5, 16), torch.rand(16) + 0.5
    torch.testing.assert_close(torch.ops.flaggems.layer_scale(x, gamma), x * gamma)  # defined: its reference
    assert "layer_scale" in {record.name for record in ops.specs()}
    assert re.search(r"^flaggems::layer_scale: generic", _run_cli(capsys, "routes"), re.M)
    _check_kit_and_bench(capsys, op, "layer_scale")
    calls = _counted(monkeypatch, "flaggems.plugins.generic.layer_scale", "layer_scale")
    flaggems.enable(include=[op])
    try:
        torch.testing.assert_close(torch.ops.flaggems.layer_scale(x, gamma), x * gamma)
        assert calls, "the routed call did not reach the kernel"
        _never_native(op)
        torch.library.opcheck(torch.ops.flaggems.layer_scale.default, (x, gamma))
        compiled = torch.compile(lambda a, b: torch.ops.flaggems.layer_scale(a, b) + 1, backend="aot_eager",
                                 dynamic=True)
        torch.testing.assert_close(compiled(x, gamma), x * gamma + 1)
    finally:
        flaggems.disable()


def test_the_fused_ops_patch_rule_patches_dinov2_with_torchs_results(added, monkeypatch):
    transformers = pytest.importorskip("transformers")
    added("layer_scale")
    calls = _counted(monkeypatch, "flaggems.plugins.generic.layer_scale", "layer_scale")
    config = transformers.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=64, image_size=32, patch_size=8)
    model = transformers.Dinov2Model(config).eval()
    pixels = torch.randn(1, 3, 32, 32)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        want = model(pixels).last_hidden_state
    report = flaggems.patch(model)
    try:
        assert report.patched["layer_scale"] == 4  # two a layer
        flaggems.enable(include=["flaggems::layer_scale"])
        with torch.no_grad():
            got = model(pixels).last_hidden_state
        torch.testing.assert_close(got, want)
        assert calls  # the kernel planned the four calls' one layout; the rest replayed its launches
        _never_native("flaggems::layer_scale")
    finally:
        flaggems.disable()
        assert flaggems.unpatch(model)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_a_new_aten_op_is_one_folder_one_kernel_file_and_one_line(added, capsys, monkeypatch):
    op = added("abs")
    assert re.search(r"^abs: generic", _run_cli(capsys, "routes"), re.M)
    _check_kit_and_bench(capsys, op, "abs")
    x = torch.tensor([[-1.5, 0.0, 2.0], [-0.0, float("inf"), -3.0]])
    want = torch.abs(x)  # torch's kernel: flaggems not enabled yet
    calls = _counted(monkeypatch, "flaggems.plugins.generic.abs", "abs_")
    flaggems.enable(include=[op])
    try:
        got = torch.abs(x)
        assert calls, "the routed call did not reach the kernel"
        _never_native(op)
        torch.testing.assert_close(got, want)
        assert torch.equal(got.signbit(), want.signbit())  # abs(-0.0) is +0.0
        torch.library.opcheck(torch.ops.aten.abs.default, (x,))
    finally:
        flaggems.disable()
