"""The randomized, differential conformance kit: every implementation of every op against native torch.

One test per (op, implementation, mode): ``direct`` calls the implementation's function, ``compiled`` and
``python`` run the same cases through the dispatcher routed to that implementation alone under that entry.
``FLAGGEMS_KIT_CASES`` cases each, from seed :data:`SEED`; a failure prints each failing case's reproducer
(``flaggems kit --op ... --impl ... --seed ... --cases ...``).
"""

from __future__ import annotations

import pytest

from flaggems import config
from flaggems.testing import random_cases as kit

SEED = 0
TARGETS = kit.targets()


@pytest.mark.parametrize("mode", kit.MODES)
@pytest.mark.parametrize("target", TARGETS, ids=str)
def test_random_conformance(target, mode):
    stream = kit.random_cases(target.op, config.get("FLAGGEMS_KIT_CASES"), SEED)
    if not stream:
        pytest.skip(f"{target.op}: no registered cases and no generator")
    tally = kit.run_target(target, stream, mode, SEED, kit.device())
    if tally.notes and tally.total == 0:
        pytest.skip("; ".join(tally.notes))
    assert not tally.failed, (f"{target} {mode}: {tally.failed} of {tally.total} cases differ from torch "
                              f"(first {len(tally.failures)}):\n" + "\n\n".join(tally.failures))


def test_every_routed_op_gets_random_cases():
    ops = {target.op for target in TARGETS}
    missing = sorted(op for op in ops if not kit.random_cases(op, 1, SEED))
    assert not missing, f"ops the randomized kit cannot build a case for: {missing}"


def test_layouts_keep_values_and_poison_the_rest():
    import random

    import torch

    from flaggems.testing import _layouts

    x = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    for mode in ("strided", "permuted", "neg"):
        plan = _layouts.plan_for(x, mode, random.Random(1))
        view, buffer = _layouts.place(x, plan)
        assert torch.equal(view, x) and view.shape == x.shape
        assert view.is_neg() == (mode == "neg")
        assert int(buffer.isnan().sum()) == buffer.numel() - x.numel()


def test_sweeps_reach_generic_plans():
    """A sweep builds one case at six sizes of one layout class: the compiled entry serves the later ones
    from a generic plan, which the kit compares with torch like any call."""
    from flaggems import compiled

    if compiled.load()[0] is None:
        pytest.skip("the compiled entry cannot be built here")
    stream = [rc for rc in kit.random_cases("copy_", 400, SEED) if rc.variant >= 0][:2 * kit.SWEEP_POINTS]
    assert len(stream) == 2 * kit.SWEEP_POINTS and len({rc.seed for rc in stream}) == 2
    target = next(t for t in TARGETS if t.op == "copy_")
    tally = kit.run_target(target, stream, "compiled", SEED, kit.device())
    assert not tally.failed and tally.generic > 0, tally


def test_a_value_outside_tolerance_is_judged_against_float64():
    import torch

    ours = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float16)
    truth = torch.tensor([1.0, 2.0, 3.0005], dtype=torch.float64)
    torch_answer = torch.tensor([1.0, 2.0, 2.99], dtype=torch.float16)
    assert kit._no_farther(ours, torch_answer, truth, 1)  # ours is the closer one
    assert not kit._no_farther(torch_answer, ours, truth, 1)
    assert not kit._no_farther(torch.tensor([float("nan"), 2.0, 3.0]).half(), ours, truth, 1)


def test_the_second_side_is_a_twin_in_its_own_memory():
    """Both sides of a case hold the same layouts and values, in separate memory: aliasing between
    arguments, poisoned buffers, negative views and leaves that require grad are kept."""
    import torch

    from flaggems.testing import _layouts

    base = torch.randn(40)
    self_ = base[2:26].view(4, 6).t()
    alias = base[3:9]  # shares self_'s storage: the twin's must share the twin's copy
    neg = torch._neg_view(torch.randn(5))
    leaf = torch.randn(3, requires_grad=True)
    index = torch.arange(8)[1::2]
    built = _layouts.Built((self_, 1, index, alias), {"neg": neg, "leaf": leaf}, [base])
    copy = _layouts.twin(built)
    pairs = [*zip(built.args, copy.args), *zip(built.kwargs.values(), copy.kwargs.values()),
             (base, copy.buffers[0])]
    for a, b in pairs:
        if not isinstance(a, torch.Tensor):
            assert a == b
            continue
        assert torch.equal(a, b) and a.dtype == b.dtype and a.stride() == b.stride()
        assert a.storage_offset() == b.storage_offset() and a.is_neg() == b.is_neg()
        assert a.requires_grad == b.requires_grad and b.is_leaf
        assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    twin_self, twin_alias = copy.args[0], copy.args[3]
    assert twin_self.untyped_storage().data_ptr() == twin_alias.untyped_storage().data_ptr()
    assert copy.buffers[0].untyped_storage().data_ptr() == twin_self.untyped_storage().data_ptr()
    twin_alias.fill_(7.0)
    assert not bool((alias == 7.0).any()) and bool((twin_self.t().reshape(-1)[1:7] == 7.0).all())
    assert _layouts.twin(_layouts.Built(([index],), {})) is None  # a list of tensors: built again
    assert _layouts.twin(_layouts.Built((torch.randn(3, dtype=torch.complex64).conj(),), {})) is None


def test_the_second_call_keeps_the_first_calls_layouts():
    """A layout draw may depend on values (stride 0 only where they repeat); the kit's second call of a case,
    built from other values, takes the first call's layouts (a bf16 rstd equal in every group once gave the
    second call a stride-0 rstd that flaggems rightly declined and torch's CUDA kernel then misread)."""
    import random

    import torch

    from flaggems.testing import _layouts

    for seed in range(200):
        constant = torch.ones(2, 3)
        first = _layouts.relayout((constant,), {}, random.Random(seed), frozenset())
        if first.args[0].stride()[1] == 0:
            break
    else:
        pytest.fail("no seed drew stride 0 for the constant dimension")
    varied = torch.arange(6.0).reshape(2, 3)
    again = _layouts.relayout((varied,), {}, random.Random(seed), frozenset())
    assert again.args[0].stride() != first.args[0].stride()  # drawn from the values: another layout
    second = _layouts.relayout((varied,), {}, random.Random(seed), frozenset(), like=first)
    assert second.args[0].stride() == first.args[0].stride()
    assert second.args[0].storage_offset() == first.args[0].storage_offset()
    assert torch.equal(second.args[0], varied[:, :1].expand(2, 3) if first.args[0].stride()[0] else
                       varied[:1, :1].expand(2, 3))


def test_a_replayed_stride_0_keeps_an_index_tensors_values():
    """Repeats or indices equal at the first call may differ at the second: they keep their values (an
    ``output_size`` is their sum; a copy onto repeated indices is defined only for equal rows)."""
    import random

    import torch

    from flaggems.testing import _layouts

    for seed in range(200):
        first = _layouts.relayout((torch.full((4,), 3),), {}, random.Random(seed), frozenset())
        if first.args[0].stride() == (0,):
            break
    else:
        pytest.fail("no seed drew stride 0")
    varied = torch.tensor([1, 2, 3, 4])
    second = _layouts.relayout((varied,), {}, random.Random(seed), frozenset(), like=first)
    assert torch.equal(second.args[0], varied) and second.args[0].stride() != (0,)


def test_the_kit_draws_only_dtypes_the_backend_computes(monkeypatch):
    """A backend declaring ``unsupported_dtypes`` (float64 on Ascend) gets no case naming one: routing would
    decline it on every implementation (``FLAGGEMS_VENDOR=ascend flaggems kit --op index_copy --cases 5``
    once drew float64 for all five cases and ran none). Without a limit, the streams are as they were."""
    import random

    import torch

    from flaggems.testing import cases_for

    cpu = torch.device("cpu")
    ops = sorted({target.op for target in TARGETS})
    monkeypatch.setattr(kit, "unsupported_dtypes", lambda: frozenset())
    for op in ops:  # no limit: each generated case is its seed's first draw
        for rc in kit.random_cases(op, 12, SEED):
            if rc.source == kit.GENERATED and rc.variant < 0:
                torch.manual_seed(rc.seed)
                first = kit.GENERATORS[op](random.Random(rc.seed), cpu)
                assert kit.build(rc, cpu, rc.seed).kind == first.kind
    monkeypatch.setattr(kit, "unsupported_dtypes", lambda: frozenset({torch.float64}))
    drew = set()
    for op in ops:
        stream = kit.random_cases(op, 40, SEED)
        assert stream, op
        for rc in stream:
            prep = kit.build(rc, cpu, rc.seed)
            named = kit.named_dtypes((*prep.built.args, *prep.built.kwargs.values()))
            assert torch.float64 not in named, f"{op} case #{rc.index} ({rc.source}, {prep.kind}) names float64"
            drew |= named
        wide = {c.name for c in cases_for(op) if torch.float64 in kit._case_facts(op, c)[1]}
        assert not wide & {c.name for c in kit.relayout_pool(op)}, op
    assert {torch.float16, torch.bfloat16, torch.float32, torch.int64} <= drew


VENDOR_PLUGINS = {"": None, "ascend": "flaggems_ascend", "kunlunxin": "flaggems_kunlunxin", "hygon": "flaggems_hygon"}
_VENDOR_KIT = """
import json, sys
from flaggems.testing import random_cases as kit
tallies = kit.run_kit(cases={cases}, modes=("direct",))
print(json.dumps({{"idle": kit.idle_ops(tallies), "ran": sorted({{t.op for t in tallies if t.passed}}),
                  "failures": [f for t in tallies for f in t.failures][:3], "failed": sum(t.failed for t in tallies)}}))
"""


@pytest.mark.parametrize("vendor", list(VENDOR_PLUGINS), ids=lambda v: v or "default")
def test_each_vendors_kit_runs_cases_for_every_op(vendor):
    """Under each vendor's configuration (the tox envs': ``FLAGGEMS_VENDOR``, the stand-in ``npu`` of
    tests/fakes for Ascend where no torch_npu is installed) every routed op runs cases and none differs."""
    import importlib.metadata
    import importlib.util
    import json
    import os
    import subprocess
    import sys

    plugin = VENDOR_PLUGINS[vendor]
    # installed means registered (an entry point), not importable: the source tree's folder is importable from
    # the repository root in every tox env, the nvidia env's included, where the plugin is not installed
    registered = {ep.value.split(":")[0] for ep in importlib.metadata.entry_points(group="flaggems.plugins")}
    if plugin is not None and plugin not in registered:
        pytest.skip(f"{plugin} is not installed")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLAGGEMS_OP_")}
    env["FLAGGEMS_VENDOR"] = vendor
    if vendor == "ascend" and importlib.util.find_spec("torch_npu") is None:
        fakes = os.path.join(os.path.dirname(__file__), "fakes")
        env.update(FAKE_TORCH_NPU="1", PYTHONPATH=os.pathsep.join(filter(None, (fakes, env.get("PYTHONPATH")))))
    elif vendor != "ascend":
        env.pop("FAKE_TORCH_NPU", None)
    proc = subprocess.run([sys.executable, "-c", _VENDOR_KIT.format(cases=16)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["ran"] and not found["idle"], f"ops that ran no case under {vendor or 'default'}: {found['idle']}"
    assert not found["failed"], "\n\n".join(found["failures"])
